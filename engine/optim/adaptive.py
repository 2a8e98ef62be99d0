"""Adaptive scalers: the moment estimates of Adam, RMSprop, Adagrad and Lion.

Each mirrors the op sequence of torch.optim's foreach implementation (and, for Adam, its fused
kernel), so the named optimizers in :mod:`engine.optim.aliases` reproduce torch.optim bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from engine.optim._common import (
    _check_keys,
    _check_lr,
    _check_range,
    _f64,
    _increment,
    _like,
    _lr_at,
    _real_only,
    _steps,
    _tensor_math,
    _zeros,
)
from engine.optim.base import (
    GradientTransformation,
    Params,
    ScheduleLike,
    Updates,
)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`; ``step`` holds torch.optim-style float32 counters."""

    step: dict[str, Tensor]
    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    max_exp_avg_sq: dict[str, Tensor]


def _adam_moments(g, state: ScaleByAdamState, keys, b1, b2, eps, amsgrad, lr):
    """Advance the Adam moments in place and return ``(step_size, denom, exp_avgs)`` such that
    the update is ``step_size * exp_avg / denom``, in torch.optim ``_multi_tensor_adam`` order."""
    steps = [state.step[k] for k in keys]
    m = [state.exp_avg[k] for k in keys]
    v = [state.exp_avg_sq[k] for k in keys]
    _increment(steps)
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, 1 - b2)
    if amsgrad:
        vmax = [state.max_exp_avg_sq[k] for k in keys]
        torch._foreach_maximum_(vmax, v)
        v = vmax
    step_size, bc2_sqrt = _adam_corrections(steps, b1, b2, lr)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    return step_size, denom, m


def _adam_corrections(steps: Sequence[Tensor], b1: float, b2: float, lr) -> tuple[list, list]:
    """Adam's ``step_size`` (``lr / (1 - b1^t)``, negated) and ``sqrt(1 - b2^t)`` per tensor."""
    num = -1.0 if lr is None else lr
    if _tensor_math(list(steps)):
        step_size = [(num / (1 - torch.pow(b1, _f64(s)))) * -1 for s in steps]
        bc2_sqrt = [(1 - torch.pow(b2, _f64(s))).sqrt() for s in steps]
        if len(steps) > 1 and len({s.device for s in steps}) == 1:
            # Stacked, so that Inductor computes each correction once: it inlines a 0-d
            # tensor's math into the loop of every kernel that reads it, where the libm pow
            # (which C's errno keeps the compiler from hoisting) ran once per vector of every
            # parameter, ~10% of a compiled step; a stack is realized into a buffer.
            step_size = list(torch.stack(step_size).unbind())
            bc2_sqrt = list(torch.stack(bc2_sqrt).unbind())
        return step_size, bc2_sqrt
    bc1 = [1 - b1 ** s.item() for s in steps]
    return [(num / bc) * -1 for bc in bc1], [(1 - b2 ** s.item()) ** 0.5 for s in steps]


def _adam_moments_out_of_place(g, state: ScaleByAdamState, keys, b1, b2, eps, amsgrad, lr):
    """:func:`_adam_moments` with new tensors for everything: ``(new_state, step_size, denom,
    exp_avgs)``, the same ops in the same order (so the same numbers), recorded by autograd."""
    steps = torch._foreach_add([state.step[k] for k in keys], 1.0)
    m = torch._foreach_lerp([state.exp_avg[k] for k in keys], g, 1 - b1)
    v = torch._foreach_mul([state.exp_avg_sq[k] for k in keys], b2)
    v = torch._foreach_addcmul(list(v), g, g, 1 - b2)
    vmax = torch._foreach_maximum([state.max_exp_avg_sq[k] for k in keys], v) if amsgrad else ()
    step_size, bc2_sqrt = _adam_corrections(steps, b1, b2, lr)
    denom = torch._foreach_div(_sqrt(vmax if amsgrad else v), bc2_sqrt)
    denom = torch._foreach_add(list(denom), eps)

    def keyed(ts: Sequence[Tensor]) -> dict[str, Tensor]:
        return dict(zip(keys, ts, strict=True))

    new = ScaleByAdamState(
        _like(state.step, keys, steps), keyed(m), keyed(v), keyed(vmax) if amsgrad else {}
    )
    return new, step_size, denom, m


