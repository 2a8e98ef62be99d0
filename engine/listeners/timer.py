"""``Timer``: time each loop and stop fitting when a time budget is spent.

Lightning's ``Timer``: stages ``"train"`` (from ``on_train_start`` to ``on_train_end``; ``"fit"``
is accepted as a synonym), ``"sanity_check"``, ``"validate"`` (the latest validation loop),
``"test"`` and ``"predict"``. With a ``duration``, it requests a stop once the training time
reaches it: after each training batch (``interval="step"``) or epoch (``"epoch"``), and when
fitting starts (a resumed run whose budget is already spent stops at once). The training time
travels in checkpoints, so a resumed run keeps counting from where it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from time import monotonic as _monotonic
from typing import Any

from engine.events import EventRecord, Listener, Stop
from engine.listeners.progress import write_message
from engine.plan._duration import parse_duration

__all__ = ["Timer", "parse_duration"]

_STAGES = ("train", "sanity_check", "validate", "test", "predict")
_ALIASES = {"fit": "train", "training": "train", "validation": "validate"}


def _stage(stage: str) -> str:
    name = _ALIASES.get(stage, stage)
    if name not in _STAGES:
        raise ValueError(f"unknown stage {stage!r}; use one of {', '.join(_STAGES)} (or 'fit')")
    return name


class Timer(Listener):
    """Measure the time of each loop; request a stop when training has run for ``duration``.

    Args:
        duration: the training time budget: ``"DD:HH:MM:SS"``, a ``timedelta``, a dict of
            ``timedelta`` keywords, or ``None`` for no limit (only measure).
        interval: check the budget after every training batch (``"step"``) or only at the end
            of each epoch (``"epoch"``).
        verbose: print a message when the budget is spent.

    Raises:
        ValueError: if ``duration`` cannot be parsed (see :func:`parse_duration`) or
            ``interval`` is not ``"step"`` or ``"epoch"``.

    Example:
        >>> from engine.events import Event, EventRecord
        >>> from engine.listeners import Timer
        >>> timer = Timer(duration={"seconds": 0}, verbose=False)
        >>> rec = EventRecord(Event.ON_TRAIN_START, "fit", None, {})
        >>> timer.on_train_start(rec)
        >>> timer.on_train_batch_end(rec)  # 0 seconds: spent at once
        Stop(reason='time limit reached: ...')
        >>> timer.time_elapsed("train") >= 0, timer.time_remaining("train") <= 0
        (True, True)
    """

    def __init__(
        self,
        duration: str | timedelta | Mapping[str, float] | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        parsed = parse_duration(duration)
        if interval not in ("step", "epoch"):
            raise ValueError(f"interval must be 'step' or 'epoch' (got {interval!r})")
        self.duration = parsed.total_seconds() if parsed is not None else None
        self.interval = interval
        self.verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0  # training seconds from before a resume

    # ------------------------------------------------------------------ queries

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (``time.monotonic()`` seconds), or ``None``."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended (``time.monotonic()`` seconds), or ``None``."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage``'s latest run (so far, if it is running).

        For ``"train"`` this includes the time restored from a checkpoint.
        """
        name = _stage(stage)
        offset = self._offset if name == "train" else 0.0
        start, end = self._start[name], self._end[name]
        if start is None:
            return offset
        return (end if end is not None else _monotonic()) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds of the budget left (negative once exceeded), or ``None`` without one."""
        if self.duration is None:
            return None
        return self.duration - self.time_elapsed(stage)

    # ------------------------------------------------------------------ stage clocks

    def _begin(self, stage: str) -> None:
        self._start[stage] = _monotonic()
        self._end[stage] = None

    def _finish(self, stage: str) -> None:
        self._end[stage] = _monotonic()

    def on_train_start(self, rec: EventRecord) -> None:
        """Start the training clock."""
        self._begin("train")

    def on_train_end(self, rec: EventRecord) -> None:
        """Stop the training clock."""
        self._finish("train")

    def on_sanity_check_start(self, rec: EventRecord) -> None:
        """Start the sanity-check clock."""
        self._begin("sanity_check")

    def on_sanity_check_end(self, rec: EventRecord) -> None:
        """Stop the sanity-check clock."""
        self._finish("sanity_check")

    def on_validation_start(self, rec: EventRecord) -> None:
        """Start the validation clock (the sanity check has its own)."""
        if rec.stage != "sanity_check":
            self._begin("validate")

    def on_validation_end(self, rec: EventRecord) -> None:
        """Stop the validation clock."""
        if rec.stage != "sanity_check":
            self._finish("validate")

    def on_test_start(self, rec: EventRecord) -> None:
        """Start the test clock."""
        self._begin("test")

    def on_test_end(self, rec: EventRecord) -> None:
        """Stop the test clock."""
        self._finish("test")

    def on_predict_start(self, rec: EventRecord) -> None:
        """Start the predict clock."""
        self._begin("predict")

    def on_predict_end(self, rec: EventRecord) -> None:
        """Stop the predict clock."""
        self._finish("predict")

    # ------------------------------------------------------------------ the budget

    def on_fit_start(self, rec: EventRecord) -> Stop | None:
        """Stop at once if a restored budget is already spent."""
        return self._check()

    handles_blocks = True  # under steps_per_call the budget is checked after each block

    def on_train_batch_end(self, rec: EventRecord) -> Stop | None:
        """With ``interval="step"``, stop once the budget is spent."""
        return self._check() if self.interval == "step" else None

    def on_train_epoch_end(self, rec: EventRecord) -> Stop | None:
        """With ``interval="epoch"``, stop once the budget is spent."""
        return self._check() if self.interval == "epoch" else None

    def _check(self) -> Stop | None:
        if self.duration is None:
            return None
        elapsed = self.time_elapsed("train")
        if elapsed < self.duration:
            return None
        message = f"time limit reached: {timedelta(seconds=int(elapsed))} of training"
        if self.verbose:
            write_message(f"Timer: {message}; stopping.")
        return Stop(message)

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Seconds elapsed per stage; the training time is restored by :meth:`load_state_dict`."""
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in _STAGES}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue counting training time from the saved total."""
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
        # The saved total already includes this object's own past runs, if any.
        self._start["train"] = self._end["train"] = None

    def __repr__(self) -> str:
        return f"Timer(duration={self.duration}, interval={self.interval!r})"
