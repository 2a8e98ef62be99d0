"""The step-transform interface: seven hooks, each the identity unless a transform overrides it.

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
                   GradFn`)                                     scaling), ``Observe``; next: a
                                                                data-parallel all-reduce
``wrap_eval``      the user's eval / predict function           ``MixedPrecision`` (autocast)
``gradients``      a stateless gradient transformation run      ``Clip``
                   before the optimizer
``wrap_update``    gradients -> optimizer update (:data:`~      ``MixedPrecision`` (unscale, finite
                   engine.step.UpdateFn`), with the state's     check, skipped step, the scale's
                   ``precision``; returns metrics too           growth), ``Observe``
``wrap_core``      each pure core (tensors in, tensors out)     ``Compile``, ``DetectAnomaly``
=================  ===========================================  ==================================

``wrap_update`` exists beside ``gradients`` because a finite check must be able to skip the
optimizer and update a loss scale kept in ``TrainState.precision``, which a gradient
transformation (gradients in, gradients out) cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.optim.base import GradientTransformation
from engine.state import TrainState
from engine.step import GradFn, UpdateFn

__all__ = ["Transform"]


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

    def prepare(self, state: TrainState) -> TrainState:
        """The state, made ready once before the steps run (placed, cast, sharded)."""
        return state

    def move(self, batch: Any) -> Any:
        """A batch, made ready for the step (moved to the device, cast)."""
        return batch

    def wrap_grad(self, grad_fn: GradFn) -> GradFn:
        """The gradient computation ``grad_fn(forward, params, accumulate, precision)``."""
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

    def overrides(self, hook: str) -> bool:
        """Whether this transform's ``hook`` is its own rather than the identity above."""
        return getattr(type(self), hook) is not getattr(Transform, hook)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"
