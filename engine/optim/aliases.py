"""Named optimizers with torch.optim's arguments and defaults, built as chains of transforms.

Each alias reproduces its ``torch.optim`` namesake: under :func:`~engine.optim.apply_gradients`
the chain's terminal ``apply`` runs the same kernel sequence as torch.optim's foreach
implementation (bitwise equal parameters), which is also its default on the CPU (the
single-tensor loop; equal bitwise): a port of ``torch.optim.X(params, ...)`` to ``optim.x(...)``
gives torch's numbers. As in torch, ``fused=True`` takes the fused kernels instead
(``torch._fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_``: bitwise
``torch.optim.X(fused=True)``; one kernel, no temporaries, faster). The composable ``update``
form agrees with torch.optim to float rounding (about 1e-7 relative per step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import attrs
import torch

from engine.optim._common import Mask, _check_betas, _check_lr, _check_range, _lr_at
from engine.optim.adaptive import scale_by_adagrad, scale_by_adam, scale_by_lion, scale_by_rms
from engine.optim.base import (
    ApplyFn,
    GradientTransformation,
    OptState,
    Params,
    ScheduleLike,
    Updates,
    apply_updates,
    chain,
    recorded,
)
from engine.optim.masking import _resolve, masked
from engine.optim.transforms import (
    add_decayed_weights,
    decoupled_weight_decay,
    scale,
    scale_by_learning_rate,
    trace,
)

# Device types with fused optimizer kernels (torch.optim's _get_fused_kernels_supported_devices).
_FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu")

# A fused step for one (device, dtype, decay) group:
# kernel(keys, grads, opt_state, params, step, decay), decay=False meaning weight_decay=0.
FusedKernel = Callable[[list[str], Updates, OptState, Params, int, bool], None]


# the torch.optim class each alias matches: LearningRateMonitor names the rate after it
_TORCH_NAMES = {"adam": "Adam", "adamw": "AdamW"}


def _fused_supported(p: torch.Tensor) -> bool:
    return torch.is_floating_point(p) and p.device.type in _FUSED_DEVICES and not p.is_sparse


def _check_mask(mask: Mask | None) -> Mask | None:
    if mask is not None and not (callable(mask) or isinstance(mask, Mapping)):
        raise TypeError(
            f"'mask' must be a dict {{name: bool}} or a callable params -> dict such as "
            f"optim.decay_mask (got {type(mask).__name__})"
        )
    return mask


def _decay(tx: GradientTransformation, mask: Mask | None) -> GradientTransformation:
    """``tx`` (a weight-decay transform) restricted to ``mask`` when one is given."""
    return tx if mask is None else masked(tx, mask)


def _gradient_prefix(
    maximize: bool, weight_decay: float, mask: Mask | None
) -> list[GradientTransformation]:
    """What torch.optim does to a gradient first: negate it to maximize, then add L2 decay."""
    members = [scale(-1.0)] if maximize else []
    if weight_decay != 0:
        members.append(_decay(add_decayed_weights(weight_decay), mask))
    return members


def _with_fused(
    base: GradientTransformation,
    kernel: FusedKernel,
    fused: bool | None,
    name: str,
    mask: Mask | None,
) -> GradientTransformation:
    """``base`` with a terminal ``apply`` that runs ``kernel`` per (device, dtype, decay) group.

    ``fused=True`` takes the kernel, and raises on parameters it does not support (as
    torch.optim does); ``fused=None`` (torch's default) and ``False`` return ``base``, torch's
    foreach sequence. Under ``torch.compile`` the fused kernels cannot be functionalised, so
    the compiled step always takes ``base`` (which Inductor fuses).
    """
    if fused is None or fused is False:
        return base
    if fused is not True:
        raise ValueError(
            f"{name}: 'fused' must be True, False or None (got {fused!r}); None (the default) "
            "is torch.optim's default path, True its fused kernel"
        )

    def fallback(grads: Updates, state: OptState, params: Params, step: int) -> OptState:
        if base.apply is not None:
            return base.apply(grads, state, params, step)
        updates, state = base.update(grads, state, params, step)
        apply_updates(params, updates)
        return state

    # The grouping depends only on the parameter tensors, which a donated state keeps from step
    # to step: remember it for the last set seen (by identity; ids hold nothing alive) instead
    # of re-walking every parameter and re-running the mask on every step.
    plan: dict[str, Any] = {"ids": None, "bad": [], "groups": []}

    def groups_of(params: Params) -> tuple[list[str], list[tuple[list[str], bool]]]:
        ids = tuple(map(id, params.values()))
        if plan["ids"] != ids:
            bad = [k for k, p in params.items() if not _fused_supported(p)]
            decays = _resolve(mask, params, "mask") if mask is not None else None
            groups: dict[tuple, list[str]] = {}
            for k, p in params.items():
                decay = decays is None or bool(decays[k])
                groups.setdefault((p.device, p.dtype, decay), []).append(k)
            plan.update(ids=ids, bad=bad, groups=[(ks, g[2]) for g, ks in groups.items()])
        return plan["bad"], plan["groups"]

    def apply(grads: Updates, state: OptState, params: Params, step: int) -> OptState:
        if not grads or torch.compiler.is_compiling():
            return fallback(grads, state, params, step) if grads else state
        bad, groups = groups_of(params)
        if bad:
            p = params[bad[0]]
            raise ValueError(
                f"{name}(fused=True): parameter {bad[0]!r} is {p.dtype} on {p.device}, which the "
                f"fused kernel does not support (it needs floating point tensors on "
                f"{'/'.join(_FUSED_DEVICES)}); leave fused out for torch.optim's default path"
            )
        for keys, decay in groups:
            kernel(keys, grads, state, params, step, decay)
        return state

    return GradientTransformation(base.init, base.update, apply, differentiable=base.differentiable)


def sgd(
    lr: ScheduleLike = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    *,
    mask: Mask | None = None,
    fused: bool | None = None,
) -> GradientTransformation:
    """Stochastic gradient descent, as torch.optim.SGD.

    ``chain([scale(-1)], [add_decayed_weights], [trace], scale_by_learning_rate)``; the momentum
    buffer is set to the first gradient on step 0, like torch.optim.

    Args:
        lr: learning rate (float or schedule ``step -> lr``).
        momentum, dampening, nesterov: heavy-ball momentum options of torch.optim.SGD.
        weight_decay: L2 penalty added to the gradient.
        maximize: ascend the objective instead.
        mask: which parameters get weight decay: ``{name: bool}`` or a callable
            ``params -> {name: bool}`` such as :func:`~engine.optim.decay_mask`; default all.
        fused: ``True`` runs ``torch._fused_sgd_`` (bitwise ``torch.optim.SGD(fused=True)``);
            ``None`` (the default) or ``False``: torch.optim.SGD's default path, matched
            bitwise (SGD is one memory-bound pass either way, so fusing gains little).

    Returns:
        The optimizer as a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params),
        ...                                       params, 0)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    arguments = dict(locals())  # as called, defaults included (the recipe)
    lr = _check_lr(lr)
    mask = _check_mask(mask)
    momentum = _check_range("momentum", momentum, 0.0)
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)
    members = _gradient_prefix(maximize, weight_decay, mask)
    trace_at = len(members)
    if momentum != 0 or nesterov:
        members.append(trace(momentum, dampening, nesterov))
    members.append(scale_by_learning_rate(lr))
    base = chain(*members)

    def kernel(keys, grads, state, params, step, decay) -> None:
        bufs = [state[trace_at].momentum_buffer[k] for k in keys] if momentum != 0 else []
        torch._fused_sgd_(
            [params[k] for k in keys],
            [grads[k] for k in keys],
            bufs,
            weight_decay=weight_decay if decay else 0.0,
            momentum=momentum,
            lr=_lr_at(lr, step),
            dampening=float(dampening),
            nesterov=nesterov,
            maximize=maximize,
            is_first_step=momentum != 0 and step == 0,
        )

    tx = attrs.evolve(_with_fused(base, kernel, fused, "sgd", mask), name="SGD")
    return recorded(tx, "sgd", arguments, _sgd)


