"""``EarlyStopping``: stop fitting when a monitored metric stops improving.

Lightning's ``EarlyStopping`` semantics, as a listener that returns :class:`~engine.events.Stop`
instead of setting ``trainer.should_stop`` (the driver sets it once every listener has had the
event, before it writes any checkpoint requested in that event):

* A *check* reads ``rec.run.callback_metrics[monitor]``. It runs at ``on_validation_end``, or at
  ``on_train_epoch_end`` when ``check_on_train_epoch_end`` is true. The default (``None``) is
  decided when fitting starts, with Lightning's rule: at the end of the training epoch when
  validation runs once per epoch, at its end (``val_check_interval == 1.0`` and
  ``check_val_every_n_epoch == 1``) or not at all; otherwise after each validation
  (:func:`engine.plan.schedule.checks_at_train_epoch_end`). Checks are skipped outside ``fit``,
  during the sanity check and under ``fast_dev_run``.
* In order: a non-finite value stops (``check_finite``); reaching ``stopping_threshold`` stops;
  being worse than ``divergence_threshold`` stops; an improvement by more than ``min_delta``
  over the best score resets the wait count; otherwise the wait count grows, and reaching
  ``patience`` stops.
* ``patience`` counts checks, not epochs.
"""

from __future__ import annotations

import enum
import math
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from engine.events import EventRecord, Listener, RunView, Stop
from engine.listeners.progress import write_message
from engine.plan import schedule

__all__ = ["EarlyStopping", "EarlyStoppingReason"]


