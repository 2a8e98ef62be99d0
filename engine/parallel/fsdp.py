"""Fully sharded data parallel training on torch's FSDP2 building blocks: :class:`FSDP`, a
:class:`~engine.transforms.Strategy`.

Every rank holds ``1/W`` of each parameter, of its gradient and of its optimizer state, as a
``torch.distributed.tensor.DTensor`` sharded along dim 0 (``Shard(0)``; a 0-dim tensor is
replicated) over a one-dimensional device mesh of the ``W`` ranks. What a step does with them:

* ``prepare(state, tx)`` broadcasts rank 0's state (as :class:`~engine.parallel.DDP` does), then
  keeps this rank's shard of every parameter, of the partial gradient sum and of every optimizer
  leaf ``tx.init`` makes parameter-shaped (the optimizer is given, so its state is sharded by
  the structure ``tx.init`` gives the sharded parameters, not guessed from shapes). The module's
  own parameter slots are left holding meta tensors (shapes only): the full weights are not kept
  anywhere;
* ``bind`` (the step's view of the parameters, inside the differentiated region) gathers each
  parameter where the forward reads it: per *unit* (the modules ``auto_wrap_policy`` picks, as
  torch's ``fully_shard`` is applied per transformer block, and the root for the rest), in a
  forward pre-hook of the unit, its slots given back their shards after the unit's forward. The
  gather is ``DTensor.full_tensor(grad_placements=[Partial()])``'s two steps (``redistribute``
  to ``Replicate()``, in the dtype below, then ``to_local``), whose backward is a
  reduce-scatter: each rank receives the sum over the ranks of its shard's gradient;
* ``reshard_after_forward=True`` (``FULL_SHARD``, ZeRO-3): a gathered parameter is not kept for
  the backward pass; what autograd saves of it is a reference to the shard, gathered again
  when backward needs it (saved-tensor hooks, in ``wrap_grad``). ``False`` (``SHARD_GRAD_OP``,
  ZeRO-2): the gathered parameter stays from the forward to the backward;
* under ``"bf16-mixed"`` (the pipeline's precision declares ``param_dtype``, which
  ``prepare`` is given) each float32 shard is cast to bfloat16 before the all-gather and each
  gradient back to float32 before the reduce-scatter (FSDP2's ``MixedPrecisionPolicy(
  param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``): the gathers move half the bytes,
  the forward reads the gathered bfloat16 tensor itself (autocast makes no copy of it, so
  under ``FULL_SHARD`` what backward keeps is the shard), and the shards, their gradients and
  the optimizer state stay float32. Every parameter is read in bfloat16, also where autocast
  runs an operation in float32 (a norm's weight, whose float32 copy autocast makes and
  backward keeps), as under FSDP2;
* ``reduce`` divides the reduce-scattered sums by ``W`` (the average, as DDP's), once per
  optimizer step, before the precision's finite check and the clip: the optimizer then updates
  each rank's shard in place. Clipping's global norm is a DTensor reduction over every shard.

A core (tensors in, tensors out, compiled or not) is handed each rank's plain shards:
``wrap_core`` unwraps every DTensor at the core's boundary, and ``bind`` and ``wrap_update`` see
them as DTensors again inside it (``DTensor.from_local``: no copy, no collective), so the
optimizer updates plain tensors in place (``torch.compile`` does not carry out an in-place
update of a DTensor graph input right: AdamW moved twice as far) while the clip's norm and the
gathers stay DTensor operations. Under ``torch.compile`` every parameter is gathered at the
start of the traced forward (units are an eager notion), and Inductor's C++ wrapper, which does
not take the all-gather, is not used.

Launch, the loaders' sharding, the driver's collectives and the metrics' sync are
:class:`~engine.parallel.DDP`'s.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from engine import step as _step
from engine.optim.base import GradientTransformation
from engine.parallel.ddp import DDP
from engine.state import TrainState

__all__ = ["FSDP", "full_state"]

_SHARDING = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
_STATE_DICT_TYPES = ("sharded", "full")


def full_state(state: TrainState) -> TrainState:
    """``state`` with every sharded tensor gathered whole: an ordinary state with the same
    values (a collective: every rank calls it). An unsharded state is returned as it is.

    This is what a ``start_method="spawn"`` run returns to its caller, which has no process
    group to hold shards in; a checkpoint of the full state is ``checkpoint.export``'s."""
    if not state.sharded:
        return state
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor().detach().requires_grad_(t.requires_grad)
        return t

    return state.replace(
        params={k: full(v) for k, v in state.params.items()},
        opt_state=pytree.tree_map(full, state.opt_state),
        grad_accum=None
        if state.grad_accum is None
        else {k: full(v) for k, v in state.grad_accum.items()},
    )


