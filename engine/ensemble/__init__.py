"""Ensembles and hyperparameter sweeps: E models trained in one vmapped step.

An *ensemble state* is an ordinary :class:`~engine.state.TrainState` whose every tensor (params,
buffers, optimizer state, tensors in ``extra``) has a leading member axis of size E. It is built
by :func:`stack` from E states of the same model and optimizer (E seeds: an ensemble) or by
:func:`sweep` from one state and E values of an injected hyperparameter (a learning-rate sweep),
trained by :func:`ensemble_step` in ONE step that maps a member's step over the member axis with
``torch.func.vmap``, and taken apart again by :func:`member` / :func:`unstack` into ordinary
states that :func:`engine.checkpoint.save` writes and a plain ``train_step`` continues.

What the stacked state holds:

* the counters (``step``, ``epoch``, ``batch_idx``, ``micro_step``) are the members' own, which
  must agree: the members take the same steps;
* each member's seed is in ``extra["ensemble_seeds"]`` (an int64 tensor, one per member), so
  :func:`member` gives each member its own seed back. ``state.seed`` is the ensemble's own (the
  first member's unless :func:`stack` is told otherwise): under the Trainer it orders the data
  (every member sees the same batches, in that seed's order) and it seeds the step's random
  numbers;
* an injected hyperparameter (:func:`engine.optim.inject_hyperparams`) that differs between
  members (a sweep) becomes a float64 tensor of the E values; one they share stays a number.

Equality with E separate runs. Member ``i`` of an ensemble trained on batches ``b_1 ... b_n``
is, for a model without random layers, the state a separate ``train_step`` run of member ``i``
reaches on the same batches, within float rounding (1e-6) and, on CPU, bitwise where the
kernels allow, which ``tests/test_ensemble.py`` checks: the optimizer stays engine's own
(fused and in place where ``train_step``'s is), its fused kernels get each member's slice as a
tensor of its own and its ``torch._foreach_*`` ops run on the stacked tensors
(``engine/ensemble/_stacked.py``), which has given the same bits for SGD, Adam(W) (fused and
foreach), RMSprop, Adagrad, Lion and global-norm clipping; the gradients come from
``torch.func.grad_and_value`` under vmap, whose batched kernels (matrix products, reductions
over the batch) round like the unbatched ones for some shapes and not for others (the MLPs of
the tests, batch 16, bitwise; batch 8 an ulp off in some gradients; batch norm 1e-8).
The per-member losses the step reports agree with a separate run's to 1e-6 (the batched
reduction may round the last bit differently).

Random layers (dropout) draw, under ``randomness="different"``, one independent mask per
member from the generator seeded by the ensemble's ``(seed, step)``: deterministic and
resumable, but not the masks member ``i``'s separate run draws from its own seed. Under
``randomness="same"`` every member draws the mask of an unbatched call, which is what a
separate run with the ensemble's seed draws: a sweep (all members from one state, one seed)
then matches its separate runs with dropout too.

Example:
    >>> import torch, torch.nn.functional as F
    >>> import engine as eg
    >>> from engine import ensemble, optim
    >>> tx = optim.adamw(1e-2)
    >>> def make(seed):
    ...     torch.manual_seed(seed)
    ...     return eg.TrainState.create(torch.nn.Linear(3, 2), tx, seed=seed)
    >>> states = ensemble.stack([make(s) for s in range(4)])
    >>> states.params["weight"].shape, ensemble.size(states)
    (torch.Size([4, 2, 3]), 4)
    >>> step = ensemble.ensemble_step(lambda m, b: F.mse_loss(m(b[0]), b[1]), tx)
    >>> states, metrics = step(states, (torch.randn(8, 3), torch.randn(8, 2)))
    >>> sorted(metrics)[:3]
    ['loss', 'loss/member_0', 'loss/member_1']
    >>> ensemble.member(states, 2).params["weight"].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from engine.ensemble._stacked import StackedKernels
from engine.optim.base import GradientTransformation, apply_updates
from engine.optim.inject import InjectHyperparamsState, set_hyperparams
from engine.state import TrainState
from engine.step import CustomStep, LossFn, Metrics
from engine.step._common import _split
from engine.step._model_view import _view

__all__ = [
    "SEEDS",
    "EnsembleStep",
    "ensemble_eval",
    "ensemble_step",
    "member",
    "member_names",
    "name_metrics",
    "size",
    "stack",
    "sweep",
    "unstack",
]

#: the key of ``TrainState.extra`` that holds an ensemble's per-member seeds
SEEDS = "ensemble_seeds"

_COUNTERS = ("step", "epoch", "batch_idx", "micro_step")
_RANDOMNESS = ("different", "same", "error")


# ---------------------------------------------------------------------- stacking


def stack(states: Sequence[TrainState], *, seed: int | None = None) -> TrainState:
    """One ensemble state from E states of the same model and optimizer.

    Every tensor is copied into a stacked tensor with a leading member axis (the states given
    are left as they are). The members must have the same parameter and buffer names, shapes,
    dtypes and devices, the same optimizer state structure, and the same counters; their
    seeds go to ``extra["ensemble_seeds"]``. An injected hyperparameter may differ (a sweep);
    every other number in the optimizer state must not.

    Args:
        states: E >= 1 states, e.g. ``TrainState.create`` of E models initialised from
            different seeds, with the same ``tx``.
        seed: the ensemble's own seed (data order under the Trainer, the step's random
            numbers); default the first member's.

    Returns:
        The ensemble state.

    Raises:
        TypeError: if an item is not a TrainState.
        ValueError: if the members do not match (the message names what differs and where).

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import ensemble, optim
        >>> a = eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1), seed=1)
        >>> b = eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1), seed=2)
        >>> both = ensemble.stack([a, b])
        >>> both.params["bias"].shape, both.extra["ensemble_seeds"].tolist(), both.seed
        (torch.Size([2, 1]), [1, 2], 1)
    """
    states = list(states)
    if not states:
        raise ValueError("stack() needs at least one TrainState (got none)")
    for i, s in enumerate(states):
        if not isinstance(s, TrainState):
            raise TypeError(f"stack(): member {i} is a {type(s).__name__}, not a TrainState")
        s.check_alive("ensemble.stack()")
        if SEEDS in s.extra:
            raise ValueError(
                f"stack(): member {i} is already an ensemble state (its extra holds "
                f"{SEEDS!r}); stack ordinary states, or take members out with "
                "ensemble.unstack() first"
            )
        if s.grad_accum is not None or s.micro_step:
            raise ValueError(
                f"stack(): member {i} is inside a gradient-accumulation window (micro_step "
                f"{s.micro_step}); stack states between optimizer steps"
            )
        if s.precision is not None:
            raise ValueError(
                f"stack(): member {i} carries a precision state ({type(s.precision).__name__}, "
                "a loss scale); an ensemble step runs in the parameters' dtype: stack states "
                "without one"
            )
    first = states[0]
    for name in _COUNTERS:
        values = [getattr(s, name) for s in states]
        if len(set(values)) > 1:
            raise ValueError(
                f"stack(): the members' {name} differ ({values}); the members of an "
                "ensemble take the same steps: stack states at the same point of training"
            )
    if seed is None:
        seed = first.seed
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"stack(seed=...) must be an int in [0, 2**63) (got {seed!r})")
    params = _stack_named(states, "params")
    buffers = _stack_named(states, "buffers")
    opt_state = _stack_opt_states(states)
    extra = _stack_tree([s.extra for s in states], "extra")
    extra[SEEDS] = torch.tensor([s.seed for s in states], dtype=torch.int64)
    for p in params.values():
        p.requires_grad_(True)
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        step=first.step,
        epoch=first.epoch,
        batch_idx=first.batch_idx,
        seed=seed,
        extra=extra,
        module=first.module,
    )


def _stack_named(states: list[TrainState], group: str) -> dict[str, Tensor]:
    first: Mapping[str, Tensor] = getattr(states[0], group)
    for i, s in enumerate(states[1:], 1):
        mine: Mapping[str, Tensor] = getattr(s, group)
        if list(mine) != list(first):
            missing = sorted(set(first) - set(mine))
            more = sorted(set(mine) - set(first))
            raise ValueError(
                f"stack(): member {i}'s {group} are not member 0's (missing: {missing}, "
                f"extra: {more}); an ensemble's members are copies of one model"
            )
        for k, t in mine.items():
            _same_kind(first[k], t, f"{group}[{k!r}]", i)
    return {k: torch.stack([getattr(s, group)[k].detach() for s in states]) for k in first}


def _same_kind(ref: Tensor, t: Tensor, where: str, i: int) -> None:
    if (ref.shape, ref.dtype, ref.device) != (t.shape, t.dtype, t.device):
        raise ValueError(
            f"stack(): member {i}'s {where} is {tuple(t.shape)} {t.dtype} on {t.device}, "
            f"member 0's {tuple(ref.shape)} {ref.dtype} on {ref.device}; an ensemble's members "
            "are copies of one model, on one device"
        )


def _hyperparam_paths(opt_state: Any) -> set[str]:
    """The key paths of the injected hyperparameters' values in an optimizer state."""
    is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
    paths = set()
    for path, leaf in pytree.tree_flatten_with_path(opt_state, is_leaf=is_leaf)[0]:
        if isinstance(leaf, InjectHyperparamsState):
            for k in leaf.hyperparams:
                key = (*path, pytree.GetAttrKey("hyperparams"), pytree.MappingKey(k))
                paths.add(pytree.keystr(key))
    return paths


