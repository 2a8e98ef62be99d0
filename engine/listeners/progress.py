"""``ProgressBar``: tqdm bars for training, validation (and the sanity check), test and predict.

Lightning's ``TQDMProgressBar`` layout: a training bar per epoch ("Epoch N", batches/total,
it/s and a postfix of the logger version and ``rec.run.progress_bar_metrics``), and below it a
validation bar that exists while a validation loop runs. Test and predict loops get a bar of
their own. A bar advances every ``refresh_rate`` batches (and on the last one); in between, a
batch costs one modulo. The postfix only formats the floats the run already holds in
``progress_bar_metrics``, so drawing never waits for the device.

Output goes to ``sys.stdout`` and, as with tqdm's ``disable=None``, no bar is drawn when it is
not a terminal (logs, CI) -- unless a ``file`` is given, which always gets bars.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from tqdm import tqdm

from engine.events import EventRecord, Listener, RunView

__all__ = ["ProgressBar", "write_message"]

# tqdm's default layout, but always "it/s" (never "s/it") so rates compare across runs.
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"


def _rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


def write_message(
    message: str, *, rank_zero_only: bool = False, file: IO[str] | None = None
) -> None:
    """Print ``message`` without breaking any tqdm bar on screen.

    In a distributed run the message is prefixed with ``[rank: N]``; with ``rank_zero_only``
    only rank 0 prints it.

    Args:
        message: the text to print.
        rank_zero_only: print on rank 0 only.
        file: where to print (default ``sys.stdout``).

    Example:
        >>> from engine.listeners.progress import write_message
        >>> write_message("val/loss improved")
        val/loss improved
    """
    rank = _rank()
    if rank is not None:
        if rank_zero_only and rank != 0:
            return
        message = f"[rank: {rank}] {message}"
    tqdm.write(message, file=file)


def _count(value: float | None) -> int | None:
    """A batch count for tqdm: ``None`` for unknown or infinite."""
    if value is None or math.isinf(value) or math.isnan(value):
        return None
    return int(value)


class _LoopBar:
    """One tqdm bar plus what it needs to follow a loop over one or more dataloaders."""

    __slots__ = ("bar", "dataloader_idx", "desc", "drawn_at", "total", "totals")

    def __init__(self, bar: Any, desc: str, totals: Sequence[int | None]) -> None:
        self.bar = bar
        self.desc = desc
        self.totals = totals
        self.dataloader_idx = -1
        self.total: int | None = None
        self.drawn_at = -math.inf  # time.monotonic() of the last draw

    def show(self, dataloader_idx: int, desc: str | None = None) -> None:
        """Point the bar at a dataloader: its description, total and a zero count."""
        self.dataloader_idx = dataloader_idx
        self.total = self.totals[dataloader_idx] if dataloader_idx < len(self.totals) else None
        # description first: reset() redraws the bar
        self.bar.set_description(desc or f"{self.desc} DataLoader {dataloader_idx}", refresh=False)
        self.bar.reset(total=self.total)


class ProgressBar(Listener):
    """tqdm progress bars for every loop, refreshed every ``refresh_rate`` batches.

    Args:
        refresh_rate: draw at most every this many batches (and at the last batch of a loop);
            0 turns the bars off.
        min_interval: and at most once per this many seconds (tqdm's ``mininterval``): drawing
            and formatting the metrics costs ~40 us, a tenth of a small model's step.
        leave: keep each epoch's finished training bar on screen (a new bar per epoch) instead
            of reusing one bar.
        file: where to draw; bars are always drawn to a given file. Default: ``sys.stdout``,
            only when it is a terminal.

    Raises:
        ValueError: if ``refresh_rate`` is not a non-negative int.

    Example:
        >>> import io
        >>> from engine.events import Event, EventRecord, RunView
        >>> from engine.listeners import ProgressBar
        >>> out = io.StringIO()
        >>> bar = ProgressBar(refresh_rate=2, file=out)
        >>> run = RunView(stage="fit", num_training_batches=4,
        ...               progress_bar_metrics={"train/loss": 0.25})
        >>> def rec(event, batch_idx=None):
        ...     return EventRecord(event, "fit", None, {}, run, batch_idx=batch_idx)
        >>> bar.on_train_epoch_start(rec(Event.ON_TRAIN_EPOCH_START))
        >>> for i in range(4):
        ...     bar.on_train_batch_end(rec(Event.ON_TRAIN_BATCH_END, i))
        >>> bar.on_train_end(rec(Event.ON_TRAIN_END))
        >>> last = out.getvalue().split("\\r")[-1]
        >>> "Epoch 0" in last and "4/4" in last and "train/loss=0.25" in last
        True
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        file: IO[str] | None = None,
        min_interval: float = 0.1,
    ):
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(
                f"refresh_rate must be a non-negative int (got {refresh_rate!r}); 0 turns the "
                "progress bar off"
            )
        self.refresh_rate = refresh_rate
        self.min_interval = min_interval
        self.leave = leave
        self.file = file
        self._train: _LoopBar | None = None
        self._val: _LoopBar | None = None
        self._test: _LoopBar | None = None
        self._predict: _LoopBar | None = None

    # ------------------------------------------------------------------ bars

    @property
    def train_progress_bar(self) -> Any:
        """The training tqdm bar, or ``None`` when there is none (not training, or off)."""
        return self._train.bar if self._train is not None else None

    @property
    def val_progress_bar(self) -> Any:
        """The validation (or sanity check) tqdm bar, or ``None``."""
        return self._val.bar if self._val is not None else None

    def _open(
        self,
        desc: str,
        totals: Sequence[int | None],
        *,
        position: int,
        leave: bool,
        first_desc: str | None = None,
    ) -> _LoopBar | None:
        if self.refresh_rate == 0:
            return None
        to_file = self.file is not None
        bar = tqdm(
            desc=first_desc or f"{desc} DataLoader 0",
            total=totals[0] if totals else None,
            position=position,
            leave=leave,
            file=self.file if to_file else sys.stdout,
            disable=False if to_file else None,  # None: off unless a terminal (tqdm's rule)
            dynamic_ncols=True,
            smoothing=0,
            bar_format=_BAR_FORMAT,
        )
        if bar.disable:
            return None
        loop = _LoopBar(bar, desc, totals)
        loop.dataloader_idx, loop.total = 0, totals[0] if totals else None
        return loop

    def _advance(self, loop: _LoopBar, rec: EventRecord, *, postfix: bool = False) -> None:
        if rec.dataloader_idx != loop.dataloader_idx:
            loop.show(rec.dataloader_idx)
        n = (rec.batch_idx or 0) + 1
        if n % self.refresh_rate and n != loop.total:
            return
        loop.bar.n = n
        now = time.monotonic()
        if n != loop.total and now - loop.drawn_at < self.min_interval:
            return
        loop.drawn_at = now
        if postfix:
            loop.bar.set_postfix(self.get_metrics(rec.run), refresh=False)
        loop.bar.refresh()

    @staticmethod
    def _close(loop: _LoopBar | None) -> None:
        if loop is not None:
            loop.bar.close()

    def get_metrics(self, run: RunView) -> dict[str, Any]:
        """The postfix: the loggers' version (``v_num``) and ``run.progress_bar_metrics``.

        Override to change what the bar shows (Lightning's ``get_metrics(trainer, pl_module)``
        takes the trainer; this takes the run's view, ``rec.run``). The values are host floats
        already; nothing here reads a device tensor.
        """
        items: dict[str, Any] = {}
        version = _version(run.loggers)
        if version not in (None, ""):
            items["v_num"] = version[-4:] if isinstance(version, str) else version
        items.update(run.progress_bar_metrics)
        return items

    # ------------------------------------------------------------------ training

    def on_train_epoch_start(self, rec: EventRecord) -> None:
        """Show the epoch's training bar: ``Epoch N`` over the epoch's batches.

        One bar is reset for every epoch; with ``leave`` each epoch gets a new bar.
        """
        run = rec.run
        totals = [_count(run.num_training_batches)]
        desc = f"Epoch {run.current_epoch}"
        if self._train is None or self.leave:
            self._close(self._train)
            self._train = self._open("Epoch", totals, position=0, leave=True, first_desc=desc)
        else:
            self._train.totals = totals
            self._train.show(0, desc)

    def on_train_batch_end(self, rec: EventRecord) -> None:
        """Advance the training bar on refresh steps, with a fresh postfix."""
        if self._train is not None:
            self._advance(self._train, rec, postfix=True)

    def on_train_epoch_end(self, rec: EventRecord) -> None:
        """Show the epoch's final metrics; close the bar when each epoch keeps its own."""
        if self._train is None:
            return
        self._train.bar.set_postfix(self.get_metrics(rec.run))
        if self.leave:
            self._close(self._train)
            self._train = None

    def on_train_end(self, rec: EventRecord) -> None:
        """Close the training bar."""
        self._close(self._train)
        self._train = None

    # ------------------------------------------------------------------ validation

    def on_sanity_check_start(self, rec: EventRecord) -> None:
        """Open the sanity-check bar (it closes when the sanity check ends)."""
        run = rec.run
        limit = run.config.num_sanity_val_steps if run.config is not None else math.inf
        totals = [_count(min(limit, n)) for n in run.num_val_batches]
        self._close(self._val)
        self._val = self._open("Sanity Checking", totals, position=0, leave=False)

    def on_sanity_check_end(self, rec: EventRecord) -> None:
        """Close the sanity-check bar."""
        self._close(self._val)
        self._val = None

    def on_validation_start(self, rec: EventRecord) -> None:
        """Open the validation bar (below the training bar while fitting)."""
        if rec.run.sanity_checking:
            return  # the sanity-check bar is already open
        fitting = rec.stage == "fit"
        totals = [_count(n) for n in rec.run.num_val_batches]
        self._close(self._val)
        self._val = self._open("Validation", totals, position=int(fitting), leave=not fitting)

    def on_validation_batch_end(self, rec: EventRecord) -> None:
        """Advance the validation bar on refresh steps."""
        if self._val is not None:
            self._advance(self._val, rec)

    def on_validation_end(self, rec: EventRecord) -> None:
        """Close the validation bar; show the new validation metrics on the training bar."""
        if rec.run.sanity_checking:
            return  # closed by on_sanity_check_end
        self._close(self._val)
        self._val = None
        if self._train is not None:
            self._train.bar.set_postfix(self.get_metrics(rec.run))

    # ------------------------------------------------------------------ test and predict

    def on_test_start(self, rec: EventRecord) -> None:
        """Open the test bar."""
        totals = [_count(n) for n in rec.run.num_test_batches]
        self._close(self._test)
        self._test = self._open("Testing", totals, position=0, leave=True)

    def on_test_batch_end(self, rec: EventRecord) -> None:
        """Advance the test bar on refresh steps."""
        if self._test is not None:
            self._advance(self._test, rec)

    def on_test_end(self, rec: EventRecord) -> None:
        """Close the test bar."""
        self._close(self._test)
        self._test = None

    def on_predict_start(self, rec: EventRecord) -> None:
        """Open the predict bar."""
        totals = [_count(n) for n in rec.run.num_predict_batches]
        self._close(self._predict)
        self._predict = self._open("Predicting", totals, position=0, leave=True)

    def on_predict_batch_end(self, rec: EventRecord) -> None:
        """Advance the predict bar on refresh steps."""
        if self._predict is not None:
            self._advance(self._predict, rec)

    def on_predict_end(self, rec: EventRecord) -> None:
        """Close the predict bar."""
        self._close(self._predict)
        self._predict = None

    def on_exception(self, rec: EventRecord) -> None:
        """Close every open bar so the traceback is not drawn over."""
        for loop in (self._val, self._test, self._predict, self._train):
            self._close(loop)
        self._train = self._val = self._test = self._predict = None

    def __getstate__(self) -> dict[str, Any]:
        # tqdm bars hold a file handle and a lock; a pickled listener starts without bars
        # (and a file may not pickle): a copy starts without bars, drawing to stdout
        state = dict(vars(self))
        for key in ("_train", "_val", "_test", "_predict", "file"):
            state[key] = None
        return state


def _version(loggers: Sequence[Any]) -> Any:
    """The loggers' version: the one version, or the distinct ones joined by ``_``."""
    versions: list[Any] = []
    for lg in loggers:
        v = getattr(lg, "version", None)
        if v is not None and v not in versions:
            versions.append(v)
    if not versions:
        return None
    return versions[0] if len(versions) == 1 else "_".join(map(str, versions))
