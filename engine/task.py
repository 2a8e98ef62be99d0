"""``Task``: the user's pure pieces in one record, usable with or without the Trainer.

A task bundles what a LightningModule's ``training_step`` / ``validation_step`` /
``test_step`` / ``predict_step`` / ``configure_optimizers`` provide, as plain functions. The
Trainer builds its steps from it (adding accumulation, clipping and compilation inside them); a
custom loop builds the same steps with :meth:`Task.train_step` and friends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from engine.metrics import LogOptions, MetricReducer
from engine.optim.base import GradientTransformation, ScheduleLike
from engine.state import TrainState
from engine.step import (
    CustomStep,
    EvalStep,
    LossFn,
    PredictStep,
    TrainStep,
    eval_step,
    predict_step,
    train_step,
)

__all__ = ["REDUCTIONS", "Task"]

REDUCTIONS = ("mean", "sum", "max", "min")


def _check_reduce(instance: Any, attribute: Any, value: Mapping[str, str]) -> None:
    for name, how in value.items():
        if how not in REDUCTIONS:
            raise ValueError(
                f"reduce[{name!r}] must be one of {', '.join(REDUCTIONS)} (got {how!r})"
            )


def _check_options(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"Task(log_options={value!r}): pass a dict of metric name -> engine.LogOptions(...)"
        )
    for name, options in value.items():
        if not isinstance(options, LogOptions):
            raise TypeError(
                f"Task(log_options={{{name!r}: {options!r}}}): pass engine.LogOptions(on_step=..., "
                "on_epoch=..., prog_bar=..., reduce_fx=...)"
            )


def _check_tx(instance: Any, attribute: Any, value: Any) -> None:
    """``tx``: an ``engine.optim`` transformation; a torch optimizer is named with its
    replacement (its state is outside the pure state, and it holds the model's tensors)."""
    if value is None or isinstance(value, GradientTransformation):
        return
    if isinstance(value, torch.optim.Optimizer) or (
        isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
    ):
        cls = value if isinstance(value, type) else type(value)
        defaults = {} if isinstance(value, type) else dict(value.defaults)
        lr = defaults.pop("lr", 1e-3)
        shown = ", ".join(
            f"{k}={v!r}" for k, v in defaults.items() if k in ("betas", "weight_decay", "momentum")
        )
        made = "" if isinstance(value, type) else "(...)"
        raise TypeError(
            f"Task(tx=torch.optim.{cls.__name__}{made}): engine takes an engine.optim "
            f"transformation, not a torch optimizer; wrap the class: "
            f"tx=optim.from_torch(torch.optim.{cls.__name__}, lr={lr!r}"
            f"{', ' + shown if shown else ''}) (bitwise the same steps), or use engine's own, "
            f"e.g. optim.adamw(lr={lr!r})"
        )
    raise TypeError(
        f"Task(tx={value!r}): pass an engine.optim GradientTransformation such as "
        "optim.adamw(1e-3), or optim.from_torch(torch.optim.SGD, lr=0.1)"
    )


@attrs.frozen
class Task:
    """What to train and how to evaluate it, as pure functions.

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, metrics)`` (Lightning's
            ``training_step``).
        tx: the optimizer (Lightning's ``configure_optimizers``).
        step_fn: instead of ``loss_fn``, your own pure training step
            ``step_fn(state, batch) -> (state, metrics)`` (Lightning's manual optimization:
            several optimizers, as a GAN's, updated in one step); see
            :class:`~engine.step.CustomStep`. ``tx`` is then optional (:meth:`init` uses it).
        eval_fn: ``eval_fn(model, batch)`` for validation: a loss, ``(loss, metrics)`` or a dict
            of metrics. Defaults to ``loss_fn``.
        test_fn: the same for ``Trainer.test``; defaults to ``eval_fn``.
        predict_fn: ``predict_fn(model, batch) -> outputs``; defaults to ``model(batch)``.
        lr: the learning rate or schedule ``tx`` uses, for learning-rate monitoring.
        prog_bar: metric names (without the ``train/`` / ``val/`` prefix) shown in the progress
            bar besides the loss.
        reduce: how a metric is reduced over an epoch: ``"mean"`` (weighted by batch size, the
            default), ``"sum"``, ``"max"`` or ``"min"``.
        grad_norm: report the gradients' total 2-norm (before clipping) as ``"grad_norm"``
            on optimizer steps (Lightning's ``grad_norm`` utility).
        hparams: hyperparameters to record with the loggers when fitting (Lightning's
            ``save_hyperparameters``); plain values or nested mappings of them.
        log_options: per metric, Lightning's ``self.log`` options as
            :class:`~engine.metrics.LogOptions` (``on_step``, ``on_epoch``, ``prog_bar``,
            ``reduce_fx``), e.g. ``{"acc": LogOptions(on_step=False, prog_bar=True)}``.
        transfer_batch_to_device: ``fn(batch, device) -> batch``, for batch types the
            Trainer cannot walk (Lightning's hook of that name); by default tensors in tuples,
            lists, dicts and named tuples, and objects with a ``to(device)`` method, are moved.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
        >>> state = task.init(torch.nn.Linear(3, 1), seed=0)
        >>> state, metrics = task.train_step()(state, (torch.randn(4, 3), torch.randn(4, 1)))
        >>> state.step
        1
    """

    loss_fn: LossFn | None = None
    tx: GradientTransformation | None = attrs.field(default=None, validator=_check_tx)
    eval_fn: Callable[[Any, Any], Any] | None = None
    test_fn: Callable[[Any, Any], Any] | None = None
    predict_fn: Callable[[Any, Any], Any] | None = None
    lr: ScheduleLike | None = None
    prog_bar: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    reduce: Mapping[str, str] = attrs.field(factory=dict, validator=_check_reduce)
    grad_norm: bool = False
    hparams: Mapping[str, Any] = attrs.field(factory=dict)
    step_fn: Callable[[TrainState, Any], tuple[TrainState, Mapping[str, Any]]] | None = None
    log_options: Mapping[str, LogOptions] = attrs.field(factory=dict, validator=_check_options)
    transfer_batch_to_device: Callable[[Any, Any], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )

    def __attrs_post_init__(self) -> None:
        if self.step_fn is None:
            if not callable(self.loss_fn):
                raise TypeError(
                    f"Task(loss_fn=...) must be callable (got {self.loss_fn!r}); or pass "
                    "step_fn=, your own pure train step"
                )
            if self.tx is None:
                raise TypeError("Task(loss_fn, tx): tx (the optimizer) is missing")
        else:
            if self.loss_fn is not None:
                raise TypeError(
                    "Task(loss_fn=..., step_fn=...): give one; step_fn is a whole train step, "
                    "loss_fn one the Trainer builds"
                )
            if not callable(self.step_fn):
                raise TypeError(f"Task(step_fn=...) must be callable (got {self.step_fn!r})")

    def reducer(self) -> MetricReducer:
        """A fresh epoch reduction of this task's metrics (its ``reduce`` and ``log_options``)."""
        return MetricReducer(self.reduce, options=self.log_options)

    @property
    def shown(self) -> frozenset[str]:
        """The metrics the progress bar shows: the loss, ``prog_bar`` and ``prog_bar=True``."""
        flagged = (k for k, o in self.log_options.items() if o.prog_bar)
        return frozenset(("loss", *self.prog_bar, *flagged))

    def init(
        self, model: nn.Module | Mapping[str, Tensor], *, seed: int = 0, **kwargs: Any
    ) -> TrainState:
        """``TrainState.create(model, self.tx, seed=seed, **kwargs)``."""
        if self.tx is None:
            raise ValueError(
                "Task.init needs the task's tx; give Task(step_fn=..., tx=...) or create the "
                "state with TrainState.create(model, tx)"
            )
        return TrainState.create(model, self.tx, seed=seed, **kwargs)

    def train_step(self, *, transforms: Any = None, **kwargs: Any) -> TrainStep | CustomStep:
        """``engine.train_step(self.loss_fn, self.tx, **kwargs)``; with ``transforms`` (an
        :class:`engine.transforms.Pipeline`), ``transforms.train_step(self.loss_fn, self.tx,
        **kwargs)``; with ``step_fn``, a :class:`~engine.step.CustomStep` of it."""
        if self.step_fn is not None:  # the user's own: the transforms seed, place and watch it
            rng_devices = None if transforms is None else transforms.rng_devices
            fn = self.step_fn
            if isinstance(fn, CustomStep):  # a built step (engine.ensemble's): its function,
                fn = fn.fn  # seeded and placed by the transforms here like any other
            for t in () if transforms is None else transforms.transforms:
                if getattr(t, "wraps_any_step", False):  # anomaly detection: around the call
                    fn = t.wrap_core(fn)
            rank = 0 if transforms is None else transforms.strategy.global_rank
            return CustomStep(fn, rng_devices=rng_devices, rank=rank)
        assert self.loss_fn is not None and self.tx is not None
        kwargs.setdefault("grad_norm", self.grad_norm)
        if transforms is not None:
            return transforms.train_step(self.loss_fn, self.tx, **kwargs)
        return train_step(self.loss_fn, self.tx, **kwargs)

    def eval_step(self, *, transforms: Any = None, **kwargs: Any) -> EvalStep:
        """The validation step, ``engine.eval_step(self.eval_fn or self.loss_fn, **kwargs)``
        (or ``transforms.eval_step(...)``)."""
        return self._inference(eval_step, self.eval_fn or self.loss_fn, transforms, kwargs)

    def test_step(self, *, transforms: Any = None, **kwargs: Any) -> EvalStep:
        """The test step: ``test_fn``, else the validation function."""
        fn = self.test_fn or self.eval_fn or self.loss_fn
        return self._inference(eval_step, fn, transforms, kwargs)

    def predict_step(self, *, transforms: Any = None, **kwargs: Any) -> PredictStep:
        """The prediction step: ``predict_fn``, else ``model(batch)``."""
        return self._inference(predict_step, self.predict_fn, transforms, kwargs)

    @staticmethod
    def _inference(build: Any, fn: Any, transforms: Any, kwargs: dict[str, Any]) -> Any:
        if fn is None and build is not predict_step:
            raise ValueError(
                "this Task has no evaluation function: a custom step_fn does not evaluate; "
                "give Task(eval_fn=...) (and test_fn=) to validate or test"
            )
        if transforms is None:
            return build(fn, **kwargs)
        method = transforms.predict_step if build is predict_step else transforms.eval_step
        return method(fn, **kwargs)
