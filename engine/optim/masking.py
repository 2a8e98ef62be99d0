"""Per-parameter options: apply a transformation to a subset, or different ones by label."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

from torch import Tensor

from engine.optim._common import (
    Labels,
    Mask,
)
from engine.optim.base import (
    ApplyFn,
    GradientTransformation,
    OptState,
    Params,
    UpdateFn,
    Updates,
    apply_updates,
    recorded,
)

# --------------------------------------------------------------------------- per-parameter options


def decay_mask(params: Params) -> dict[str, bool]:
    """``True`` for tensors with at least 2 dimensions (weight matrices, conv kernels).

    The usual rule "no weight decay on biases and norm weights": 1-D tensors (biases, LayerNorm
    and BatchNorm weights) and 0-D scalars are ``False``. Use it as the mask of :func:`masked`, or
    to build labels for :func:`multi_transform`.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> params = {"fc.weight": torch.zeros(3, 2), "fc.bias": torch.zeros(3)}
        >>> optim.decay_mask(params)
        {'fc.weight': True, 'fc.bias': False}
        >>> tx = optim.chain(optim.masked(optim.add_decayed_weights(1e-4), optim.decay_mask),
        ...                  optim.adam(1e-3))
    """
    return {k: p.ndim >= 2 for k, p in params.items()}


def _resolve(spec: Any, params: Params, what: str) -> Mapping[str, Any]:
    value = spec(params) if callable(spec) else spec
    if not isinstance(value, Mapping) or value.keys() != params.keys():
        got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise KeyError(
            f"{what} must give one entry per parameter: parameters are {sorted(params)}, got "
            f"{got}; pass a dict with the same keys or a callable params -> dict"
        )
    return value


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner state, for the masked parameters only."""

    inner: OptState


def masked(tx: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``tx`` only to the parameters where ``mask`` is ``True``.

    Updates of unmasked parameters pass through unchanged (as in optax), so ``masked`` belongs
    before the final scaling of a chain. To give groups of parameters different optimizers, use
    :func:`multi_transform`.

    Args:
        tx: the transformation for the masked subset; its state covers only that subset.
        mask: ``{name: bool}`` or a callable ``params -> {name: bool}`` (e.g. :func:`decay_mask`).

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.masked(optim.scale(0.0), {"w": True, "b": False})
        >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> tx.update({"w": torch.ones(1), "b": torch.ones(1)}, tx.init(params), params, 0)[0]
        {'w': tensor([0.]), 'b': tensor([1.])}
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"masked() needs a GradientTransformation (got {type(tx).__name__})")

    def split(tree: Mapping[str, Tensor], m: Mapping[str, Any]) -> dict[str, Tensor]:
        return {k: v for k, v in tree.items() if m[k]}

    def init(params: Params) -> MaskedState:
        return MaskedState(tx.init(split(params, _resolve(mask, params, "mask"))))

    def updating(inner_update: UpdateFn) -> UpdateFn:  # tx.update, or its differentiable form
        def update(updates: Updates, state: MaskedState, params: Params, step: int):
            m = _resolve(mask, params, "mask")
            sub, inner = inner_update(split(updates, m), state.inner, split(params, m), step)
            return {k: sub[k] if m[k] else u for k, u in updates.items()}, MaskedState(inner)

        return update

    inner_apply = cast(ApplyFn, tx.apply)  # only used when tx has one (see below)

    def apply(grads: Updates, state: MaskedState, params: Params, step: int) -> MaskedState:
        m = _resolve(mask, params, "mask")
        inner = inner_apply(split(grads, m), state.inner, split(params, m), step)
        rest = {k: p for k, p in params.items() if not m[k]}
        if rest:
            apply_updates(rest, grads)
        return MaskedState(inner)

    differentiable = None if tx.differentiable is None else updating(tx.differentiable)
    return recorded(
        GradientTransformation(
            init,
            updating(tx.update),
            None if tx.apply is None else apply,
            differentiable=differentiable,
        ),
        "masked",
        {"tx": tx, "mask": mask},
        lambda a: masked(a["tx"], a["mask"]),
    )


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`: one inner state per label."""

    inner: dict[Any, OptState]


def multi_transform(
    transforms: Mapping[Any, GradientTransformation], labels: Labels
) -> GradientTransformation:
    """Give each group of parameters its own transformation (torch.optim's param groups).

    Args:
        transforms: ``{label: tx}``.
        labels: ``{name: label}`` or a callable ``params -> {name: label}``.

    If any member has a fused ``apply`` the result has one too, so ``adamw`` groups stay fused.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> labels = lambda ps: {k: "decay" if m else "no_decay"
        ...                      for k, m in optim.decay_mask(ps).items()}
        >>> tx = optim.multi_transform(
        ...     {"decay": optim.adamw(1e-3, weight_decay=0.1),
        ...      "no_decay": optim.adamw(1e-3, weight_decay=0.0)}, labels)
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> sorted(tx.init(params).inner)
        ['decay', 'no_decay']
    """
    transforms = dict(transforms)
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"multi_transform: transforms[{label!r}] must be a GradientTransformation "
                f"(got {type(t).__name__})"
            )

    def groups(params: Params) -> dict[Any, list[str]]:
        lab = _resolve(labels, params, "labels")
        out: dict[Any, list[str]] = {label: [] for label in transforms}
        for k, label in lab.items():
            if label not in out:
                raise KeyError(
                    f"multi_transform: parameter {k!r} has label {label!r}, which has no "
                    f"transform (labels with transforms: {sorted(map(repr, transforms))})"
                )
            out[label].append(k)
        return out

    def init(params: Params) -> MultiTransformState:
        return MultiTransformState(
            {
                label: transforms[label].init({k: params[k] for k in ks})
                for label, ks in groups(params).items()
            }
        )

    def updating(form: Callable[[GradientTransformation], UpdateFn]) -> UpdateFn:
        """The update that runs ``form(tx)`` (``update``, or the differentiable form) of each
        group's transformation."""

        def update(updates: Updates, state: MultiTransformState, params: Params, step: int):
            new: dict[str, Tensor] = {}
            inner = {}
            for label, ks in groups(params).items():
                sub, inner[label] = form(transforms[label])(
                    {k: updates[k] for k in ks},
                    state.inner[label],
                    {k: params[k] for k in ks},
                    step,
                )
                new.update(sub)
            return {k: new[k] for k in updates}, MultiTransformState(inner)

        return update

    def apply(grads: Updates, state: MultiTransformState, params: Params, step: int):
        inner = {}
        for label, ks in groups(params).items():
            t, g, p = transforms[label], {k: grads[k] for k in ks}, {k: params[k] for k in ks}
            if t.apply is not None:
                inner[label] = t.apply(g, state.inner[label], p, step)
            else:
                u, inner[label] = t.update(g, state.inner[label], p, step)
                if u:
                    apply_updates(p, u)
        return MultiTransformState(inner)

    has_apply = any(t.apply is not None for t in transforms.values())
    # one optimizer with param groups when every group runs the same one (torch.optim's
    # param groups are of one class)
    names = {t.name for t in transforms.values()}
    name = names.pop() if len(names) == 1 else None
    differentiable = None
    if all(t.differentiable is not None for t in transforms.values()):
        differentiable = updating(lambda t: cast(UpdateFn, t.differentiable))
    return recorded(
        GradientTransformation(
            init,
            updating(lambda t: t.update),
            apply if has_apply else None,
            name,
            differentiable=differentiable,
        ),
        "multi_transform",
        {"transforms": dict(transforms), "labels": labels},
        lambda a: multi_transform(a["transforms"], a["labels"]),
    )
