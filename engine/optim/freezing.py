"""Frozen parameters as optimizer state, so that a state transition can change which are trained.

:func:`freezable` wraps an optimizer; its state (:class:`FreezableState`) holds, per parameter,
whether it is frozen and whether its slice of the inner optimizer's state must be built afresh
before its next update. A frozen parameter gets no update at all (its tensor keeps its bits) and
its slice of the inner state is not advanced. Unfreezing (:func:`unfreeze`) marks the slice
*fresh*: the next update rebuilds it with the inner ``init`` on those parameters, so a parameter
that starts training mid-run gets the state torch.optim gives a new param group (Adam: step 0,
zero moments), whatever it had before it was frozen. The set of frozen parameters is part of the
checkpoint, and :class:`engine.Transition` s that change it are journaled and replayed.

The inner optimizer runs on the trainable parameters only: every dict of its state keyed by
parameter names is cut to the trainable ones before the call and merged back after it, so fused
kernels (``optim.adamw``) keep their grouping and see only what they update. Gradients of frozen
parameters are still computed by the step (and counted by ``Trainer(gradient_clip_val=...)``,
which clips before the optimizer): clip inside the wrapper,
``freezable(chain(clip_by_global_norm(1.0), adamw(1e-3)))``, to clip the trained ones only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from torch.utils import _pytree as pytree

from engine.optim.base import (
    GradientTransformation,
    OptState,
    Params,
    StepCounters,
    Updates,
    apply_updates,
    recorded,
)
from engine.optim.inject import get_hyperparams, set_hyperparams
from engine.optim.masking import MultiTransformState
from engine.optim.torch_adapter import TorchOptimizerState

__all__ = [
    "FreezableState",
    "freezable",
    "freeze",
    "frozen_names",
    "get_group_hyperparams",
    "match_prefixes",
    "set_group_hyperparams",
    "unfreeze",
]

FrozenSpec = Sequence[str] | Mapping[str, bool] | Callable[[Params], Mapping[str, bool]]


class FreezableState(NamedTuple):
    """State of :func:`freezable`.

    Attributes:
        frozen: ``{name: bool}`` for every parameter: ``True`` means no update.
        fresh: ``{name: bool}``: ``True`` means the parameter's slice of ``inner`` is rebuilt
            (``tx.init``) before its next update (set by :func:`unfreeze`).
        inner: the wrapped optimizer's state, for every parameter.
    """

    frozen: dict[str, bool]
    fresh: dict[str, bool]
    inner: OptState


def match_prefixes(
    names: Iterable[str], prefixes: Iterable[str], what: str = "prefix"
) -> list[str]:
    """The names under any of ``prefixes``: the name itself or a name beginning ``prefix.``
    (module paths: ``"backbone"`` covers ``"backbone.0.weight"``, not ``"backbone2.weight"``).

    Raises:
        TypeError: for a prefix that is not a non-empty str.
        ValueError: for a prefix that matches no name.

    Example:
        >>> from engine.optim.freezing import match_prefixes
        >>> match_prefixes(["backbone.0.weight", "backbone2.bias", "head.weight"], ["backbone"])
        ['backbone.0.weight']
    """
    names = list(names)
    out: set[str] = set()
    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"a {what} must be a non-empty str naming a module (got {prefix!r})")
        hit = [n for n in names if n == prefix or n.startswith(prefix + ".")]
        if not hit:
            tops = sorted({n.split(".")[0] for n in names})
            raise ValueError(
                f"{what} {prefix!r} matches no trainable parameter; the parameters are under "
                f"{tops} (pass a module path such as {tops[0] if tops else 'backbone'!r})"
            )
        out.update(hit)
    return [n for n in names if n in out]


def _frozen_mask(spec: FrozenSpec, params: Params) -> dict[str, bool]:
    if callable(spec):
        value = spec(params)
    elif isinstance(spec, Mapping):
        value = spec
    elif isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise TypeError(
            f"freezable(frozen={spec!r}): pass a list of module prefixes, a dict "
            "{name: bool} or a callable params -> {name: bool}"
        )
    else:
        names = set(match_prefixes(params, spec, "freezable(frozen=...): prefix"))
        value = {k: k in names for k in params}
    if not isinstance(value, Mapping) or value.keys() != params.keys():
        got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise KeyError(
            f"freezable(frozen=...) must give one bool per parameter: parameters are "
            f"{sorted(params)}, got {got}"
        )
    return {k: bool(value[k]) for k in params}


# ------------------------------------------------------------------- restricting the inner state


def _per_param(names: frozenset[str]) -> Callable[[Any], bool]:
    """Whether a state node is a dict keyed by parameter names (or an empty dict): a plain dict
    or Adam's :class:`~engine.optim.StepCounters`, whose type a cut or merge keeps."""

    def test(x: Any) -> bool:
        return type(x) in (dict, StepCounters) and all(isinstance(k, str) and k in names for k in x)

    return test


