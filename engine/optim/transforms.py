"""Small gradient transformations that named optimizers are chained from.

Every transform here follows the protocol of :mod:`engine.optim.base`: it may overwrite the
``updates`` it receives and its own state tensors in place, and never touches ``params`` in
``update``. Hot loops are single ``torch._foreach_*`` calls over all tensors. Each also has a
``differentiable`` form: the same ``_foreach`` ops in the same order, out of place, for
:func:`~engine.optim.differentiable_step`.

Transforms that end a torch.optim step (:func:`scale_by_learning_rate`,
:func:`decoupled_weight_decay`, and :func:`scale_by_adam` / :func:`scale_by_rms` /
:func:`scale_by_adagrad` when given ``lr``) also have a terminal ``apply`` that writes the
parameters with the exact kernel sequence of ``torch.optim``'s foreach implementation, so a
chain ending in one of them reproduces ``torch.optim`` bitwise under
:func:`~engine.optim.apply_gradients`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from engine.optim._common import (
    _check_keys,
    _check_lr,
    _check_range,
    _lr_at,
    _zeros,
)
from engine.optim.base import (
    GradientTransformation,
    Params,
    ScheduleLike,
    Updates,
)

# --------------------------------------------------------------------------- stateless transforms


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by a constant ``factor`` (``scale(-1.0)`` negates them exactly).

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.scale(-2.0)
        >>> tx.update({"w": torch.ones(2)}, tx.init({}), {"w": torch.zeros(2)}, 0)[0]["w"]
        tensor([-2., -2.])
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or math.isnan(factor):
        raise ValueError(f"'factor' must be a float (got {factor!r})")
    factor = float(factor)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Updates, state: tuple, params: Params, step: int):
        if updates:
            torch._foreach_mul_(list(updates.values()), factor)
        return updates, state

    def differentiable(updates: Updates, state: tuple, params: Params, step: int):
        if not updates:
            return updates, state
        return _keyed(updates, torch._foreach_mul(list(updates.values()), factor)), state

    return GradientTransformation(init, update, differentiable=differentiable)


def scale_by_learning_rate(lr: ScheduleLike) -> GradientTransformation:
    """Multiply updates by ``-lr`` (a float or a schedule of the step).

    Its terminal ``apply`` writes ``p.add_(u, alpha=-lr)``, torch.optim.SGD's final kernel (a
    fused multiply-add, so ``apply`` and ``p + update`` can differ in the last bit).

    Args:
        lr: learning rate, or a schedule ``step -> lr`` evaluated at the current step.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.scale_by_learning_rate(0.1)
        >>> tx.update({"w": torch.ones(2)}, tx.init({}), {"w": torch.zeros(2)}, 0)[0]["w"]
        tensor([-0.1000, -0.1000])
    """
    lr = _check_lr(lr)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Updates, state: tuple, params: Params, step: int):
        if not updates:
            return updates, state
        torch._foreach_mul_(list(updates.values()), -_lr_at(lr, step))
        return updates, state

    def differentiable(updates: Updates, state: tuple, params: Params, step: int):
        if not updates:
            return updates, state
        scaled = torch._foreach_mul(list(updates.values()), -_lr_at(lr, step))
        return _keyed(updates, scaled), state

    def apply(grads: Updates, state: tuple, params: Params, step: int) -> tuple:
        if grads:
            torch._foreach_add_(
                list(params.values()), [grads[k] for k in params], alpha=-_lr_at(lr, step)
            )
        return state

    return GradientTransformation(init, update, apply, differentiable=differentiable)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Add ``weight_decay * param`` to the updates (L2 regularisation, torch.optim's
    ``weight_decay`` for SGD/Adam/RMSprop/Adagrad).

    Put it before the optimizer's scaling; wrap it in :func:`masked` with :func:`decay_mask` to
    skip biases and norm weights.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.add_decayed_weights(0.5)
        >>> tx.update({"w": torch.zeros(2)}, tx.init({}), {"w": torch.ones(2)}, 0)[0]["w"]
        tensor([0.5000, 0.5000])
    """
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Updates, state: tuple, params: Params, step: int):
        if updates and weight_decay != 0:
            keys = list(updates)
            torch._foreach_add_(
                [updates[k] for k in keys], [params[k] for k in keys], alpha=weight_decay
            )
        return updates, state

    def differentiable(updates: Updates, state: tuple, params: Params, step: int):
        if not updates or weight_decay == 0:
            return updates, state
        keys = list(updates)
        decayed = torch._foreach_add(
            [updates[k] for k in keys], [params[k] for k in keys], alpha=weight_decay
        )
        return dict(zip(keys, decayed, strict=True)), state

    return GradientTransformation(init, update, differentiable=differentiable)


