"""``TrainState``: one frozen record holding everything a training run needs to continue.

The state is data, not behaviour: parameters, buffers, optimizer state, progress counters, the run's
seed, the precision state and a user ``extra`` mapping. It changes only by building a new record
(:meth:`TrainState.replace`); steps return new states. It is registered as a pytree, so
``torch.utils._pytree.tree_map`` maps over its tensors.

Donation: by default a step *consumes* its input state and reuses its tensors in place, so the
immutable API costs no extra memory. Every state carries a small :class:`_Ownership` token shared
with the records made from it by ``replace`` (they share tensors, so they share fate); consuming a
state marks the token, and using it again raises :class:`ConsumedStateError`.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import xxhash
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from engine.optim.base import GradientTransformation, OptState

__all__ = ["ConsumedStateError", "TrainState"]

Params = dict[str, Tensor]


class ConsumedStateError(RuntimeError):
    """A state whose tensors were donated to a step was used again."""


@attrs.define(eq=False, slots=True)
class _Ownership:
    """Mutable token shared by the records that share one set of tensors."""

    consumed_by: str | None = None
    at_step: int = 0


_CONSUMED_MSG = (
    "this TrainState was consumed by {by}: its tensors were donated and have since been updated in "
    "place, so it no longer holds the values it was created with. Use the state the step returned "
    "(`state, metrics = step(state, batch)`), take a snapshot first with `state.copy()`, or build "
    "the step with `donate=False` to keep every input state intact."
)


def _refuse_wrapped(module: nn.Module) -> None:
    """A module under torch's data-parallel or sharding wrappers trains wrongly here: its
    wrapper gathers and reduces around its own parameters, which a step never reads (FSDP2's
    ``fully_shard`` would overwrite the slots the step binds, and the step would train on zero
    gradients). Name the wrapper and say what to pass instead."""
    wrappers: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    sharded: tuple[type, ...] = ()
    fsdp2: tuple[type, ...] = ()
    # only a process that imported torch's sharding can hold its modules or DTensors (the
    # import alone costs ~0.8 s: never paid here)
    if torch.distributed.is_available() and "torch.distributed.tensor" in sys.modules:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.distributed.tensor import DTensor

        wrappers = (*wrappers, FullyShardedDataParallel, FSDPModule)
        sharded, fsdp2 = (DTensor,), (FSDPModule,)
    for name, sub in module.named_modules():
        if isinstance(sub, wrappers):
            where = f"its submodule {name!r} is" if name else "it is"
            kind = "fully_shard (FSDP2)" if isinstance(sub, fsdp2) else type(sub).__name__
            raise TypeError(
                f"the module passed to TrainState.create / task.init is wrapped: {where} a "
                f"{kind} module. Pass the plain module and choose a strategy instead "
                "(Trainer(strategy='ddp' or 'fsdp'), or engine.parallel.DDP() / FSDP() in "
                "transforms.compose): the strategy shards and reduces the state itself"
            )
    for name, p in module.named_parameters():
        if isinstance(p, sharded):
            raise TypeError(
                f"the module's parameter {name!r} is already a DTensor (sharded by "
                "fully_shard or a tensor-parallel plan): pass the plain module and choose "
                "strategy='fsdp', which shards the state itself"
            )


def _params_from_module(module: nn.Module) -> tuple[Params, Params]:
    _refuse_wrapped(module)
    # detach() shares storage: the state borrows the module's tensors, it does not copy them.
    # Frozen parameters (requires_grad=False) are not trained, so they travel with the buffers.
    params, buffers = {}, {}
    for k, p in module.named_parameters():
        if p.requires_grad:
            params[k] = p.detach().requires_grad_(True)
        else:
            buffers[k] = p.detach()
    buffers.update((k, b.detach()) for k, b in module.named_buffers())
    return params, buffers


@attrs.frozen(eq=False, repr=False)
class TrainState:
    """Everything a training run needs to continue, as one immutable record.

    Attributes:
        params: trainable tensors by name (``module.named_parameters()`` names).
        buffers: non-trainable tensors by name: the module's buffers (BatchNorm running
            statistics, ...) and its frozen parameters (``requires_grad=False``).
        opt_state: the optimizer's state pytree (``tx.init(params)``).
        step: optimizer steps taken (Lightning's ``global_step``).
        epoch: the current epoch (Lightning's ``current_epoch``).
        batch_idx: batches consumed in the current epoch (the data position).
        micro_step: micro-batches accumulated towards the next optimizer step.
        seed: the run's seed; all randomness of step ``n`` derives from ``(seed, n, micro_step)``.
        grad_accum: gradients summed over the current accumulation window, or ``None``.
        precision: the precision policy's state (e.g. a loss scale), or ``None``.
        extra: any user data (a mapping of pytrees) carried along and checkpointed.
        module: the ``nn.Module`` used as a stateless template by the steps, or ``None`` for
            pure-function models. It is structure, not data: it is not part of the pytree leaves.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> model = torch.nn.Linear(3, 2)
        >>> state = eg.TrainState.create(model, optim.sgd(0.1), seed=0)
        >>> state.step, sorted(state.params)
        (0, ['bias', 'weight'])
        >>> state.replace(epoch=1).epoch
        1
    """

    params: Params
    buffers: Params = attrs.field(factory=dict)
    opt_state: OptState = ()
    step: int = 0
    epoch: int = 0
    batch_idx: int = 0
    micro_step: int = 0
    seed: int = 0
    grad_accum: Params | None = None
    precision: Any = None
    extra: Mapping[str, Any] = attrs.field(factory=dict)
    module: nn.Module | None = None
    _ownership: _Ownership = attrs.field(factory=_Ownership, alias="_ownership")

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        model: nn.Module | Mapping[str, Tensor],
        tx: GradientTransformation,
        *,
        seed: int = 0,
        buffers: Mapping[str, Tensor] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TrainState:
        """Build the initial state from a module (or a dict of parameters) and an optimizer.

        A module's tensors are borrowed, not copied: the state's parameters share storage with
        ``model``'s, so no second copy of the weights is made. From then on the module serves as a
        stateless template; read trained values from ``state.params`` (or
        :meth:`load_into` a module).

        Args:
            model: an ``nn.Module``, or a dict of parameter tensors for a pure-function model.
            tx: the optimizer, a :class:`~engine.optim.GradientTransformation`.
            seed: the run's seed (a non-negative int below 2**63).
            buffers: extra non-trainable tensors for a pure-function model.
            extra: user data carried in the state.

        Raises:
            TypeError: if ``model`` or ``tx`` has the wrong type.
            ValueError: if ``seed`` is out of range or a parameter is not floating point.
        """
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"tx must be an engine.optim.GradientTransformation (got {type(tx).__name__}); "
                "build one with engine.optim, e.g. optim.adamw(1e-3), or wrap a torch.optim class "
                "with optim.from_torch(torch.optim.SGD, lr=0.1)"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63) (got {seed!r})")
        if isinstance(model, nn.Module):
            if buffers is not None:
                raise TypeError("buffers= is for pure-function models; a module brings its own")
            params, bufs = _params_from_module(model)
            module: nn.Module | None = model
        elif isinstance(model, Mapping):
            params = {k: v.detach() for k, v in _check_tensors(model).items()}
            bufs = {k: v.detach() for k, v in _check_tensors(buffers or {}).items()}
            module = None
        else:
            raise TypeError(
                f"model must be an nn.Module or a dict of parameter tensors "
                f"(got {type(model).__name__})"
            )
        for name, p in params.items():
            if not p.is_floating_point() and not p.is_complex():
                raise ValueError(
                    f"parameter {name!r} has dtype {p.dtype}; trainable parameters must be "
                    "floating point (register integer tensors as buffers instead)"
                )
            p.requires_grad_(True)
        return cls(
            params=params,
            buffers=bufs,
            opt_state=tx.init(params),
            seed=seed,
            extra=dict(extra or {}),
            module=module,
        )

    # ------------------------------------------------------------------ functional updates

    def replace(self, **changes: Any) -> TrainState:
        """A new state with ``changes`` applied; it shares tensors (and fate) with this one."""
        return attrs.evolve(self, **changes)

    def copy(self) -> TrainState:
        """A deep snapshot: fresh tensors and its own ownership, unaffected by later steps."""
        self.check_alive("copy()")
        cloned = pytree.tree_map(_clone_leaf, self)
        return attrs.evolve(cloned, _ownership=_Ownership())

    @property
    def sharded(self) -> bool:
        """Whether any of the state's tensors is a DTensor (``engine.parallel.FSDP`` sharded
        it): such a state is saved, gathered and fingerprinted by every rank together.

        Example:
            >>> import torch
            >>> from engine import optim
            >>> TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1)).sharded
            False
        """
        if "torch.distributed.tensor" not in sys.modules:  # nothing made a DTensor here
            return False
        from torch.distributed.tensor import DTensor

        tensors = (self.params, self.buffers, self.grad_accum, self.opt_state)
        return any(isinstance(t, DTensor) for t in pytree.tree_leaves(tensors))

    # ------------------------------------------------------------------ donation

    @property
    def consumed(self) -> bool:
        """Whether a step has consumed this state (its tensors now hold newer values)."""
        return self._ownership.consumed_by is not None

    def check_alive(self, what: str = "this step") -> None:
        """Raise :class:`ConsumedStateError` if a step already consumed this state."""
        by = self._ownership.consumed_by
        if by is not None:
            if by == "Trainer.fit":
                raise ConsumedStateError(
                    f"{what} received a consumed state: this TrainState was given to "
                    "Trainer.fit, whose steps donated its tensors and updated them in place. "
                    "Use the state fit returned: `state = trainer.fit(task, state, ...)` (fit "
                    "from `state.copy()` to keep the one you started from)"
                )
            raise ConsumedStateError(
                f"{what} received a consumed state: "
                + _CONSUMED_MSG.format(by=f"{by} (at step {self._ownership.at_step})")
            )

    def _consume(self, by: str) -> None:
        self.check_alive(by)
        self._ownership.consumed_by = by  # formatted only if the error is raised
        self._ownership.at_step = self.step

    # ------------------------------------------------------------------ inspection

    def fingerprint(self, algorithm: str = "xxh3_128") -> str:
        """A hex digest of the bits of params, buffers, optimizer state, precision state (a
        loss scale) and counters.

        Two states have equal fingerprints exactly when those hold bitwise-identical values
        (same names, shapes, dtypes and bytes). Replay compares fingerprints to verify a run.

        A sharded state (DTensor leaves, ``strategy="fsdp"``) has the fingerprint of the same
        values unsharded: each DTensor's full value is gathered (``full_tensor()``) and hashed.
        That gather is a collective: call ``fingerprint()`` on every rank of the process
        group, in the same order (each rank gets the same digest).

        Args:
            algorithm: ``"xxh3_128"`` (32 hex digits; about 20 times faster than SHA-256, so a
                checkpoint-sized state costs milliseconds), or ``"sha256"`` (64 hex digits: what
                journals written by engine before checkpoint format 3 hold).

        Example:
            >>> import torch
            >>> import engine as eg
            >>> from engine import optim
            >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
            >>> len(state.fingerprint()), len(state.fingerprint("sha256"))
            (32, 64)
        """
        if algorithm not in _FINGERPRINTS:
            raise ValueError(
                f"unknown fingerprint algorithm {algorithm!r}; use one of {sorted(_FINGERPRINTS)}"
            )
        h = _FINGERPRINTS[algorithm]()
        h.update(
            struct.pack("<5q", self.step, self.epoch, self.batch_idx, self.micro_step, self.seed)
        )
        for group in (self.params, self.buffers, self.grad_accum or {}):
            for name, t in group.items():
                h.update(name.encode())
                _hash_leaf(h, t)
        for path, leaf in pytree.tree_flatten_with_path(self.opt_state)[0]:
            h.update(pytree.keystr(path).encode())
            _hash_leaf(h, leaf)
        if self.precision is not None:  # a loss scale (absent: the digest states had before)
            leaves = pytree.tree_flatten_with_path(self.precision)[0]
            for key, leaf in sorted((pytree.keystr(p), x) for p, x in leaves):  # dicts' order
                h.update(b"precision" + key.encode())  # is not kept by a checkpoint's JSON
                _hash_leaf(h, leaf)
        return h.hexdigest()

    def num_params(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.params.values())

    def load_into(self, module: nn.Module) -> nn.Module:
        """Copy params and buffers into ``module`` (strict) and return it, e.g. for export.

        A sharded state's DTensors are gathered first (a collective: call it on every rank).
        Tied weights (one tensor under two names, as an output layer sharing the embedding's)
        are held once in the state, under the first name; the module's other names for them
        get the same values.
        """
        tensors = {k: _full(t.detach()) for k, t in {**self.params, **self.buffers}.items()}
        named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(
            remove_duplicate=False))  # fmt: skip
        first: dict[int, str] = {}
        for name, t in named:
            known = first.setdefault(id(t), name)
            if name not in tensors and known in tensors:
                tensors[name] = tensors[known]
        module.load_state_dict(tensors, strict=True)
        return module

    def __repr__(self) -> str:
        return (
            f"TrainState(step={self.step}, epoch={self.epoch}, batch_idx={self.batch_idx}, "
            f"micro_step={self.micro_step}, seed={self.seed}, params={len(self.params)} tensors "
            f"/ {self.num_params():,} values, buffers={len(self.buffers)}, "
            f"consumed={self.consumed})"
        )


def _check_tensors(d: Mapping[str, Any]) -> dict[str, Tensor]:
    for k, v in d.items():
        if not isinstance(k, str) or not isinstance(v, Tensor):
            raise TypeError(
                f"expected a dict of str -> Tensor; entry {k!r} has value type {type(v).__name__}"
            )
    return dict(d)


def _clone_leaf(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


_FINGERPRINTS: dict[str, Callable[[], Any]] = {
    "xxh3_128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}


def _full(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective: gathered from every rank); a tensor itself."""
    if type(t) is not Tensor and "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.full_tensor()
    return t


def _hash_leaf(h: Any, leaf: Any) -> None:
    if isinstance(leaf, Tensor):
        t = _full(leaf.detach())
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            t = t.to("cpu").contiguous()
            # view as bytes: exact bits, including -0.0 and NaN payloads
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashed in place, no copy
    else:
        h.update(repr(leaf).encode())


# ---------------------------------------------------------------------- pytree registration

_CHILDREN = ("params", "buffers", "opt_state", "grad_accum", "precision", "extra")
_STATIC = ("step", "epoch", "batch_idx", "micro_step", "seed", "module", "_ownership")


def _flatten(s: TrainState) -> tuple[list[Any], tuple[Any, ...]]:
    return [getattr(s, n) for n in _CHILDREN], tuple(getattr(s, n) for n in _STATIC)


def _unflatten(children: Any, context: tuple[Any, ...]) -> TrainState:
    kw = dict(zip(_CHILDREN, children, strict=True))
    static = dict(zip(_STATIC, context, strict=True))
    static["_ownership"] = static.pop("_ownership")
    return TrainState(**kw, **static)


def _flatten_with_keys(s: TrainState):
    children, ctx = _flatten(s)
    return [(pytree.GetAttrKey(n), c) for n, c in zip(_CHILDREN, children, strict=True)], ctx


pytree.register_pytree_node(
    TrainState,
    _flatten,
    _unflatten,
    serialized_type_name="engine.TrainState",
    flatten_with_keys_fn=_flatten_with_keys,
)
