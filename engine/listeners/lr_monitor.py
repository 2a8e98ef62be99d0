"""``LearningRateMonitor``: log the learning rate the optimizer uses, as metric ``"lr"``.

The rate is read from the task (``Task(lr=...)``: a float or a schedule ``step -> lr``),
evaluated at ``state.step`` -- the number of optimizer steps taken, which is the step the
schedule is evaluated at by the next optimizer update. As in Lightning, it is logged at the start
of a training batch (``logging_interval="step"``, the rate this batch's update will use) or of a
training epoch (``"epoch"``), by returning :class:`~engine.events.Log` at ``step=state.step``
(the driver sends it to the loggers once every listener has had the event).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from engine.events import EventRecord, Listener, Log, RunView
from engine.optim.inject import get_hyperparams
from engine.state import TrainState

__all__ = ["LearningRateMonitor"]


def _value(value: Any, step: int) -> float:
    return float(value(step) if callable(value) else value)


def _injected(state: TrainState | None) -> float | None:
    """The learning rate an ``optim.inject_hyperparams`` optimizer keeps in the state, if any."""
    if state is None:
        return None
    try:
        return get_hyperparams(state.opt_state).get("lr")
    except ValueError:
        return None


def _state(rec: EventRecord) -> TrainState:
    state = rec.state
    if state is None:
        raise RuntimeError(f"LearningRateMonitor: {rec.event.value} arrived without a TrainState")
    return state


class LearningRateMonitor(Listener):
    """Log the learning rate (and optionally the momentum) with the run's loggers.

    Args:
        logging_interval: ``"step"`` (every optimizer step), ``"epoch"`` (every epoch start) or
            ``None``; engine schedules are functions of the step, so ``None`` means ``"step"``.
        log_momentum: also log ``"momentum"`` from the task's ``momentum`` attribute (a float or
            a schedule ``step -> momentum``), when it has one.

    Attributes:
        lrs: ``{"lr": [...]}``, every rate logged, in order.

    Raises:
        ValueError: if ``logging_interval`` is not ``"step"``, ``"epoch"`` or ``None``.

    In step mode the rate is logged once per optimizer step (at the first micro-batch of an
    accumulation window), and only on the logging steps (``rec.run.config.log_every_n_steps``:
    Lightning logs when ``(step + 1) % log_every_n_steps == 0``).

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.events import Event, EventRecord, RunView
        >>> from engine.listeners import LearningRateMonitor
        >>> run = RunView(loggers=["a logger"], task=eg.Task(lambda m, b: 0.0, optim.sgd(0.1),
        ...                                                  lr=optim.step_lr(0.1, 2)))
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> monitor = LearningRateMonitor(logging_interval="step")
        >>> monitor.on_fit_start(EventRecord(Event.ON_FIT_START, "fit", state, {}, run))
        >>> for step in range(3):
        ...     rec = EventRecord(Event.ON_TRAIN_BATCH_START, "fit", state.replace(step=step),
        ...                       {}, run, batch_idx=step)
        ...     print(monitor.on_train_batch_start(rec))
        Log(metrics={'lr': 0.1}, step=0)
        Log(metrics={'lr': 0.1}, step=1)
        Log(metrics={'lr': 0.010000000000000002}, step=2)
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"logging_interval must be 'step', 'epoch' or None (got {logging_interval!r})"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.lrs: dict[str, list[float]] = {"lr": []}
        self._last_step: int | None = None

    def on_fit_start(self, rec: EventRecord) -> None:
        """Check that there is a logger to send to and a learning rate to read."""
        if not rec.run.loggers:
            raise RuntimeError(
                "LearningRateMonitor needs a logger to send the learning rate to, and the "
                "Trainer has none; pass Trainer(logger=...) (e.g. engine.loggers.CSVLogger) or "
                "remove the LearningRateMonitor"
            )
        task = rec.run.task
        if getattr(task, "lr", None) is None and _injected(rec.state) is None:
            raise RuntimeError(
                "LearningRateMonitor reads the learning rate from the optimizer state (an "
                "optim.inject_hyperparams optimizer) or the task, and this run has neither; pass "
                "Task(lr=...) with the same float or schedule the optimizer uses"
            )
        if self.log_momentum and getattr(task, "momentum", None) is None:
            warnings.warn(
                "LearningRateMonitor(log_momentum=True): the task has no `momentum` attribute, "
                "so no momentum is logged; give the task a momentum (float or schedule) or pass "
                "log_momentum=False",
                RuntimeWarning,
                stacklevel=2,
            )
        self.lrs = {"lr": []}
        self._last_step = None

    def on_train_batch_start(self, rec: EventRecord) -> Log | None:
        """In step mode: log the rate this batch's optimizer update uses."""
        if self.logging_interval == "epoch":
            return None
        state = _state(rec)
        if state.micro_step or state.step == self._last_step:
            return None  # one record per optimizer step, not per micro-batch
        config = rec.run.config
        every = config.log_every_n_steps if config is not None else None
        if every and (state.step + 1) % every:
            return None
        return self._log(rec.run, state)

    def on_train_epoch_start(self, rec: EventRecord) -> Log | None:
        """In epoch mode: log the rate at the epoch's first step."""
        if self.logging_interval != "epoch":
            return None
        state = _state(rec)
        return self._log(rec.run, state)

    def _log(self, run: RunView, state: TrainState) -> Log:
        task, step = run.task, state.step
        injected = _injected(state)  # a rate a transition may have changed: the state's
        lr = injected if injected is not None else _value(getattr(task, "lr", None), step)
        stats = {"lr": lr}
        momentum = getattr(task, "momentum", None) if self.log_momentum else None
        if momentum is not None:
            stats["momentum"] = _value(momentum, step)
        self.lrs["lr"].append(stats["lr"])
        self._last_step = step
        return Log(stats, step=step)

    def state_dict(self) -> dict[str, Any]:
        """Nothing to carry: the rate is a function of the step, or in the state."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore."""
        return None