def _stack_opt_states(states: list[TrainState]) -> Any:
    flat = [pytree.tree_flatten_with_path(s.opt_state) for s in states]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], 1):
        if other != spec:
            raise ValueError(
                f"stack(): member {i}'s optimizer state has another structure than member 0's "
                "(a different optimizer, or one built for other parameters); build every "
                "member's state with the same tx"
            )
    swept = _hyperparam_paths(states[0].opt_state)
    leaves = []
    for j, (path, ref) in enumerate(flat[0][0]):
        values = [f[0][j][1] for f in flat]
        where = pytree.keystr(path)
        if isinstance(ref, Tensor):
            for i, t in enumerate(values[1:], 1):
                if not isinstance(t, Tensor):
                    raise ValueError(f"stack(): member {i}'s optimizer state{where} is no tensor")
                _same_kind(ref, t, f"optimizer state{where}", i)
            leaves.append(torch.stack([t.detach() for t in values]))
        elif all(_equal(v, ref) for v in values):
            leaves.append(ref)
        elif where in swept and all(_number(v) for v in values):
            leaves.append(torch.tensor([float(v) for v in values], dtype=torch.float64))
        else:
            raise ValueError(
                f"stack(): the members' optimizer state{where} differ ({values}); only an "
                "injected hyperparameter may differ between members (a sweep: "
                "optim.inject_hyperparams(...), then ensemble.sweep(state, lr=[...]))"
            )
    return pytree.tree_unflatten(leaves, spec)


