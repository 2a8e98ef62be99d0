"""SIGTERM and SIGINT during a fit: :class:`SignalCatcher`, the flag the Trainer holds, and the
decision every rank of a run takes on it at the loop's checks (see its docstring and
``docs/distributed.md``, a preempted or failing rank)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from engine import parallel
from engine.state import TrainState

__all__ = ["SignalCatcher"]


class SignalCatcher:
    """SIGTERM and SIGINT during a fit: ``received`` records the signal, and the loop, at its
    next check, saves a checkpoint and exits (:meth:`stop`).

    With several ranks the decision is the one the ranks agreed on, never this rank's flag
    read after the agreement: the flag is read once, before the agreement's collective
    (:meth:`offer`), and the agreement's outcome is what :meth:`settle` records in
    ``agreed``. A signal that lands while the collective waits (the peer may be writing a
    checkpoint for minutes) is the next check's, on every rank: acting on it now would send
    this rank into the interrupted save's collectives while the others train on.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # set by the handler: this process's signal
        self.agreed: int | None = None  # the signal every rank acts on (set by settle)
        self._offered: int | None = None
        self._depth = 0

    @property
    def came(self) -> bool:
        """Whether a signal came to this process, or to another rank (agreed), in the fit."""
        return self.received is not None or self.agreed is not None

    @contextlib.contextmanager
    def catching(self, active: bool = True) -> Iterator[None]:
        """During fit, SIGTERM and SIGINT only raise a flag, checked after each training batch
        (with its validation) and after each epoch's end: there the loop saves a checkpoint and
        exits (see :meth:`stop`). One that comes later, once the last epoch has ended, finds the
        fit finished: it returns, saying so on stderr (:meth:`report_late`).

        Nested uses are one: a fit catches from before its process group is joined (so a
        signal during the rendezvous is caught too, and acted on at the first check, where the
        default action would kill the rank and leave its peers waiting in a collective) and
        the run inside it keeps that handler and what it has received. ``active=False``: a
        context that does nothing (the Trainer's other entry points)."""
        if not active:
            yield
            return
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.received = self.agreed = self._offered = None
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            # only an assignment: the handler runs between any two bytecodes of the main
            # thread (inside a lock, a collective's Python wrapper, a save), so it does nothing
            # that is not reentrant; the loop acts on the flag at its next agreed check
            if self.received is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self.received = signum
            parallel.signalled()  # a collective failing now reports without waiting

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for s, h in previous.items():
                signal.signal(s, h)

    def offer(self) -> bool:
        """Whether this process has received a signal, read once for an agreement (what it
        offers to the other ranks); :meth:`settle` then records the outcome."""
        self._offered = self.received
        return self._offered is not None

    def settle(self, signalled: bool) -> None:
        """Record the agreement's outcome: ``signalled`` (some rank received a signal) makes
        ``agreed`` this rank's offered signal, or SIGTERM for another rank's."""
        if signalled and self.agreed is None:
            self.agreed = self._offered if self._offered is not None else signal.SIGTERM

    def stop(
        self,
        state: TrainState,
        root: str,
        save: Callable[[Path], Any],
        barrier: Callable[[], None] = lambda: None,
    ) -> NoReturn:
        """Save ``state``'s run with ``save`` (the Trainer's ``save_checkpoint``) under
        ``root``'s ``checkpoints``, say where on stderr, and exit as the signal asks; with
        several ranks, each exits once every rank is past the save (``barrier``), so no launcher
        ends rank 0's write by seeing another rank exit first."""
        assert self.agreed is not None
        name = signal.Signals(self.agreed).name
        path = save(Path(root) / "checkpoints" / f"interrupted-step={state.step}")
        barrier()
        message = (
            f"{name} received: finished step {state.step} (epoch {state.epoch}, "
            f"batch {state.batch_idx}), saved a checkpoint to {path}; resume exactly with "
            f"Trainer.fit(..., ckpt_path={str(path)!r}) or ckpt_path='last'"
        )
        print(message, file=sys.stderr)
        if self.agreed == signal.SIGINT:
            raise KeyboardInterrupt(message)
        raise SystemExit(message)

    def report_late(self, step: int, epoch: int) -> None:
        """A signal that came after the last check of the fit (in ``on_train_end``,
        ``on_fit_end`` or teardown): training had finished, so the fit returns its final
        state; say so, since the signal asked for an end that had already come."""
        late = self.received if self.received is not None else self.agreed
        assert late is not None
        name = signal.Signals(late).name
        print(
            f"{name} received after the last training step: the fit had finished (step "
            f"{step}, epoch {epoch}) and returns its final state; no "
            "interrupted checkpoint was needed",
            file=sys.stderr,
        )
