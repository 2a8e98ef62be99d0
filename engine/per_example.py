"""Per-example gradients of a step's loss: ``torch.func.vmap`` over ``torch.func.grad``.

The loss function a train step takes, ``loss_fn(model, batch) -> loss`` (or ``(loss, metrics)``),
is reused as it is: each example becomes a batch of one (every tensor in the batch is split
along its first dimension and given it back with ``unsqueeze(0)``), so the per-example loss is
``loss_fn`` on that one-example batch, whatever its reduction, and ``vmap`` runs the examples
in one batched computation rather than a Python loop. The model is the state's module bound to
the tensors ``grad`` differentiates (:class:`engine.step.ModelView`, the semantics of
``torch.func.functional_call``), its buffers passed unbatched.

A module that mixes the examples of a batch has no per-example gradients: batch norm (its
statistics are the batch's) is refused, as Opacus refuses it; use ``nn.GroupNorm`` or
``nn.LayerNorm``. Random layers (dropout) draw a different mask for each example
(``randomness="different"``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from engine import rng
from engine.state import TrainState
from engine.step._common import LossFn, _cuda_devices, _set_mode, _split
from engine.step._model_view import _view

__all__ = [
    "check_per_example_module",
    "chunks",
    "examples",
    "per_example_grads",
    "vmapped_grads",
]

#: ``apply(params, batch) -> (loss, aux)``: a loss function bound to its model
Apply = Callable[[Mapping[str, Tensor], Any], "tuple[Tensor, Mapping[str, Any]]"]


def check_per_example_module(module: nn.Module | None) -> None:
    """Refuse a module whose forward pass mixes the examples of a batch.

    Batch norm normalises each example by the batch's statistics (and updates running ones in
    place), so an example's gradient depends on the others: it has no per-example gradient, and
    DP-SGD's per-example clipping would not bound any one example's influence. Instance norm
    that tracks running statistics updates them in place from every example.

    Raises:
        ValueError: naming the first such submodule and what to use instead.

    Example:
        >>> from torch import nn
        >>> check_per_example_module(nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2)))
        >>> check_per_example_module(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        Traceback (most recent call last):
        ...
        ValueError: per-example gradients: submodule '1' is BatchNorm1d, ...
    """
    if module is None:
        return
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"per-example gradients: submodule {name!r} is {type(sub).__name__}, which "
                "normalises each example by the whole batch's statistics, so no example has a "
                "gradient of its own (Opacus refuses it too); replace it with nn.GroupNorm or "
                "nn.LayerNorm"
            )
        if isinstance(sub, nn.modules.instancenorm._InstanceNorm) and sub.track_running_stats:
            raise ValueError(
                f"per-example gradients: submodule {name!r} is {type(sub).__name__} with "
                "track_running_stats=True, which updates its running statistics from every "
                "example in place; build it with track_running_stats=False"
            )


def _metric(name: str, value: Any) -> Tensor:
    """A loss function's metric for one example, as a 0-d tensor ``vmap`` can stack."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        return value.detach().reshape(())
    if isinstance(value, numbers.Real):
        return torch.as_tensor(float(value))
    raise TypeError(
        f"per-example gradients: the loss function's metric {name!r} is {value!r:.60}; with "
        "per-example gradients each example's metrics are averaged over the batch, so each "
        "must be one real number (a torchmetrics object cannot be: update it outside the step)"
    )


def examples(batch: Any) -> int:
    """The number of examples in ``batch``: the first dimension its tensors share.

    Raises:
        TypeError: a batch without tensors.
        ValueError: tensors whose first dimensions differ, a 0-d tensor, or no examples.

    Example:
        >>> import torch
        >>> examples({"x": torch.zeros(5, 3), "y": torch.zeros(5), "scale": 2.0})
        5
    """
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, Tensor)]
    if not shapes:
        raise TypeError(
            f"per-example gradients: the batch holds no tensor (got {type(batch).__name__}); "
            "the examples are split along the first dimension of its tensors"
        )
    if any(not s for s in shapes) or len({s[0] for s in shapes}) != 1 or shapes[0][0] == 0:
        raise ValueError(
            "per-example gradients: every tensor in the batch needs the same, non-empty first "
            f"(example) dimension (got shapes {shapes}); keep per-batch constants out of the "
            "batch's tensors or give them that dimension"
        )
    return shapes[0][0]


def chunks(batch: Any, size: int) -> list[Any]:
    """``batch`` cut into batches of at most ``size`` examples (its tensors sliced along the
    first dimension, other leaves shared).

    Example:
        >>> import torch
        >>> [b[0].tolist() for b in chunks((torch.arange(5), "tag"), 2)]
        [[0, 1], [2, 3], [4]]
    """
    n = examples(batch)
    leaves, spec = pytree.tree_flatten(batch)
    return [
        pytree.tree_unflatten(
            [x[i : i + size] if isinstance(x, Tensor) else x for x in leaves], spec
        )
        for i in range(0, n, size)
    ]