class FSDP(DDP):
    """Fully sharded data parallel (Lightning's ``strategy="fsdp"``), on DTensors.

    The precision decides what the gathers move: under ``"bf16-mixed"`` the shards are cast to
    bfloat16 before each all-gather and the gradients to float32 before each reduce-scatter
    (FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
    the shards, gradients and optimizer state stay float32); under any other precision the
    shards' own dtype. The pipeline tells ``prepare`` (``param_dtype``, what the precision
    declares as :attr:`~engine.transforms.Transform.param_dtype`).

    Args:
        auto_wrap_policy: which submodules are units, each gathered at its own forward and
            freed after it: a set (or list, tuple) of module classes, such as
            ``{nn.TransformerEncoderLayer}``, or a function ``policy(module) -> bool``. The root
            module is always a unit (for the parameters no other unit holds). Default: the root
            alone (every parameter gathered at the start of the forward).
        sharding_strategy: ``"FULL_SHARD"`` (ZeRO-3: parameters freed after each unit's forward
            and gathered again in backward) or ``"SHARD_GRAD_OP"`` (ZeRO-2: kept from forward to
            backward). Lightning's ``"NO_SHARD"`` is :class:`~engine.parallel.DDP`.
        reshard_after_forward: FSDP2's name for the same choice (``True``: ``FULL_SHARD``); when
            given it must agree with ``sharding_strategy`` if that is given too.
        cpu_offload: keep the shards on the CPU (torch's ``CPUOffloadPolicy``); accepted where
            the shards are on the CPU already (a CPU run), refused on an accelerator, where it is
            not built yet.
        state_dict_type: how the Trainer's checkpoints are written: ``"sharded"`` (each rank its
            shards, through ``torch.distributed.checkpoint``) or ``"full"`` (gathered).
        **kwargs: :class:`~engine.parallel.DDP`'s ``environment``, ``backend``, ``timeout``,
            ``start_method``, ``devices``, ``sync_batchnorm``, ``broadcast_buffers``.

    Raises:
        ValueError: an unknown ``sharding_strategy`` or ``state_dict_type``, a
            ``reshard_after_forward`` that contradicts it, or a bad ``auto_wrap_policy``.

    Example:
        >>> FSDP(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward
        False
        >>> FSDP(sharding_strategy="NO_SHARD")
        Traceback (most recent call last):
        ...
        ValueError: FSDP(sharding_strategy='NO_SHARD') shards nothing: use strategy='ddp' ...
    """

    evaluates_in_lockstep = True  # every forward gathers the parameters

    def __init__(
        self,
        *,
        auto_wrap_policy: Iterable[type[nn.Module]] | Callable[[nn.Module], bool] | None = None,
        sharding_strategy: str | None = None,
        reshard_after_forward: bool | None = None,
        cpu_offload: bool = False,
        state_dict_type: str = "sharded",
        **kwargs: Any,
    ) -> None:
        for unused in ("bucket_cap_mb", "find_unused_parameters"):
            if unused in kwargs:
                raise TypeError(f"FSDP({unused}=...) is DDP's option; FSDP has no buckets")
        super().__init__(**kwargs)
        if sharding_strategy is not None and sharding_strategy not in _SHARDING:
            if sharding_strategy == "NO_SHARD":
                raise ValueError(
                    "FSDP(sharding_strategy='NO_SHARD') shards nothing: use strategy='ddp' "
                    "(engine.parallel.DDP)"
                )
            raise ValueError(
                f"FSDP(sharding_strategy={sharding_strategy!r}): pass 'FULL_SHARD' (ZeRO-3) or "
                "'SHARD_GRAD_OP' (ZeRO-2)"
                + (
                    "; hybrid sharding (a mesh of nodes) is not built"
                    if str(sharding_strategy).startswith("HYBRID")
                    else ""
                )
            )
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"FSDP(reshard_after_forward={reshard_after_forward!r}): pass True or False"
            )
        implied = None if sharding_strategy is None else _SHARDING[sharding_strategy]
        if None not in (implied, reshard_after_forward) and implied != reshard_after_forward:
            raise ValueError(
                f"FSDP(sharding_strategy={sharding_strategy!r}, reshard_after_forward="
                f"{reshard_after_forward!r}) contradict each other: pass one of them"
            )
        if reshard_after_forward is None:
            reshard_after_forward = True if implied is None else implied
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ValueError(f"FSDP(state_dict_type={state_dict_type!r}): pass 'sharded' or 'full'")
        if not isinstance(cpu_offload, bool):
            raise TypeError(f"FSDP(cpu_offload={cpu_offload!r}): pass True or False")
        self.auto_wrap_policy = _policy(auto_wrap_policy)
        self.reshard_after_forward = reshard_after_forward
        self.sharding_strategy = "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self._mesh: Any = None
        # what the cores' plain shards are DTensors of (see wrap_core)
        self._specs: dict[_Spec, _Spec] = {}
        self._param_specs: dict[str, _Spec] = {}
        self._opt_specs: list[_Spec | None] = []
        self._loss_scaled = False
        # what the parameters are gathered in (None: the shards' own dtype); see prepare
        self._gather_dtype: torch.dtype | None = None
        # the gathered tensors alive in this step's forward, by storage (see _Saved)
        self._saved = _Saved()

    def __repr__(self) -> str:
        return (
            f"FSDP(world_size={self.world_size}, global_rank={self.global_rank}, "
            f"sharding_strategy={self.sharding_strategy!r}, backend={self._backend()!r})"
        )

    @property
    def mesh(self) -> Any:
        """The one-dimensional device mesh of every rank (built at the first ``prepare``)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device = self.device
            kind = device.type if device is not None else "cpu"
            self._mesh = init_device_mesh(kind, (dist.get_world_size(),))
        return self._mesh

    # ------------------------------------------------------------------ step hooks

    def prepare(
        self,
        state: TrainState,
        tx: GradientTransformation | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> TrainState:
        """``state`` with this rank's shards of its parameters, partial gradient sum and
        optimizer state (rank 0's values: broadcast first); a sharded state as it is.

        ``param_dtype`` (the pipeline's precision declares it: ``"bf16-mixed"``'s bfloat16) is
        the dtype the steps gather the parameters in; their gradients are reduced in the
        shards' own dtype."""
        self._gather_dtype = param_dtype
        if state.sharded:
            return state
        state = super().prepare(state)  # rank 0's bits everywhere (and synced batch norms)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return state
        if self.cpu_offload and any(p.device.type != "cpu" for p in state.params.values()):
            raise ValueError(
                "FSDP(cpu_offload=True) with the state on "
                f"{next(iter(state.params.values())).device}: offloading an accelerator's "
                "shards to the CPU is not built yet; leave cpu_offload off"
            )
        mesh = self.mesh
        params = {
            k: _shard(p, mesh).requires_grad_(p.requires_grad) for k, p in state.params.items()
        }
        opt_state = _shard_optimizer(state, params, tx, mesh)
        grad_accum = (
            None
            if state.grad_accum is None
            else {k: _shard(g, mesh) for k, g in state.grad_accum.items()}
        )
        _step.gathers_in_graph(state.module)
        # a loss scale's finite check sees this rank's shards only: reduce makes any rank's
        # non-finite gradient every rank's, so every rank skips the same steps
        self._loss_scaled = state.precision is not None
        if state.module is not None:
            _release(state.module)
            _Units.install(state.module, self.auto_wrap_policy, self)
        return state.replace(params=params, opt_state=opt_state, grad_accum=grad_accum)

    def checkpoint_state(self, state: TrainState) -> TrainState:
        """``state_dict_type="full"``: the state gathered whole (every rank joins), so rank 0
        writes an ordinary checkpoint; ``"sharded"``: the shards, which every rank writes."""
        return full_state(state) if self.state_dict_type == "full" else state

    def spawned_result(self, out: Any) -> Any:
        """A spawned fit's final state, every shard gathered (every rank joins): the caller has
        no process group to hold shards in, so rank 0's whole state goes back."""
        return full_state(out) if isinstance(out, TrainState) else out

    def bind(self, module: Any, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The parameters the forward reads: under compilation (or for a pure-function model)
        every one gathered here; eagerly the shards, which each unit's forward pre-hook gathers
        into its slots (see the module's docstring)."""
        shards = {k: self._view(k, p) for k, p in params.items()}
        if module is None or torch.compiler.is_compiling():
            return {k: self.gather(p) for k, p in shards.items()}
        return shards

    def gather(self, shard: Tensor) -> Tensor:
        """The full value of ``shard`` (a plain tensor passes), its gradient reduce-scattered
        back to the shard in backward (summed over the ranks).

        Under a precision that declares a ``param_dtype`` (``"bf16-mixed"``) a floating shard
        is cast to it before the all-gather (the gather moves, and the forward reads, bfloat16)
        and the gradient back to the shard's dtype before the reduce-scatter (float32
        reduction, as FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32)``)."""
        from torch.distributed.tensor import DTensor, Partial

        if not isinstance(shard, DTensor):
            return shard
        dtype = _gather_dtype(shard, self._gather_dtype)
        full = _gathered(shard, dtype).to_local(
            grad_placements=[Partial()] * shard.device_mesh.ndim
        )
        if self.reshard_after_forward and not torch.compiler.is_compiling():
            if not full.is_contiguous():
                full = full.contiguous()
            self._saved.add(full, shard)
        return full

    # A core sees plain tensors: each rank's shards, unwrapped at the core's boundary
    # (wrap_core) and seen as DTensors again inside it (bind, wrap_update), without copying.
    # An in-place update of a DTensor that is a compiled graph's input is not carried out
    # right by torch.compile (AdamW moved twice as far), one of a plain input is.

    def _spec(self, t: Any) -> _Spec:
        spec = _Spec(t.device_mesh, tuple(t.placements), t.shape, t.stride())
        cached = self._specs.get(spec)
        if cached is None:
            cached = self._specs[spec] = spec  # one object per spec: no new guard a step
        return cached

    def _view(self, name: str, t: Tensor) -> Tensor:
        spec = self._param_specs.get(name)
        return t if spec is None else spec.view(t)

    def wrap_core(self, core: Callable) -> Callable:
        """``core`` (with DDP's buffer broadcast after an optimizer step) called with every
        DTensor of its arguments as this rank's plain shard, its results wrapped again."""
        from torch.distributed.tensor import DTensor

        core = super().wrap_core(core)

        def on_shards(module: Any, params: Any, buffers: Any, *args: Any) -> Any:
            if not any(isinstance(p, DTensor) for p in params.values()):
                return core(module, params, buffers, *args)
            local: dict[str, Tensor] = {}
            for k, p in params.items():
                if isinstance(p, DTensor):
                    self._param_specs[k] = self._spec(p)
                    local[k] = p.to_local()
                else:
                    local[k] = p
            trees: list[tuple[Any, list[_Spec | None]]] = []
            unwrapped = []
            for arg in args:
                leaves, spec = pytree.tree_flatten(arg)
                if not any(isinstance(x, DTensor) for x in leaves):
                    unwrapped.append(arg)
                    continue
                specs = [self._spec(x) if isinstance(x, DTensor) else None for x in leaves]
                trees.append((spec, specs))
                if not (isinstance(arg, dict) and set(arg) <= set(params)):
                    self._opt_specs = specs  # the optimizer state's: read by wrap_update
                leaves = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
                unwrapped.append(pytree.tree_unflatten(leaves, spec))
            out = core(module, local, buffers, *unwrapped)
            return self._wrapped(out, trees)

        return on_shards

    def _wrapped(self, out: Any, trees: list[tuple[Any, list[_Spec | None]]]) -> Any:
        """A core's results with the shards it returned as DTensors again: a tree shaped as one
        of its arguments (the optimizer state) by that argument's specs, a dict of the
        parameters' names (the partial gradient sum) by the parameters'."""
        if not isinstance(out, tuple):
            return out
        parts = []
        for part in out:
            leaves, spec = pytree.tree_flatten(part)
            specs = next((sp for tree, sp in trees if tree == spec), None)
            if specs is not None:
                leaves = [
                    x if sp is None else sp.view(x) for x, sp in zip(leaves, specs, strict=True)
                ]
                part = pytree.tree_unflatten(leaves, spec)
            elif isinstance(part, dict) and part and set(part) <= set(self._param_specs):
                part = {k: self._view(k, v) for k, v in part.items()}
            parts.append(part)
        return tuple(parts)

    def wrap_update(self, update_fn: Any) -> Any:
        """``update_fn`` on DTensor views of the shards it is given (the clip's global norm
        over every rank, the optimizer on each rank's part, in place), returning plain shards
        and whole metrics (a gradient norm, say)."""
        from torch.distributed.tensor import DTensor

        def update(grads, params, opt_state, precision, step):
            g = {k: self._view(k, v) for k, v in grads.items()}
            p = {k: self._view(k, v) for k, v in params.items()}
            leaves, spec = pytree.tree_flatten(opt_state)
            specs = self._opt_specs
            if len(specs) == len(leaves):
                leaves = [
                    x if sp is None else sp.view(x) for x, sp in zip(leaves, specs, strict=True)
                ]
            opt, precision, metrics = update_fn(
                g, p, pytree.tree_unflatten(leaves, spec), precision, step
            )
            opt = pytree.tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, opt)
            metrics = {
                k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()
            }
            return opt, precision, metrics

        return update

    def wrap_grad(self, grad_fn: Any) -> Any:
        """``grad_fn`` with what autograd saves of a gathered parameter replaced by its shard
        (gathered again when backward reads it): ``reshard_after_forward``'s memory."""
        if not self.reshard_after_forward:
            return grad_fn
        saved = self._saved

        def grad(forward, params, accumulate, precision):
            if torch.compiler.is_compiling():
                return grad_fn(forward, params, accumulate, precision)
            with saved.hooks():
                return grad_fn(forward, params, accumulate, precision)

        return grad

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The average over the ranks of each shard's gradient: the backward's reduce-scatter
        summed them, so this divides by the world size."""
        self._stepped = True  # buffers are broadcast after this step (DDP.wrap_core)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return grads
        names, values = list(grads), list(grads.values())
        torch._foreach_div_(values, float(world))  # the step's own gradients: no copy a step
        if self._loss_scaled:
            values = _agree_finite(values)
        return dict(zip(names, values, strict=True))


# ---------------------------------------------------------------------- sharding


def _gather_dtype(shard: Tensor, wanted: torch.dtype | None) -> torch.dtype | None:
    """The dtype ``shard`` is gathered in: ``wanted`` for a floating shard of another dtype,
    else ``None`` (its own)."""
    if wanted is None or not shard.is_floating_point() or shard.dtype == wanted:
        return None
    return wanted


def _gathered(shard: Any, dtype: torch.dtype | None) -> Any:
    """``shard`` replicated (the all-gather), cast to ``dtype`` before it (``None``: not
    cast); in backward the gradient is cast to the shard's dtype before the reduce-scatter
    (``DTensor.redistribute``'s ``forward_dtype`` / ``backward_dtype``, traced by
    ``torch.compile`` as the rest)."""
    from torch.distributed.tensor import Replicate

    mesh = shard.device_mesh
    return shard.redistribute(
        mesh, [Replicate()] * mesh.ndim, forward_dtype=dtype, backward_dtype=shard.dtype
    )


def _agree_finite(grads: list[Tensor]) -> list[Tensor]:
    """``grads`` unchanged where every rank's are finite, else NaN on every rank: one scalar
    all-reduce (a functional collective under compilation)."""
    ok = torch.stack([torch.isfinite(g).all() for g in grads]).all().to(torch.float32)
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol

        ok = funcol.all_reduce(ok, "min", dist.group.WORLD)  # type: ignore[arg-type]
    else:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    poison = torch.where(ok > 0, 1.0, float("nan")).to(grads[0].dtype)
    return list(torch._foreach_mul(grads, poison))


class _Spec(NamedTuple):
    """What a plain shard is a DTensor of: the mesh, the placements, the global shape and
    stride."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def view(self, local: Tensor) -> Tensor:
        """``local`` seen as the DTensor it is a shard of (no copy, no collective)."""
        from torch.distributed.tensor import DTensor

        if isinstance(local, DTensor):
            return local
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )


def _shard(t: Tensor, mesh: Any) -> Tensor:
    """This rank's part of ``t`` (identical on every rank: rank 0's, broadcast): ``Shard(0)``,
    or replicated for a 0-dim tensor. Sliced locally, no collective."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placement = Shard(0) if t.ndim > 0 else Replicate()
    return distribute_tensor(t.detach(), mesh, [placement], src_data_rank=None)


def _shard_optimizer(
    state: TrainState, params: dict[str, Tensor], tx: GradientTransformation | None, mesh: Any
) -> Any:
    """``state.opt_state`` sharded as ``tx.init`` shards it for the sharded ``params``: each
    leaf the sharded init makes a DTensor is cut from the (full) value the state holds."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    old, spec = pytree.tree_flatten_with_path(state.opt_state)
    if not any(isinstance(v, Tensor) and v.ndim > 0 for _, v in old):
        return state.opt_state
    if tx is None:
        raise ValueError(
            "FSDP.prepare(state) needs the optimizer to shard its state: call "
            "pipeline.prepare(state, tx) with the optimizer the state was made with"
        )
    fresh = dict(pytree.tree_flatten_with_path(tx.init(params))[0])
    out = []
    for path, value in old:
        model = fresh.get(path)
        if isinstance(model, DTensor) and isinstance(value, Tensor):
            if tuple(value.shape) != tuple(model.shape):
                raise ValueError(
                    f"FSDP: the optimizer state's {pytree.keystr(path)} has shape "
                    f"{tuple(value.shape)} where the optimizer makes {tuple(model.shape)}: the "
                    "state was not made by this optimizer"
                )
            value = distribute_tensor(
                value.detach(), mesh, list(model.placements), src_data_rank=None
            )
        out.append(value)
    return pytree.tree_unflatten(out, spec)


def _release(module: nn.Module) -> None:
    """The module's own parameters replaced by meta tensors of the same shapes (tied ones
    still tied): a template under FSDP is never read, and its full weights would be a whole
    unsharded copy on every rank."""
    replaced: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or p.device.type == "meta":
                continue
            if id(p) not in replaced:
                replaced[id(p)] = nn.Parameter(
                    torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                )
            sub._parameters[name] = replaced[id(p)]


def _policy(
    policy: Iterable[type[nn.Module]] | Callable[[nn.Module], bool] | None,
) -> Callable[[nn.Module], bool]:
    if policy is None:
        return lambda module: False
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not classes or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in classes
        ):
            raise ValueError(
                f"FSDP(auto_wrap_policy={policy!r}): pass nn.Module classes, such as "
                "{nn.TransformerEncoderLayer}, or a function module -> bool"
            )
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise ValueError(
        f"FSDP(auto_wrap_policy={policy!r}): pass a set of nn.Module classes or a function "
        "module -> bool"
    )


