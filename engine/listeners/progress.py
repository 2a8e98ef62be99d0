"""``ProgressBar``: tqdm bars for training, validation (and the sanity check), test and predict.

Lightning's ``TQDMProgressBar`` layout: a training bar per epoch ("Epoch N", batches/total,
it/s and a postfix of the logger version and ``rec.run.progress_bar_metrics``), and below it a
validation bar that exists while a validation loop runs. Test and predict loops get a bar of
their own. A bar advances every ``refresh_rate`` batches (and on the last one); in between, a
batch costs one modulo. The postfix formats the floats the run already holds in
``progress_bar_metrics`` and the latest step's loss, read from the device at most once per
``loss_interval`` seconds, so the loss shows from the first batch without a host sync per step.

Output goes to ``sys.stdout``. When that is not a terminal (CI, ``nohup``, a notebook's log),
there are no bars but plain lines, no carriage returns: one per training epoch, at its end, and
one per dataloader of each validation, test and predict loop, as the final state of each of
Lightning's bars reads in a log file. A given ``file`` always gets bars.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from numbers import Number
from time import monotonic
from typing import IO, Any

from tqdm import tqdm

from engine.events import EventRecord, Listener, RunView

__all__ = ["ProgressBar", "write_message"]

# tqdm's default layout, but always "it/s" (never "s/it") so rates compare across runs.
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
# the same without the bar and the time left: the line a finished loop leaves in a log
_LINE_FORMAT = (
    "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}, {rate_noinv_fmt}{postfix}]"
)
_LINE_FORMAT_UNSIZED = "{desc}: {n_fmt}/? [{elapsed}, {rate_noinv_fmt}{postfix}]"
# the key of the step's loss in the postfix: the name the run logs it under
_LOSS_KEY = "train/loss"


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


def _to_float(value: Any) -> float:
    """A loss as a host float (the one device sync): a tensor's mean, or ``float(value)``."""
    numel = getattr(value, "numel", None)
    if numel is not None and numel() != 1:
        value = value.detach().float().mean()
    return float(value)


def _line(
    desc: str,
    n: int,
    total: int | None,
    elapsed: float,
    postfix: Mapping[str, Any] | None = None,
) -> str:
    """One loop's progress as a line of text, as a finished tqdm bar reads in a log file.

    Numbers in ``postfix`` are formatted as tqdm formats a bar's postfix.

    Example:
        >>> from engine.listeners.progress import _line
        >>> _line("Epoch 3", 62, 62, 4.2, {"v_num": 0, "train/loss": 0.23114})
        'Epoch 3: 100% 62/62 [00:04, 14.76it/s, v_num=0, train/loss=0.231]'
        >>> _line("Predicting DataLoader 0", 7, None, 1.0)
        'Predicting DataLoader 0: 7/? [00:01,  7.00it/s]'
    """
    text = ", ".join(
        f"{k}={tqdm.format_num(v) if isinstance(v, Number) else str(v).strip()}"
        for k, v in (postfix or {}).items()
    )
    return tqdm.format_meter(
        n,
        total,
        elapsed,
        prefix=desc,
        postfix=text,
        bar_format=_LINE_FORMAT if total else _LINE_FORMAT_UNSIZED,
    )


class _LoopBar:
    """One tqdm bar plus what it needs to follow a loop over one or more dataloaders."""

    __slots__ = ("bar", "dataloader_idx", "desc", "drawn_at", "total", "totals")

    def __init__(self, bar: Any, desc: str, totals: Sequence[int | None]) -> None:
        self.bar = bar
        self.desc = desc
        self.totals = totals
        self.dataloader_idx = -1
        self.total: int | None = None
        self.drawn_at = -math.inf  # monotonic() of the last draw

    def show(self, dataloader_idx: int, desc: str | None = None) -> None:
        """Point the bar at a dataloader: its description, total and a zero count."""
        self.dataloader_idx = dataloader_idx
        self.total = self.totals[dataloader_idx] if dataloader_idx < len(self.totals) else None
        # description first: reset() redraws the bar
        self.bar.set_description(desc or f"{self.desc} DataLoader {dataloader_idx}", refresh=False)
        self.bar.reset(total=self.total)


