"""Validation and step-counter helpers shared by the transforms (private)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from engine.optim.base import (
    Params,
    ScheduleLike,
    StepCounters,
)

Mask = Mapping[str, bool] | Callable[[Params], Mapping[str, bool]]
Labels = Mapping[str, Any] | Callable[[Params], Mapping[str, Any]]

# --------------------------------------------------------------------------- validation helpers


def _check_lr(lr: ScheduleLike, name: str = "lr") -> ScheduleLike:
    if callable(lr):
        return lr
    if isinstance(lr, Tensor):
        # a 0-d tensor, as torch.optim takes: an ensemble's swept learning rates, one per
        # member under torch.func.vmap (engine.ensemble), whose values cannot be read here
        if lr.dim() != 0 or not lr.is_floating_point():
            raise ValueError(
                f"'{name}' as a tensor must be a 0-d floating point tensor (got shape "
                f"{tuple(lr.shape)}, {lr.dtype}); e.g. {name}=torch.tensor(1e-3)"
            )
        if not torch._C._functorch.is_functorch_wrapped_tensor(lr) and not bool(lr >= 0):
            raise ValueError(f"'{name}' must be non-negative (got {lr!r})")
        return lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(
            f"'{name}' must be a non-negative float or a schedule (a callable step -> float) "
            f"(got {lr!r}); e.g. {name}=1e-3 or {name}=optim.schedules.cosine_decay(1e-3, 1000)"
        )
    return float(lr)


def _check_range(name: str, value: float, lo: float, hi: float | None = None) -> float:
    """Check ``lo <= value`` (and ``value < hi`` when given)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= lo
    ok = ok and (hi is None or value < hi)
    if not ok:
        where = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"'{name}' must be a float {where} (got {value!r})")
    return float(value)


def _check_betas(betas: tuple[float, float], name: str = "betas") -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"'{name}' must be a pair (beta1, beta2) (got {betas!r})")
    return (
        _check_range(f"{name}[0]", betas[0], 0.0, 1.0),
        _check_range(f"{name}[1]", betas[1], 0.0, 1.0),
    )


def _lr_at(lr: Any, step: int) -> float:  # Any: closures hold an Optional lr
    """The learning rate at ``step``: a schedule is called, a float is returned as is."""
    return lr(step) if callable(lr) else lr


def _check_keys(updates: Mapping[str, Tensor], state: Mapping[str, Any], what: str) -> None:
    if updates.keys() != state.keys():
        raise KeyError(
            f"{what}: updates have keys {sorted(updates)} but the state was built for "
            f"{sorted(state)}; call tx.init(params) with the same parameter dict you update"
        )


def _real_only(params: Params, what: str) -> None:
    for k, p in params.items():
        if p.is_complex():
            raise TypeError(
                f"{what}: parameter {k!r} is complex ({p.dtype}), which engine.optim's moment "
                "estimates do not handle; use optim.from_torch(torch.optim.Adam, ...) (torch.optim "
                "views complex tensors as real pairs) or split it into real and imaginary parts"
            )


def _zeros(params: Params) -> dict[str, Tensor]:
    return {k: torch.zeros_like(p, memory_format=torch.preserve_format) for k, p in params.items()}


def _steps(params: Params, *, host: bool = False) -> dict[str, Tensor]:
    """Per-parameter float32 step counters, as torch.optim keeps them: with ``host``, on the CPU
    in :class:`StepCounters` (its default Adam's); otherwise on each parameter's device."""
    if host:
        return StepCounters({k: torch.zeros((), dtype=torch.float32) for k in params})
    return {k: torch.zeros((), dtype=torch.float32, device=p.device) for k, p in params.items()}


def _like(counters: dict[str, Tensor], keys: list[str], steps: Any) -> dict[str, Tensor]:
    """New counters ``steps`` for ``keys`` in the container type of ``counters``."""
    return type(counters)(zip(keys, steps, strict=True))


def _tensor_math(steps: list[Tensor]) -> bool:
    """Whether bias corrections must stay tensors: under torch.compile, or when ``.item()`` on
    the step counters would be a host-device sync (mirrors torch.optim's ``capturable`` idea)."""
    return torch.compiler.is_compiling() or not steps[0].is_cpu


def _f64(step: Tensor) -> Tensor:
    """A step counter in float64 for bias corrections (as exact as torch.optim's Python floats);
    MPS has no float64."""
    return step if step.device.type == "mps" else step.to(torch.float64)


def _increment(steps: list[Tensor]) -> None:
    # Same overload torch.optim uses for CPU counters (one wrapped scalar, not one per tensor).
    if not torch.compiler.is_compiling() and steps[0].is_cpu:
        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1)
