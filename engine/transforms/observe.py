"""``Observe``: Lightning's hooks inside the step (``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``) as a step transform that calls back between the step's phases."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from engine.step import GradFn, UpdateFn
from engine.transforms.base import Transform

__all__ = ["Observe"]


class Observe(Transform):
    """Call back inside a train step, where Lightning calls its step hooks.

    Args:
        before_backward: ``fn(loss)`` after the forward pass, before backward: the loss
            backward starts from, before the accumulation divisor; multiplied by the loss scale
            under ``"16-mixed"``, as Lightning's ``on_before_backward`` receives it.
        after_backward: ``fn(grads)`` right after backward: this micro-batch's gradients (of
            ``loss / accumulate``; scaled by a loss scale if the precision uses one, as
            Lightning's are at this hook), a tuple in the order of the state's parameters.
        before_optimizer_step: ``fn(grads)`` on the calls that step the optimizer, before the
            gradient chain (clipping) and the update: the window's summed gradients, unscaled,
            a ``{name: tensor}`` dict.

    The callbacks receive the step's own tensors: read them, never change them in place. The
    callbacks are Python calls between the step's phases, so a step observed this way cannot be
    compiled into one graph; :func:`~engine.transforms.compose` places ``Observe`` inside the
    precision (it sees what Lightning's hooks see) and outside the gradient chain.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim, transforms
        >>> seen = []
        >>> observe = transforms.Observe(before_backward=lambda loss: seen.append("backward"),
        ...     before_optimizer_step=lambda grads: seen.append(sorted(grads)))
        >>> tx = optim.sgd(0.1)
        >>> step = transforms.compose(observe=observe).train_step(
        ...     lambda m, b: F.mse_loss(m(b[0]), b[1]), tx)
        >>> state = eg.TrainState.create(torch.nn.Linear(2, 1), tx)
        >>> _ = step(state, (torch.ones(3, 2), torch.ones(3, 1)))
        >>> seen
        ['backward', ['bias', 'weight']]
    """

    def __init__(
        self,
        *,
        before_backward: Callable[[Tensor], Any] | None = None,
        after_backward: Callable[[tuple[Tensor, ...]], Any] | None = None,
        before_optimizer_step: Callable[[Mapping[str, Tensor]], Any] | None = None,
    ) -> None:
        for name, fn in (
            ("before_backward", before_backward),
            ("after_backward", after_backward),
            ("before_optimizer_step", before_optimizer_step),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"Observe({name}={fn!r}): pass a function or None")
        self.before_backward = before_backward
        self.after_backward = after_backward
        self.before_optimizer_step = before_optimizer_step

    def wrap_grad(self, grad_fn: GradFn) -> GradFn:
        before, after = self.before_backward, self.after_backward
        if before is None and after is None:
            return grad_fn

        def observed(forward, params, accumulate, precision):
            if before is not None:

                def forward_then_call():
                    loss, aux = forward()
                    before(loss)
                    return loss, aux

                out = grad_fn(forward_then_call, params, accumulate, precision)
            else:
                out = grad_fn(forward, params, accumulate, precision)
            if after is not None:
                after(out[0])
            return out

        return observed

    def wrap_update(self, update_fn: UpdateFn) -> UpdateFn:
        call = self.before_optimizer_step
        if call is None:
            return update_fn

        def observed(grads, params, opt_state, precision, step):
            call(grads)
            return update_fn(grads, params, opt_state, precision, step)

        return observed
