"""Run any ``torch.optim.Optimizer`` class as a functional :class:`GradientTransformation`.

The optimizer's per-parameter state lives in the ``opt_state`` pytree (so
:func:`~engine.optim.state_dict` checkpoints it); a private optimizer instance is bound to the
current parameter tensors for the duration of one ``step()`` and holds nothing in between.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any, NamedTuple

import torch

from engine.optim._common import _check_lr, _lr_at
from engine.optim.base import GradientTransformation, Params, ScheduleLike, Updates, recorded


class TorchOptimizerState(NamedTuple):
    """``started`` is False until the first step; before it, ``state`` holds placeholders of the
    right shapes and dtypes (so it can serve as a :func:`load_state_dict` template) that the
    first step discards, letting the optimizer initialise its state itself."""

    started: bool
    state: dict[str, dict[str, Any]]


def from_torch(
    optimizer_cls: type[torch.optim.Optimizer], lr: ScheduleLike = 1e-3, **kwargs: Any
) -> GradientTransformation:
    """Wrap a ``torch.optim.Optimizer`` class; the result gives bitwise the parameters of using
    the optimizer directly.

    Its terminal ``apply`` (used by :func:`~engine.optim.apply_gradients`) binds the optimizer to
    the ``params`` tensors it is given, swaps the state in, runs ``step()`` in place and swaps
    the state out, so parameter dicts whose tensors change between steps (``donate=False``) work.
    The ``update`` form steps on copies and returns ``new - old``, which agrees with ``apply`` to
    float rounding only.

    Args:
        optimizer_cls: e.g. ``torch.optim.Adam``. Optimizers whose ``step`` needs a closure
            (LBFGS) are not supported.
        lr: learning rate, or a schedule ``step -> lr`` written into the param group each step.
        **kwargs: the optimizer's other arguments, e.g. ``betas=(0.9, 0.95), foreach=False``.

    Returns:
        The optimizer as a :class:`GradientTransformation` with a :class:`TorchOptimizerState`.

    Raises:
        TypeError: if ``optimizer_cls`` is not an Optimizer subclass or needs a closure.
        ValueError: if torch.optim rejects the arguments.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.from_torch(torch.optim.Adam, lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params),
        ...                                       params, 0)
        >>> params["w"], sorted(state.state["w"])
        (tensor([0.9000, 0.9000]), ['exp_avg', 'exp_avg_sq', 'step'])
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch() needs a torch.optim.Optimizer subclass such as torch.optim.Adam "
            f"(got {optimizer_cls!r}); pass the class, not an instance"
        )
    closure = inspect.signature(optimizer_cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"{optimizer_cls.__name__}.step() needs a closure that re-evaluates the loss, which "
            "apply_gradients cannot provide; use the optimizer directly"
        )
    lr = _check_lr(lr)
    try:  # let torch.optim validate the arguments now rather than at the first step
        optimizer_cls([torch.zeros(1, requires_grad=True)], lr=_lr_at(lr, 0), **kwargs)  # type: ignore[call-arg]
    except (TypeError, ValueError) as e:
        raise type(e)(f"from_torch({optimizer_cls.__name__}, lr={lr!r}, **{kwargs!r}): {e}") from e
    cache: list[torch.optim.Optimizer] = []  # one reusable instance; holds no tensors between steps

    def init(params: Params) -> TorchOptimizerState:
        if not params:
            return TorchOptimizerState(False, {})
        names = list(params)
        dummies = [torch.zeros_like(p).requires_grad_(True) for p in params.values()]
        opt = optimizer_cls(dummies, lr=_lr_at(lr, 0), **kwargs)  # type: ignore[call-arg]
        for d in dummies:
            d.grad = torch.zeros_like(d)
        opt.step()  # a throwaway step on zeros, to learn the state's layout
        return TorchOptimizerState(
            False, {k: dict(opt.state.get(d, {})) for k, d in zip(names, dummies, strict=True)}
        )

    def apply(grads: Updates, state: TorchOptimizerState, params: Params, step: int):
        if not params:
            return state
        if grads.keys() != params.keys() or (state.started and state.state.keys() != params.keys()):
            raise KeyError(
                f"from_torch({optimizer_cls.__name__}): grads {sorted(grads)}, params "
                f"{sorted(params)} and state {sorted(state.state)} must have the same keys"
            )
        names = list(params)
        plist = [params[k] for k in names]
        lr_now = _lr_at(lr, step)
        if state.started and cache:
            opt = cache[0]
            opt.param_groups[0]["params"] = plist
            opt.param_groups[0]["lr"] = lr_now
        else:  # a fresh instance: optimizers such as Adagrad initialise their state eagerly
            opt = optimizer_cls(plist, lr=lr_now, **kwargs)  # type: ignore[call-arg]
        if state.started:
            opt.state = defaultdict(
                dict, {p: dict(state.state[k]) for k, p in zip(names, plist, strict=True)}
            )
        old_grads = [p.grad for p in plist]
        try:
            for k, p in zip(names, plist, strict=True):
                p.grad = grads[k]
            opt.step()
            new = {k: dict(opt.state.get(p, {})) for k, p in zip(names, plist, strict=True)}
        finally:
            for p, g in zip(plist, old_grads, strict=True):
                p.grad = g
            opt.state = defaultdict(dict)
            opt.param_groups[0]["params"] = []
        cache[:] = [opt]
        return TorchOptimizerState(True, new)

    def update(updates: Updates, state: TorchOptimizerState, params: Params, step: int):
        copies = {k: p.detach().clone() for k, p in params.items()}
        state = apply(dict(updates), state, copies, step)
        return {k: copies[k].sub_(params[k]) for k in params}, state

    # the recipe: torch's defaults, then the arguments given (what the fit-start checks read)
    signature = inspect.signature(optimizer_cls.__init__).parameters.values()
    defaults = {p.name: p.default for p in signature if p.default is not inspect.Parameter.empty}
    return recorded(
        GradientTransformation(init, update, apply, optimizer_cls.__name__),
        f"from_torch(torch.optim.{optimizer_cls.__name__})",
        {**defaults, "optimizer_cls": optimizer_cls, "lr": lr, **kwargs},
        lambda a: from_torch(**{k: a[k] for k in ("optimizer_cls", "lr", *kwargs)}),
    )