def vmapped_grads(
    apply: Apply,
    params: Mapping[str, Tensor],
    batch: Any,
    *,
    frozen: Mapping[str, Tensor] | None = None,
    chunk_size: int | None = None,
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
    """Each example's gradient of ``apply(params, one_example_batch)``'s loss.

    Args:
        apply: ``apply(params, batch) -> (loss, aux)``, the loss of a batch.
        params: the parameters differentiated (detached here: no graph reaches the caller's).
        batch: a pytree whose tensors all have the examples along their first dimension;
            other leaves are passed to every example as they are.
        frozen: parameters read but not differentiated.
        chunk_size: examples per vectorised chunk (``vmap``'s; ``None``: all at once).

    Returns:
        ``(grads, losses, aux)``: ``{name: tensor[B, *shape]}``, the ``B`` losses and each
        metric of ``aux`` per example (``tensor[B]``).

    Example:
        >>> import torch
        >>> apply = lambda p, b: ((p["w"] * b).sum() ** 2 / 2, {"n": 1})
        >>> grads, losses, aux = vmapped_grads(apply, {"w": torch.tensor(2.0)},
        ...                                    torch.tensor([1.0, 3.0]))
        >>> grads["w"].tolist(), losses.tolist(), aux["n"].tolist()
        ([2.0, 18.0], [2.0, 18.0], [1.0, 1.0])
    """
    leaves, spec = pytree.tree_flatten(batch)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    examples(batch)  # checks the tensors' first dimensions
    fixed = dict(frozen or {})

    def one(p: dict[str, Tensor], *examples: Tensor) -> tuple[Tensor, Any]:
        filled = list(leaves)
        for i, e in zip(where, examples, strict=True):
            filled[i] = e.unsqueeze(0)
        loss, aux = apply({**p, **fixed} if fixed else p, pytree.tree_unflatten(filled, spec))
        if loss.ndim != 0:
            raise ValueError(
                f"loss_fn must return a scalar loss (got shape {tuple(loss.shape)} for one "
                "example); reduce it, e.g. with .mean()"
            )
        return loss, (loss.detach(), {k: _metric(k, v) for k, v in aux.items()})

    per_example = torch.func.vmap(
        torch.func.grad(one, has_aux=True),
        in_dims=(None, *[0] * len(where)),
        randomness="different",
        chunk_size=chunk_size,
    )
    detached = {k: p.detach() for k, p in params.items()}
    grads, (losses, aux) = per_example(detached, *(leaves[i] for i in where))
    return grads, losses, aux


def per_example_grads(
    loss_fn: LossFn,
    state: TrainState | Mapping[str, Tensor],
    batch: Any,
    *,
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """Each example's gradient of ``loss_fn``, vectorised with ``torch.func.vmap``.

    ``loss_fn(model, batch)`` is a train step's loss function, reused as it is: example ``i``'s
    gradient is that of ``loss_fn(model, batch_i)``, ``batch_i`` the batch of that one example
    (every tensor of ``batch`` cut along its first dimension), so a mean and a sum reduction
    give the same per-example gradients, and their mean over the batch is the gradient of the
    batch's mean loss. For a :class:`~engine.state.TrainState` the module runs in training mode
    and its random layers draw from the seed a train step on this state would use
    (``(seed, step, micro_step)``), a different mask per example; the state is read, not
    consumed. For a dict of tensors (a pure-function model) ``loss_fn`` receives the dict.

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``-> (loss, metrics)``.
        state: a train state, or a dict of parameter tensors.
        batch: tensors (in tuples, lists, dicts) with the examples along the first dimension.
        chunk_size: examples per vectorised chunk (``vmap``'s): bounds the memory of the
            intermediate values, not of the result (``None``: all at once).

    Returns:
        ``{name: tensor[B, *param.shape]}`` for every trainable parameter.

    Raises:
        ValueError: a module with batch norm, tensors whose first dimensions differ, or a
            loss that is not a scalar for one example.
        TypeError: a batch without tensors, or a metric that is not one number.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> batch = (torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])
        >>> grads = eg.per_example_grads(loss_fn, state, batch)
        >>> grads["weight"].shape
        torch.Size([5, 2, 3])
        >>> mean = torch.autograd.grad(loss_fn(eg.ModelView(state.module, state.params, {}),
        ...                                    batch), state.params["weight"])[0]
        >>> torch.allclose(grads["weight"].mean(0), mean, atol=1e-6)
        True
    """
    if not callable(loss_fn):
        raise TypeError(f"per_example_grads: loss_fn must be callable (got {loss_fn!r:.60})")
    if isinstance(state, TrainState):
        state.check_alive("per_example_grads")
        module, params, buffers = state.module, state.params, state.buffers
        check_per_example_module(module)

        def apply(p: Mapping[str, Tensor], b: Any) -> tuple[Tensor, Mapping[str, Any]]:
            return _split(loss_fn(_view(module, p, buffers), b), "loss_fn")

        _set_mode(module, True)
        seed = rng.derive_seed(state.seed, state.step, state.micro_step)
        with rng.seeded(seed, _cuda_devices(state)):
            return vmapped_grads(apply, params, batch, chunk_size=chunk_size)[0]
    if isinstance(state, Mapping) and all(isinstance(v, Tensor) for v in state.values()):

        def pure(p: Mapping[str, Tensor], b: Any) -> tuple[Tensor, Mapping[str, Any]]:
            return _split(loss_fn(p, b), "loss_fn")

        return vmapped_grads(pure, state, batch, chunk_size=chunk_size)[0]
    raise TypeError(
        f"per_example_grads: state must be a TrainState or a dict of tensors (got "
        f"{type(state).__name__})"
    )
