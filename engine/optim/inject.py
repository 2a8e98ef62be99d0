"""Hyperparameters as optimizer state, for what changes with what training observes.

A schedule (``lr=optim.warmup_cosine(...)``) is a pure function of the step and needs no state.
A learning rate that a plateau halves, or that stochastic weight averaging anneals, depends on
what the run has seen: it must be part of the state, so that a checkpoint holds it and a state
transition (:class:`engine.Transition`) can change it. :func:`inject_hyperparams` puts a named
optimizer's numeric arguments into its state (optax's ``inject_hyperparams``);
:func:`get_hyperparams` / :func:`set_hyperparams` read and replace them in a state.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, cast

from torch import Tensor
from torch.utils import _pytree as pytree

from engine.optim.base import (
    LOADED,
    GradientTransformation,
    OptState,
    Params,
    UpdateFn,
    Updates,
    apply_updates,
    recorded,
)

__all__ = [
    "InjectHyperparamsState",
    "get_hyperparams",
    "inject_hyperparams",
    "set_hyperparams",
]


class InjectHyperparamsState(NamedTuple):
    """State of an :func:`inject_hyperparams` optimizer: its numeric arguments and the state of
    the optimizer they build."""

    hyperparams: dict[str, float]
    inner: OptState


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def inject_hyperparams(
    factory: Callable[..., GradientTransformation],
) -> Callable[..., GradientTransformation]:
    """``factory`` (an optimizer such as :func:`~engine.optim.adamw`) with its numeric keyword
    arguments kept in the optimizer state, where a state transition can change them.

    The optimizer is built from the hyperparameters the state holds at each step (built once
    per set of values, so a step costs a dict lookup). Non-numeric arguments (a schedule, a
    mask, ``betas``) stay fixed.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> optim.get_hyperparams(state)
        {'lr': 0.1, 'momentum': 0.9}
        >>> state = optim.set_hyperparams(state, lr=0.01)  # what ReduceLROnPlateau does
        >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(2)}, state, params, 0)
        >>> params["w"]
        tensor([0.9900, 0.9900])
    """
    if not callable(factory):
        raise TypeError(
            f"inject_hyperparams({factory!r}): pass an optimizer factory such as optim.adamw"
        )

    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        if args:
            raise TypeError(
                f"inject_hyperparams({getattr(factory, '__name__', factory)})(...): pass the "
                "hyperparameters by name, e.g. (lr=1e-3, weight_decay=1e-2)"
            )
        numeric = {k: float(v) for k, v in kwargs.items() if _numeric(v)}
        fixed = {k: v for k, v in kwargs.items() if not _numeric(v)}
        probe = factory(**fixed, **numeric)  # refuses bad arguments now, not at the first step
        builder = _Builder(factory, fixed, tuple(sorted(numeric)))
        _BUILDERS.add(builder)
        tx_for = builder.tx_for

        def init(params: Params) -> InjectHyperparamsState:
            return InjectHyperparamsState(dict(numeric), tx_for(numeric).init(params))

        def update(updates: Updates, state: InjectHyperparamsState, params: Params, step: int):
            out, inner = tx_for(state.hyperparams).update(updates, state.inner, params, step)
            return out, InjectHyperparamsState(state.hyperparams, inner)

        def differentiable(
            updates: Updates, state: InjectHyperparamsState, params: Params, step: int
        ):
            form = cast(UpdateFn, tx_for(state.hyperparams).differentiable)
            out, inner = form(updates, state.inner, params, step)
            return out, InjectHyperparamsState(state.hyperparams, inner)

        def apply(grads: Updates, state: InjectHyperparamsState, params: Params, step: int):
            tx = tx_for(state.hyperparams)
            if tx.apply is not None:
                return InjectHyperparamsState(
                    state.hyperparams, tx.apply(grads, state.inner, params, step)
                )
            out, inner = tx.update(grads, state.inner, params, step)
            apply_updates(params, out)
            return InjectHyperparamsState(state.hyperparams, inner)

        # the recipe: the optimizer's own arguments (defaults included), rebuilt from those given
        given = tuple(kwargs)
        arguments = {**(probe.recipe.arguments if probe.recipe is not None else {}), **kwargs}
        tx = recorded(
            GradientTransformation(
                init,
                update,
                apply,
                probe.name,
                differentiable=None if probe.differentiable is None else differentiable,
            ),
            getattr(factory, "__name__", "inject_hyperparams"),
            arguments,
            functools.partial(_inject_again, factory, given),
        )
        _KEEP_ALIVE[tx] = builder  # the builder lives as long as the optimizer
        return tx

    return build


def _inject_again(
    factory: Callable[..., GradientTransformation], given: tuple[str, ...], a: Any
) -> GradientTransformation:
    """An injected optimizer built again from its recipe's arguments (module level, so a
    pickled task holds a reference to it, not the module's registries)."""
    return inject_hyperparams(factory)(**{k: a[k] for k in given})


