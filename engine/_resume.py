"""The Trainer's checkpointing: save, resolve and restore checkpoints; carry out the listeners'
:class:`~engine.events.Save` requests; stop cleanly on signals.

A mixin of :class:`engine.trainer.Trainer`. It reads the loop's position only from the
Trainer's record of the last ``state`` / ``progress`` the fit loop (:mod:`engine.loop.fit`)
handed it; the loop itself lives in ``engine/loop/fit.py``.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import CancelledError, Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import checkpoint
from engine.events import Event, Save
from engine.loop import LoopConfig
from engine.loop.progress import Progress
from engine.metrics import MetricReducer
from engine.state import TrainState

__all__: list[str] = []


class CheckpointingMixin:
    """Checkpoint and signal handling for the Trainer (which provides these attributes)."""

    callbacks: list[Any]
    loggers: list[Any]
    config: LoopConfig
    default_root_dir: str
    stage: str | None
    task: Any
    callback_metrics: dict[str, float]
    logged_metrics: dict[str, float]
    progress_bar_metrics: dict[str, float]
    _version: int
    ckpt_path: str | None
    # the last state and loop progress the fit loop handed the Trainer (engine.loop.fit)
    _state: TrainState | None
    _progress: Progress
    _emitter: Any
    _in_flight: list[tuple[Future[Any], tuple[str, ...]]]
    _signal: int | None

    if TYPE_CHECKING:  # the Trainer's methods this mixin calls

        def _emit(self, event: Event, **fields: Any) -> None: ...

        @property
        def global_step(self) -> int: ...

        @property
        def current_epoch(self) -> int: ...

    def _keyed_listeners(self, *, stateful_only: bool = True) -> list[tuple[str, Any]]:
        """The listeners by key: ``state_key`` or the class name, ``#n`` for the n-th of a key."""
        keyed: list[tuple[str, Any]] = []
        seen: dict[str, int] = {}
        for listener in self.callbacks:
            if stateful_only and not callable(getattr(listener, "state_dict", None)):
                continue
            key = getattr(listener, "state_key", None) or type(listener).__qualname__
            seen[key] = seen.get(key, 0) + 1
            keyed.append((key if seen[key] == 1 else f"{key}#{seen[key]}", listener))
        return keyed

    def save_checkpoint(
        self,
        filepath: str | os.PathLike[str],
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """Save the current state, the listeners' states and the loop position to ``filepath``.

        The checkpoint determines the rest of the run: ``fit(..., ckpt_path=filepath)`` continues
        it. See :func:`engine.checkpoint.save` for the format and the guarantees. With
        ``asynchronous=True`` only a snapshot blocks and the write happens in the background
        (:func:`engine.checkpoint.save_async`); returns a future of the path instead of the path.
        A run waits for its pending saves before it ends. ``weights_only=True`` saves the model
        alone (Lightning's meaning): ``validate`` / ``test`` / ``predict`` can start from it,
        ``fit`` cannot.

        For code outside events (after ``fit``, say). A listener returns
        :class:`~engine.events.Save` instead, which the driver carries out through this method
        once the event has reached every listener.

        Raises:
            RuntimeError: before a run, or when called while an event is being dispatched (from
                a handler that holds the trainer): return ``engine.Save(path)`` there.
        """
        if self._state is None:
            raise RuntimeError("save_checkpoint(): nothing to save yet; call fit() first")
        dispatching = self._emitter.dispatching
        if dispatching is not None:
            raise RuntimeError(
                f"trainer.save_checkpoint() was called while {dispatching.value} was being "
                "dispatched; a listener returns engine.Save(path) (with asynchronous=, "
                "weights_only=, replaces=) and the driver writes it once every listener has had "
                "the event, so the checkpoint holds all their states after it"
            )
        # the event comes first (a listener's state must be in the checkpoint), the write after;
        # for an asynchronous save listeners get a future that the write's future completes,
        # whatever happens meanwhile
        landed = _Landing() if asynchronous else None
        chained = False
        try:
            self._emit(
                Event.ON_SAVE_CHECKPOINT,
                checkpoint_path=os.fspath(filepath),
                checkpoint_future=landed,
            )
            out = self._write_checkpoint(
                filepath, metrics=metrics, asynchronous=asynchronous, weights_only=weights_only
            )
            if landed is not None:
                out.add_done_callback(partial(_complete, landed))
            chained = True
        except BaseException as e:
            if landed is not None and not chained and not landed.done():
                landed.set_exception(e)
            raise
        return out

    def _write_checkpoint(
        self,
        filepath: str | os.PathLike[str],
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """save_checkpoint's write, after its event."""
        assert self._state is not None
        listeners = {}
        for key, listener in self._keyed_listeners():
            state = listener.state_dict()
            if state:
                listeners[key] = state
        progress = self._progress
        extra = {
            "listeners": listeners,
            "trainer": {
                **progress.to_json(),  # the loop's position: total_batch_idx, phase, ...
                "stage": self.stage,
                # what listeners have seen so far
                "callback_metrics": _finite_or_str(self.callback_metrics),
                "logged_metrics": _finite_or_str(self.logged_metrics),
                "progress_bar_metrics": _finite_or_str(self.progress_bar_metrics),
                # breaks ties between checkpoints of one step for ckpt_path="last"
                "saved_at_ns": time.time_ns(),
            },
            "config": self.config.to_json(),  # the flags the run was made with
            # the epoch's metric reduction so far: logged epoch means survive a resume bitwise
            "train_metrics": None if progress.reducer is None else progress.reducer.state_dict(),
        }
        metrics = dict(self.callback_metrics) if metrics is None else metrics
        if asynchronous:  # its fingerprint is hashed from the snapshot, off the loop (journal)
            return checkpoint.save_async(
                self._state,
                filepath,
                metrics=metrics,
                extra=extra,
                fingerprint=True,
                weights_only=weights_only,
            )
        return checkpoint.save(
            self._state, filepath, metrics=metrics, extra=extra, weights_only=weights_only
        )

    def _resolve_ckpt(self, ckpt_path: str | os.PathLike[str]) -> Path | None:
        if ckpt_path not in ("last", "best"):
            return Path(ckpt_path)
        savers = [x for x in self.callbacks if _is(x, "ModelCheckpoint")]
        if ckpt_path == "best":
            best = next((x.best_model_path for x in savers if x.best_model_path), None)
            if not best:
                raise ValueError(
                    'ckpt_path="best": no best checkpoint is known; give a ModelCheckpoint with '
                    "a monitor, or pass a path"
                )
            return Path(best)
        roots = [Path(x.dirpath) for x in savers if getattr(x, "dirpath", None)]
        roots.append(Path(self.default_root_dir) / "checkpoints")
        found = []
        for root in roots:
            checkpoint.clean_leftovers(root)
            if root.is_dir():
                found += [p for p in root.iterdir() if (p / checkpoint.META).is_file()]
        ranked, unreadable = [], []
        for path in found:
            try:
                ranked.append((_recency(path), path))
            except checkpoint.CheckpointError as e:  # its step is not known: it ranks nowhere
                unreadable.append(f"{path} ({e})")
        if unreadable:
            warnings.warn(
                'ckpt_path="last": passing over checkpoints whose meta.json fails verification: '
                + "; ".join(unreadable),
                stacklevel=3,
            )
        newest = [path for _, path in sorted(ranked, key=lambda x: x[0], reverse=True)]
        for i, path in enumerate(newest):
            try:
                checkpoint.verify(path)
            except checkpoint.CheckpointError:
                continue  # damaged (meta.json included): the next newest
            if i:
                warnings.warn(
                    f'ckpt_path="last": {newest[0]} fails verification; resuming from the '
                    f"newest valid checkpoint, {path}",
                    stacklevel=3,
                )
            return path
        warnings.warn(
            'ckpt_path="last": no valid checkpoint found; training starts from the given state',
            stacklevel=3,
        )
        return None

    def _restore(self, ckpt_path: str | os.PathLike[str], template: TrainState) -> None:
        path = self._resolve_ckpt(ckpt_path)
        if path is None:
            return
        if self.stage == "fit" and checkpoint.read_meta(path).get("weights_only"):
            raise ValueError(
                f"fit(ckpt_path={str(ckpt_path)!r}): {path} holds only the model's weights (saved "
                "with weights_only=True / ModelCheckpoint(save_weights_only=True)), not the "
                "optimizer state a fit continues from. Resume from a full checkpoint, or load "
                "the weights into the state you start from (checkpoint.load(path, state))"
            )
        self._state = checkpoint.load(path, template)
        self.ckpt_path = str(path)  # ModelCheckpoint never deletes the one a run resumed from
        meta = checkpoint.read_meta(path)
        try:
            self._restore_run(meta)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            # meta.json verified, so written like this: by hand, or by another engine
            raise checkpoint.CheckpointError(
                f"{path / checkpoint.META}: the run's state in 'extra' cannot be restored "
                f"({type(e).__name__}: {e}); was the file edited, or written by another engine?"
            ) from e
        self._emit(Event.ON_LOAD_CHECKPOINT, checkpoint_path=str(path))

    def _restore_run(self, meta: dict[str, Any]) -> None:
        """The loop's and the listeners' state, from a checkpoint's verified ``meta``."""
        saved = meta.get("extra", {}).get("listeners", {})
        for key, listener in self._keyed_listeners():
            if key in saved and callable(getattr(listener, "load_state_dict", None)):
                listener.load_state_dict(saved[key])
        extra = meta.get("extra", {})
        saved_loop = extra.get("trainer", {})
        restored = Progress.from_checkpoint(saved_loop)
        now = self._progress
        if self.stage != "fit":  # nothing continues: only the checks above matter
            return
        # the run continues: what its listeners had seen, they see
        for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
            if name in saved_loop:
                setattr(self, name, {k: float(v) for k, v in saved_loop[name].items()})
        self._version += 1
        reducer = now.reducer
        if extra.get("train_metrics") and self.task is not None:
            reducer = MetricReducer(self.task.reduce)
            reducer.load_state_dict(extra["train_metrics"])
        self._progress = restored._replace(
            num_training_batches=now.num_training_batches,
            val_check_batch=now.val_check_batch,
            reducer=reducer,
        )

    @contextlib.contextmanager
    def _catch_signals(self) -> Iterator[None]:
        """During fit, SIGTERM and SIGINT only raise a flag, checked after each training batch
        (with its validation) and after each epoch's end: there the loop saves a checkpoint and
        exits (see ``_stop_for_signal``). One that comes later, once the last epoch has ended,
        finds the fit finished: it returns, saying so on stderr (``_report_late_signal``)."""
        self._signal = None
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self._signal = signum

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _stop_for_signal(self) -> None:
        assert self._signal is not None and self._state is not None
        name = signal.Signals(self._signal).name
        path = self.save_checkpoint(
            Path(self.default_root_dir) / "checkpoints" / f"interrupted-step={self.global_step}"
        )
        message = (
            f"{name} received: finished step {self.global_step} (epoch {self.current_epoch}, "
            f"batch {self._state.batch_idx}), saved a checkpoint to {path}; resume exactly with "
            f"Trainer.fit(..., ckpt_path={str(path)!r}) or ckpt_path='last'"
        )
        print(message, file=sys.stderr)
        if self._signal == signal.SIGINT:
            raise KeyboardInterrupt(message)
        raise SystemExit(message)

    def _report_late_signal(self) -> None:
        """A signal that came after the last check of the fit (in ``on_train_end``,
        ``on_fit_end`` or teardown): training had finished, so the fit returns its final
        state; say so, since the signal asked for an end that had already come."""
        assert self._signal is not None
        name = signal.Signals(self._signal).name
        print(
            f"{name} received after the last training step: the fit had finished (step "
            f"{self.global_step}, epoch {self.current_epoch}) and returns its final state; no "
            "interrupted checkpoint was needed",
            file=sys.stderr,
        )

    # ------------------------------------------------------------------ requested saves

    def _save_requested(self, listener: Any, request: Save) -> None:
        """Carry out a listener's :class:`~engine.events.Save`: write it, tell the loggers when
        a ``ModelCheckpoint`` asked (Lightning's ``after_save_checkpoint``), and delete what it
        replaces once it is on disk (an asynchronous one: once it has landed, see :meth:`_reap`)."""
        out = self.save_checkpoint(
            request.path, asynchronous=request.asynchronous, weights_only=request.weights_only
        )
        if _is(listener, "ModelCheckpoint"):
            for logger in self.loggers:
                if callable(getattr(logger, "after_save_checkpoint", None)):
                    logger.after_save_checkpoint(listener)
        saved = os.path.abspath(request.path)
        doomed = tuple(p for p in request.replaces if os.path.abspath(p) != saved)
        if not doomed:
            return
        if request.asynchronous:
            self._in_flight.append((out, doomed))
        else:
            for path in doomed:
                checkpoint.remove(path)

    def _reap(self, *, wait: bool) -> None:
        """Delete the checkpoints replaced by asynchronous saves that have landed (all of them,
        waiting, with ``wait``), in the order they were asked for; a save that failed or was
        cancelled leaves what it would have replaced."""
        while self._in_flight:
            future, doomed = self._in_flight[0]
            if not wait and not future.done():
                return
            self._in_flight.pop(0)
            if future.cancelled() or future.exception() is not None:
                continue
            for path in doomed:
                checkpoint.remove(path)


def _recency(path: Path) -> tuple[int, int, float]:
    """Newest first: the step, then when the checkpoint says it was saved (nanoseconds: two
    checkpoints of one step are milliseconds apart), then the directory's mtime. Raises
    ``CheckpointError`` when its ``meta.json`` fails verification."""
    meta = checkpoint.read_meta(path)
    saved_ns = meta["extra"].get("trainer", {}).get("saved_at_ns", -1)
    return meta["step"], saved_ns if isinstance(saved_ns, int) else -1, path.stat().st_mtime


class _Landing(Future):
    """``EventRecord.checkpoint_future`` of an asynchronous save: the checkpoint's path once it
    is on disk. ``fingerprint`` is the one its writer recorded, read on the writer thread right
    after the write, before a later save to the same path can replace it."""

    fingerprint: str | None = None


def _complete(landed: _Landing, write: Future[Path]) -> None:
    """Complete ``landed`` as ``write`` completed (a done-callback, on the writer thread)."""
    if landed.done():  # the save was abandoned on the loop's side
        return
    if write.cancelled():
        landed.set_exception(CancelledError(f"the asynchronous save was cancelled: {write}"))
        return
    error = write.exception()
    if error is not None:
        landed.set_exception(error)
        return
    path = write.result()
    with contextlib.suppress(checkpoint.CheckpointError, OSError):
        landed.fingerprint = checkpoint.read_meta(path).get("fingerprint")
    landed.set_result(path)


def _finite_or_str(metrics: Mapping[str, float]) -> dict[str, Any]:
    """Metrics for meta.json: JSON has no NaN or infinity, so those travel as strings."""
    return {k: (v if math.isfinite(v) else repr(float(v))) for k, v in metrics.items()}


def _is(obj: Any, cls_name: str) -> bool:
    return any(c.__name__ == cls_name for c in type(obj).__mro__)