class _LoopLines:
    """A loop followed without a bar: counts and start times, printed as lines at its end."""

    __slots__ = (
        "dataloader_idx",
        "desc",
        "done",
        "label",
        "n",
        "started",
        "stream",
        "total",
        "totals",
    )

    def __init__(self, stream: IO[str], desc: str, totals: Sequence[int | None]) -> None:
        self.stream = stream
        self.desc = desc
        self.totals = totals
        # the dataloaders finished so far: (dataloader_idx, label, n, total, elapsed)
        self.done: list[tuple[int, str, int, int | None, float]] = []
        self.dataloader_idx = -1
        self.label = desc
        self.total: int | None = None
        self.n = 0
        self.started = monotonic()

    def show(self, dataloader_idx: int, desc: str | None = None) -> None:
        """Start counting a dataloader; keep the one before if it counted any batch."""
        if self.n:
            self.done.append(self._record())
        self.dataloader_idx = dataloader_idx
        self.label = desc or f"{self.desc} DataLoader {dataloader_idx}"
        self.total = self.totals[dataloader_idx] if dataloader_idx < len(self.totals) else None
        self.n = 0
        self.started = monotonic()

    def _record(self) -> tuple[int, str, int, int | None, float]:
        return self.dataloader_idx, self.label, self.n, self.total, monotonic() - self.started

    def print(self, postfix: Mapping[int, Mapping[str, Any]]) -> None:
        """Print a line per dataloader (``postfix[dataloader_idx]`` in each), then start over."""
        records = [*self.done, self._record()] if self.n or not self.done else self.done
        for idx, label, n, total, elapsed in records:
            self.stream.write(_line(label, n, total, elapsed, postfix.get(idx)) + "\n")
        self.stream.flush()
        self.done, self.n = [], 0


_Loop = _LoopBar | _LoopLines


