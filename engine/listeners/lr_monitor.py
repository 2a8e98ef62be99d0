"""``LearningRateMonitor``: log the learning rate the optimizer uses, named as Lightning names it.

The rate is read from the optimizer state (an ``optim.inject_hyperparams`` optimizer, whose rate
a transition may change) or the task (``Task(lr=...)``: a float or a schedule ``step -> lr``),
evaluated at ``state.step`` -- the number of optimizer steps taken, which is the step the
schedule is evaluated at by the next optimizer update. As in Lightning, it is logged at the start
of a training batch (``logging_interval="step"``, the rate this batch's update will use) or of a
training epoch (``"epoch"``), by returning :class:`~engine.events.Log` at ``step=state.step``
(the driver sends it to the loggers once every listener has had the event).

**Names** are Lightning's: ``lr-<optimizer>`` after the ``torch.optim`` class the optimizer
matches (``optim.adamw`` is ``lr-AdamW``, ``optim.from_torch(torch.optim.RAdam)`` is
``lr-RAdam``; a transformation of your own without a ``name`` is ``lr``). An
``optim.multi_transform`` of one optimizer is one optimizer with parameter groups: each group's
rate is ``lr-AdamW/<label>`` for a string label (Lightning's named param group) and
``lr-AdamW/pg<i>`` (from 1, in the order of the groups) for any other. The momentum is
``<name>-momentum``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch.utils._pytree as pytree

from engine.events import EventRecord, Listener, Log, RunView
from engine.optim.inject import get_hyperparams
from engine.optim.masking import MultiTransformState
from engine.state import TrainState

__all__ = ["LearningRateMonitor"]


def _value(value: Any, step: int) -> float:
    return float(value(step) if callable(value) else value)


def _injected(opt_state: Any) -> float | None:
    """The learning rate an ``optim.inject_hyperparams`` optimizer keeps in ``opt_state``, if
    it holds exactly one."""
    if opt_state is None:
        return None
    try:
        return get_hyperparams(opt_state).get("lr")
    except ValueError:
        return None


def _groups(opt_state: Any) -> dict[Any, Any] | None:
    """The per-group states of the one ``optim.multi_transform`` in ``opt_state``, if any."""
    is_leaf = lambda x: isinstance(x, MultiTransformState)  # noqa: E731
    found = [x for x in pytree.tree_leaves(opt_state, is_leaf=is_leaf) if is_leaf(x)]
    return dict(found[0].inner) if len(found) == 1 and len(found[0].inner) > 0 else None


def _group_name(label: Any, i: int) -> str:
    """Lightning's param group suffix: the group's name, else ``pg<i + 1>``."""
    return label if isinstance(label, str) and label else f"pg{i + 1}"


def _state(rec: EventRecord) -> TrainState:
    state = rec.state
    if state is None:
        raise RuntimeError(f"LearningRateMonitor: {rec.event.value} arrived without a TrainState")
    return state


class LearningRateMonitor(Listener):
    """Log the learning rate (and optionally the momentum) with the run's loggers.

    Args:
        logging_interval: ``"step"`` (every logging step), ``"epoch"`` (every epoch start) or
            ``None``: Lightning's default, the logging steps and, for a rate that is no
            schedule (a float, or one the state holds), every epoch start too.
        log_momentum: also log ``<name>-momentum`` from the task's ``momentum`` attribute (a
            float or a schedule ``step -> momentum``), when it has one.

    Attributes:
        lrs: ``{name: [...]}``, every rate logged, by name, in order (Lightning's ``lrs``).

    Raises:
        ValueError: if ``logging_interval`` is not ``"step"``, ``"epoch"`` or ``None``.

    In step mode the rate is logged once per optimizer step (at the first micro-batch of an
    accumulation window), and only on the logging steps (``rec.run.config.log_every_n_steps``:
    Lightning logs when ``(step + 1) % log_every_n_steps == 0``, or when the run is stopping).

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
        Log(metrics={'lr-SGD': 0.1}, step=0)
        Log(metrics={'lr-SGD': 0.1}, step=1)
        Log(metrics={'lr-SGD': 0.010000000000000002}, step=2)
    """

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"logging_interval must be 'step', 'epoch' or None (got {logging_interval!r})"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.lrs: dict[str, list[float]] = {}
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
        state = rec.state
        opt_state = state.opt_state if state is not None else None
        groups = _groups(opt_state) or {}
        if (
            getattr(task, "lr", None) is None
            and _injected(opt_state) is None
            and (not groups or any(_injected(g) is None for g in groups.values()))
        ):
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
        self.lrs = {}
        self._last_step = None

    def on_train_batch_start(self, rec: EventRecord) -> Log | None:
        """In step mode (and Lightning's default): log the rates this batch's update uses."""
        if self.logging_interval == "epoch":
            return None
        state = _state(rec)
        if state.micro_step or state.step == self._last_step:
            return None  # one record per optimizer step, not per micro-batch
        config = rec.run.config
        every = config.log_every_n_steps if config is not None else None
        if every and (state.step + 1) % every and not rec.run.should_stop:
            return None
        return self._log(rec.run, state)

    def on_train_epoch_start(self, rec: EventRecord) -> Log | None:
        """In epoch mode: log the rates at the epoch's first step; by default (Lightning's
        ``None``), those that are no schedule."""
        if self.logging_interval == "step":
            return None
        state = _state(rec)
        if self.logging_interval is None and callable(getattr(rec.run.task, "lr", None)):
            return None  # a schedule is a step-interval scheduler: logged at its steps
        return self._log(rec.run, state)

    def rates(self, run: RunView, state: TrainState) -> dict[str, float]:
        """The learning rates (and momenta) at ``state.step``, by Lightning's names."""
        task, step = run.task, state.step
        tx_name = getattr(getattr(task, "tx", None), "name", None)
        base = f"lr-{tx_name}" if tx_name else "lr"
        lr = getattr(task, "lr", None)
        injected = _injected(state.opt_state)  # a rate a transition may have changed
        groups = _groups(state.opt_state)
        named: list[tuple[str, float]] = []
        if groups is None or (injected is not None and not isinstance(lr, Mapping)):
            named.append((base, injected if injected is not None else _value(lr, step)))
        else:
            for i, (label, group_state) in enumerate(groups.items()):
                own = _injected(group_state)
                if own is None:
                    own = _value(lr[label] if isinstance(lr, Mapping) else lr, step)
                named.append((f"{base}/{_group_name(label, i)}", own))
        stats: dict[str, float] = {}
        momentum = getattr(task, "momentum", None) if self.log_momentum else None
        for name, rate in named:
            stats[name] = rate
            if momentum is not None:
                stats[f"{name}-momentum"] = _value(momentum, step)
        return stats

    def _log(self, run: RunView, state: TrainState) -> Log:
        stats = self.rates(run, state)
        for name, value in stats.items():
            if not name.endswith("-momentum"):
                self.lrs.setdefault(name, []).append(value)
        self._last_step = state.step
        return Log(stats, step=state.step)

    def state_dict(self) -> dict[str, Any]:
        """Nothing to carry: the rate is a function of the step, or in the state."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore."""
        return None