def decoupled_weight_decay(weight_decay: float, lr: ScheduleLike) -> GradientTransformation:
    """Decoupled weight decay (AdamW, Lion): the new parameter is ``p * (1 - lr * wd) + u``.

    Put it last, after the learning rate has been applied to the updates. The terminal ``apply``
    multiplies the parameters by ``1 - lr * wd`` and then adds the updates, the op order of
    torch.optim.AdamW; ``update`` returns ``(p * (1 - lr * wd) + u) - p`` computed the same way,
    which is ``u - lr * wd * p`` up to half an ulp of ``p`` and makes ``p + update`` equal
    ``apply``'s result bit for bit (the subtraction is exact while the step is smaller than
    ``|p|``, by Sterbenz's lemma).

    Args:
        weight_decay: decay coefficient ``wd`` (non-negative).
        lr: learning rate (float or schedule) that the decay is scaled by.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.decoupled_weight_decay(0.5, lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> _ = tx.apply({"w": torch.zeros(2)}, tx.init(params), params, 0)
        >>> params["w"]
        tensor([0.9500, 0.9500])
    """
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)
    lr = _check_lr(lr)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Updates, state: tuple, params: Params, step: int):
        if not updates or weight_decay == 0:
            return updates, state
        # (p * (1 - lr * wd) + u) - p with apply's kernels, so p + update is what apply writes
        keys = list(updates)
        plist = [params[k] for k in keys]
        new = torch._foreach_mul(plist, 1 - _lr_at(lr, step) * weight_decay)
        torch._foreach_add_(new, [updates[k] for k in keys])
        torch._foreach_sub_(new, plist)
        return dict(zip(keys, new, strict=True)), state

    def differentiable(updates: Updates, state: tuple, params: Params, step: int):
        if not updates or weight_decay == 0:
            return updates, state
        keys = list(updates)
        plist = [params[k] for k in keys]
        new = torch._foreach_mul(plist, 1 - _lr_at(lr, step) * weight_decay)
        new = torch._foreach_add(new, [updates[k] for k in keys])
        return dict(zip(keys, torch._foreach_sub(new, plist), strict=True)), state

    def apply(grads: Updates, state: tuple, params: Params, step: int) -> tuple:
        if grads:
            plist = list(params.values())
            if weight_decay != 0:
                torch._foreach_mul_(plist, 1 - _lr_at(lr, step) * weight_decay)
            torch._foreach_add_(plist, [grads[k] for k in params])
        return state

    return GradientTransformation(init, update, apply, differentiable=differentiable)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (total_norm + 1e-6))``.

    Numerically identical to :func:`torch.nn.utils.clip_grad_norm_` (same norm reduction, same
    ``1e-6``, always multiplies so there is no host-device sync).

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.clip_by_global_norm(1.0)
        >>> tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init({}), {}, 0)[0]["w"]
        tensor([0.6000, 0.8000])
    """
    max_norm = _check_range("max_norm", max_norm, 0.0)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Updates, state: tuple, params: Params, step: int):
        if not updates:
            return updates, state
        grads = list(updates.values())
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, gs in by_device.items():
            torch._foreach_mul_(gs, coef.to(device))
        return updates, state

    def differentiable(updates: Updates, state: tuple, params: Params, step: int):
        if not updates:
            return updates, state
        total = torch.nn.utils.get_total_norm(list(updates.values()), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[torch.device, list[str]] = {}
        for k, g in updates.items():
            by_device.setdefault(g.device, []).append(k)
        out: dict[str, Tensor] = {}
        for device, keys in by_device.items():
            scaled = torch._foreach_mul([updates[k] for k in keys], coef.to(device))
            out.update(zip(keys, scaled, strict=True))
        return {k: out[k] for k in updates}, state

    return GradientTransformation(init, update, differentiable=differentiable)


def clip_by_value(limit: float) -> GradientTransformation:
    """Clamp every update element to ``[-limit, limit]``, like ``clip_grad_value_``.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.clip_by_value(1.0)
        >>> tx.update({"w": torch.tensor([-3.0, 0.5])}, tx.init({}), {}, 0)[0]["w"]
        tensor([-1.0000,  0.5000])
    """
    limit = _check_range("limit", limit, 0.0)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Updates, state: tuple, params: Params, step: int):
        if updates:
            us = list(updates.values())
            torch._foreach_clamp_min_(us, -limit)
            torch._foreach_clamp_max_(us, limit)
        return updates, state

    def differentiable(updates: Updates, state: tuple, params: Params, step: int):
        if not updates:
            return updates, state
        low = torch._foreach_clamp_min(list(updates.values()), -limit)
        return _keyed(updates, torch._foreach_clamp_max(low, limit)), state

    return GradientTransformation(init, update, differentiable=differentiable)


# --------------------------------------------------------------------------- stateful transforms


class TraceState(NamedTuple):
    """State of :func:`trace`: one momentum buffer per parameter."""

    momentum_buffer: dict[str, Tensor]


def trace(
    momentum: float, dampening: float = 0.0, nesterov: bool = False
) -> GradientTransformation:
    """Heavy-ball momentum as in torch.optim.SGD: ``buf = momentum * buf + (1 - dampening) * u``.

    On the first step (``step == 0``) the buffer is set to the update itself, as torch.optim does;
    a state built later (``step > 0``) starts from a zero buffer, which only differs when
    ``dampening != 0``. With ``nesterov`` the output is ``u + momentum * buf``, else ``buf``.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.trace(0.9)
        >>> params = {"w": torch.zeros(1)}
        >>> s = tx.init(params)
        >>> u, s = tx.update({"w": torch.ones(1)}, s, params, 0)
        >>> u, s = tx.update({"w": torch.ones(1)}, s, params, 1)
        >>> u["w"]
        tensor([1.9000])
    """
    momentum = _check_range("momentum", momentum, 0.0)
    dampening = float(dampening)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov momentum needs momentum > 0 and dampening == 0 (got momentum={momentum}, "
            f"dampening={dampening})"
        )

    def init(params: Params) -> TraceState:
        return TraceState(_zeros(params))

    def update(updates: Updates, state: TraceState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.momentum_buffer, "trace")
        keys = list(updates)
        us = [updates[k] for k in keys]
        bufs = [state.momentum_buffer[k] for k in keys]
        if step == 0:
            torch._foreach_copy_(bufs, us)
        else:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, us, alpha=1 - dampening)
        if nesterov:
            torch._foreach_add_(us, bufs, alpha=momentum)
        else:
            # Copy into the donated update buffers: later transforms may scale their input in
            # place, which must not reach the momentum buffer.
            torch._foreach_copy_(us, bufs)
        return updates, state

    def differentiable(updates: Updates, state: TraceState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.momentum_buffer, "trace")
        keys = list(updates)
        us = [updates[k] for k in keys]
        bufs: Sequence[Tensor]
        if step == 0:
            bufs = [u.clone() for u in us]  # torch.optim's first buffer is a copy of the update
        else:
            decayed = torch._foreach_mul([state.momentum_buffer[k] for k in keys], momentum)
            bufs = torch._foreach_add(decayed, us, alpha=1 - dampening)
        out = torch._foreach_add(us, bufs, alpha=momentum) if nesterov else bufs
        buffers = dict(zip(keys, bufs, strict=True))
        return dict(zip(keys, out, strict=True)), TraceState(buffers)

    return GradientTransformation(init, update, differentiable=differentiable)


def _keyed(like: Updates, tensors: Sequence[Tensor]) -> Updates:
    """``tensors`` (computed from ``like``'s values, in order) under ``like``'s keys."""
    return dict(zip(like, tensors, strict=True))