def _adam_family(lr, betas, eps, weight_decay, amsgrad, maximize, mask, fused, decoupled, name):
    lr = _check_lr(lr)
    mask = _check_mask(mask)
    b1, b2 = _check_betas(betas)
    eps = _check_range("eps", eps, 0.0)
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)
    members = _gradient_prefix(maximize, 0.0 if decoupled else weight_decay, mask)
    adam_at = len(members)
    # torch.optim keeps the counters on the host unless fused (its kernel reads them on device)
    members.append(scale_by_adam(b1, b2, eps, amsgrad, lr=lr, host_counters=fused is not True))
    if weight_decay != 0 and decoupled:
        members.append(_decay(decoupled_weight_decay(weight_decay, lr), mask))
    base = chain(*members)
    if weight_decay != 0 and decoupled:
        base = _decayed_first(base, members, adam_at, weight_decay, lr, mask)
    fused_op = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def kernel(keys, grads, state, params, step, decay) -> None:
        s = state[adam_at]
        steps = [s.step[k] for k in keys]
        torch._foreach_add_(steps, 1)
        # lr goes in as given (float, SymFloat under torch.compile, or tensor): no .item() here.
        fused_op(
            [params[k] for k in keys],
            [grads[k] for k in keys],
            [s.exp_avg[k] for k in keys],
            [s.exp_avg_sq[k] for k in keys],
            [s.max_exp_avg_sq[k] for k in keys] if amsgrad else [],
            steps,
            lr=_lr_at(lr, step),
            beta1=b1,
            beta2=b2,
            weight_decay=weight_decay if decay else 0.0,
            eps=eps,
            amsgrad=amsgrad,
            maximize=maximize,
        )

    return attrs.evolve(_with_fused(base, kernel, fused, name, mask), name=_TORCH_NAMES[name])


