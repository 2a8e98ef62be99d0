"""An optimizer with another learning rate: :func:`with_learning_rate`.

A named optimizer records how it was built (its :class:`~engine.optim.Recipe`), so the same
optimizer can be built again with a different ``lr`` -- inside a chain, a mask, a
``multi_transform`` or any other container that records its members. A learning-rate range test
(:class:`engine.Tuner`'s ``lr_find``) runs the task's own optimizer with the rate following its
grid this way, and hands back the task with the suggested rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils import _pytree as pytree

from engine.optim._common import _check_lr
from engine.optim.base import GradientTransformation, OptState, Params, ScheduleLike, Updates
from engine.optim.inject import InjectHyperparamsState, injected_names

__all__ = ["with_learning_rate"]


def with_learning_rate(
    tx: GradientTransformation, lr: ScheduleLike, *, name: str = "lr"
) -> GradientTransformation:
    """``tx`` built again with its learning rate ``lr`` (a float or a schedule ``step -> lr``).

    Every optimizer recorded in ``tx`` that takes an argument ``name`` gets ``lr`` (each group
    of an ``optim.multi_transform`` the same, as Lightning's learning-rate finder sets every
    param group). The optimizer state is unchanged in structure: a state made for ``tx`` works
    with the result. Where ``tx`` keeps the rate in its state (:func:`inject_hyperparams` with
    ``lr=`` a number): a float becomes the initial value of new states (set an existing state's
    with :func:`set_hyperparams`); a schedule replaces the state's value at every step, so the
    state keeps its shape.

    Args:
        tx: an optimizer built by engine (``optim.sgd``, ``adamw``, ``from_torch``, and chains
            or containers of them).
        lr: the new rate: a float >= 0 or a callable of the step.
        name: the argument that holds the rate (``"lr"`` for every engine optimizer).

    Raises:
        ValueError: when ``tx`` records no optimizer taking ``name`` (a transformation built by
            hand, such as ``chain(scale_by_adam(), scale_by_learning_rate(1e-3))``, records no
            rate to replace), or one that ignores it when built again.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
        >>> faster = optim.with_learning_rate(tx, 0.5)
        >>> params = {"w": torch.zeros(1)}
        >>> new, _ = optim.apply_gradients(faster, {"w": torch.ones(1)}, faster.init(params),
        ...                                params, 0)
        >>> new["w"]
        tensor([-0.5000])
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"with_learning_rate needs an engine.optim GradientTransformation (got "
            f"{type(tx).__name__}), e.g. optim.adamw(1e-3)"
        )
    lr = _check_lr(lr, name)
    replaced: list[GradientTransformation] = []  # rebuilt with the rate (checked below)
    injected = [0]  # optimizers whose state holds the rate, given a schedule

    def replace(x: Any) -> Any:
        if not isinstance(x, GradientTransformation) or x.recipe is None:
            return x
        if callable(lr) and name in injected_names(x):
            injected[0] += 1  # the state holds a number: set from the schedule at each step
            return x
        arguments = dict(x.recipe.arguments)
        changed = {k: _walk(v, replace) for k, v in arguments.items()}
        own = name in arguments
        if own:
            changed[name] = lr
        if not own and all(changed[k] is arguments[k] for k in arguments):
            return x
        out = x.recipe.rebuild(changed)
        if own:
            replaced.append(out)
        return out

    out = replace(tx)
    ignored = [
        t.recipe.name if t.recipe is not None else str(t.name)
        for t in replaced
        if t.recipe is None or t.recipe.arguments.get(name) is not lr
    ]
    if ignored:
        raise ValueError(
            f"with_learning_rate: {', '.join(ignored)} did not take {name}= when built again "
            f"(an optim.inject_hyperparams optimizer takes it only if {name}= was given to it: "
            f"inject_hyperparams(optim.adamw)({name}=1e-3))"
        )
    if not replaced and not injected[0]:
        what = tx.recipe.name if tx.recipe is not None else tx.name or "this transformation"
        raise ValueError(
            f"with_learning_rate: {what} records no optimizer taking {name}=, so its "
            "learning rate cannot be replaced; build it from engine's named optimizers "
            "(optim.sgd, adam, adamw, rmsprop, adagrad, lion, from_torch), chained or "
            f"contained as you need, or pass name= for an argument called otherwise"
        )
    if injected[0]:
        assert callable(lr)  # a schedule: only then are injected rates left to set
        out = _setting_injected(out, name, lr)
    return out


def _walk(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every transformation in it (through tuples, lists and
    dicts); ``value`` itself when nothing in it changed."""
    if isinstance(value, GradientTransformation):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [_walk(v, fn) for v in value]
        same = all(a is b for a, b in zip(items, value, strict=True))
        return value if same else type(value)(items)
    if isinstance(value, dict):
        new = {k: _walk(v, fn) for k, v in value.items()}
        return value if all(new[k] is value[k] for k in value) else new
    return value


def _setting_injected(
    tx: GradientTransformation, name: str, lr: Callable[[int], float]
) -> GradientTransformation:
    """``tx`` with the injected hyperparameter ``name`` set to ``lr(step)`` before each step."""

    def at(opt_state: OptState, step: int) -> OptState:
        value = lr(step)

        def setting(x: Any) -> Any:
            if isinstance(x, InjectHyperparamsState) and name in x.hyperparams:
                return InjectHyperparamsState({**x.hyperparams, name: value}, x.inner)
            return x

        is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
        return pytree.tree_map(setting, opt_state, is_leaf=is_leaf)

    def update(updates: Updates, opt_state: OptState, params: Params, step: int):
        return tx.update(updates, at(opt_state, step), params, step)

    apply = None
    if tx.apply is not None:
        inner_apply = tx.apply

        def apply(grads: Updates, opt_state: OptState, params: Params, step: int) -> OptState:
            return inner_apply(grads, at(opt_state, step), params, step)

    differentiable = None
    if tx.differentiable is not None:
        form = tx.differentiable

        def differentiable(updates: Updates, opt_state: OptState, params: Params, step: int):
            return form(updates, at(opt_state, step), params, step)

    return GradientTransformation(tx.init, update, apply, tx.name, differentiable=differentiable)
