"""Learning rates that change with what training observes, as journaled state transitions.

Lightning steps the schedulers ``configure_optimizers`` returns, with a config of ``interval``
(``"epoch"`` or ``"step"``), ``frequency`` and, for ``ReduceLROnPlateau``, ``monitor`` and
``strict``. In engine a learning rate that is a function of the step is a schedule
(``optim.adamw(optim.warmup_cosine(...))``) and needs nothing here. These listeners are for the
rest: :class:`ReduceLROnPlateau` (the monitored metric decides) and :class:`LearningRateSchedule`
(a schedule stepped per epoch, or every ``frequency`` epochs). Each change is a
:class:`~engine.events.Transition` that sets the learning rate kept in the optimizer state by
:func:`engine.optim.inject_hyperparams`, so a checkpoint holds it, a resume continues it and
:func:`engine.replay` applies it again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from engine.events import EventRecord, Listener, Transition
from engine.optim.inject import get_hyperparams, set_hyperparams

__all__ = ["LearningRateSchedule", "ReduceLROnPlateau"]

_INTERVALS = ("epoch", "step")


def _check_interval(owner: str, interval: Any, frequency: Any) -> None:
    if interval not in _INTERVALS:
        raise ValueError(f"{owner}(interval={interval!r}): pass 'epoch' or 'step'")
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ValueError(f"{owner}(frequency={frequency!r}): pass an int >= 1")


def _lr(rec: EventRecord, owner: str) -> float:
    assert rec.state is not None
    try:
        lr = get_hyperparams(rec.state.opt_state).get("lr")
    except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None
    if lr is None:
        raise ValueError(
            f"{owner}: the optimizer's injected hyperparameters have no 'lr'; build it with "
            "optim.inject_hyperparams(optim.adamw)(lr=1e-3)"
        )
    return lr


def _set_lr(lr: float) -> Callable[[Any], Any]:
    def set_lr(state: Any) -> Any:
        return state.replace(opt_state=set_hyperparams(state.opt_state, lr=lr))

    return set_lr


class _Stepped(Listener):
    """Counts the ``interval`` boundaries and steps every ``frequency``-th, where Lightning
    does: per epoch when ``current_epoch + 1`` is divisible by the frequency; per step after a
    batch that stepped the optimizer whose index in the epoch, plus one, is (Lightning counts
    the batch index within the epoch, not the global step). A check that reads a metric
    (``after_validation``) waits for that batch's validation, if one follows it."""

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    interval: str
    frequency: int
    #: read the monitored metric after the batch's validation (ReduceLROnPlateau)
    after_validation = False
    #: a per-step check waiting for the validation after its batch
    _due = False

    def on_train_epoch_end(self, rec: EventRecord) -> Transition | None:
        if self.interval == "step":
            return self._due_now(rec)  # the epoch's last batch: no validation followed it
        if rec.run.sanity_checking:
            return None
        if (rec.run.current_epoch + 1) % self.frequency:
            return None
        return self._step(rec)

    def on_train_batch_end(self, rec: EventRecord) -> Transition | None:
        if self.interval != "step" or rec.state is None or rec.state.micro_step:
            return None  # mid accumulation window: no optimizer step was taken
        if rec.batch_idx is None or (rec.batch_idx + 1) % self.frequency:
            return None
        if self.after_validation:  # after this batch's validation, when one follows
            self._due = True
            return None
        return self._step(rec)

    def _due_now(self, rec: EventRecord) -> Transition | None:
        if not self._due:
            return None
        self._due = False
        return self._step(rec)

    def _step(self, rec: EventRecord) -> Transition | None:
        raise NotImplementedError