class ProgressBar(Listener):
    """tqdm progress bars for every loop, refreshed every ``refresh_rate`` batches; lines in a log.

    In a terminal, the training bar's postfix shows the latest step's loss (``train/loss``)
    from the first batch on, read from the device at most once per ``loss_interval`` seconds
    (and at each epoch's and validation's end), and the metrics of the last logging step.
    When the output is not a terminal, each finished loop prints one line instead: the
    epoch with its batch count, rate and metrics (validation's included) at each training
    epoch's end, and one line per dataloader at the end of each validation (its ``val/``
    metrics), test (``test/``) and predict loop. The sanity check prints nothing: its results
    are discarded and Lightning's bar for it vanishes too.

    Args:
        refresh_rate: draw at most every this many batches (and at the last batch of a loop);
            0 turns the bars (and the lines) off.
        min_interval: and at most once per this many seconds (tqdm's ``mininterval``): drawing
            and formatting the metrics costs ~40 us, a tenth of a small model's step.
        leave: keep each epoch's finished training bar on screen (a new bar per epoch) instead
            of reusing one bar.
        file: where to draw; bars are always drawn to a given file. Default: ``sys.stdout``,
            bars when it is a terminal, else lines.
        loss_interval: read the latest step's ``outputs["loss"]`` (one host sync) at most once
            per this many seconds of drawing; ``None`` shows only ``get_metrics``.

    Raises:
        ValueError: if ``refresh_rate`` is not a non-negative int, or ``loss_interval`` is
            negative.

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

        Where the output is not a terminal (here, a ``StringIO`` in place of ``sys.stdout``),
        the epoch leaves one line:

        >>> import contextlib
        >>> log = io.StringIO()
        >>> with contextlib.redirect_stdout(log):
        ...     bar = ProgressBar()
        ...     bar.on_train_epoch_start(rec(Event.ON_TRAIN_EPOCH_START))
        ...     for i in range(4):
        ...         bar.on_train_batch_end(rec(Event.ON_TRAIN_BATCH_END, i))
        ...     bar.on_train_epoch_end(rec(Event.ON_TRAIN_EPOCH_END))
        >>> print(log.getvalue(), end="")
        Epoch 0: 100% 4/4 [00:00, ...it/s, train/loss=0.25]
    """

    rank_zero_only = True  # its output is the run's, written once
    handles_blocks = True  # a block advances the bar by its batches
    may_stop = False

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        file: IO[str] | None = None,
        min_interval: float = 0.1,
        loss_interval: float | None = 0.5,
    ):
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(
                f"refresh_rate must be a non-negative int (got {refresh_rate!r}); 0 turns the "
                "progress bar off"
            )
        if loss_interval is not None and not loss_interval >= 0:
            raise ValueError(
                f"loss_interval must be a number of seconds >= 0 (got {loss_interval!r}); None "
                "shows the loss of logging steps only"
            )
        self.refresh_rate = refresh_rate
        self.min_interval = min_interval
        self.loss_interval = loss_interval
        self.leave = leave
        self.file = file
        self._train: _Loop | None = None
        self._val: _Loop | None = None
        self._test: _Loop | None = None
        self._predict: _Loop | None = None
        self._loss: Any = None  # the latest step's loss, as the step returned it (unread)
        self._loss_value: float | None = None  # the last one read
        self._loss_read_at = -math.inf

    # ------------------------------------------------------------------ bars

    @property
    def train_progress_bar(self) -> Any:
        """The training tqdm bar, or ``None`` when there is none (not training, off, lines)."""
        return self._train.bar if isinstance(self._train, _LoopBar) else None

    @property
    def val_progress_bar(self) -> Any:
        """The validation (or sanity check) tqdm bar, or ``None``."""
        return self._val.bar if isinstance(self._val, _LoopBar) else None

    def _open(
        self,
        desc: str,
        totals: Sequence[int | None],
        *,
        position: int,
        leave: bool,
        first_desc: str | None = None,
        lines: bool = True,
    ) -> _Loop | None:
        """A bar, or where the output is not a terminal, a loop printed as lines (if
        ``lines``), or ``None``."""
        if self.refresh_rate == 0:
            return None
        stream = self.file if self.file is not None else sys.stdout
        if stream is None:
            return None  # no stdout at all (pythonw)
        if self.file is None and not _is_terminal(stream):
            if not lines:
                return None
            loop_lines = _LoopLines(stream, desc, totals)
            loop_lines.show(0, first_desc)
            return loop_lines
        bar = tqdm(
            desc=first_desc or f"{desc} DataLoader 0",
            total=totals[0] if totals else None,
            position=position,
            leave=leave,
            file=stream,
            disable=False,
            dynamic_ncols=True,
            smoothing=0,
            bar_format=_BAR_FORMAT,
        )
        loop = _LoopBar(bar, desc, totals)
        loop.dataloader_idx, loop.total = 0, totals[0] if totals else None
        return loop

    def _advance(self, loop: _Loop, rec: EventRecord, *, postfix: bool = False) -> None:
        if rec.dataloader_idx != loop.dataloader_idx:
            loop.show(rec.dataloader_idx)
        n = (rec.batch_idx or 0) + 1
        if isinstance(loop, _LoopLines):
            loop.n = n  # printed at the loop's end
            return
        # the batches since the last event: one, or a block's (steps_per_call)
        since = n - len(rec.block["loss"]) if rec.block and "loss" in rec.block else n - 1
        if n // self.refresh_rate == since // self.refresh_rate and n != loop.total:
            return
        loop.bar.n = n
        now = monotonic()
        if n != loop.total and now - loop.drawn_at < self.min_interval:
            return
        loop.drawn_at = now
        if postfix:
            loop.bar.set_postfix(self._postfix(rec.run, now), refresh=False)
        loop.bar.refresh()

    @staticmethod
    def _close(loop: _Loop | None) -> None:
        if isinstance(loop, _LoopBar):
            loop.bar.close()

    def get_metrics(self, run: RunView) -> dict[str, Any]:
        """The postfix: the loggers' version (``v_num``) and ``run.progress_bar_metrics``.

        Override to change what the bar shows (Lightning's ``get_metrics(trainer, pl_module)``
        takes the trainer; this takes the run's view, ``rec.run``). The values are host floats
        already; nothing here reads a device tensor. The training bar adds the latest step's
        loss as ``train/loss`` unless ``loss_interval`` is ``None``.
        """
        items: dict[str, Any] = {}
        version = _version(run.loggers)
        if version not in (None, ""):
            items["v_num"] = version[-4:] if isinstance(version, str) else version
        items.update(run.progress_bar_metrics)
        return items

    def _postfix(self, run: RunView, now: float | None = None) -> dict[str, Any]:
        """``get_metrics`` with the latest step's loss: read again if ``loss_interval`` has
        passed since the last read (always with ``now=None``)."""
        items = self.get_metrics(run)
        if self._loss is not None:
            assert self.loss_interval is not None  # else no loss is kept
            if now is None or now - self._loss_read_at >= self.loss_interval:
                self._loss_value = _to_float(self._loss)
                self._loss_read_at = monotonic() if now is None else now
        if self._loss_value is not None:
            items[_LOSS_KEY] = self._loss_value
        return items

    def _eval_postfix(self, loop: _Loop, run: RunView, prefix: str) -> dict[int, dict[str, Any]]:
        """Each dataloader's metrics of the stage ``prefix`` (those suffixed with its index when
        the loop has several), for the lines of an evaluation loop."""
        if not prefix:
            return {}
        metrics = {  # val/loss or val_loss: named for this stage (engine.metrics.metric_name)
            k: v
            for k, v in self.get_metrics(run).items()
            if k.startswith(prefix) and k[len(prefix) : len(prefix) + 1] in ("/", "_")
        }
        if len(loop.totals) <= 1:
            return {0: metrics}
        return {
            i: {k: v for k, v in metrics.items() if k.endswith(f"/dataloader_idx_{i}")}
            for i in range(len(loop.totals))
        }

    def _end(self, loop: _Loop | None, run: RunView, prefix: str = "") -> None:
        """Close an evaluation loop's bar, or print its lines."""
        if isinstance(loop, _LoopLines):
            loop.print(self._eval_postfix(loop, run, prefix))
        self._close(loop)

    def _forget_loss(self) -> None:
        self._loss = self._loss_value = None
        self._loss_read_at = -math.inf

    # ------------------------------------------------------------------ training

    def on_train_epoch_start(self, rec: EventRecord) -> None:
        """Show the epoch's training bar: ``Epoch N`` over the epoch's batches.

        One bar is reset for every epoch; with ``leave`` each epoch gets a new bar.
        """
        run = rec.run
        totals = [_count(run.num_training_batches)]
        desc = f"Epoch {run.current_epoch}"
        if self._train is None or (self.leave and isinstance(self._train, _LoopBar)):
            self._close(self._train)
            self._train = self._open("Epoch", totals, position=0, leave=True, first_desc=desc)
        else:
            self._train.totals = totals
            self._train.show(0, desc)

    def on_train_batch_end(self, rec: EventRecord) -> None:
        """Keep the step's loss (unread); advance the training bar on refresh steps."""
        loop = self._train
        if loop is None:
            return
        outputs = rec.outputs
        if isinstance(outputs, dict) and self.loss_interval is not None:
            self._loss = outputs.get("loss")
        self._advance(loop, rec, postfix=True)

    def on_train_epoch_end(self, rec: EventRecord) -> None:
        """Show the epoch's final metrics, or print the epoch's line; close the bar when each
        epoch keeps its own."""
        loop = self._train
        if loop is None:
            return
        if isinstance(loop, _LoopLines):
            loop.print({0: self._postfix(rec.run)})
            return
        loop.bar.set_postfix(self._postfix(rec.run))
        if self.leave:
            self._close(loop)
            self._train = None

    def on_train_end(self, rec: EventRecord) -> None:
        """Close the training bar."""
        self._close(self._train)
        self._train = None
        self._forget_loss()

    # ------------------------------------------------------------------ validation

    def on_sanity_check_start(self, rec: EventRecord) -> None:
        """Open the sanity-check bar (it closes when the sanity check ends); no line."""
        run = rec.run
        limit = run.config.num_sanity_val_steps if run.config is not None else math.inf
        totals = [_count(min(limit, n)) for n in run.num_val_batches]
        self._close(self._val)
        self._val = self._open("Sanity Checking", totals, position=0, leave=False, lines=False)

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
        """Close the validation bar (or print its lines, with the ``val/`` metrics); show the
        new validation metrics on the training bar."""
        if rec.run.sanity_checking:
            return  # closed by on_sanity_check_end
        self._end(self._val, rec.run, "val")
        self._val = None
        if isinstance(self._train, _LoopBar):
            self._train.bar.set_postfix(self._postfix(rec.run))

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
        """Close the test bar, or print its lines with the ``test/`` metrics."""
        self._end(self._test, rec.run, "test")
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
        """Close the predict bar, or print its lines."""
        self._end(self._predict, rec.run)
        self._predict = None

    def on_exception(self, rec: EventRecord) -> None:
        """Close every open bar so the traceback is not drawn over; print the lines of the
        loops that were running (the loss as last read: the device is not asked again)."""
        for loop in (self._train, self._val, self._test, self._predict):
            if isinstance(loop, _LoopLines) and loop.n:
                metrics = self.get_metrics(rec.run) if loop is self._train else {}
                if loop is self._train and self._loss_value is not None:
                    metrics[_LOSS_KEY] = self._loss_value
                loop.print({loop.dataloader_idx: metrics})
        for loop in (self._val, self._test, self._predict, self._train):
            self._close(loop)
        self._train = self._val = self._test = self._predict = None
        self._forget_loss()

    def __getstate__(self) -> dict[str, Any]:
        # tqdm bars hold a file handle and a lock; a pickled listener starts without bars
        # (and a file may not pickle): a copy starts without bars, drawing to stdout
        state = dict(vars(self))
        for key in ("_train", "_val", "_test", "_predict", "file", "_loss", "_loss_value"):
            state[key] = None
        state["_loss_read_at"] = -math.inf
        return state


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (what tqdm's ``disable=None`` asks)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


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