class EarlyStoppingReason(enum.Enum):
    """Why :class:`EarlyStopping` stopped (Lightning's values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


_OPS: dict[str, Callable[[float, float], bool]] = {"min": operator.lt, "max": operator.gt}
_ORDER = {"min": "<", "max": ">"}


class EarlyStopping(Listener):
    """Stop fitting when ``monitor`` has not improved for ``patience`` checks.

    Args:
        monitor: the metric to watch, a key of ``rec.run.callback_metrics`` (``"val/loss"``).
        min_delta: an improvement must exceed this much (absolute); a change of at most
            ``min_delta`` counts as no improvement.
        patience: checks without improvement after which to stop (checks, not epochs: with
            validation every 10 epochs, ``patience=3`` trains at least 40 epochs).
        verbose: print each improvement and the reason for stopping.
        mode: ``"min"`` (stop when the metric stops decreasing) or ``"max"``.
        strict: raise if ``monitor`` is missing from the metrics; if false, skip the check
            (with a warning when ``verbose``).
        check_finite: stop as soon as the metric is NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of each training epoch (``True``) or after
            each validation (``False``); ``None`` decides when fitting starts (see the module).
        log_rank_zero_only: in a distributed run, print messages on rank 0 only.

    Attributes:
        wait_count: checks since the last improvement.
        best_score: the best value seen (``inf`` / ``-inf`` before the first check).
        stopped_epoch: the epoch in which this listener requested the stop (0 if it has not).
        stopping_reason: an :class:`EarlyStoppingReason`.
        stopping_reason_message: the message explaining the stop, or ``None``.

    Raises:
        ValueError: if ``mode`` is not ``"min"`` or ``"max"``, or ``patience`` is negative.

    Example:
        >>> from engine.events import Event, EventRecord, RunView
        >>> from engine.listeners import EarlyStopping
        >>> es = EarlyStopping("val/loss", patience=2, check_on_train_epoch_end=False)
        >>> def validate(loss):
        ...     run = RunView(stage="fit", callback_metrics={"val/loss": loss})
        ...     rec = EventRecord(Event.ON_VALIDATION_END, "fit", None, run.callback_metrics, run)
        ...     return es.on_validation_end(rec)
        >>> [validate(x) for x in (1.0, 0.5, 0.6)]
        [None, None, None]
        >>> validate(0.7)
        Stop(reason='val/loss has not improved for 2 checks (best: 0.500); stopping.')
        >>> es.best_score, es.wait_count
        (0.5, 2)
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"monitor must be a metric name such as 'val/loss' (got {monitor!r})")
        if mode not in _OPS:
            raise ValueError(f"mode must be 'min' or 'max' (got {mode!r})")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience must be a non-negative int (got {patience!r})")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.verbose = verbose
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.log_rank_zero_only = log_rank_zero_only
        # Stored with the sign that makes "current - min_delta beats best" the improvement test:
        # positive for "max", negative for "min" (Lightning's convention).
        self.min_delta = float(min_delta) * (1 if mode == "max" else -1)
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None
        self._check_on_train_epoch_end_arg = check_on_train_epoch_end
        self._check_on_train_epoch_end = check_on_train_epoch_end

    @property
    def monitor_op(self) -> Callable[[float, float], bool]:
        """``operator.lt`` for ``"min"``, ``operator.gt`` for ``"max"``: "is better than"."""
        return _OPS[self.mode]

    @property
    def state_key(self) -> str:
        """A checkpoint key that tells several EarlyStopping listeners apart (monitor, mode)."""
        return f"EarlyStopping{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    # ------------------------------------------------------------------ events

    def on_fit_start(self, rec: EventRecord) -> None:
        """Decide where checks run when ``check_on_train_epoch_end`` was left as ``None``."""
        if self._check_on_train_epoch_end_arg is None:
            self._check_on_train_epoch_end = _checks_at_train_epoch_end(rec.run)

    def on_train_epoch_end(self, rec: EventRecord) -> Stop | None:
        """Check here when ``check_on_train_epoch_end`` is true."""
        if not self._at_epoch_end(rec) or self._skip(rec):
            return None
        return self._run_check(rec)

    def on_validation_end(self, rec: EventRecord) -> Stop | None:
        """Check here unless checks run at the end of the training epoch."""
        if self._at_epoch_end(rec) or self._skip(rec):
            return None
        return self._run_check(rec)

    # ------------------------------------------------------------------ the check

    def _at_epoch_end(self, rec: EventRecord) -> bool:
        if self._check_on_train_epoch_end is None:  # no on_fit_start seen: decide now
            self._check_on_train_epoch_end = _checks_at_train_epoch_end(rec.run)
        return self._check_on_train_epoch_end

    @staticmethod
    def _skip(rec: EventRecord) -> bool:
        run = rec.run
        fast_dev_run = run.config is not None and bool(run.config.fast_dev_run)
        return rec.stage != "fit" or run.sanity_checking or fast_dev_run

    def _run_check(self, rec: EventRecord) -> Stop | None:
        metrics: Mapping[str, Any] = rec.run.callback_metrics
        if self.monitor not in metrics:
            message = (
                f"EarlyStopping(monitor={self.monitor!r}): no metric of that name; the metrics "
                f"available are {sorted(metrics)}. Pass one of them as monitor=, log the metric, "
                "or pass strict=False to skip checks while it is missing"
            )
            if self.strict:
                raise RuntimeError(message)
            if self.verbose:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return None
        current = float(metrics[self.monitor])
        should_stop, reason = self.evaluate(current)
        if should_stop:
            self.stopped_epoch = int(rec.run.current_epoch)
            self.stopping_reason_message = reason
        if reason and self.verbose:
            write_message(reason, rank_zero_only=self.log_rank_zero_only)
        return Stop(reason or "") if should_stop else None

    def evaluate(self, current: float) -> tuple[bool, str | None]:
        """Update the state with one value of the metric: ``(should_stop, message)``.

        This is the whole decision of one check, without the run; the message describes
        an improvement or the reason to stop (``None`` when neither).

        Args:
            current: the metric's value at this check.

        Example:
            >>> from engine.listeners import EarlyStopping
            >>> es = EarlyStopping("val/acc", mode="max", stopping_threshold=0.9)
            >>> es.evaluate(0.5)
            (False, 'val/acc improved; new best: 0.500')
            >>> es.evaluate(0.95)[0], es.stopping_reason.name
            (True, 'STOPPING_THRESHOLD')
        """
        if self.check_finite and not math.isfinite(current):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (
                f"{self.monitor} = {current} is not finite (best so far: "
                f"{self.best_score:.3f}); stopping."
            )
        if self.stopping_threshold is not None and self.monitor_op(
            current, self.stopping_threshold
        ):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (
                f"{self.monitor} = {current} reached the stopping threshold "
                f"({_ORDER[self.mode]} {self.stopping_threshold}); stopping."
            )
        if self.divergence_threshold is not None and self.monitor_op(
            -current, -self.divergence_threshold
        ):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (
                f"{self.monitor} = {current} is worse than the divergence threshold "
                f"{self.divergence_threshold}; stopping."
            )
        if self.monitor_op(current - self.min_delta, self.best_score):
            message = self._improvement_message(current)
            self.best_score = current
            self.wait_count = 0
            return False, message
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (
                f"{self.monitor} has not improved for {self.wait_count} checks "
                f"(best: {self.best_score:.3f}); stopping."
            )
        return False, None

    def _improvement_message(self, current: float) -> str:
        if math.isfinite(self.best_score):
            return (
                f"{self.monitor} improved by {abs(self.best_score - current):.3f} >= "
                f"min_delta = {abs(self.min_delta)}; new best: {current:.3f}"
            )
        return f"{self.monitor} improved; new best: {current:.3f}"

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The counters and best score, for checkpoints."""
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a tensor ``best_score`` is accepted)."""
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = float(state["best_score"])
        self.patience = int(state["patience"])
        self.stopping_reason = EarlyStoppingReason(
            state.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value)
        )
        self.stopping_reason_message = state.get("stopping_reason_message")

    def __repr__(self) -> str:
        return (
            f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}, "
            f"patience={self.patience}, wait_count={self.wait_count}, "
            f"best_score={self.best_score})"
        )


def _checks_at_train_epoch_end(run: RunView) -> bool:
    """Lightning's default for ``check_on_train_epoch_end``: the run's schedule
    (:func:`engine.plan.schedule.checks_at_train_epoch_end`). A view without the schedule (no
    ``config``: a test's) is judged by whether there are validation batches: checks go after
    validation when there are.
    """
    num_val = sum(run.num_val_batches)
    if run.config is None:
        return num_val == 0
    return schedule.checks_at_train_epoch_end(run.config, num_val)