class ReduceLROnPlateau(_Stepped):
    """``torch.optim.lr_scheduler.ReduceLROnPlateau`` as a listener: when ``monitor`` has not
    improved for ``patience`` checks, the learning rate is multiplied by ``factor`` (not below
    ``min_lr``), then ``cooldown`` checks pass before counting again.

    The arguments and the arithmetic are torch's; ``monitor``, ``interval``, ``frequency`` and
    ``strict`` are the keys of Lightning's scheduler config. A check happens at the end of every
    ``frequency``-th training epoch (after that epoch's validation, where Lightning steps it) or,
    with ``interval="step"``, after each optimizer-stepping batch whose index in the epoch plus
    one the frequency divides: after that batch's validation when one follows it (so a
    validation metric is the one just computed, as in Lightning), else before the next batch.
    The optimizer must
    keep its learning rate in its state: ``tx=optim.inject_hyperparams(optim.adamw)(lr=1e-3)``.

    Args:
        monitor: the metric (as ``trainer.callback_metrics`` names it, e.g. ``"val/loss"``).
        mode: ``"min"`` or ``"max"``.
        factor: the multiplier, in ``(0, 1)``.
        patience: checks without improvement before a reduction.
        threshold, threshold_mode: what counts as an improvement (``"rel"`` or ``"abs"``).
        cooldown: checks after a reduction during which no bad check is counted.
        min_lr: the floor.
        eps: a reduction smaller than this is not made.
        interval, frequency, strict: Lightning's config keys; without ``strict`` a missing metric
            skips the check with a warning, with it (the default) raises.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> tx = optim.inject_hyperparams(optim.sgd)(lr=0.1)
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), tx)
        >>> data = [(torch.ones(4, 2), torch.ones(4, 1))]
        >>> plateau = ReduceLROnPlateau("val/loss", patience=0, factor=0.5)
        >>> trainer = eg.Trainer(max_epochs=3, callbacks=[plateau], logger=False,
        ...     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        ...     enable_journal=False, num_sanity_val_steps=0)
        >>> state = trainer.fit(task, task.init(torch.nn.Linear(2, 1)), data, data)
        >>> optim.get_hyperparams(state.opt_state)["lr"] <= 0.1
        True
    """

    def __init__(
        self,
        monitor: str,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float = 0.0,
        eps: float = 1e-8,
        *,
        interval: str = "epoch",
        frequency: int = 1,
        strict: bool = True,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"ReduceLROnPlateau(monitor={monitor!r}): pass a metric name")
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau(mode={mode!r}): pass 'min' or 'max'")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(
                f"ReduceLROnPlateau(threshold_mode={threshold_mode!r}): pass 'rel' or 'abs'"
            )
        if not (isinstance(factor, (int, float)) and 0.0 < factor < 1.0):
            raise ValueError(f"ReduceLROnPlateau(factor={factor!r}): pass a float in (0, 1)")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ReduceLROnPlateau({name}={value!r}): pass an int >= 0")
        for name, number in (("threshold", threshold), ("min_lr", min_lr), ("eps", eps)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or number < 0:
                raise ValueError(f"ReduceLROnPlateau({name}={number!r}): pass a number >= 0")
        _check_interval("ReduceLROnPlateau", interval, frequency)
        self.monitor, self.mode, self.factor = monitor, mode, float(factor)
        self.patience, self.threshold, self.threshold_mode = (
            patience,
            float(threshold),
            threshold_mode,
        )
        self.cooldown, self.min_lr, self.eps = cooldown, float(min_lr), float(eps)
        self.interval, self.frequency, self.strict = interval, frequency, strict
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_epochs = 0
        self.cooldown_counter = 0
        self.last_epoch = 0

    after_validation = True

    def on_validation_end(self, rec: EventRecord) -> Transition | None:
        if rec.run.sanity_checking or rec.run.stage != "fit":
            return None
        return self._due_now(rec)  # the validation after the batch a check was due after

    def on_train_batch_start(self, rec: EventRecord) -> Transition | None:
        return self._due_now(rec)  # no validation followed the batch the check was due after

    def _better(self, current: float) -> bool:
        best = self.best
        if self.mode == "min":
            edge = (
                best * (1 - self.threshold)
                if self.threshold_mode == "rel"
                else best - self.threshold
            )
            return current < edge
        edge = (
            best * (self.threshold + 1) if self.threshold_mode == "rel" else best + self.threshold
        )
        return current > edge

    def _step(self, rec: EventRecord) -> Transition | None:
        value = rec.run.callback_metrics.get(self.monitor)
        if value is None:
            shown = sorted(rec.run.callback_metrics)
            if self.strict:
                raise ValueError(
                    f"ReduceLROnPlateau(monitor={self.monitor!r}): the metric is not available "
                    f"(available: {shown}); log it, or pass strict=False to skip such checks"
                )
            warnings.warn(
                f"ReduceLROnPlateau(monitor={self.monitor!r}): not available (available: "
                f"{shown}); with strict=False the check is skipped",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        current = float(value)
        self.last_epoch += 1
        if self._better(current):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs <= self.patience:
            return None
        self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        old = _lr(rec, "ReduceLROnPlateau")
        new = max(old * self.factor, self.min_lr)
        if old - new <= self.eps:
            return None
        return Transition(_set_lr(new), name=f"ReduceLROnPlateau: lr {old:g} -> {new:g}")

    def on_fit_start(self, rec: EventRecord) -> None:
        if rec.state is not None:
            _lr(rec, "ReduceLROnPlateau")  # refuse an optimizer without an injected lr now

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "num_bad_epochs": self.num_bad_epochs,
            "cooldown_counter": self.cooldown_counter,
            "last_epoch": self.last_epoch,
            "due": self._due,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = float(state["best"])
        self.num_bad_epochs = int(state["num_bad_epochs"])
        self.cooldown_counter = int(state["cooldown_counter"])
        self.last_epoch = int(state["last_epoch"])
        self._due = bool(state.get("due", False))  # absent from checkpoints before it


class LearningRateSchedule(_Stepped):
    """A schedule stepped at Lightning's ``interval`` / ``frequency`` instead of every optimizer
    step: after the ``n``-th scheduler step the learning rate is ``schedule(n)`` (a torch
    ``StepLR`` stepped per epoch is ``LearningRateSchedule(optim.step_lr(0.1, 30, 0.1))``).

    For a schedule of the optimizer step, pass it as the optimizer's ``lr`` instead: that costs
    nothing per step. The optimizer must keep its learning rate in its state
    (:func:`engine.optim.inject_hyperparams`); the run starts at ``schedule(0)``.

    Example:
        >>> from engine import optim
        >>> every_two_epochs = LearningRateSchedule(optim.step_lr(0.1, 1, 0.5), frequency=2)
    """

    def __init__(
        self, schedule: Callable[[int], float], *, interval: str = "epoch", frequency: int = 1
    ) -> None:
        if not callable(schedule):
            raise TypeError(
                f"LearningRateSchedule({schedule!r}): pass a schedule n -> lr, such as "
                "optim.step_lr(0.1, 30, 0.1)"
            )
        _check_interval("LearningRateSchedule", interval, frequency)
        self.schedule, self.interval, self.frequency = schedule, interval, frequency
        self.steps = 0

    def on_train_start(self, rec: EventRecord) -> Transition | None:
        lr = float(self.schedule(self.steps))
        if _lr(rec, "LearningRateSchedule") == lr:
            return None
        return Transition(_set_lr(lr), name=f"LearningRateSchedule: lr {lr:g}")

    def _step(self, rec: EventRecord) -> Transition | None:
        self.steps += 1
        old, new = _lr(rec, "LearningRateSchedule"), float(self.schedule(self.steps))
        if new == old:
            return None
        return Transition(_set_lr(new), name=f"LearningRateSchedule: lr {old:g} -> {new:g}")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