def _sqrt(xs: Sequence[Tensor]) -> list[Tensor]:
    """``torch._foreach_sqrt(xs)`` whose derivative is 0 where an ``x`` is exactly 0 (not
    infinite): a parameter whose gradient is exactly zero (a dead ReLU's) has zero moments, and
    ``0 * inf`` would make the whole meta-gradient NaN. The values are sqrt's, bitwise."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in xs):
        return list(torch._foreach_sqrt(list(xs)))
    return list(_SqrtZeroAtZero.apply(*xs))


class _SqrtZeroAtZero(torch.autograd.Function):
    """The forward is one ``_foreach_sqrt``; the masking costs only in backward. The backward
    is made of differentiable ops, so it can itself be differentiated."""

    @staticmethod
    def forward(ctx: Any, *xs: Tensor) -> tuple[Tensor, ...]:
        out = tuple(torch._foreach_sqrt(list(xs)))
        ctx.save_for_backward(*out)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:
        out = []
        for root, g in zip(ctx.saved_tensors, grads, strict=True):
            nonzero = root != 0
            safe = torch.where(nonzero, root, 1.0)
            out.append(torch.where(nonzero, g / (2 * safe), 0.0))
        return tuple(out)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    amsgrad: bool = False,
    *,
    lr: ScheduleLike | None = None,
    host_counters: bool = True,
) -> GradientTransformation:
    """Adam's rescaling: ``m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments.

    Args:
        b1, b2: decay rates of the first and second moments, in ``[0, 1)``.
        eps: added to the denominator (after the square root, as torch.optim does).
        amsgrad: normalise by the running maximum of the second moment.
        lr: when given, the learning rate is folded in and the output is the final update
            ``-lr * m_hat / (sqrt(v_hat) + eps)``, computed in torch.optim's op order; the
            terminal ``apply`` then is torch.optim.Adam's ``addcdiv_``. When ``None`` the output is
            the direction, for :func:`scale_by_learning_rate` to scale.
        host_counters: keep the per-parameter float32 ``step`` tensors on the CPU in
            :class:`~engine.optim.StepCounters`, as torch.optim's default Adam does (the bias
            corrections are then Python floats, its CUDA bits); ``False`` puts them on each
            parameter's device, as its ``fused`` and ``capturable`` Adam do.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.scale_by_adam()
        >>> params = {"w": torch.zeros(2)}
        >>> u, _ = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params, 0)
        >>> u["w"].round(decimals=4)
        tensor([ 1., -1.])
    """
    b1, b2 = _check_range("b1", b1, 0.0, 1.0), _check_range("b2", b2, 0.0, 1.0)
    eps = _check_range("eps", eps, 0.0)
    if lr is not None:
        lr = _check_lr(lr)

    def init(params: Params) -> ScaleByAdamState:
        _real_only(params, "scale_by_adam")
        return ScaleByAdamState(
            _steps(params, host=host_counters),
            _zeros(params),
            _zeros(params),
            _zeros(params) if amsgrad else {},
        )

    def update(updates: Updates, state: ScaleByAdamState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.exp_avg, "scale_by_adam")
        keys = list(updates)
        lr_now = None if lr is None else _lr_at(lr, step)
        step_size, denom, m = _adam_moments(
            [updates[k] for k in keys], state, keys, b1, b2, eps, amsgrad, lr_now
        )
        out = torch._foreach_mul(m, step_size)
        torch._foreach_div_(out, denom)
        return dict(zip(keys, out, strict=True)), state

    def differentiable(updates: Updates, state: ScaleByAdamState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.exp_avg, "scale_by_adam")
        keys = list(updates)
        lr_now = None if lr is None else _lr_at(lr, step)
        new, step_size, denom, m = _adam_moments_out_of_place(
            [updates[k] for k in keys], state, keys, b1, b2, eps, amsgrad, lr_now
        )
        out = torch._foreach_div(torch._foreach_mul(m, step_size), denom)
        return dict(zip(keys, out, strict=True)), new

    def apply(grads: Updates, state: ScaleByAdamState, params: Params, step: int):
        if not grads:
            return state
        _check_keys(grads, state.exp_avg, "scale_by_adam")
        keys = list(grads)
        step_size, denom, m = _adam_moments(
            [grads[k] for k in keys], state, keys, b1, b2, eps, amsgrad, _lr_at(lr, step)
        )
        plist = [params[k] for k in keys]
        if isinstance(step_size[0], Tensor):
            out = torch._foreach_mul(m, step_size)
            torch._foreach_div_(out, denom)
            torch._foreach_add_(plist, out)
        else:
            torch._foreach_addcdiv_(plist, m, denom, step_size)
        return state

    return GradientTransformation(
        init, update, None if lr is None else apply, differentiable=differentiable
    )


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms` (``grad_avg`` is empty unless centered)."""

    square_avg: dict[str, Tensor]
    grad_avg: dict[str, Tensor]


