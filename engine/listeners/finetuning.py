"""Fine-tuning listeners: freeze parameter groups, unfreeze them at an epoch (Lightning's
``BaseFinetuning`` and ``BackboneFinetuning``).

The frozen set lives in the optimizer state (:func:`engine.optim.freezing.freezable`), so the
listeners change it by returning an :class:`engine.Transition` at ``on_train_epoch_start``, as
Lightning's callbacks do their work in that hook: the journal records it, ``engine replay``
applies it again, and checkpoints carry the frozen set and each group's learning rate. A
parameter unfrozen mid-run gets a fresh optimizer state, as a new torch.optim param group does.

What differs from Lightning, and why:

- BatchNorm running statistics: Lightning's ``freeze(..., train_bn=False)`` sets
  ``track_running_stats = False`` on the frozen BatchNorm layers. Here the step puts the whole
  module in training mode and a module attribute is not part of the state (so no transition
  could record it): running statistics of frozen BatchNorm layers keep updating. ``train_bn``
  decides only whether their weight and bias are trained.
- Lightning's ``freeze_before_training`` in ``BackboneFinetuning`` leaves the backbone's
  BatchNorm layers trainable (``freeze``'s own ``train_bn=True``), so an optimizer built over
  ``requires_grad`` parameters trains them from the first epoch at the head's rate. Here the
  whole backbone is frozen before the unfreeze epoch; ``train_bn=False`` keeps its BatchNorm
  parameters frozen after it too.
- The gradients of frozen parameters are still computed by the step (and counted by
  ``Trainer(gradient_clip_val=...)``); clip inside the optimizer to clip the trained ones only.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from engine.events import EventRecord, Listener, Transition
from engine.optim.freezing import (
    freeze,
    frozen_names,
    get_group_hyperparams,
    match_prefixes,
    set_group_hyperparams,
    unfreeze,
)
from engine.state import TrainState

__all__ = ["BackboneFinetuning", "Finetuning", "FinetuningTransition", "multiplicative"]

log = logging.getLogger(__name__)

Prefixes = str | Sequence[str]


def multiplicative(epoch: int) -> float:
    """``BackboneFinetuning``'s default ``lambda_func``: doubles the backbone's rate each epoch."""
    return 2.0


def _prefixes(value: Any, what: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable):
        raise TypeError(f"{what}: pass a module prefix or a list of them (got {value!r})")
    items = tuple(items)
    for p in items:
        if not isinstance(p, str) or not p:
            raise TypeError(
                f"{what}: a prefix must be a non-empty str such as 'backbone' (got {p!r})"
            )
    return items


def _epoch(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an epoch, an int >= 0 (got {value!r})")
    return value


@attrs.frozen
class FinetuningTransition:
    """The state change a fine-tuning listener asks for: freeze ``freeze``, unfreeze
    ``unfreeze`` (parameter names) and set ``hyperparams`` (``((group, name, value), ...)``)
    in the optimizer state. A pure function ``state -> state`` that pickles by reference, for
    the journal and replay.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.optim.freezing import freezable, frozen_names
        >>> from engine.listeners.finetuning import FinetuningTransition
        >>> state = eg.TrainState.create(torch.nn.Linear(2, 1), freezable(optim.adam(0.1)))
        >>> state = FinetuningTransition(freeze=("bias",))(state)
        >>> frozen_names(state.opt_state)
        ['bias']
    """

    freeze: tuple[str, ...] = ()
    unfreeze: tuple[str, ...] = ()
    hyperparams: tuple[tuple[Any, str, float], ...] = ()

    def __call__(self, state: TrainState) -> TrainState:
        opt = state.opt_state
        if self.freeze:
            opt = freeze(opt, self.freeze)
        if self.unfreeze:
            opt = unfreeze(opt, self.unfreeze)
        for group, name, value in self.hyperparams:
            opt = set_group_hyperparams(opt, group, **{name: value})
        return state.replace(opt_state=opt)


def _batchnorm_params(module: nn.Module | None) -> set[str]:
    if module is None:
        return set()
    out: set[str] = set()
    for path, sub in module.named_modules():
        if isinstance(sub, _BatchNorm):
            out.update(f"{path}.{n}" if path else n for n, p in sub.named_parameters(recurse=False))
    return out


def _state(rec: EventRecord, who: str) -> TrainState:
    if rec.state is None:
        raise RuntimeError(f"{who}: {rec.event.value} arrived without a TrainState")
    return rec.state


class Finetuning(Listener):
    """Freeze module prefixes at the start of training and unfreeze them at given epochs
    (Lightning's ``BaseFinetuning``), by state transitions at ``on_train_epoch_start``.

    The task's optimizer must be wrapped in :func:`engine.optim.freezing.freezable`. Subclass
    and override :meth:`freeze_before_training` / :meth:`finetune_function` (Lightning's names,
    returning prefixes instead of changing a module) and :meth:`hyperparams_function` (per-group
    learning rates) for other policies.

    Args:
        schedule: ``{epoch: prefixes}``: unfreeze these at the start of that epoch.
        freeze_at_start: prefixes frozen at the start of training (the first epoch start this
            listener sees; on a resume the checkpoint's frozen set stands).
        train_bn: whether the BatchNorm parameters under an unfrozen prefix are trained (``False``:
            they stay frozen).

    Raises:
        ValueError: for an epoch that is not an int >= 0; at fit start, for a prefix that
            matches no trainable parameter or an optimizer without a ``freezable`` state.
        TypeError: for a prefix that is not a non-empty str.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.optim.freezing import freezable
        >>> from engine.listeners.finetuning import Finetuning
        >>> model = torch.nn.Sequential()
        >>> model.add_module("backbone", torch.nn.Linear(4, 4))
        >>> model.add_module("head", torch.nn.Linear(4, 1))
        >>> task = eg.Task(lambda m, b: (m(b[0]) - b[1]).pow(2).mean(),
        ...                freezable(optim.adam(1e-2)))
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1))] * 2
        >>> trainer = eg.Trainer(max_epochs=3, logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False,
        ...                      enable_journal=False,
        ...                      callbacks=[Finetuning({2: ["backbone"]}, ["backbone"])])
        >>> before = model.backbone.weight.detach().clone()
        >>> state = trainer.fit(task, task.init(model, seed=0), data)
        >>> # frozen for epochs 0 and 1, trained in epoch 2
        >>> torch.equal(state.params["backbone.weight"], before)
        False
    """

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    def __init__(
        self,
        schedule: Mapping[int, Prefixes] | None = None,
        freeze_at_start: Prefixes = (),
        *,
        train_bn: bool = True,
    ) -> None:
        if schedule is not None and not isinstance(schedule, Mapping):
            raise TypeError(
                f"Finetuning(schedule={schedule!r}): pass {{epoch: prefixes}}, e.g. {{10: "
                "['backbone']}"
            )
        self.schedule = {
            _epoch(e, f"Finetuning(schedule=...): key {e!r}"): _prefixes(
                p, f"Finetuning(schedule={{{e!r}: ...}})"
            )
            for e, p in (schedule or {}).items()
        }
        self.freeze_at_start = _prefixes(freeze_at_start, "Finetuning(freeze_at_start=...)")
        if not isinstance(train_bn, bool):
            raise TypeError(f"Finetuning(train_bn={train_bn!r}): pass True or False")
        self.train_bn = train_bn
        self.last_epoch: int | None = None  # the last epoch start handled

    # ------------------------------------------------------------------ the policy (override)

    def freeze_before_training(self) -> Sequence[str]:
        """The prefixes to freeze before the first epoch (default: ``freeze_at_start``)."""
        return self.freeze_at_start

    def finetune_function(self, epoch: int) -> Sequence[str]:
        """The prefixes to unfreeze at the start of ``epoch`` (default: the schedule's)."""
        return self.schedule.get(epoch, ())

    def hyperparams_function(self, state: TrainState, epoch: int) -> dict[Any, dict[str, float]]:
        """``{group: {name: value}}`` to set at the start of ``epoch`` in the injected
        hyperparameters of an ``optim.multi_transform`` group (default: none)."""
        return {}

    # ------------------------------------------------------------------ events

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_epoch = state.get("last_epoch")

    def on_fit_start(self, rec: EventRecord) -> None:
        state = _state(rec, type(self).__name__)
        frozen_names(state.opt_state)  # exactly one freezable state, or a message saying so
        who = type(self).__name__
        match_prefixes(state.params, self.freeze_before_training(), f"{who}: freeze prefix")
        for epoch, prefixes in self.schedule.items():
            match_prefixes(state.params, prefixes, f"{who}: prefix at epoch {epoch}")

    def on_train_epoch_start(self, rec: EventRecord) -> Transition | None:
        state = _state(rec, type(self).__name__)
        epoch = state.epoch
        if self.last_epoch is not None and epoch <= self.last_epoch:
            return None  # the epoch start again, on a resume inside the epoch
        first = self.last_epoch is None
        self.last_epoch = epoch
        who = type(self).__name__
        names = list(state.params)
        current = set(frozen_names(state.opt_state))
        to_freeze: set[str] = set()
        if first:
            to_freeze = set(match_prefixes(names, self.freeze_before_training(), f"{who}: prefix"))
        epochs = range(epoch + 1) if first else (epoch,)  # catch up on a resume without state
        woken = set()
        for e in epochs:
            woken.update(match_prefixes(names, self.finetune_function(e), f"{who}: prefix"))
        if not self.train_bn:
            woken -= _batchnorm_params(state.module)
        target = (current | to_freeze) - woken
        hyper = tuple(
            (group, k, float(v))
            for group, values in self.hyperparams_function(state, epoch).items()
            for k, v in values.items()
        )
        fn = FinetuningTransition(
            freeze=tuple(n for n in names if n in target - current),
            unfreeze=tuple(n for n in names if n in current - target),
            hyperparams=hyper,
        )
        if not (fn.freeze or fn.unfreeze or fn.hyperparams):
            return None
        return Transition(fn, name=f"{who} at epoch {epoch}")


class BackboneFinetuning(Finetuning):
    """Lightning's ``BackboneFinetuning``: the backbone is frozen until
    ``unfreeze_backbone_at_epoch``, then trained at a learning rate of its own that grows each
    epoch by ``lambda_func`` until it reaches the head's.

    The learning rates follow Lightning's: at the unfreeze epoch the backbone's rate is
    ``backbone_initial_lr`` or the head's times ``backbone_initial_ratio_lr``; at each later
    epoch ``e`` it is ``lambda_func(e + 1)`` times the previous one, capped at the head's when
    ``should_align``. The rates are the injected ``lr`` of two groups of an
    ``optim.multi_transform`` in the optimizer state, read and set by state transitions
    (the previous rate is the state's, so nothing else needs saving):

    .. code-block:: python

        labels = lambda ps: {k: "backbone" if k.startswith("backbone.") else "head" for k in ps}
        tx = optim.freezable(optim.multi_transform(
            {"backbone": optim.inject_hyperparams(optim.adam)(lr=1e-3),  # set at the unfreeze
             "head": optim.inject_hyperparams(optim.adam)(lr=1e-3)}, labels))

    Args:
        unfreeze_backbone_at_epoch: the epoch whose start unfreezes the backbone.
        lambda_func: ``epoch -> factor`` for the backbone's rate (called with ``epoch + 1``, as
            Lightning does).
        backbone_initial_ratio_lr: the backbone's first rate as a fraction of the head's.
        backbone_initial_lr: the backbone's first rate, if given.
        should_align: cap the backbone's rate at the head's.
        initial_denom_lr: accepted for Lightning's signature; as in Lightning it has no effect
            (``BackboneFinetuning`` always passes a rate to ``unfreeze_and_add_param_group``).
        train_bn: train the backbone's BatchNorm parameters once it is unfrozen.
        verbose: log both rates at each change (``logging``, at INFO).
        rounding: digits of the logged rates.
        backbone: the backbone's module prefix(es).
        backbone_group, head_group: the ``multi_transform`` labels of the two groups.

    Raises:
        ValueError: for a negative epoch or rate; at fit start, for a backbone prefix that
            matches no trainable parameter or an optimizer state without the two groups.
        TypeError: for a ``lambda_func`` that is not callable.

    Example:
        >>> from engine.listeners.finetuning import BackboneFinetuning
        >>> BackboneFinetuning(unfreeze_backbone_at_epoch=-1)
        Traceback (most recent call last):
        ...
        ValueError: BackboneFinetuning(unfreeze_backbone_at_epoch=...) must be an epoch, ...(got -1)
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
        *,
        backbone: Prefixes = "backbone",
        backbone_group: Any = "backbone",
        head_group: Any = "head",
    ) -> None:
        who = "BackboneFinetuning"
        epoch = _epoch(unfreeze_backbone_at_epoch, f"{who}(unfreeze_backbone_at_epoch=...)")
        prefixes = _prefixes(backbone, f"{who}(backbone=...)")
        super().__init__({epoch: prefixes}, prefixes, train_bn=train_bn)
        if not callable(lambda_func):
            raise TypeError(f"{who}(lambda_func={lambda_func!r}): pass a function epoch -> factor")
        for name, value in [
            ("backbone_initial_ratio_lr", backbone_initial_ratio_lr),
            ("backbone_initial_lr", backbone_initial_lr),
            ("initial_denom_lr", initial_denom_lr),
        ]:
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0
            ):
                raise ValueError(f"{who}({name}={value!r}): pass a number >= 0")
        self.unfreeze_backbone_at_epoch = epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.verbose = verbose
        self.rounding = rounding
        self.backbone_group = backbone_group
        self.head_group = head_group

    def on_fit_start(self, rec: EventRecord) -> None:
        super().on_fit_start(rec)
        state = _state(rec, "BackboneFinetuning")
        for group in (self.backbone_group, self.head_group):
            if "lr" not in get_group_hyperparams(state.opt_state, group):
                raise ValueError(
                    f"BackboneFinetuning: the group {group!r} has no injected 'lr'; build it "
                    "with optim.inject_hyperparams(optim.adam)(lr=1e-3)"
                )

    def hyperparams_function(self, state: TrainState, epoch: int) -> dict[Any, dict[str, float]]:
        """The backbone's learning rate at the start of ``epoch`` (Lightning's rule)."""
        k = self.unfreeze_backbone_at_epoch
        if epoch < k:
            return {}
        head = get_group_hyperparams(state.opt_state, self.head_group)["lr"]
        if epoch == k:
            lr = (
                float(self.backbone_initial_lr)
                if self.backbone_initial_lr is not None
                else head * self.backbone_initial_ratio_lr
            )
        else:
            previous = get_group_hyperparams(state.opt_state, self.backbone_group)["lr"]
            lr = self.lambda_func(epoch + 1) * previous
            if self.should_align and lr > head:
                lr = head
        if self.verbose:
            log.info(
                f"Current lr: {round(head, self.rounding)}, Backbone lr: {round(lr, self.rounding)}"
            )
        return {self.backbone_group: {"lr": lr}}
