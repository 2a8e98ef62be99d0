"""An exponential moving average of the weights, kept in the optimizer state.

:func:`ema_weights` wraps an optimizer so that each of its steps also moves an average of the
parameters toward the new parameters (torch's ``AveragedModel`` with
``get_ema_multi_avg_fn(decay)``: the first update copies, each later one is
``ema = decay * ema + (1 - decay) * params``). Being optimizer state, the average is
checkpointed, resumed, fingerprinted and replayed with the rest of the state, and it moves once
per optimizer step (after an accumulation window, never on a step a loss scale skipped). The
listener :class:`~engine.listeners.averaging.EMAWeightAveraging` evaluates with it and hands it
back at the end of ``fit``; :func:`ema_params` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from engine.optim.base import (
    GradientTransformation,
    OptState,
    Params,
    Updates,
    apply_updates,
    recorded,
)

__all__ = ["EmaState", "ema_params", "ema_weights"]


class EmaState(NamedTuple):
    """State of :func:`ema_weights`: the wrapped optimizer's state, the averaged weights by
    parameter name, and how many optimizer steps have updated them (``step``: a float32 tensor,
    like torch.optim's; named so that a true precision's cast leaves it alone)."""

    inner: OptState
    ema: dict[str, Tensor]
    step: Tensor


def _check_decay(decay: Any) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
        raise ValueError(
            f"ema_weights(decay={decay!r}): pass a number in [0, 1], e.g. 0.999 (the weight the "
            "average keeps at each step)"
        )
    return float(decay)


def ema_weights(
    tx: GradientTransformation,
    decay: float = 0.999,
    *,
    every_n_steps: int = 1,
    start_step: int = 0,
) -> GradientTransformation:
    """``tx`` that also keeps an exponential moving average of the parameters in its state.

    After ``tx`` writes the new parameters, the average moves toward them with
    ``torch._foreach_lerp_(ema, params, 1 - decay)``; the first step copies them (torch's
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` bitwise). Wrap the whole
    optimizer (it writes the parameters: ``apply``); the step is branch-free, so it compiles.

    Args:
        tx: the optimizer, e.g. ``optim.adamw(1e-3)``.
        decay: the weight the average keeps at each step, in ``[0, 1]``.
        every_n_steps, start_step: update the average only after optimizer steps ``n`` (counted
            from 0, before the step) with ``n >= start_step`` and ``n % every_n_steps == 0``
            (Lightning's ``EMAWeightAveraging(update_every_n_steps=,
            update_starting_at_step=)``); the first update copies.

    Raises:
        TypeError: if ``tx`` is not a :class:`~engine.optim.GradientTransformation`.
        ValueError: for a ``decay`` outside ``[0, 1]``.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> from engine.optim.averaging import ema_params, ema_weights
        >>> tx = ema_weights(optim.sgd(0.5), decay=0.5)
        >>> params = {"w": torch.zeros(2)}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, state, params, 0)
        >>> params["w"], ema_params(state)["w"]  # first step copied -0.5, then halfway to -1
        (tensor([-1., -1.]), tensor([-0.7500, -0.7500]))
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"ema_weights({type(tx).__name__}): pass the optimizer to average, e.g. "
            "optim.ema_weights(optim.adamw(1e-3), decay=0.999)"
        )
    decay = _check_decay(decay)
    for name, value, least in (("every_n_steps", every_n_steps, 1), ("start_step", start_step, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"ema_weights({name}={value!r}): pass an int >= {least}")

    def due(step: int) -> bool:
        return step >= start_step and step % every_n_steps == 0

    def init(params: Params) -> EmaState:
        first = next(iter(params.values()), None)
        device = first.device if first is not None else None
        ema = {k: p.detach().clone() for k, p in params.items()}
        return EmaState(tx.init(params), ema, torch.zeros((), dtype=torch.float32, device=device))

    def average(state: EmaState, params: Params) -> None:
        # the first update copies (a lerp of weight 1 is the end point, bitwise), later ones
        # lerp by 1 - decay; the weight is a tensor so that nothing branches on the count
        count = state.step
        weight = torch.where(count == 0, 1.0, 1.0 - decay)
        keys = list(state.ema)
        by_dtype: dict[torch.dtype, Tensor] = {}
        weights = []
        for k in keys:
            dtype = state.ema[k].dtype
            if dtype not in by_dtype:
                by_dtype[dtype] = weight.to(dtype)
            weights.append(by_dtype[dtype])
        if keys:
            torch._foreach_lerp_(
                [state.ema[k] for k in keys], [params[k].detach() for k in keys], weights
            )
        count.add_(1)

    def update(updates: Updates, state: EmaState, params: Params, step: int):
        updates, inner = tx.update(updates, state.inner, params, step)
        with torch.no_grad():  # the parameters the caller will write: p + u, as apply_updates
            keys = list(params)
            if due(step):
                new = torch._foreach_add(
                    [params[k].detach() for k in keys], [updates[k] for k in keys]
                )
                average(state, dict(zip(keys, new, strict=True)))
        return updates, EmaState(inner, state.ema, state.step)

    def apply(grads: Updates, state: EmaState, params: Params, step: int) -> EmaState:
        if tx.apply is not None:
            inner = tx.apply(grads, state.inner, params, step)
        else:
            updates, inner = tx.update(grads, state.inner, params, step)
            apply_updates(params, updates)
        if due(step):
            with torch.no_grad():
                average(state, params)
        return EmaState(inner, state.ema, state.step)

    arguments = {"tx": tx, "decay": decay, "every_n_steps": every_n_steps, "start_step": start_step}
    return recorded(
        GradientTransformation(init, update, apply), "ema_weights", arguments, _ema_again
    )


def _ema_again(a: Mapping[str, Any]) -> GradientTransformation:
    return ema_weights(**a)


def _found(opt_state: OptState) -> list[EmaState]:
    is_leaf = lambda x: isinstance(x, EmaState)  # noqa: E731
    return [x for x in pytree.tree_leaves(opt_state, is_leaf=is_leaf) if isinstance(x, EmaState)]


def find_ema(opt_state: OptState) -> EmaState | None:
    """The :class:`EmaState` in an optimizer state, or ``None`` when it has none.

    Raises:
        ValueError: when it holds more than one (an average per parameter group is not
            supported: wrap the whole optimizer once).
    """
    found = _found(opt_state)
    if len(found) > 1:
        raise ValueError(
            f"the optimizer state holds {len(found)} ema_weights averages; wrap the whole "
            "optimizer once: optim.ema_weights(optim.chain(...), decay=...)"
        )
    return found[0] if found else None


def ema_params(opt_state: OptState) -> dict[str, Tensor]:
    """The averaged weights an :func:`ema_weights` optimizer state holds (the state's tensors,
    not copies: clone them to keep them past the next step).

    Raises:
        ValueError: if the state has no :class:`EmaState` (say how to build one).
    """
    found = find_ema(opt_state)
    if found is None:
        raise ValueError(
            "the optimizer state holds no moving average of the weights; build the optimizer "
            "with ema_weights, e.g. tx=optim.ema_weights(optim.adamw(1e-3), decay=0.999)"
        )
    return dict(found.ema)