def scale_by_rms(
    alpha: float = 0.99,
    eps: float = 1e-8,
    centered: bool = False,
    *,
    lr: ScheduleLike | None = None,
) -> GradientTransformation:
    """RMSprop's rescaling ``u / (sqrt(E[u^2] (- E[u]^2 if centered)) + eps)``, no bias correction.

    Args:
        alpha: smoothing constant of the running averages.
        eps: added after the square root, as torch.optim.RMSprop does.
        centered: subtract the squared running mean of the updates (centered RMSprop).
        lr: when given, the output is ``-lr * u / denom`` in torch.optim's op order and the
            terminal ``apply`` is RMSprop's ``addcdiv_`` (momentum-free RMSprop).

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.scale_by_rms(alpha=0.0, eps=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params, 0)[0]["w"]
        tensor([ 1., -1.])
    """
    alpha = _check_range("alpha", alpha, 0.0)
    eps = _check_range("eps", eps, 0.0)
    if lr is not None:
        lr = _check_lr(lr)

    def init(params: Params) -> ScaleByRmsState:
        _real_only(params, "scale_by_rms")
        return ScaleByRmsState(_zeros(params), _zeros(params) if centered else {})

    def denominator(g: list[Tensor], state: ScaleByRmsState, keys: list[str]) -> list[Tensor]:
        sq = [state.square_avg[k] for k in keys]
        torch._foreach_mul_(sq, alpha)
        torch._foreach_addcmul_(sq, g, g, value=1 - alpha)
        if centered:
            ga = [state.grad_avg[k] for k in keys]
            torch._foreach_lerp_(ga, g, 1 - alpha)
            avg = list(torch._foreach_addcmul(sq, ga, ga, value=-1))
            torch._foreach_sqrt_(avg)
        else:
            avg = list(torch._foreach_sqrt(sq))
        torch._foreach_add_(avg, eps)
        return avg

    def update(updates: Updates, state: ScaleByRmsState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.square_avg, "scale_by_rms")
        keys = list(updates)
        g = [updates[k] for k in keys]
        avg = denominator(g, state, keys)
        if lr is not None:
            torch._foreach_mul_(g, -_lr_at(lr, step))
        torch._foreach_div_(g, avg)
        return updates, state

    def differentiable(updates: Updates, state: ScaleByRmsState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.square_avg, "scale_by_rms")
        keys = list(updates)
        g = [updates[k] for k in keys]
        sq = torch._foreach_mul([state.square_avg[k] for k in keys], alpha)
        sq = torch._foreach_addcmul(sq, g, g, value=1 - alpha)
        ga: list[Tensor] | tuple[Tensor, ...] = []
        if centered:
            ga = torch._foreach_lerp([state.grad_avg[k] for k in keys], g, 1 - alpha)
            avg = _sqrt(torch._foreach_addcmul(sq, ga, ga, value=-1))
        else:
            avg = _sqrt(sq)
        avg = list(torch._foreach_add(avg, eps))
        if lr is not None:
            g = list(torch._foreach_mul(g, -_lr_at(lr, step)))
        out = torch._foreach_div(g, avg)
        new = ScaleByRmsState(
            dict(zip(keys, sq, strict=True)), dict(zip(keys, ga, strict=True)) if centered else {}
        )
        return dict(zip(keys, out, strict=True)), new

    def apply(grads: Updates, state: ScaleByRmsState, params: Params, step: int):
        if not grads:
            return state
        _check_keys(grads, state.square_avg, "scale_by_rms")
        keys = list(grads)
        g = [grads[k] for k in keys]
        avg = denominator(g, state, keys)
        torch._foreach_addcdiv_([params[k] for k in keys], g, avg, value=-_lr_at(lr, step))
        return state

    return GradientTransformation(
        init, update, None if lr is None else apply, differentiable=differentiable
    )


class ScaleByAdagradState(NamedTuple):
    """State of :func:`scale_by_adagrad`: step counters and sums of squares."""

    step: dict[str, Tensor]
    sum: dict[str, Tensor]


