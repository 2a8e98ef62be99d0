"""The pure cores a train step is made of, which step transforms wrap (private): the forward
pass as a gradient computation receives it (:class:`Forward`), the gradient computation
(:func:`grad_core`, :data:`GradFn`) and the optimizer application (:func:`update_core`,
:data:`UpdateFn`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from engine.optim.base import GradientTransformation, apply_updates


class Forward:
    """One micro-batch's forward pass, as a gradient computation (:data:`GradFn`) receives it.

    ``forward()`` runs the loss function on the step's parameters and batch and returns
    ``(loss, aux)``: all :func:`grad_core` needs. A gradient computation that needs more than
    the batch's loss, such as per-example gradients (:class:`engine.privacy.DPSGD`), reads what
    the call closes over:

    * ``params``: the step's parameters by name (the order of the list ``grad_fn`` is given);
    * ``batch``: the micro-batch;
    * ``at(params, batch)``: the same loss function, with the state's module and buffers, on
      other parameters (a dict, by name) or another batch: ``(loss, aux)``;
    * ``extra``: the entries of ``TrainState.extra`` that the pipeline's transforms read
      (:attr:`engine.transforms.Transform.reads_extra`), so their numbers are state;
    * ``first``: whether this micro-batch opens an accumulation window (always, without
      accumulation): what happens once per optimizer step happens here.

    A transform that wraps the forward pass (autocast, a loss scale, ``on_before_backward``)
    passes a plain function inward, which has none of these: a gradient computation that needs
    them must be the innermost ``wrap_grad`` and refuse such a function.

    Example:
        >>> import torch
        >>> params = {"w": torch.tensor(2.0)}
        >>> f = Forward(lambda p, b: ((p["w"] * b).sum(), {}), params, torch.ones(3))
        >>> f()[0].item(), f.at({"w": torch.tensor(1.0)}, torch.ones(2))[0].item(), f.first
        (6.0, 2.0, True)
    """

    __slots__ = ("_run", "batch", "extra", "first", "params")

    def __init__(
        self,
        run: Callable[[Mapping[str, Tensor], Any], tuple[Tensor, Mapping[str, Any]]],
        params: Mapping[str, Tensor],
        batch: Any,
        *,
        extra: Mapping[str, Any] | None = None,
        first: bool = True,
    ) -> None:
        self._run = run
        self.params = params
        self.batch = batch
        self.extra = extra if extra is not None else {}
        self.first = first

    def __call__(self) -> tuple[Tensor, Mapping[str, Any]]:
        return self._run(self.params, self.batch)

    def at(self, params: Mapping[str, Tensor], batch: Any) -> tuple[Tensor, Mapping[str, Any]]:
        """``(loss, aux)`` of the loss function on ``params`` and ``batch``."""
        return self._run(params, batch)


GradFn = Callable[
    [Callable[[], "tuple[Tensor, Mapping[str, Any]]"], "list[Tensor]", int, Any],
    "tuple[tuple[Tensor, ...], Tensor, Mapping[str, Any]]",
]
UpdateFn = Callable[
    [dict[str, Tensor], dict[str, Tensor], Any, Any, int], "tuple[Any, Any, Mapping[str, Tensor]]"
]


def grad_core(
    forward: Callable[[], tuple[Tensor, Mapping[str, Any]]],
    params: list[Tensor],
    accumulate: int,
    precision: Any,
) -> tuple[tuple[Tensor, ...], Tensor, Mapping[str, Any]]:
    """The gradient computation every train step starts from: ``forward()`` gives
    ``(loss, aux)``; the gradients are those of ``loss / accumulate``. Step transforms wrap it
    (``wrap_grad``): autocast around ``forward``, or a loss scale (read from ``precision``, the
    state's precision state, which this function does not use) applied to the loss that
    ``forward`` returns and taken off the one this returns."""
    loss, aux = forward()
    if loss.ndim != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss (got shape {tuple(loss.shape)}); "
            "reduce it, e.g. with .mean()"
        )
    objective = loss / accumulate if accumulate > 1 else loss
    if not isinstance(params, PartlyFrozen):
        return torch.autograd.grad(objective, params, materialize_grads=True), loss, aux
    # frozen parameters (optim.freezable) are left out of backward: no weight gradient is
    # computed for them, and they count as zeros (for clipping, as Lightning's have no .grad)
    wanted = [p for p in params if p.requires_grad]
    computed = iter(torch.autograd.grad(objective, wanted, materialize_grads=True))
    grads = tuple(next(computed) if p.requires_grad else torch.zeros_like(p) for p in params)
    return grads, loss, aux


class PartlyFrozen(list):
    """The parameters a step differentiates, some frozen: those are detached (``requires_grad``
    false), and :func:`grad_core` gives them zero gradients without computing any."""

    __slots__ = ()


def total_norm(grads: Mapping[str, Tensor]) -> Tensor:
    """The gradients' total 2-norm: Lightning's ``grad_norm(..., norm_type=2)``'s
    ``"grad_2.0_norm_total"``."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads.values()))))


def reporting_grad_norm(update_fn: UpdateFn) -> UpdateFn:
    """``update_fn`` reporting the total norm of the gradients it receives as ``"grad_norm"``:
    placed innermost in a pipeline's update, it measures them unscaled and before clipping."""

    def update(grads, params, opt_state, precision, step):
        norm = total_norm(grads)
        opt_state, precision, metrics = update_fn(grads, params, opt_state, precision, step)
        return opt_state, precision, {**metrics, "grad_norm": norm}

    return update


def update_core(
    tx: GradientTransformation, gradients: GradientTransformation | None = None
) -> UpdateFn:
    """The optimizer application every train step ends with:
    ``update(grads, params, opt_state, precision, step) -> (opt_state, precision, metrics)``,
    running the stateless ``gradients`` chain (clipping, later an all-reduce) before ``tx`` and
    writing the parameters in place. Step transforms wrap it (``wrap_update``): a loss scale's
    unscale, finite check and skipped step, with its state in ``precision`` and the skip in
    ``metrics`` (which this function leaves empty: the step's metrics are merged with them)."""

    def update(grads, params, opt_state, precision, step):
        if gradients is not None:
            grads, _ = gradients.update(grads, (), params, step)
        if tx.apply is not None:
            return tx.apply(grads, opt_state, params, step), precision, {}
        updates, opt_state = tx.update(grads, opt_state, params, step)
        apply_updates(params, updates)
        return opt_state, precision, {}

    return update