def _decayed_first(
    base: GradientTransformation,
    members: list[GradientTransformation],
    adam_at: int,
    weight_decay: float,
    lr: ScheduleLike,
    mask: Mask | None,
) -> GradientTransformation:
    """``base`` (``..., scale_by_adam, decoupled decay``) with torch.optim.AdamW's terminal op
    order: the parameters decayed in place first, then Adam's ``apply`` (its ``addcdiv_``)
    into them. On CUDA ``addcdiv_`` computes ``p + s * (m / d)`` in one kernel, which adding
    an update ``s * m / d`` after the decay does not reproduce bit for bit; on the CPU the two
    are the same bits. The state is ``base``'s."""
    head, adam = members[:adam_at], members[adam_at]
    adam_apply = cast(ApplyFn, adam.apply)  # scale_by_adam(lr=...) has one

    def apply(grads: Updates, state: OptState, params: Params, step: int) -> OptState:
        if not grads:
            return state
        new = []
        for t, s in zip(head, state, strict=False):
            grads, s = t.update(grads, s, params, step)
            new.append(s)
        decays = _resolve(mask, params, "mask") if mask is not None else None
        decayed = [p for k, p in params.items() if decays is None or bool(decays[k])]
        if decayed:
            torch._foreach_mul_(decayed, 1 - _lr_at(lr, step) * weight_decay)
        new.append(adam_apply(grads, state[adam_at], params, step))
        return (*new, *state[adam_at + 1 :])

    return attrs.evolve(base, apply=apply)