def _restrict(tree: OptState, names: frozenset[str], keep: Iterable[str]) -> OptState:
    """``tree`` with every parameter-keyed dict cut to the names in ``keep``."""
    keep = set(keep)
    is_leaf = _per_param(names)

    def cut(x: Any) -> Any:
        return type(x)((k, v) for k, v in x.items() if k in keep) if is_leaf(x) else x

    return pytree.tree_map(cut, tree, is_leaf=is_leaf)


def _merge(
    full: OptState, part: OptState, names: frozenset[str], others_from_part: bool
) -> OptState:
    """``full`` with the entries of ``part`` (a restriction of it) written over it; the leaves
    that are not parameter-keyed come from ``part`` when ``others_from_part`` (an update's
    result), else from ``full`` (a fresh ``init`` must not reset injected hyperparameters)."""
    is_leaf = _per_param(names)
    full_leaves, spec = pytree.tree_flatten(full, is_leaf=is_leaf)
    part_leaves, part_spec = pytree.tree_flatten(part, is_leaf=is_leaf)
    if part_spec != spec:
        raise ValueError(
            "freezable: the inner optimizer's state changes shape with the set of parameters in "
            "a way other than dicts keyed by parameter names; it cannot be run on the trainable "
            "parameters alone"
        )
    out = []
    for a, b in zip(full_leaves, part_leaves, strict=True):
        if is_leaf(a) and is_leaf(b):
            out.append(type(a)((k, b.get(k, v)) for k, v in a.items()))
        else:
            out.append(b if others_from_part else a)
    return pytree.tree_unflatten(out, spec)


_LABEL_HINT = (
    "; inside optim.freezable the inner optimizer runs on the trainable parameters only, so "
    "masks and labels must be callables params -> dict (e.g. labels=lambda ps: {k: "
    "'backbone' if k.startswith('backbone.') else 'head' for k in ps}), not dicts over every "
    "parameter"
)