def _stack_tree(trees: list[Any], what: str) -> Any:
    flat = [pytree.tree_flatten_with_path(t) for t in trees]
    spec = flat[0][1]
    if any(f[1] != spec for f in flat[1:]):
        raise ValueError(f"stack(): the members' {what} have different structures")
    leaves = []
    for j, (path, ref) in enumerate(flat[0][0]):
        values = [f[0][j][1] for f in flat]
        if isinstance(ref, Tensor):
            for i, t in enumerate(values[1:], 1):
                _same_kind(ref, t, f"{what}{pytree.keystr(path)}", i)
            leaves.append(torch.stack([t.detach() for t in values]))
        elif all(_equal(v, ref) for v in values):
            leaves.append(ref)
        else:
            raise ValueError(
                f"stack(): the members' {what}{pytree.keystr(path)} differ ({values}); "
                "give members the same non-tensor values"
            )
    return dict(pytree.tree_unflatten(leaves, spec))


def _equal(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def size(state: TrainState) -> int:
    """The number of members E of an ensemble state.

    Raises:
        ValueError: if ``state`` is not an ensemble state (made by :func:`stack`).
    """
    seeds = state.extra.get(SEEDS) if isinstance(state.extra, Mapping) else None
    if not isinstance(seeds, Tensor) or seeds.dim() != 1:
        raise ValueError(
            f"not an ensemble state: its extra has no {SEEDS!r} tensor; build one with "
            "ensemble.stack([state, ...]) or ensemble.sweep(state, lr=[...])"
        )
    return int(seeds.shape[0])


def member(state: TrainState, i: int) -> TrainState:
    """Member ``i`` of an ensemble state, as an ordinary state of its own.

    Its tensors are copies (training it leaves the ensemble as it is), its seed is the
    member's, swept hyperparameters are numbers again, and its module is the ensemble's
    template. ``checkpoint.save`` writes it, and a ``train_step`` of the members' ``tx``
    continues it as the ensemble would have.

    Args:
        state: an ensemble state.
        i: the member, ``0 <= i < E`` (negative counts from the end).

    Raises:
        ValueError: if ``state`` is not an ensemble state.
        IndexError: if ``i`` is out of range.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import ensemble, optim
        >>> tx = optim.inject_hyperparams(optim.sgd)(lr=0.1)
        >>> swept = ensemble.sweep(eg.TrainState.create(torch.nn.Linear(2, 1), tx), lr=[0.1, 0.5])
        >>> optim.get_hyperparams(ensemble.member(swept, 1).opt_state)
        {'lr': 0.5}
    """
    n = size(state)
    state.check_alive("ensemble.member()")
    if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
        raise IndexError(f"member {i!r} of an ensemble of {n} (use 0 ... {n - 1})")
    i %= n
    swept = _hyperparam_paths(state.opt_state)

    def take(path: Any, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if pytree.keystr(path) in swept:  # a swept hyperparameter: a number again
            return float(x[i])
        return x[i].detach().clone()

    params = {k: v[i].detach().clone().requires_grad_(True) for k, v in state.params.items()}
    buffers = {k: v[i].detach().clone() for k, v in state.buffers.items()}
    opt_state = pytree.tree_map_with_path(take, state.opt_state)
    extra = {k: v for k, v in state.extra.items() if k != SEEDS}
    extra = pytree.tree_map(lambda x: x[i].clone() if isinstance(x, Tensor) else x, extra)
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        step=state.step,
        epoch=state.epoch,
        batch_idx=state.batch_idx,
        seed=int(state.extra[SEEDS][i]),
        extra=extra,
        module=state.module,
    )


def unstack(state: TrainState) -> list[TrainState]:
    """Every member of an ensemble state, as ordinary states (see :func:`member`)."""
    return [member(state, i) for i in range(size(state))]


def sweep(state: TrainState, **values: Sequence[float]) -> TrainState:
    """An ensemble of copies of ``state``, member ``i`` with hyperparameters ``values[k][i]``.

    ``state``'s optimizer must keep the swept hyperparameters in its state
    (``optim.inject_hyperparams(optim.adamw)(lr=...)``), and the optimizer must accept them as
    0-d tensors, as every optimizer of :mod:`engine.optim` takes its learning rate. All members
    start from the same parameters and share ``state``'s seed.

    Args:
        state: the state every member starts from (read, not consumed).
        **values: hyperparameter name -> E values, every list as long.

    Returns:
        The ensemble state (E = the lists' length).

    Raises:
        ValueError: if no values are given, or the lists differ in length.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import ensemble, optim
        >>> tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
        >>> state = eg.TrainState.create(torch.nn.Linear(2, 1), tx)
        >>> swept = ensemble.sweep(state, lr=[1e-3, 1e-2, 1e-1])
        >>> ensemble.member_names(swept, "lr")
        ['lr=0.001', 'lr=0.01', 'lr=0.1']
    """
    if not values:
        raise ValueError("sweep() needs the values to sweep, e.g. sweep(state, lr=[1e-3, 1e-2])")
    lengths = {k: len(v) for k, v in values.items()}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        raise ValueError(f"sweep(): give every hyperparameter as many values (got {lengths})")
    n = next(iter(lengths.values()))
    members = []
    for i in range(n):
        copy = state.copy()
        chosen = {k: v[i] for k, v in values.items()}
        members.append(copy.replace(opt_state=set_hyperparams(copy.opt_state, **chosen)))
    return stack(members)


# ---------------------------------------------------------------------- metrics


def member_names(state: TrainState, *by: str) -> list[str]:
    """Names for an ensemble's members: ``member_0``, ... or, given hyperparameter names (or
    ``"seed"``), ``lr=0.001``, ``seed=3``, ... joined by ``,``.

    Args:
        state: an ensemble state.
        *by: injected hyperparameters, or ``"seed"``, that tell the members apart.

    Raises:
        ValueError: if ``state`` is not an ensemble state, a name is not found, or two members
            would have the same name.
    """
    n = size(state)
    if not by:
        return [f"member_{i}" for i in range(n)]
    found: dict[str, Any] = {"seed": state.extra[SEEDS].tolist()}
    is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
    for leaf in pytree.tree_leaves(state.opt_state, is_leaf=is_leaf):
        if isinstance(leaf, InjectHyperparamsState):
            for k, v in leaf.hyperparams.items():
                found[k] = v.tolist() if isinstance(v, Tensor) else [v] * n
    unknown = [k for k in by if k not in found]
    if unknown:
        raise ValueError(
            f"member_names(): {unknown} are neither 'seed' nor injected hyperparameters of "
            f"this ensemble (it has {sorted(found)})"
        )
    names = [",".join(f"{k}={found[k][i]:g}" for k in by) for i in range(n)]
    if len(set(names)) != n:
        raise ValueError(f"member_names(): {list(by)} do not tell the members apart ({names})")
    return names


def name_metrics(metrics: Mapping[str, Tensor], names: Sequence[str]) -> Metrics:
    """Per-member metrics (each a tensor of E values) as one number per name: ``"loss"`` the
    members' mean, ``"loss/<name>"`` each member's, and so for every metric; what a logger
    writes, one column per member.

    Example:
        >>> import torch
        >>> name_metrics({"loss": torch.tensor([1.0, 3.0])}, ["lr=0.1", "lr=1"])
        {'loss': tensor(2.), 'loss/lr=0.1': tensor(1.), 'loss/lr=1': tensor(3.)}
    """
    out: dict[str, Tensor] = {}
    for k, v in metrics.items():
        if v.dim() != 1 or v.shape[0] != len(names):
            raise ValueError(
                f"metric {k!r} has shape {tuple(v.shape)}; expected one value per member "
                f"({len(names)} names)"
            )
        out[k] = v.float().mean() if not v.is_floating_point() else v.mean()
        out.update((f"{k}/{name}", x) for name, x in zip(names, v.unbind(), strict=True))
    return out


def _member_metrics(loss: Tensor | None, aux: Mapping[str, Any]) -> dict[str, Tensor]:
    out = {} if loss is None else {"loss": loss.detach()}
    for k, v in aux.items():
        if isinstance(v, Tensor):
            if v.dim() != 0:
                raise ValueError(
                    f"metric {k!r} has shape {tuple(v.shape)} for one member; a logged metric "
                    f"is one number per member: reduce it ({k}.mean())"
                )
            out[k] = v.detach()
        elif _number(v) or isinstance(v, bool):
            out[k] = torch.as_tensor(float(v))
        else:
            raise TypeError(
                f"metric {k!r} is a {type(v).__name__}; an ensemble's metrics are numbers or "
                "0-d tensors (a torchmetrics object cannot be mapped over members)"
            )
    return out


# ---------------------------------------------------------------------- steps


def _check_randomness(randomness: str) -> str:
    if randomness not in _RANDOMNESS:
        raise ValueError(
            f"randomness must be one of {', '.join(map(repr, _RANDOMNESS))} (got {randomness!r})"
        )
    return randomness


class EnsembleStep(CustomStep):
    """``(ensemble state, batch) -> (ensemble state, metrics)``: every member's train step in
    one ``torch.func.vmap``. Built by :func:`ensemble_step` (see there); a
    :class:`~engine.step.CustomStep`, so it is seeded from the state's ``(seed, step)``,
    consumes its input, advances ``batch_idx``, and ``Task(step_fn=...)`` runs it under the
    Trainer."""

    def __init__(
        self,
        loss_fn: LossFn,
        tx: GradientTransformation,
        *,
        in_dims: Any = None,
        randomness: str = "different",
        names: Sequence[str] | None = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (got {type(loss_fn).__name__})")
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"tx must be an engine.optim.GradientTransformation (got {type(tx).__name__})"
            )
        self.loss_fn = loss_fn
        self.tx = tx
        self.in_dims = in_dims
        self.randomness = _check_randomness(randomness)
        self.names = None if names is None else list(names)
        super().__init__(self._step)

    def _member(self, module: Any, spec: Any, leaves: list[Any], step: int) -> Callable:
        """One member's step, for vmap: gradients, then the optimizer on its tensors."""
        loss_fn, tx = self.loss_fn, self.tx
        where = [j for j, x in enumerate(leaves) if isinstance(x, Tensor)]

        def one(params, buffers, tensors, batch):
            def objective(p, b):  # the buffers are an input too: a batch norm updates them
                loss, aux = _split(loss_fn(_view(module, p, b), batch), "loss_fn")
                if loss.dim() != 0:
                    raise ValueError(
                        f"loss_fn must return a scalar loss per member (got shape "
                        f"{tuple(loss.shape)}); reduce it, e.g. with .mean()"
                    )
                return loss, (loss, aux)

            grads, (loss, aux) = torch.func.grad(objective, has_aux=True)(params, buffers)
            merged = list(leaves)
            for j, t in zip(where, tensors, strict=True):
                merged[j] = t
            opt_state = pytree.tree_unflatten(merged, spec)
            level = torch._C._functorch.maybe_current_level()
            with torch.no_grad(), StackedKernels(level):
                if tx.apply is not None:
                    opt_state = tx.apply(dict(grads), opt_state, params, step)
                else:
                    updates, opt_state = tx.update(dict(grads), opt_state, params, step)
                    apply_updates(params, updates)
            new_leaves, new_spec = pytree.tree_flatten(opt_state)
            if new_spec != spec or any(
                not isinstance(x, Tensor) and not _equal(x, leaves[j])
                for j, x in enumerate(new_leaves)
            ):
                raise ValueError(
                    "the optimizer changed its state's structure or a number in it during a "
                    "step; an ensemble maps only optimizers whose state changes in tensors"
                )
            return [new_leaves[j] for j in where], _member_metrics(loss, aux)

        return one

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        n = size(state)
        names = self.names if self.names is not None else member_names(state)
        if len(names) != n:
            raise ValueError(f"names: {len(names)} names for an ensemble of {n} members")
        if state.grad_accum is not None or state.precision is not None:
            raise ValueError(
                "an ensemble step runs without accumulation or a precision state; this state "
                "has one"
            )
        leaves, spec = pytree.tree_flatten(state.opt_state)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        one = self._member(state.module, spec, leaves, state.step)
        mapped = torch.func.vmap(one, in_dims=(0, 0, 0, self.in_dims), randomness=self.randomness)
        new_tensors, metrics = mapped(state.params, state.buffers, tensors, batch)
        it = iter(new_tensors)
        leaves = [_owned(next(it)) if isinstance(x, Tensor) else x for x in leaves]
        new = state.replace(opt_state=pytree.tree_unflatten(leaves, spec), step=state.step + 1)
        return new, name_metrics(metrics, names)


def _owned(t: Tensor) -> Tensor:
    """A tensor vmap returned, as a state keeps it: contiguous, memory of its own (a value
    every member shares comes back expanded)."""
    return t if t.is_contiguous() else t.contiguous()


def ensemble_step(
    loss_fn: LossFn,
    tx: GradientTransformation,
    *,
    in_dims: Any = None,
    randomness: str = "different",
    names: Sequence[str] | None = None,
) -> EnsembleStep:
    """Build the train step of an ensemble state: every member's step in one vmapped call.

    Each member runs what ``engine.train_step(loss_fn, tx)`` runs on its own state: the
    gradients of ``loss_fn`` (``torch.func.grad_and_value``, under ``torch.func.vmap``), then
    ``tx``'s terminal ``apply`` (or ``update`` and ``apply_updates``), whose ``_foreach`` ops and
    fused kernels run once on the stacked tensors, in place (see ``engine/ensemble/_stacked.py``).

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``, as for
            ``train_step``; ``model`` is one member's view.
        tx: the members' optimizer (the one their states were created with).
        in_dims: how the batch maps over members: ``None`` (default) gives every member the
            same batch; ``0`` splits a batch whose every tensor has a leading member axis (a
            batch of its own per member); a pytree of these for mixed batches
            (``torch.func.vmap``'s ``in_dims``).
        randomness: ``torch.func.vmap``'s: ``"different"`` (default) draws independent
            numbers per member, ``"same"`` one draw for all, ``"error"`` refuses random ops.
            Draws are seeded by the ensemble's ``(seed, step)``; see the module's docstring.
        names: one name per member for the metrics (``member_names(state, "lr")``); default
            ``member_0``, ``member_1``, ...

    Returns:
        An :class:`EnsembleStep`. Its metrics are ``"loss"`` (the members' mean) and
        ``"loss/<name>"`` per member, and the same for each metric ``loss_fn`` returns.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import ensemble, optim
        >>> tx = optim.inject_hyperparams(optim.sgd)(lr=0.1)
        >>> state = ensemble.sweep(eg.TrainState.create(torch.nn.Linear(3, 1), tx),
        ...                        lr=[0.01, 0.1])
        >>> step = ensemble.ensemble_step(lambda m, b: F.mse_loss(m(b[0]), b[1]), tx,
        ...                               names=ensemble.member_names(state, "lr"))
        >>> state, metrics = step(state, (torch.randn(8, 3), torch.randn(8, 1)))
        >>> sorted(metrics), state.step
        (['loss', 'loss/lr=0.01', 'loss/lr=0.1'], 1)
    """
    return EnsembleStep(loss_fn, tx, in_dims=in_dims, randomness=randomness, names=names)


def ensemble_eval(
    fn: Callable[[Any, Any], Any],
    *,
    in_dims: Any = None,
    names: Sequence[str] | None = None,
) -> Callable[[Any, Any], Metrics]:
    """An evaluation function for an ensemble state, from one member's: for
    ``Task(eval_fn=...)`` or ``engine.eval_step``.

    Args:
        fn: ``fn(model, batch)`` of one member: a loss, ``(loss, metrics)`` or a dict of
            metrics, as an evaluation function returns.
        in_dims: how the batch maps over members (see :func:`ensemble_step`).
        names: one name per member; default ``member_0``, ...

    Returns:
        ``evaluate(model, batch) -> metrics`` over the stacked state, named as
        :func:`name_metrics` names them.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import ensemble, optim
        >>> state = ensemble.stack(
        ...     [eg.TrainState.create(torch.nn.Linear(3, 1), optim.sgd(0.1)) for _ in range(2)])
        >>> evaluate = eg.eval_step(ensemble.ensemble_eval(lambda m, b: F.mse_loss(m(b), b[:, :1])))
        >>> sorted(evaluate(state, torch.randn(4, 3)))
        ['loss', 'loss/member_0', 'loss/member_1']
    """
    if not callable(fn):
        raise TypeError(f"ensemble_eval(fn): fn must be callable (got {type(fn).__name__})")

    def evaluate(model: Any, batch: Any) -> Metrics:
        if isinstance(model, Mapping):  # a pure-function model: its tensors, all stacked
            module, params, buffers = None, dict(model), {}
        else:
            module, params, buffers = model.module, model.params, model.buffers

        def one(p: Any, b: Any, batch: Any) -> dict[str, Tensor]:
            out = fn(_view(module, p, b), batch)
            if isinstance(out, Mapping):  # metrics alone
                return _member_metrics(None, out)
            loss, aux = _split(out, "the eval function")
            return _member_metrics(loss, aux)

        metrics = torch.func.vmap(one, in_dims=(0, 0, in_dims), randomness="different")(
            params, buffers, batch
        )
        n = next(iter(params.values())).shape[0]
        chosen = list(names) if names is not None else [f"member_{i}" for i in range(n)]
        return name_metrics(metrics, chosen)

    return evaluate