# ---------------------------------------------------------------------- units


class _Units:
    """The forward hooks that gather each unit's parameters into its slots (and give the
    slots their shards back after the unit's forward), installed once per module."""

    _installed: ClassVar[weakref.WeakKeyDictionary[nn.Module, _Units]] = weakref.WeakKeyDictionary()

    def __init__(self, module: nn.Module, policy: Callable[[nn.Module], bool], owner: FSDP):
        self.owner = owner
        units = [module] + [m for m in module.modules() if m is not module and policy(m)]
        unit_ids = {id(u) for u in units}
        for unit in units:
            own: list[tuple[dict[str, Any], str]] = []
            stack = [unit]
            while stack:
                m = stack.pop()
                own.extend((m._parameters, name) for name in m._parameters)
                stack.extend(c for c in m.children() if id(c) not in unit_ids)
            # the unit's slots travel with its hook (a pickled module, a spawned run's
            # returned state, keeps hooks that still find them)
            unit.register_forward_pre_hook(functools.partial(self._pre, own))
            unit.register_forward_hook(self._post, always_call=True)
        self._held: dict[int, list[list[tuple[dict[str, Any], str, Tensor]]]] = {}

    @classmethod
    def install(cls, module: nn.Module, policy: Callable[[nn.Module], bool], owner: FSDP) -> None:
        units = cls._installed.get(module)
        if units is None:
            cls._installed[module] = cls(module, policy, owner)
        else:
            units.owner = owner

    def _pre(self, own: list[tuple[dict[str, Any], str]], unit: nn.Module, args: Any) -> None:
        from torch.distributed.tensor import DTensor

        held: list[tuple[dict[str, Any], str, Tensor]] = []
        for store, name in own:
            t = store.get(name)
            if isinstance(t, DTensor):
                held.append((store, name, t))
                store[name] = self.owner.gather(t)
        self._held.setdefault(id(unit), []).append(held)

    def _post(self, unit: nn.Module, args: Any, out: Any) -> None:
        stack = self._held.get(id(unit))
        if stack:
            for store, name, shard in stack.pop():
                store[name] = shard