def freezable(tx: GradientTransformation, frozen: FrozenSpec = ()) -> GradientTransformation:
    """``tx`` with a set of frozen parameters in its state (see the module's docstring).

    Args:
        tx: the optimizer of the trainable parameters. Put it whole inside (``freezable`` is the
            terminal member: a chain after it would see the frozen parameters' zero updates).
        frozen: the parameters frozen at ``init``: module prefixes (``["backbone"]``), a dict
            ``{name: bool}`` or a callable ``params -> {name: bool}``.

    Raises:
        TypeError: for ``tx`` that is not a GradientTransformation, a bad ``frozen``, or an
            ``optim.from_torch`` optimizer inside (its state is shared by all parameters).
        ValueError: for a prefix in ``frozen`` that matches no parameter.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> from engine.optim.freezing import freezable, frozen_names, unfreeze
        >>> tx = freezable(optim.adam(0.1), frozen=["body"])
        >>> params = {"body.w": torch.ones(2), "head.w": torch.ones(2)}
        >>> grads = {"body.w": torch.ones(2), "head.w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> frozen_names(state)
        ['body.w']
        >>> params, state = optim.apply_gradients(tx, dict(grads), state, params, 0)
        >>> params["body.w"], params["head.w"]
        (tensor([1., 1.]), tensor([0.9000, 0.9000]))
        >>> state = unfreeze(state, ["body.w"])  # a fresh Adam state at its next step
        >>> params, state = optim.apply_gradients(tx, dict(grads), state, params, 1)
        >>> params["body.w"]
        tensor([0.9000, 0.9000])
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"freezable() needs a GradientTransformation (got {type(tx).__name__}), e.g. "
            "optim.freezable(optim.adamw(1e-3), frozen=['backbone'])"
        )
    if not callable(frozen) and not isinstance(frozen, (Mapping, Sequence)):
        raise TypeError(
            f"freezable(frozen={frozen!r}): pass a list of module prefixes, a dict "
            "{name: bool} or a callable params -> {name: bool}"
        )

    def init(params: Params) -> FreezableState:
        mask = _frozen_mask(frozen, params)
        inner = tx.init(params)
        is_torch = lambda x: isinstance(x, TorchOptimizerState)  # noqa: E731
        if any(is_torch(x) for x in pytree.tree_leaves(inner, is_leaf=is_torch)):
            raise TypeError(
                "freezable(optim.from_torch(...)): a torch.optim optimizer's state is shared by "
                "all its parameters, so a subset cannot be frozen; use an engine.optim optimizer"
            )
        return FreezableState(mask, {k: False for k in params}, inner)

    def prepare(state: FreezableState, params: Params) -> tuple[frozenset[str], list[str], Any]:
        """The trainable names, and the inner state with fresh slices rebuilt."""
        if state.frozen.keys() != params.keys():
            raise KeyError(
                f"freezable: the state was built for parameters {sorted(state.frozen)} but the "
                f"step has {sorted(params)}; call tx.init with the parameters you update"
            )
        names = frozenset(params)
        keep = [k for k in params if not state.frozen[k]]
        inner = state.inner
        fresh = [k for k in keep if state.fresh[k]]
        if fresh:
            try:
                new = tx.init({k: params[k] for k in fresh})
            except KeyError as e:
                raise KeyError(str(e.args[0] if e.args else e) + _LABEL_HINT) from e
            inner = _merge(inner, new, names, others_from_part=False)
        return names, keep, inner

    def finish(state: FreezableState, inner: OptState) -> FreezableState:
        fresh = state.fresh
        if any(fresh[k] and not state.frozen[k] for k in fresh):
            fresh = {k: v and state.frozen[k] for k, v in fresh.items()}
        return FreezableState(state.frozen, fresh, inner)

    def update(updates: Updates, state: FreezableState, params: Params, step: int):
        names, keep, inner = prepare(state, params)
        if len(keep) == len(params):  # nothing frozen: the inner optimizer as it is
            out, inner = tx.update(updates, inner, params, step)
            return out, finish(state, inner)
        sub = _restrict(inner, names, keep)
        try:
            out, sub = tx.update(
                {k: updates[k] for k in keep}, sub, {k: params[k] for k in keep}, step
            )
        except KeyError as e:
            raise KeyError(str(e.args[0] if e.args else e) + _LABEL_HINT) from e
        # -0.0, not 0.0: p + (-0.0) has p's bits for every p (0.0 would turn -0.0 into 0.0)
        result = {k: out[k] if k in out else updates[k].fill_(-0.0) for k in updates}
        return result, finish(state, _merge(inner, sub, names, others_from_part=True))

    def apply(grads: Updates, state: FreezableState, params: Params, step: int) -> FreezableState:
        names, keep, inner = prepare(state, params)
        if not keep:
            return finish(state, inner)
        everything = len(keep) == len(params)  # nothing frozen: the inner optimizer as it is
        sub = inner if everything else _restrict(inner, names, keep)
        g = grads if everything else {k: grads[k] for k in keep}
        p = params if everything else {k: params[k] for k in keep}
        try:
            if tx.apply is not None:
                sub = tx.apply(g, sub, p, step)
            else:
                out, sub = tx.update(g, sub, p, step)
                apply_updates(p, out)
        except KeyError as e:
            raise KeyError(str(e.args[0] if e.args else e) + _LABEL_HINT) from e
        if everything:
            return finish(state, sub)
        return finish(state, _merge(inner, sub, names, others_from_part=True))

    return recorded(
        GradientTransformation(init, update, apply),
        "freezable",
        {"tx": tx, "frozen": frozen},
        lambda a: freezable(a["tx"], a["frozen"]),
    )


# ------------------------------------------------------------------- changing a state


def _the_state(opt_state: OptState, what: str) -> None:
    found = _found(opt_state)
    if len(found) != 1:
        raise ValueError(
            f"{what}: the optimizer state holds {len(found) or 'no'} freezable states; wrap the "
            "optimizer once with optim.freezable, e.g. tx=optim.freezable(optim.adamw(1e-3), "
            "frozen=['backbone'])"
        )


def _found(opt_state: OptState) -> list[FreezableState]:
    is_leaf = lambda x: isinstance(x, FreezableState)  # noqa: E731
    return [x for x in pytree.tree_leaves(opt_state, is_leaf=is_leaf) if is_leaf(x)]


def _replace(opt_state: OptState, fn: Callable[[FreezableState], FreezableState]) -> OptState:
    is_leaf = lambda x: isinstance(x, FreezableState)  # noqa: E731
    return pytree.tree_map(lambda x: fn(x) if is_leaf(x) else x, opt_state, is_leaf=is_leaf)


def _names(state: FreezableState, names: Iterable[str], what: str) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{what}({names!r}): pass a list of parameter names, not one str")
    names = list(names)
    unknown = [n for n in names if n not in state.frozen]
    if unknown:
        raise KeyError(
            f"{what}: {unknown} are not parameters of this optimizer (it has "
            f"{sorted(state.frozen)}); match module prefixes with match_prefixes"
        )
    return names


def frozen_names(opt_state: OptState) -> list[str]:
    """The names of the frozen parameters in an optimizer state holding one
    :class:`FreezableState`."""
    _the_state(opt_state, "frozen_names")
    return [k for k, v in _found(opt_state)[0].frozen.items() if v]


def freeze(opt_state: OptState, names: Iterable[str]) -> OptState:
    """A new optimizer state with ``names`` frozen (no update; their inner state kept as it is,
    and rebuilt when they are unfrozen). The tensors are shared.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> from engine.optim.freezing import freezable, freeze, frozen_names
        >>> state = freezable(optim.sgd(0.1)).init({"a": torch.ones(1), "b": torch.ones(1)})
        >>> frozen_names(freeze(state, ["b"]))
        ['b']
    """
    _the_state(opt_state, "freeze")
    names = _names(_found(opt_state)[0], names, "freeze")
    return _replace(
        opt_state,
        lambda s: s._replace(frozen={k: v or k in names for k, v in s.frozen.items()}),
    )


def unfreeze(opt_state: OptState, names: Iterable[str]) -> OptState:
    """A new optimizer state with ``names`` trainable; those that were frozen get their inner
    state rebuilt by ``tx.init`` before their next update (a new param group's state). Names
    already trainable are left as they are. The tensors are shared."""
    _the_state(opt_state, "unfreeze")
    names = set(_names(_found(opt_state)[0], names, "unfreeze"))

    def change(s: FreezableState) -> FreezableState:
        woken = {k for k, v in s.frozen.items() if v and k in names}
        return s._replace(
            frozen={k: v and k not in names for k, v in s.frozen.items()},
            fresh={k: v or k in woken for k, v in s.fresh.items()},
        )

    return _replace(opt_state, change)


# ------------------------------------------------------------------- per-group hyperparameters


def _group(opt_state: OptState, group: Any, what: str) -> None:
    is_leaf = lambda x: isinstance(x, MultiTransformState)  # noqa: E731
    found = [x for x in pytree.tree_leaves(opt_state, is_leaf=is_leaf) if is_leaf(x)]
    hits = [x for x in found if group in x.inner]
    if len(hits) != 1:
        labels = sorted({repr(label) for x in found for label in x.inner})
        raise ValueError(
            f"{what}: {'no' if not hits else len(hits)} optim.multi_transform in the optimizer "
            f"state has a group {group!r} (its groups: {labels or 'none'}); build it as "
            "optim.multi_transform({'backbone': optim.inject_hyperparams(optim.adam)(lr=1e-4), "
            "'head': optim.inject_hyperparams(optim.adam)(lr=1e-3)}, labels)"
        )


def get_group_hyperparams(opt_state: OptState, group: Any) -> dict[str, float]:
    """The injected hyperparameters of one group of an ``optim.multi_transform`` whose members
    are ``optim.inject_hyperparams`` optimizers (a copy).

    Example:
        >>> import torch
        >>> from engine import optim
        >>> from engine.optim.freezing import get_group_hyperparams, set_group_hyperparams
        >>> tx = optim.multi_transform(
        ...     {"a": optim.inject_hyperparams(optim.sgd)(lr=0.1),
        ...      "b": optim.inject_hyperparams(optim.sgd)(lr=0.2)},
        ...     lambda ps: {k: k[0] for k in ps})
        >>> state = tx.init({"a.w": torch.ones(1), "b.w": torch.ones(1)})
        >>> state = set_group_hyperparams(state, "b", lr=0.5)
        >>> get_group_hyperparams(state, "a"), get_group_hyperparams(state, "b")
        ({'lr': 0.1}, {'lr': 0.5})
    """
    _group(opt_state, group, "get_group_hyperparams")
    is_leaf = lambda x: isinstance(x, MultiTransformState)  # noqa: E731
    hit = next(
        x for x in pytree.tree_leaves(opt_state, is_leaf=is_leaf) if is_leaf(x) and group in x.inner
    )
    return get_hyperparams(hit.inner[group])


def set_group_hyperparams(opt_state: OptState, group: Any, **values: float) -> OptState:
    """A new optimizer state with the injected hyperparameters of ``group`` (a label of an
    ``optim.multi_transform``) replaced; see :func:`get_group_hyperparams`."""
    _group(opt_state, group, "set_group_hyperparams")
    is_leaf = lambda x: isinstance(x, MultiTransformState)  # noqa: E731

    def change(x: Any) -> Any:
        if is_leaf(x) and group in x.inner:
            return MultiTransformState(
                {**x.inner, group: set_hyperparams(x.inner[group], **values)}
            )
        return x

    return pytree.tree_map(change, opt_state, is_leaf=is_leaf)


def frozen_reader(opt_state: OptState) -> Callable[[OptState], frozenset[str]] | None:
    """For optimizer states shaped like ``opt_state``: a function returning the names frozen in
    one (those any :class:`FreezableState` in it freezes), or ``None`` when it holds none. The
    search walks the state once; the function follows the paths found (a train step asks it
    every step, to leave frozen parameters out of backward)."""
    is_leaf = lambda x: isinstance(x, FreezableState)  # noqa: E731
    leaves, _ = pytree.tree_flatten_with_path(opt_state, is_leaf=is_leaf)
    paths = [path for path, leaf in leaves if is_leaf(leaf)]
    if not paths:
        return None

    def frozen(state: OptState) -> frozenset[str]:
        names: set[str] = set()
        for path in paths:
            found = state
            for key in path:
                found = key.get(found)
            names.update(k for k, v in found.frozen.items() if v)
        return frozenset(names)

    return frozen
