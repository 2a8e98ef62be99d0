"""The step-transform interface: nine hooks, each the identity unless a transform overrides it.

A transform changes how a step runs without changing what it computes in float32 on one device:
where the state lives and batches go, the precision of the forward pass and the loss scale, the
gradients' processing before the optimizer, compilation. Each kind of change has its hook, and
:func:`engine.transforms.compose` applies every hook of every transform in one declared order.

=================  ===========================================  ==================================
hook               what it wraps or changes                     implementations
=================  ===========================================  ==================================
``prepare``        the state, once before training (and         ``SingleDevice`` (places it),
                   before a checkpoint is restored into it:     ``TruePrecision`` (casts it),
                   idempotent)                                  ``MixedPrecision`` (a loss scale);
                                                                next: sharding
``move``           each batch, before the step                  ``SingleDevice`` (pinned,
                                                                non_blocking), ``TruePrecision``
``wrap_grad``      loss -> gradients (:data:`~engine.step.      ``MixedPrecision`` (autocast, loss
                   GradFn`); its ``forward`` is a               scaling), ``Observe``, ``DPSGD``
                   :class:`~engine.step.Forward`                (per-example gradients)
``wrap_eval``      the user's eval / predict function           ``MixedPrecision`` (autocast)
``gradients``      a stateless gradient transformation run      ``Clip``
                   before the optimizer
``wrap_update``    gradients -> optimizer update (:data:`~      ``MixedPrecision`` (unscale, finite
                   engine.step.UpdateFn`), with the state's     check, skipped step, the scale's
                   ``precision``; returns metrics too           growth), ``Observe``
``wrap_core``      each pure core (tensors in, tensors out)     ``Compile``, ``DetectAnomaly``
``bind``           the parameters the forward reads, inside     ``FSDP`` (gathers the shards)
                   the differentiated region
``reduce``         the accumulation window's gradients, once    ``DDP`` (a bucketed all-reduce)
                   per optimizer step, before every
                   ``wrap_update`` (so the precision's finite
                   check and the clip see the global gradient)
=================  ===========================================  ==================================

A :class:`Strategy` is the transform that says how the work is spread over processes: besides
the hooks above (``prepare`` makes the state identical on every rank, ``reduce`` averages the
gradients) it has the rank facts, the loaders' sharding and the collectives the driver needs at
its existing checks (``agree``, ``broadcast``, ``barrier``, the metrics' ``sync``).

``wrap_update`` exists beside ``gradients`` because a finite check must be able to skip the
optimizer and update a loss scale kept in ``TrainState.precision``, which a gradient
transformation (gradients in, gradients out) cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from engine.optim.base import GradientTransformation
from engine.state import TrainState
from engine.step import GradFn, UpdateFn

__all__ = ["Strategy", "Transform"]

_T = TypeVar("_T")


class Transform:
    """A step transform: override the hooks it needs (see the module's table).

    Example:
        >>> import torch
        >>> class Noisy(Transform):  # adds noise to every batch (a toy transform)
        ...     def move(self, batch):
        ...         x, y = batch
        ...         return x + 0.01 * torch.randn_like(x), y
        >>> Noisy().prepare("state")  # the hooks it does not override are the identity
        'state'
    """

    #: the keys of ``TrainState.extra`` this transform's ``wrap_grad`` reads: each train step
    #: passes those entries to the gradient computation as ``forward.extra``
    #: (:class:`~engine.step.Forward`), so numbers a transition changes and a checkpoint
    #: carries steer it (DP-SGD's noise multiplier and sampling rate)
    reads_extra: tuple[str, ...] = ()
    #: the dtype the forward pass may read the parameters in, declared by a precision that
    #: computes in it (``"bf16-mixed"``: ``torch.bfloat16``): a sharding strategy gathers the
    #: parameters in it (FSDP2's ``MixedPrecisionPolicy.param_dtype``). ``None``: their own
    param_dtype: torch.dtype | None = None
    #: the kind of ``Trainer(plugins=[...])`` entry this transform is, which says the slot of
    #: :func:`~engine.transforms.compose` it fills: a transform of the user's own is a
    #: precision; engine's placement, anomaly detection and DP-SGD declare theirs
    plugin_kind: str = "precision"

    def prepare(self, state: TrainState) -> TrainState:
        """The state, made ready once before the steps run (placed, cast, sharded).

        A transform that must see the optimizer (to shard its state as the parameters are)
        declares ``prepare(self, state, tx=None)``: :meth:`Pipeline.prepare` passes the run's
        optimizer to it; one that gathers parameters declares ``param_dtype=None`` too, and is
        passed the pipeline's (see :attr:`param_dtype`)."""
        return state

    def bind(self, module: Any, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The parameters as the forward reads them, inside the differentiated region: called
        once per forward of every train, evaluation and prediction step (eager and compiled),
        with the state's parameters, whose gradients the step takes. ``module`` is the state's
        module template (``None`` for a pure-function model). A sharding strategy gathers the
        shards here, so that the gradient flows back to them through the gather."""
        return params

    def move(self, batch: Any) -> Any:
        """A batch, made ready for the step (moved to the device, cast)."""
        return batch

    def wrap_grad(self, grad_fn: GradFn) -> GradFn:
        """The gradient computation ``grad_fn(forward, params, accumulate, precision)``:
        ``forward()`` gives ``(loss, aux)``; the step's own ``forward`` is a
        :class:`~engine.step.Forward`, which also gives the batch, the parameters by name and
        the loss function on other tensors (what per-example gradients need)."""
        return grad_fn

    def wrap_eval(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """The user's evaluation / prediction function ``fn(model, batch)``."""
        return fn

    def gradients(self) -> GradientTransformation | None:
        """A stateless gradient transformation to run before the optimizer, or ``None``."""
        return None

    def wrap_update(self, update_fn: UpdateFn) -> UpdateFn:
        """The update ``update_fn(grads, params, opt_state, precision, step) -> (opt_state,
        precision, metrics)``: ``metrics`` (tensors) join the step's own."""
        return update_fn

    def wrap_core(self, core: Callable) -> Callable:
        """A pure core ``core(module, params, buffers, *args)`` of a step."""
        return core

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The gradients of a whole accumulation window, once per optimizer step, before every
        ``wrap_update``: a data-parallel strategy averages them over the ranks here."""
        return grads

    def overrides(self, hook: str) -> bool:
        """Whether this transform's ``hook`` is its own rather than the identity above."""
        return getattr(type(self), hook) is not getattr(Transform, hook)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Strategy(Transform):
    """How the work is spread over processes: a :class:`Transform` with the rank facts and the
    few collectives the driver needs, each at a point the driver already has.

    This base class is one process (every collective the identity); ``engine.parallel.DDP`` is
    data parallel over ``torch.distributed``.

    ========================  ===============================================================
    ``world_size`` ...        ``world_size``, ``global_rank``, ``local_rank``, ``node_rank``,
                              ``is_global_zero``: who this process is
    ``setup()``               join the process group (idempotent); ``teardown()`` leaves it
    ``shard(loader, stage)``  this rank's part of a loader (``"train"``, ``"val"``, ``"test"``,
                              ``"predict"``); the loader itself for one process
    ``agree_loaders()``       the loaders ``shard`` took since the last call measured alike
                              on every rank (one collective), else an error on every rank
    ``agree(flags)``          each flag true on any rank, for every rank (one collective): the
                              loop's stop and signal checks
    ``broadcast(obj)``        rank 0's object on every rank (directory and version names)
    ``barrier()``             wait for every rank
    ``sync``                  what the metrics' reductions sync through (``None``: no sync)
    ``launcher``              what starts the other processes (``None``: nothing to start)
    ========================  ===============================================================

    Example:
        >>> s = Strategy()
        >>> s.world_size, s.is_global_zero, s.agree((False, True))
        (1, True, (False, True))
    """

    #: why this strategy's steps cannot be compiled (``None``: they can); ``compose`` refuses
    #: ``compile=True`` with it, saying so
    plugin_kind = "strategy"  # passed as Trainer(strategy=...), refused in plugins
    not_compilable: str | None = None
    #: why a run under this strategy cannot be journaled (``None``: it can); the Trainer then
    #: runs without its journal, saying so, and refuses a Journal given as a callback
    not_journaled: str | None = None

    def resolve_flags(self, flags: Mapping[str, Any], world: int) -> dict[str, Any]:
        """The Trainer flags this strategy's own config sets, checked against ``flags`` (the
        Trainer's, as given; ``world``: devices x nodes): none here; DeepSpeed's config sets
        ``precision``, clipping and accumulation."""
        return {}

    def spawned_result(self, out: Any) -> Any:
        """What a spawned run's rank returns to the caller, which has no process group (a
        collective: every rank calls it): ``out`` itself, or a sharding strategy's state
        gathered whole."""
        return out

    def checkpoint_state(self, state: TrainState) -> TrainState:
        """The state as the Trainer's checkpoints hold it (called on every rank that saves):
        the state itself, or a sharding strategy's gathered whole (``state_dict_type="full"``)."""
        return state

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return 1

    @property
    def global_rank(self) -> int:
        """This process's rank, 0 to ``world_size - 1``."""
        return 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return 0

    @property
    def node_rank(self) -> int:
        """This process's node."""
        return 0

    @property
    def root_device(self) -> Any:
        """This process's device when the strategy places it (``None``: the placement's)."""
        return None

    @property
    def sync(self) -> Any:
        """What the metrics' reductions sync through (``None``: nothing to sync)."""
        return None

    @property
    def launcher(self) -> Any:
        """What starts the other processes (``None``: nothing to start)."""
        return None

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0: the one that writes logs, the bar, checkpoints."""
        return self.global_rank == 0

    def setup(self) -> None:
        """Join the process group (idempotent)."""

    def teardown(self) -> None:
        """Leave what :meth:`setup` joined."""

    def shard(self, loader: Any, stage: str) -> Any:
        """This rank's part of ``loader`` for ``stage``."""
        return loader

    def agree_loaders(self) -> None:
        """Check that every rank built the loaders :meth:`shard` took since the last call
        alike (their samples and batches), before any step reads them: a data-parallel
        strategy raises on every rank when they differ. Called once a stage's loaders are
        ready, on every rank alike."""

    def agree(self, flags: Sequence[bool | int]) -> tuple[bool | int, ...]:
        """Each value's maximum over the ranks: a flag, true if it is true on any rank; an
        int, the largest (one collective for them all)."""
        return tuple(flags)

    def broadcast(self, obj: _T) -> _T:
        """Rank 0's ``obj``, on every rank."""
        return obj

    def barrier(self) -> None:
        """Return once every rank has called it."""