class _Saved:
    """What autograd saves of a gathered parameter, kept as its shard and gathered again when
    backward reads it (``reshard_after_forward``).

    A gathered tensor is known by its storage's address while that storage lives (a weak
    reference to the storage: an address is reused once its storage is freed, and any view of
    a gathered tensor keeps its storage alive, so a live storage at the address is the one
    gathered). The table is emptied when the step's backward ends.
    """

    def __init__(self) -> None:
        self.live: dict[int, tuple[Any, Tensor, int, torch.dtype | None]] = {}
        self.active = False

    def add(self, full: Tensor, shard: Tensor) -> None:
        if self.active:
            storage = full.untyped_storage()
            self.live[storage.data_ptr()] = (
                StorageWeakRef(storage),
                shard,
                int(full.storage_offset()),
                _gather_dtype(shard, full.dtype),  # gathered again as it was (bfloat16)
            )

    def _pack(self, t: Tensor) -> Any:
        try:
            key = t.untyped_storage().data_ptr()
        except Exception:  # a tensor without storage (a subclass): kept as it is
            return t
        entry = self.live.get(key)
        if entry is None or entry[0].expired():
            return t
        _, shard, base, dtype = entry
        return (_Regather, shard, dtype, t.size(), t.stride(), t.storage_offset() - base)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, tuple) and packed and packed[0] is _Regather:
            _, shard, dtype, size, stride, offset = packed
            with torch.no_grad():
                full = _gathered(shard, dtype).to_local().contiguous()
            return full.as_strided(size, stride, offset)
        return packed

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.active = False
            self.live.clear()


class _Regather:
    """The marker of a packed gathered parameter (see :class:`_Saved`)."""
