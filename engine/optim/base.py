"""The gradient-transformation protocol: a stateful component as a pair of pure functions.

A :class:`GradientTransformation` is optax's shape with one addition for speed:

* ``init(params) -> opt_state`` builds the transformation's state for a parameter dict.
* ``update(updates, opt_state, params, step) -> (updates, opt_state)`` turns incoming updates
  (gradients, for the first member of a chain) into outgoing updates. ``step`` is the number of
  optimizer steps already taken (0 on the first call); schedules read it.
* ``apply(grads, opt_state, params, step) -> opt_state`` (optional) is a *terminal* form that
  writes the new parameters into ``params`` itself, used for fused kernels such as
  ``torch._fused_adamw_``. :func:`apply_gradients` uses it when the last member of a chain has it.
* ``differentiable(updates, opt_state, params, step) -> (updates, opt_state)`` (optional) is
  ``update`` out of place: the same math in the same op order, writing into nothing it was given,
  so autograd records it and a loss can be differentiated through optimizer steps (MAML's inner
  loop). :func:`differentiable_step` runs it.

Buffers are donated: ``update`` may overwrite the ``updates`` it receives and the tensors of its
own ``opt_state`` in place, and ``apply`` may overwrite ``params``. That is what keeps a functional
optimizer as fast and as lean as ``torch.optim``. Callers that need the inputs intact pass
``donate=False`` to :func:`apply_gradients`, which then works on copies. Neither can be
differentiated through (the writes are in place, under ``torch.no_grad``): that is
:func:`differentiable_step`'s job.

Parameters, gradients and updates are ``dict[str, Tensor]`` with the same keys in the same order.
An optimizer state is any pytree of tensors, Python scalars and containers registered with
``torch.utils._pytree`` (dicts, lists, tuples, named tuples); :func:`state_dict` flattens it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

Params = Mapping[str, Tensor]
Updates = dict[str, Tensor]
OptState = Any


# Plain callable types rather than Protocols: transforms name their arguments and type their
# own state (``state: ScaleByAdamState``), which a Protocol's exact signature would reject.
InitFn = Callable[[Params], OptState]
UpdateFn = Callable[[Updates, OptState, Params, int], tuple[Updates, OptState]]
ApplyFn = Callable[[Updates, OptState, Params, int], OptState]


@attrs.frozen
class GradientTransformation:
    """A pair of pure functions ``init`` / ``update``, plus an optional fused ``apply``.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(2)}, state, params, 0)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])
    """

    init: InitFn
    update: UpdateFn
    apply: ApplyFn | None = None
    #: the ``torch.optim`` class this optimizer matches (``"AdamW"``), ``None`` for a piece of
    #: one; ``LearningRateMonitor`` names the rate after it, as Lightning does (``lr-AdamW``)
    name: str | None = None
    #: how a named optimizer was built (:class:`Recipe`): its name and arguments, for the
    #: Trainer's checks at fit start and for resolving ``total_steps="auto"`` schedules
    recipe: Recipe | None = attrs.field(default=None, kw_only=True, eq=False, repr=False)
    #: ``update`` out of place, recorded by autograd (see :func:`differentiable_step`); ``None``
    #: for a transformation that has no such form
    differentiable: UpdateFn | None = attrs.field(default=None, kw_only=True, repr=False)


@attrs.frozen
class Recipe:
    """How a transformation was built: ``name`` (``"adamw"``), its ``arguments`` by name
    (defaults included) and ``rebuild(arguments) -> GradientTransformation``, which builds it
    again from changed arguments (a schedule resolved to the run's length)."""

    name: str
    arguments: Mapping[str, Any]
    rebuild: Callable[[Mapping[str, Any]], GradientTransformation] = attrs.field(repr=False)


def recorded(
    tx: GradientTransformation,
    name: str,
    arguments: Mapping[str, Any],
    rebuild: Callable[[Mapping[str, Any]], GradientTransformation],
) -> GradientTransformation:
    """``tx`` with its :class:`Recipe` attached (the named optimizers and containers call this)."""
    return attrs.evolve(tx, recipe=Recipe(name, dict(arguments), rebuild))


def _is_deferred(x: Any) -> bool:
    return callable(getattr(x, "resolve_total_steps", None))


def _walk(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every transformation or deferred schedule in it
    (through tuples, lists and dicts)."""
    if isinstance(value, GradientTransformation) or _is_deferred(value):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_walk(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    return value


def recipes(tx: GradientTransformation) -> list[Recipe]:
    """The recipes of ``tx`` and of every transformation recorded inside it, outermost first."""
    found: list[Recipe] = []

    def visit(x: Any) -> Any:
        if isinstance(x, GradientTransformation) and x.recipe is not None:
            found.append(x.recipe)
            _walk(x.recipe.arguments, visit)
        return x

    visit(tx)
    return found


def has_deferred(tx: GradientTransformation) -> bool:
    """Whether a ``total_steps="auto"`` schedule (or another deferred length) is recorded in
    ``tx``'s arguments, anywhere in it."""
    return any(_is_deferred(v) for r in recipes(tx) for v in _flat(r.arguments))


def _flat(arguments: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []

    def keep(x: Any) -> Any:
        out.append(x)
        return x

    _walk(dict(arguments), keep)
    return out


def resolve_total_steps(tx: GradientTransformation, total_steps: int) -> GradientTransformation:
    """``tx`` rebuilt with every ``total_steps="auto"`` schedule in its recorded arguments
    given the run's length (the Trainer does this at fit start, from
    ``trainer.estimated_stepping_batches``); ``tx`` itself when it has none.

    Example:
        >>> from engine import optim
        >>> tx = optim.adamw(optim.warmup_cosine(1e-3, warmup_steps=2, total_steps="auto"))
        >>> lr = optim.resolve_total_steps(tx, 10).recipe.arguments["lr"]
        >>> round(lr(2), 6), lr(10)
        (0.001, 0.0)
    """

    def resolve(x: Any) -> Any:
        if _is_deferred(x):
            return x.resolve_total_steps(total_steps)
        if x.recipe is None or not has_deferred(x):
            return x
        return x.recipe.rebuild(_walk(dict(x.recipe.arguments), resolve))

    return resolve(tx)


def identity() -> GradientTransformation:
    """A transformation that passes updates through unchanged and keeps no state."""

    def init(params: Params) -> OptState:
        return ()

    def update(updates: Updates, opt_state: OptState, params: Params, step: int):
        return updates, opt_state

    return GradientTransformation(init, update, differentiable=update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right; the state is a tuple of the members' states.

    If the last member has a fused ``apply``, the chain has one too: the earlier members run
    their ``update`` and the last one writes the parameters.

    Example:
        >>> from engine import optim
        >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
        >>> tx.apply is not None
        True
    """
    if not transforms:
        return identity()
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain() argument {i} must be a GradientTransformation (got {type(t).__name__}); "
                "build one with engine.optim (e.g. optim.adamw(1e-3)) or optim.from_torch(...)"
            )

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Updates, opt_state: tuple, params: Params, step: int):
        new_state = []
        for t, s in zip(transforms, opt_state, strict=False):
            updates, s = t.update(updates, s, params, step)
            new_state.append(s)
        return updates, tuple(new_state)

    differentiable: UpdateFn | None = None
    if all(t.differentiable is not None for t in transforms):
        forms = [cast(UpdateFn, t.differentiable) for t in transforms]

        def out_of_place(updates: Updates, opt_state: tuple, params: Params, step: int):
            new_state = []
            for form, s in zip(forms, opt_state, strict=False):
                updates, s = form(updates, s, params, step)
                new_state.append(s)
            return updates, tuple(new_state)

        differentiable = out_of_place

    # the optimizer a chain is (clipping then AdamW is AdamW): its last named member
    name = next((t.name for t in reversed(transforms) if t.name is not None), None)
    recipe = ({"transforms": transforms}, lambda a: chain(*a["transforms"]))
    last = transforms[-1].apply
    if last is None:
        tx = GradientTransformation(init, update, name=name, differentiable=differentiable)
        return recorded(tx, "chain", *recipe)
    head = transforms[:-1]

    def apply(grads: Updates, opt_state: tuple, params: Params, step: int) -> tuple:
        new_state = []
        for t, s in zip(head, opt_state, strict=False):
            grads, s = t.update(grads, s, params, step)
            new_state.append(s)
        new_state.append(last(grads, opt_state[-1], params, step))
        return tuple(new_state)

    tx = GradientTransformation(init, update, apply, name, differentiable=differentiable)
    return recorded(tx, "chain", *recipe)


@torch.no_grad()
def apply_updates(params: Params, updates: Mapping[str, Tensor]) -> None:
    """Add ``updates`` to ``params`` in place (``p += u``), one ``_foreach`` kernel for all."""
    torch._foreach_add_(list(params.values()), [updates[k] for k in params])


def apply_gradients(
    tx: GradientTransformation,
    grads: Mapping[str, Tensor],
    opt_state: OptState,
    params: Params,
    step: int,
    *,
    donate: bool = True,
) -> tuple[Params, OptState]:
    """Run one optimizer step and return ``(new_params, new_opt_state)``.

    With ``donate=True`` (the default) the parameters, gradients and optimizer state are updated
    in place and the returned objects are the same tensors. With ``donate=False`` the inputs are
    left bitwise unchanged and fresh tensors are returned.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> tx = optim.sgd(0.5)
        >>> params = {"w": torch.zeros(2)}
        >>> new, _ = optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params), params, 0,
        ...                                donate=False)
        >>> params["w"], new["w"]
        (tensor([0., 0.]), tensor([-0.5000, -0.5000]))
    """
    _check_grads(grads, params)
    if donate:
        grads = dict(grads)
    else:
        params = {k: _clone(v) for k, v in params.items()}
        grads = {k: v.detach().clone() for k, v in grads.items()}
        opt_state = pytree.tree_map(_clone_tensor, opt_state)
    with torch.no_grad():
        if tx.apply is not None:
            opt_state = tx.apply(grads, opt_state, params, step)
        else:
            updates, opt_state = tx.update(grads, opt_state, params, step)
            apply_updates(params, updates)
    return params, opt_state


def _check_grads(grads: Mapping[str, Tensor], params: Params) -> None:
    if grads.keys() != params.keys():
        missing = sorted(set(params) - set(grads))
        extra = sorted(set(grads) - set(params))
        raise KeyError(
            f"gradients and parameters have different keys (missing grads: {missing}, "
            f"grads for unknown params: {extra}); pass one gradient per parameter"
        )


def differentiable_step(
    tx: GradientTransformation,
    grads: Mapping[str, Tensor],
    opt_state: OptState,
    params: Params,
    step: int,
) -> tuple[dict[str, Tensor], OptState]:
    """One optimizer step that autograd can differentiate through: ``(new_params, new_state)``.

    The step runs ``tx.differentiable``, the out-of-place form of ``tx.update`` (the same ops in
    the same order, so the numbers are those of ``update`` + ``p + u``, bitwise), and adds the
    updates to the parameters out of place. Nothing it is given is written to, nothing runs
    under ``torch.no_grad``: pass gradients taken with ``create_graph=True`` and a later loss
    differentiates through the step to whatever ``params`` and ``grads`` depend on (MAML's
    second-order meta-gradient; pass detached gradients for the first-order one). The fast
    in-place path (:func:`apply_gradients`, the train step) is unchanged; this one allocates new
    parameters and a new optimizer state every call.

    The named optimizers (``sgd``, ``adam``, ``adamw``, ``rmsprop``, ``adagrad``, ``lion``), the
    transforms they are chained from, ``chain``, ``masked``, ``multi_transform`` and
    ``inject_hyperparams`` of them have a differentiable form. Where a square root of a second
    moment is exactly zero (a gradient that is exactly zero, as a dead ReLU's), its derivative
    is taken as 0 rather than the infinity that would turn the meta-gradient into NaN.

    Args:
        tx: the optimizer.
        grads: one gradient per parameter, same keys as ``params``.
        opt_state: the optimizer state (``tx.init(params)`` on the first step); not modified.
        params: the parameters; not modified.
        step: optimizer steps taken before this one (schedules read it).

    Returns:
        The new parameters and the new optimizer state, both new tensors.

    Raises:
        TypeError: if ``tx`` has no differentiable form (``ema_weights``, ``freezable``,
            ``from_torch`` and hand-built transformations without one).
        KeyError: if ``grads`` and ``params`` have different keys.

    Example:
        >>> import torch
        >>> from engine import optim
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> tx = optim.sgd(0.1)
        >>> (g,) = torch.autograd.grad((w ** 2).sum(), w, create_graph=True)
        >>> new, _ = optim.differentiable_step(tx, {"w": g}, tx.init({"w": w}), {"w": w}, 0)
        >>> new["w"]                      # w - 0.1 * 2w
        tensor([0.8000, 1.6000], grad_fn=<...>)
        >>> torch.autograd.grad(new["w"].sum(), w)[0]   # d(0.8 w)/dw
        tensor([0.8000, 0.8000])
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"differentiable_step needs an engine.optim GradientTransformation (got "
            f"{type(tx).__name__}), e.g. optim.sgd(0.1) or optim.adam(1e-3)"
        )
    if tx.differentiable is None:
        what = tx.recipe.name if tx.recipe is not None else tx.name or "this transformation"
        raise TypeError(
            f"{what} has no differentiable form, so it cannot be differentiated through: use "
            "a named optimizer (optim.sgd, adam, adamw, rmsprop, adagrad, lion), or a chain, "
            "masked, multi_transform or inject_hyperparams of them (ema_weights, freezable "
            "and from_torch have none)"
        )
    _check_grads(grads, params)
    updates, opt_state = tx.differentiable(dict(grads), opt_state, params, step)
    if not params:
        return {}, opt_state
    keys = list(params)
    new = torch._foreach_add([params[k] for k in keys], [updates[k] for k in keys])
    return dict(zip(keys, new, strict=True)), opt_state


def _clone(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def _clone_tensor(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, Tensor) else x


# --------------------------------------------------------------------------- state dicts


def state_dict(opt_state: OptState) -> dict[str, Any]:
    """Flatten an optimizer state into ``{key path: leaf}`` (tensors and Python scalars).

    The keys are pytree key paths such as ``"[1][0].exp_avg['w']"``; load with
    :func:`load_state_dict` against a template from ``tx.init(params)``.
    """
    leaves, _ = pytree.tree_flatten_with_path(opt_state)
    return {pytree.keystr(path): leaf for path, leaf in leaves}


def load_state_dict(template: OptState, sd: Mapping[str, Any]) -> OptState:
    """Rebuild an optimizer state from :func:`state_dict` output, shaped like ``template``.

    Raises:
        KeyError: if ``sd`` lacks keys of the template or has extra ones.
        ValueError: if a tensor's shape or dtype differs from the template's.
    """
    leaves, spec = pytree.tree_flatten_with_path(template)
    keys = [pytree.keystr(p) for p, _ in leaves]
    missing = [k for k in keys if k not in sd]
    unexpected = [k for k in sd if k not in set(keys)]
    if missing or unexpected:
        raise KeyError(
            f"optimizer state dict does not match the optimizer (missing: {missing}, "
            f"unexpected: {unexpected}); was it saved with a different optimizer chain?"
        )
    out = []
    for key, (_, ref) in zip(keys, leaves, strict=True):
        value = sd[key]
        if isinstance(ref, Tensor):
            if (
                not isinstance(value, Tensor)
                or value.shape != ref.shape
                or value.dtype != ref.dtype
            ):
                got = (
                    f"{tuple(value.shape)} {value.dtype}"
                    if isinstance(value, Tensor)
                    else type(value).__name__
                )
                raise ValueError(
                    f"optimizer state {key!r}: expected {tuple(ref.shape)} {ref.dtype}, got {got}"
                )
            value = value.to(ref.device)
        elif isinstance(value, Tensor) or (
            ref is not None and type(value) is not type(ref) and not _numbers(value, ref)
        ):
            raise ValueError(
                f"optimizer state {key!r}: expected a {type(ref).__name__} like the optimizer's "
                f"{ref!r}, got {value!r} ({type(value).__name__})"
            )
        out.append(value)
    state = pytree.tree_unflatten(out, spec)
    for hook in LOADED:  # e.g. injected hyperparameters: their optimizers built now, eagerly
        hook(state)
    return state


LOADED: list[Callable[[OptState], None]] = []
"""Called with every optimizer state :func:`load_state_dict` rebuilds (registered by the modules
whose transformations need to prepare for loaded values, such as ``inject``)."""


def _numbers(value: Any, ref: Any) -> bool:
    """Whether ``value`` may stand for the scalar leaf ``ref``: an int for a float (JSON writes
    ``1.0`` back as ``1.0``, but a hand-made state dict may hold ``1``), never a bool."""
    return type(ref) is float and type(value) is int


def tree_tensors(tree: Any) -> list[Tensor]:
    """All tensor leaves of a pytree, in flattening order."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, Tensor)]


class StepCounters(dict):
    """Per-parameter step counters that an optimizer reads on the host, as torch.optim's
    default (not ``capturable``, not ``fused``) Adam keeps ``state["step"]`` on the CPU.

    A ``dict`` of 0-d float32 tensors that pytrees walk like a dict (the same key paths in a
    state dict). Placement leaves it where it is: :class:`~engine.transforms.SingleDevice`
    puts the parameters and the moments on the accelerator and keeps these on the CPU, so
    the bias corrections are Python floats read with ``.item()`` and no host-device sync,
    the ops and scalars of torch's default CUDA path, bit for bit. A compiled step
    (:class:`~engine.transforms.Compile`) has them moved next to the parameters instead, as
    torch.optim's ``capturable`` counters, so the whole step stays one device graph (and CUDA
    graphs can capture it).

    Example:
        >>> import torch
        >>> from engine import optim
        >>> (adam,) = optim.adam(1e-3).init({"w": torch.zeros(2)})
        >>> type(adam.step).__name__, adam.step["w"].device.type
        ('StepCounters', 'cpu')
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"StepCounters({dict.__repr__(self)})"


pytree.register_pytree_node(
    StepCounters,
    lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: StepCounters(zip(keys, values, strict=True)),
    serialized_type_name="engine.optim.StepCounters",
    flatten_with_keys_fn=lambda d: ([(pytree.MappingKey(k), v) for k, v in d.items()], list(d)),
)


def map_placed(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` over the leaves of ``tree`` that live with the parameters: every leaf but the
    :class:`StepCounters`, which are kept as they are (placement's rule for a state)."""
    return pytree.tree_map(
        lambda x: x if isinstance(x, StepCounters) else fn(x),
        tree,
        is_leaf=lambda x: isinstance(x, StepCounters),
    )


def map_counters(fn: Callable[[Tensor], Tensor], tree: Any) -> Any:
    """``fn`` over the tensors of the :class:`StepCounters` in ``tree``, the rest kept."""
    return pytree.tree_map(
        lambda x: (
            StepCounters({k: fn(v) for k, v in x.items()}) if isinstance(x, StepCounters) else x
        ),
        tree,
        is_leaf=lambda x: isinstance(x, StepCounters),
    )


ScheduleLike = float | Callable[[int], float]