class _Builder:
    """Builds (and keeps) the optimizer for each set of hyperparameter values it meets."""

    def __init__(self, factory: Callable[..., Any], fixed: dict[str, Any], keys: tuple) -> None:
        self.factory, self.fixed, self.keys = factory, fixed, keys
        self.built: OrderedDict[tuple[tuple[str, float], ...], GradientTransformation] = (
            OrderedDict()
        )

    def tx_for(self, values: dict[str, Any]) -> GradientTransformation:
        if any(isinstance(v, Tensor) for v in values.values()):
            # an ensemble's swept values (engine.ensemble): one 0-d tensor per member under
            # torch.func.vmap, no number to key a cache by; the optimizer takes them as tensors
            return self.factory(**self.fixed, **values)
        # float(): under torch.compile the state's numbers arrive symbolic; a graph is
        # specialised to them (a new value, as after a plateau, recompiles once). Building an
        # optimizer cannot be traced, so values are built eagerly first (see warm())
        key = tuple((k, float(values[k])) for k in sorted(values))
        tx = self.built.get(key)
        if tx is None:
            tx = self.built[key] = self.factory(**self.fixed, **dict(key))
            if len(self.built) > 16:  # a schedule of values: keep the recent ones
                self.built.popitem(last=False)
        return tx


_BUILDERS: weakref.WeakSet[_Builder] = weakref.WeakSet()
_KEEP_ALIVE: weakref.WeakKeyDictionary[GradientTransformation, _Builder] = (
    weakref.WeakKeyDictionary()
)


def injected_names(tx: GradientTransformation) -> tuple[str, ...]:
    """The hyperparameters ``tx`` keeps in its state, if it is an :func:`inject_hyperparams`
    optimizer (its numeric arguments, sorted); ``()`` for any other transformation."""
    builder = _KEEP_ALIVE.get(tx)
    return () if builder is None else builder.keys


def warm(opt_state: OptState) -> None:
    """Build, outside any compiled code, the optimizers for the hyperparameter values an
    optimizer state holds (``set_hyperparams`` and checkpoint loading call this), so a compiled
    step finds them built."""
    for _, found in _found(opt_state):
        if any(isinstance(v, Tensor) for v in found.hyperparams.values()):
            continue  # an ensemble's swept values (one per member): built at each step
        keys = tuple(sorted(found.hyperparams))
        for builder in list(_BUILDERS):
            if builder.keys == keys:
                builder.tx_for(found.hyperparams)


def _found(opt_state: OptState) -> list[tuple[Any, InjectHyperparamsState]]:
    is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
    leaves, _ = pytree.tree_flatten_with_path(opt_state, is_leaf=is_leaf)
    return [(path, leaf) for path, leaf in leaves if isinstance(leaf, InjectHyperparamsState)]


def _one(opt_state: OptState, what: str) -> None:
    found = _found(opt_state)
    if len(found) != 1:
        why = "none" if not found else f"{len(found)}"
        raise ValueError(
            f"{what}: the optimizer state holds {why} injected hyperparameters; build the "
            "optimizer with optim.inject_hyperparams, e.g. "
            "tx=optim.inject_hyperparams(optim.adamw)(lr=1e-3), so that its learning rate is "
            "state a transition can change"
        )


def get_hyperparams(opt_state: OptState) -> dict[str, float]:
    """The hyperparameters an :func:`inject_hyperparams` optimizer's state holds (a copy)."""
    _one(opt_state, "get_hyperparams")
    return dict(_found(opt_state)[0][1].hyperparams)


def set_hyperparams(opt_state: OptState, **values: float) -> OptState:
    """A new optimizer state with the given hyperparameters replaced (the tensors shared)."""
    _one(opt_state, "set_hyperparams")
    current = _found(opt_state)[0][1].hyperparams
    unknown = sorted(set(values) - set(current))
    if unknown:
        raise KeyError(
            f"set_hyperparams: {unknown} are not injected hyperparameters of this optimizer "
            f"(it has {sorted(current)})"
        )
    for k, v in values.items():
        if not _numeric(v):
            raise TypeError(f"set_hyperparams({k}={v!r}): pass a number")

    def replace(x: Any) -> Any:
        if isinstance(x, InjectHyperparamsState):
            return InjectHyperparamsState(
                {**x.hyperparams, **{k: float(v) for k, v in values.items()}}, x.inner
            )
        return x

    is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
    out = pytree.tree_map(replace, opt_state, is_leaf=is_leaf)
    warm(out)
    return out


LOADED.append(warm)  # a loaded checkpoint's values are built before a compiled step meets them