def adam(
    lr: ScheduleLike = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    *,
    mask: Mask | None = None,
    fused: bool | None = None,
) -> GradientTransformation:
    """Adam, as torch.optim.Adam (``weight_decay`` is an L2 penalty on the gradient).

    ``chain([scale(-1)], [add_decayed_weights], scale_by_adam(lr=lr))``. By default the terminal
    ``apply`` is torch.optim's foreach kernel sequence, bitwise the default torch.optim.Adam
    (on the CPU, whose default single-tensor loop gives the same bits, as on CUDA); with
    ``fused=True`` it is ``torch._fused_adam_``, bitwise ``torch.optim.Adam(fused=True)``:
    one kernel, no temporaries, faster (see benchmarks/README.md).

    Args:
        lr: learning rate (float or schedule ``step -> lr``).
        betas: moment decay rates, each in ``[0, 1)``.
        eps: denominator term.
        weight_decay: L2 penalty.
        amsgrad: use the running maximum of the second moment.
        maximize: ascend the objective instead.
        mask: which parameters get weight decay: ``{name: bool}`` or a callable
            ``params -> {name: bool}`` such as :func:`~engine.optim.decay_mask`; default all.
        fused: ``True`` runs the fused kernel (parameters it does not support are refused, as
            in torch); ``None`` (the default) or ``False``: torch.optim's default path.

    Returns:
        The optimizer as a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.adam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params),
        ...                                       params, 0)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    arguments = dict(locals())  # as called, defaults included (the recipe)
    tx = _adam_family(lr, betas, eps, weight_decay, amsgrad, maximize, mask, fused, False, "adam")
    return recorded(tx, "adam", arguments, _adam)


def adamw(
    lr: ScheduleLike = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    *,
    mask: Mask | None = None,
    fused: bool | None = None,
) -> GradientTransformation:
    """AdamW, as torch.optim.AdamW (decoupled weight decay ``p *= 1 - lr * weight_decay``).

    ``chain([scale(-1)], scale_by_adam(lr=lr), [decoupled_weight_decay])``: bitwise the default
    torch.optim.AdamW; ``fused=True`` runs ``torch._fused_adamw_`` (bitwise
    ``torch.optim.AdamW(fused=True)``, faster). ``mask=optim.decay_mask`` skips decay on biases
    and norm weights (like two torch.optim param groups; a fused kernel then runs once per
    group).

    Args:
        lr: learning rate (float or schedule ``step -> lr``).
        betas: moment decay rates, each in ``[0, 1)``.
        eps: denominator term.
        weight_decay: decoupled decay coefficient.
        amsgrad: use the running maximum of the second moment.
        maximize: ascend the objective instead.
        mask: which parameters get weight decay: ``{name: bool}`` or a callable
            ``params -> {name: bool}`` such as :func:`~engine.optim.decay_mask`; default all.
        fused: ``True`` runs the fused kernel (parameters it does not support are refused, as
            in torch); ``None`` (the default) or ``False``: torch.optim's default path.

    Returns:
        The optimizer as a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params),
        ...                                       params, 0)
        >>> params["w"]
        tensor([0.8500, 0.8500])
    """
    arguments = dict(locals())  # as called, defaults included (the recipe)
    tx = _adam_family(lr, betas, eps, weight_decay, amsgrad, maximize, mask, fused, True, "adamw")
    return recorded(tx, "adamw", arguments, _adamw)


def rmsprop(
    lr: ScheduleLike = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    maximize: bool = False,
    *,
    mask: Mask | None = None,
) -> GradientTransformation:
    """RMSprop, as torch.optim.RMSprop.

    ``chain([scale(-1)], [add_decayed_weights], scale_by_rms, [trace, scale_by_learning_rate])``;
    without momentum the learning rate is folded into ``scale_by_rms`` as torch.optim does.

    Args:
        lr: learning rate (float or schedule ``step -> lr``).
        alpha: smoothing constant.
        eps: denominator term.
        weight_decay: L2 penalty.
        momentum: momentum factor.
        centered: normalise by the estimated variance instead of the second moment.
        maximize: ascend the objective instead.
        mask: which parameters get weight decay (see :func:`~engine.optim.decay_mask`).

    Returns:
        The optimizer as a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.rmsprop(0.1, alpha=0.0, eps=0.0)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params),
        ...                                       params, 0)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    arguments = dict(locals())  # as called, defaults included (the recipe)
    lr = _check_lr(lr)
    mask = _check_mask(mask)
    momentum = _check_range("momentum", momentum, 0.0)
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)
    members = _gradient_prefix(maximize, weight_decay, mask)
    if momentum > 0:
        members += [scale_by_rms(alpha, eps, centered), trace(momentum), scale_by_learning_rate(lr)]
    else:
        members.append(scale_by_rms(alpha, eps, centered, lr=lr))
    tx = attrs.evolve(chain(*members), name="RMSprop")
    return recorded(tx, "rmsprop", arguments, _rmsprop)