def scale_by_adagrad(
    lr_decay: float = 0.0,
    eps: float = 1e-10,
    initial_accumulator_value: float = 0.0,
    *,
    lr: ScheduleLike | None = None,
) -> GradientTransformation:
    """Adagrad's rescaling ``u / (sqrt(sum u^2) + eps) / (1 + (t - 1) * lr_decay)``.

    Args:
        lr_decay: decay of the step size with the per-parameter step count ``t``.
        eps: added after the square root.
        initial_accumulator_value: starting value of the sum of squares.
        lr: when given, the output is the final ``-lr``-scaled update in torch.optim's op order
            and the terminal ``apply`` is torch.optim.Adagrad's ``addcdiv_``.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.scale_by_adagrad(eps=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params, 0)[0]["w"]
        tensor([ 1., -1.])
    """
    lr_decay = _check_range("lr_decay", lr_decay, 0.0)
    eps = _check_range("eps", eps, 0.0)
    init_acc = _check_range("initial_accumulator_value", initial_accumulator_value, 0.0)
    if lr is not None:
        lr = _check_lr(lr)

    def init(params: Params) -> ScaleByAdagradState:
        _real_only(params, "scale_by_adagrad")
        sums = {
            k: torch.full_like(p, init_acc, memory_format=torch.preserve_format)
            for k, p in params.items()
        }
        return ScaleByAdagradState(_steps(params), sums)

    def rates(steps: list[Tensor], lr_now: float | None) -> list:
        num = 1.0 if lr_now is None else -lr_now
        if _tensor_math(steps):
            return [num / (1 + (_f64(s) - 1) * lr_decay) for s in steps]
        return [num / (1 + (s.item() - 1) * lr_decay) for s in steps]

    def numerator_and_std(g, state, keys, lr_now):
        steps = [state.step[k] for k in keys]
        _increment(steps)
        clr = rates(steps, lr_now)
        sums = [state.sum[k] for k in keys]
        torch._foreach_addcmul_(sums, g, g, value=1)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, eps)
        torch._foreach_mul_(g, clr)
        return std

    def update(updates: Updates, state: ScaleByAdagradState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.sum, "scale_by_adagrad")
        keys = list(updates)
        g = [updates[k] for k in keys]
        lr_now = None if lr is None else _lr_at(lr, step)
        std = numerator_and_std(g, state, keys, lr_now)
        torch._foreach_div_(g, std)
        return updates, state

    def differentiable(updates: Updates, state: ScaleByAdagradState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.sum, "scale_by_adagrad")
        keys = list(updates)
        g = [updates[k] for k in keys]
        steps = list(torch._foreach_add([state.step[k] for k in keys], 1.0))
        clr = rates(steps, None if lr is None else _lr_at(lr, step))
        sums = torch._foreach_addcmul([state.sum[k] for k in keys], g, g, value=1)
        std = torch._foreach_add(_sqrt(sums), eps)
        out = torch._foreach_div(torch._foreach_mul(g, clr), std)
        new = ScaleByAdagradState(
            _like(state.step, keys, steps), dict(zip(keys, sums, strict=True))
        )
        return dict(zip(keys, out, strict=True)), new

    def apply(grads: Updates, state: ScaleByAdagradState, params: Params, step: int):
        if not grads:
            return state
        _check_keys(grads, state.sum, "scale_by_adagrad")
        keys = list(grads)
        g = [grads[k] for k in keys]
        std = numerator_and_std(g, state, keys, _lr_at(lr, step))
        torch._foreach_addcdiv_([params[k] for k in keys], g, std)
        return state

    return GradientTransformation(
        init, update, None if lr is None else apply, differentiable=differentiable
    )


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`: the momentum."""

    exp_avg: dict[str, Tensor]


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction ``sign(b1 * m + (1 - b1) * u)``, then ``m = b2 * m + (1 - b2) * u``.

    From "Symbolic Discovery of Optimization Algorithms" (Chen et al., 2023), Algorithm 2.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.scale_by_lion()
        >>> params = {"w": torch.zeros(2)}
        >>> tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params, 0)[0]["w"]
        tensor([ 1., -1.])
    """
    b1, b2 = _check_range("b1", b1, 0.0, 1.0), _check_range("b2", b2, 0.0, 1.0)

    def init(params: Params) -> ScaleByLionState:
        _real_only(params, "scale_by_lion")
        return ScaleByLionState(_zeros(params))

    def update(updates: Updates, state: ScaleByLionState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.exp_avg, "scale_by_lion")
        keys = list(updates)
        g = [updates[k] for k in keys]
        m = [state.exp_avg[k] for k in keys]
        c = torch._foreach_mul(m, b1)
        torch._foreach_add_(c, g, alpha=1 - b1)
        torch._foreach_sign_(c)
        torch._foreach_mul_(m, b2)
        torch._foreach_add_(m, g, alpha=1 - b2)
        return dict(zip(keys, c, strict=True)), state

    def differentiable(updates: Updates, state: ScaleByLionState, params: Params, step: int):
        if not updates:
            return updates, state
        _check_keys(updates, state.exp_avg, "scale_by_lion")
        keys = list(updates)
        g = [updates[k] for k in keys]
        m = [state.exp_avg[k] for k in keys]
        c = torch._foreach_sign(torch._foreach_add(torch._foreach_mul(m, b1), g, alpha=1 - b1))
        moved = torch._foreach_add(torch._foreach_mul(m, b2), g, alpha=1 - b2)
        new = ScaleByLionState(dict(zip(keys, moved, strict=True)))
        return dict(zip(keys, c, strict=True)), new

    return GradientTransformation(init, update, differentiable=differentiable)