def adagrad(
    lr: ScheduleLike = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    *,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Adagrad, as torch.optim.Adagrad: ``chain([scale(-1)], [add_decayed_weights],
    scale_by_adagrad(lr=lr))``.

    Args:
        lr: learning rate (float or schedule ``step -> lr``).
        lr_decay: learning-rate decay with the step count.
        weight_decay: L2 penalty.
        initial_accumulator_value: starting value of the sum of squared gradients.
        eps: denominator term.
        maximize: ascend the objective instead.
        mask: which parameters get weight decay (see :func:`~engine.optim.decay_mask`).

    Returns:
        The optimizer as a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.adagrad(0.1, eps=0.0)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params),
        ...                                       params, 0)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    arguments = dict(locals())  # as called, defaults included (the recipe)
    lr = _check_lr(lr)
    mask = _check_mask(mask)
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)
    members = _gradient_prefix(maximize, weight_decay, mask)
    members.append(scale_by_adagrad(lr_decay, eps, initial_accumulator_value, lr=lr))
    tx = attrs.evolve(chain(*members), name="Adagrad")
    return recorded(tx, "adagrad", arguments, _adagrad)


def lion(
    lr: ScheduleLike = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    *,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023): ``p = p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g)``.

    ``chain(scale_by_lion, scale_by_learning_rate, [decoupled_weight_decay])``.

    Args:
        lr: learning rate (float or schedule ``step -> lr``); typically 3-10x smaller than AdamW's.
        betas: interpolation rate of the update and decay rate of the momentum.
        weight_decay: decoupled decay coefficient.
        mask: which parameters get weight decay (see :func:`~engine.optim.decay_mask`).

    Returns:
        The optimizer as a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.lion(0.5)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.tensor([1.0, -1.0])},
        ...                                       tx.init(params), params, 0)
        >>> params["w"]
        tensor([0.5000, 1.5000])
    """
    arguments = dict(locals())  # as called, defaults included (the recipe)
    lr = _check_lr(lr)
    mask = _check_mask(mask)
    b1, b2 = _check_betas(betas)
    weight_decay = _check_range("weight_decay", weight_decay, 0.0)
    members = [scale_by_lion(b1, b2), scale_by_learning_rate(lr)]
    if weight_decay != 0:
        members.append(_decay(decoupled_weight_decay(weight_decay, lr), mask))
    tx = attrs.evolve(chain(*members), name="Lion")
    return recorded(tx, "lion", arguments, _lion)


def _sgd(a: Mapping[str, Any]) -> GradientTransformation:
    return sgd(**a)


def _adam(a: Mapping[str, Any]) -> GradientTransformation:
    return adam(**a)


def _adamw(a: Mapping[str, Any]) -> GradientTransformation:
    return adamw(**a)


def _rmsprop(a: Mapping[str, Any]) -> GradientTransformation:
    return rmsprop(**a)


def _adagrad(a: Mapping[str, Any]) -> GradientTransformation:
    return adagrad(**a)


def _lion(a: Mapping[str, Any]) -> GradientTransformation:
    return lion(**a)
