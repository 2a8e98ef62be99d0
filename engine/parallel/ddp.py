"""Data parallel training on ``torch.distributed``: :class:`DDP`, a :class:`~engine.transforms.
Strategy`.

Every rank holds the whole state and trains on its shard of each batch order. What keeps the
ranks one run:

* ``prepare`` broadcasts rank 0's tensors (parameters, buffers, optimizer and precision state),
  so every rank starts from the same bits whatever each built;
* ``reduce`` averages the gradients of each accumulation window once per optimizer step, in
  buckets of ``bucket_cap_mb`` flattened per dtype and device (one collective per bucket, all in
  flight at once), before the precision's finite check (every rank skips the same steps) and
  before clipping (the clip sees the global gradient, as Lightning's does). Under
  ``torch.compile`` the collective is traced into the graph (functional collectives);
* ``shard`` gives each rank a disjoint part of a loader's ``(seed, epoch)`` order
  (:func:`engine.data.shard_loader`): padded to equal lengths for training, as
  ``DistributedSampler`` pads, unpadded for evaluation so no sample counts twice;
* ``agree`` / ``broadcast`` / ``barrier``: the few collectives the driver makes at the checks it
  already has (stops, signals, directory names);
* ``sync``: the metrics' reductions across ranks (once per epoch);
* ``sync_batchnorm=True``: ``prepare`` replaces the state's module's batch norms by synced ones
  (statistics over every rank's batch) before any step is traced: torch's
  ``nn.SyncBatchNorm`` on CUDA, :class:`engine.parallel.SyncBatchNorm` elsewhere (torch's
  refuses CPU tensors), the parameter and buffer names unchanged;
* ``broadcast_buffers=True`` (the default, as torch's DDP): after each optimizer step rank 0's
  floating buffers (BatchNorm running statistics) are copied to every rank in one flattened
  broadcast (none for a model without buffers), so every rank evaluates, and a checkpoint
  resumes, with the same buffers. ``wrap_core`` does it, outside the compiled core, after the
  core in which ``reduce`` ran (the one that steps the optimizer).

The process group is joined in :meth:`DDP.setup` from a cluster environment
(:mod:`engine.parallel.environments`: torchrun's variables, SLURM's, or the Trainer's own
launcher's).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from engine.errors import CollectiveError
from engine.metrics import distributed_sync
from engine.parallel import _watchdog, elastic, lengths
from engine.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from engine.state import TrainState
from engine.step import _model_view as _step
from engine.transforms.base import Strategy

__all__ = ["DDP"]

_T = TypeVar("_T")


class DDP(Strategy):
    """Data parallel over ``torch.distributed`` (Lightning's ``strategy="ddp"``).

    Args:
        environment: who this process is (``engine.parallel.environments``); default: detected
            from the variables torchrun or SLURM set, else the Trainer's own launch.
        backend: ``"gloo"`` (the default on the CPU) or ``"nccl"`` (on CUDA).
        timeout: how long a collective may wait for the other ranks before it fails (a rank
            that died or hangs): seconds or a ``datetime.timedelta``, default 30 minutes (as
            torch's and Lightning's). It bounds every collective (the process group's), so it
            must exceed the longest legitimate wait: a step, or rank 0 writing a checkpoint
            while the others wait at the next check. When one of engine's own collectives
            (the loop's agreements, barriers, broadcasts, the metrics' reductions, a sharded
            save's exchanges) fails or waits that long, every rank's Python stacks go to
            stderr and a :class:`~engine.errors.CollectiveError` names it and the ranks that
            did not join (``engine.parallel._watchdog``).
        bucket_cap_mb: the size of each flattened gradient bucket (25 MiB, DDP's default).
        find_unused_parameters: accepted for Lightning's flag; every parameter's gradient is
            always reduced (one without a path to the loss has a zero gradient), so nothing has
            to be found.
        start_method: how the Trainer starts the other processes of ``devices=N`` when no
            launcher did: ``"popen"`` (Lightning's ``"ddp"``: the script runs again),
            ``"spawn"`` (``"ddp_spawn"``) or ``"fork"`` (``"ddp_fork"``).
        devices: this node's devices, one per local rank (the Trainer's ``devices``).
        sync_batchnorm: batch norm statistics over every rank's batch (the Trainer's
            ``sync_batchnorm``): ``prepare`` converts the module's batch norms (see the
            module's docstring); without it each rank normalises by its own batch's.
        broadcast_buffers: after each optimizer step, rank 0's floating buffers on every rank
            (torch DDP's ``broadcast_buffers``, whose broadcast is before each forward: the
            same buffers at every optimizer step's forward when there is no accumulation; in
            an accumulation window the other ranks' buffers are their own until its step).
            ``False``: each rank keeps the running statistics of its own batches.

    Example:
        >>> DDP().world_size  # before setup(): read from the environment (one process here)
        1
    """

    #: whether the evaluation steps are collectives (FSDP's forward gathers the parameters),
    #: so that every rank must run as many evaluation batches: its evaluation shards are then
    #: padded (as training's), unless the loader drops its last partial batch
    evaluates_in_lockstep: bool = False

    def __init__(
        self,
        *,
        environment: Any = None,
        backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        start_method: str = "popen",
        devices: Sequence[str | torch.device] | None = None,
        sync_batchnorm: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        if backend is not None and backend not in ("gloo", "nccl", "mpi", "ucc"):
            raise ValueError(
                f"DDP(backend={backend!r}): pass 'gloo' (CPU) or 'nccl' (CUDA), or leave it out"
            )
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"DDP(bucket_cap_mb={bucket_cap_mb!r}): pass a size in MiB > 0")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"DDP(start_method={start_method!r}): pass 'popen', 'spawn', 'fork' or 'forkserver'"
            )
        owner = type(self).__name__
        self.environment = environment
        self.backend = backend
        #: how long a collective waits for the other ranks (see the class's ``timeout``)
        self.timeout: datetime.timedelta = _watchdog.check_timeout(owner, timeout)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.start_method = start_method
        #: this node's devices, one per local rank (``None``: wherever the state is)
        self.devices = None if devices is None else tuple(torch.device(d) for d in devices)
        self.sync_batchnorm = bool(sync_batchnorm)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._joined = False
        # the loaders shard() took since agree_loaders() last ran, measured before sharding
        self._measured: list[lengths.Length] = []
        self._measured_ids: dict[int, lengths.Length] = {}
        # set by reduce (which runs once per optimizer step, inside the update core) and read
        # by the wrap_core wrapper around it: a store only, so a compiled core is not guarded
        # on it
        self._stepped = False

    # ------------------------------------------------------------------ who this process is

    def _env(self, name: str, default: int) -> int:
        env = self.environment
        if env is not None:
            return int(getattr(env, name)())
        if dist.is_available() and dist.is_initialized():
            if name == "world_size":
                return dist.get_world_size()
            if name == "global_rank":
                return dist.get_rank()
        key = {
            "world_size": "WORLD_SIZE",
            "global_rank": "RANK",
            "local_rank": "LOCAL_RANK",
            "node_rank": "GROUP_RANK",
        }[name]
        return int(os.environ.get(key, default))

    @property
    def world_size(self) -> int:
        return self._env("world_size", 1)

    @property
    def global_rank(self) -> int:
        return self._env("global_rank", 0)

    @property
    def local_rank(self) -> int:
        return self._env("local_rank", 0)

    @property
    def node_rank(self) -> int:
        return self._env("node_rank", 0)

    @property
    def device(self) -> torch.device | None:
        """This process's device: its local rank's among ``devices``."""
        if not self.devices:
            return None
        return self.devices[self.local_rank % len(self.devices)]

    @property
    def root_device(self) -> torch.device | None:
        return self.device

    @property
    def launcher(self) -> Any:
        """What starts the other processes of a ``devices=N`` run that no launcher started
        (``None`` under torchrun or SLURM, in a process already launched, or for one
        process): :class:`~engine.parallel.launch.ScriptLauncher` for ``"popen"`` (the script
        runs again), :class:`~engine.parallel.launch.SpawnLauncher` for ``"spawn"`` /
        ``"fork"``."""
        from engine.parallel.environments import LAUNCHED_BY_VAR, LocalEnvironment

        env = self.environment
        if not isinstance(env, LocalEnvironment) or env.world_size() == 1:
            return None
        if LAUNCHED_BY_VAR in os.environ:  # a process a launcher started: it only joins
            return None
        from engine.parallel.launch import ScriptLauncher, SpawnLauncher

        if self.start_method == "popen":
            # also for the script's later calls in the launching process: the launcher starts
            # no more processes, and watches the ones it started (a dead one is reported)
            return ScriptLauncher(env.devices, env.num_nodes, env)
        if env.creates_processes_externally:
            return None
        if env.num_nodes > 1:
            raise ValueError(
                f"DDP(start_method={self.start_method!r}) starts the processes of one node; for "
                f"num_nodes={env.num_nodes} use strategy='ddp' (the script runs on each node) "
                "or torchrun"
            )
        return SpawnLauncher(env.devices, start_method=self.start_method)

    def __repr__(self) -> str:
        return (
            f"DDP(world_size={self.world_size}, global_rank={self.global_rank}, "
            f"backend={self._backend()!r})"
        )

    def _backend(self) -> str:
        if self.backend is not None:
            return self.backend
        return "nccl" if self.device is not None and self.device.type == "cuda" else "gloo"

    def _collective_device(self) -> torch.device:
        """Where the small tensors of ``agree`` live (NCCL takes only CUDA tensors)."""
        if self._backend() == "nccl":
            return self.device or torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ the process group

    def setup(self) -> None:
        """Join the process group this process's environment describes (once: a group already
        initialised, by this strategy or by the user, is used as it is)."""
        if not dist.is_available():
            raise RuntimeError(
                "DDP needs torch.distributed, which this build of torch does not have"
            )
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
            if self.environment is not None and (
                world != self.environment.world_size() or rank != self.environment.global_rank()
            ):
                raise RuntimeError(
                    f"DDP: the process group already initialised has world size {world} and "
                    f"this process is its rank {rank}, but the environment says world size "
                    f"{self.environment.world_size()}, rank {self.environment.global_rank()}"
                )
            self._joined = True
            _watchdog.start(self.timeout)  # its own timeout bounds the waits; we watch them
            return
        env = self.environment
        kwargs: dict[str, Any] = {"timeout": self.timeout}
        if env is not None:
            kwargs.update(
                init_method=f"tcp://{_host(env.main_address)}:{int(env.main_port)}",
                world_size=env.world_size(),
                rank=env.global_rank(),
            )
        else:
            kwargs["init_method"] = "env://"
        start, where = time.monotonic(), kwargs["init_method"]
        try:
            if elastic.shared_store():  # torchrun's store: keys of this attempt's own
                with _attempt_store(kwargs, self.timeout) as (kwargs, where):
                    dist.init_process_group(self._backend(), **kwargs)
            else:
                dist.init_process_group(self._backend(), **kwargs)
        except dist.DistError as e:  # the rendezvous's store: refused, or timed out
            raise self._rendezvous_failed(where, time.monotonic() - start, e) from e
        atexit.register(_destroy)
        self._joined = True
        _watchdog.start(self.timeout)

    def _rendezvous_failed(
        self, where: str, waited: float, cause: BaseException
    ) -> CollectiveError:
        """The error of a rendezvous that did not complete within the timeout: who waited
        for whom, where."""
        if where == "env://":
            where = f"tcp://{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        rank, world = self.global_rank, self.world_size
        who = (
            "the other ranks did not all join"
            if rank == 0
            else "rank 0, which holds the rendezvous, did not answer"
        )
        first = (str(cause).strip().splitlines() or [""])[0]
        return CollectiveError(
            f"joining the process group at {where} failed on rank {rank} of {world} after "
            f"{waited:.1f} s (timeout {self.timeout.total_seconds():g} s): {who} (dead, not "
            f"started yet, or given another address, port or world size); cause: "
            f"{type(cause).__name__}: {first[:300]}. Every rank must start and reach the "
            "Trainer's call within the timeout (DDP(timeout=...))"
        )

    def teardown(self) -> None:
        """Kept joined: a process's later ``validate`` / ``test`` runs reuse the group; it is
        destroyed when the process exits."""

    # ------------------------------------------------------------------ step hooks

    def prepare(self, state: TrainState) -> TrainState:
        """Rank 0's tensors on every rank: parameters, buffers, optimizer and precision state
        (broadcast in place, in flattened buckets), so every rank starts from the same bits;
        with ``sync_batchnorm``, the module's batch norms replaced by synced ones first."""
        if self.sync_batchnorm:
            state = _with_sync_batchnorm(state)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return state
        state.check_alive("DDP.prepare()")
        tensors = [
            t
            for t in torch.utils._pytree.tree_leaves(
                (state.params, state.buffers, state.opt_state, state.precision, state.grad_accum)
            )
            if isinstance(t, Tensor)
        ]
        with torch.no_grad(), _watchdog.guard("the broadcast of rank 0's state (prepare)"):
            carrier = _host_carrier()
            for bucket in _buckets(tensors, self.bucket_cap_mb):
                flat = _flatten_dense_tensors(bucket)
                if carrier is not None and flat.is_cpu:  # the optimizer's host step counters
                    flat = flat.to(carrier)
                dist.broadcast(flat, src=0)
                for t, v in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    t.copy_(v)
        return state

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The average of ``grads`` over the ranks: one all-reduce per bucket, every bucket in
        flight before the first is waited for."""
        self._stepped = True  # the core running this steps the optimizer: see wrap_core
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return grads
        names, tensors = list(grads), list(grads.values())
        buckets = _buckets(tensors, self.bucket_cap_mb)
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol

            out: list[Tensor] = []
            for bucket in buckets:
                flat = funcol.all_reduce(
                    torch.cat([g.reshape(-1) for g in bucket]),
                    "sum",
                    dist.group.WORLD,  # type: ignore[arg-type]
                )
                flat = flat / world
                offset = 0
                for g in bucket:
                    out.append(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            return _in_order(names, tensors, buckets, out)
        flats, works = [], []
        for bucket in buckets:
            flat = _flatten_dense_tensors(bucket)
            works.append(dist.all_reduce(flat, async_op=True))
            flats.append(flat)
        reduced: list[Tensor] = []
        for bucket, flat, work in zip(buckets, flats, works, strict=True):
            work.wait()
            flat.div_(world)
            reduced.extend(_unflatten_dense_tensors(flat, bucket))
        return _in_order(names, tensors, buckets, reduced)

    def wrap_core(self, core: Callable) -> Callable:
        """``core`` followed, when it stepped the optimizer (``reduce`` ran in it), by rank 0's
        floating buffers broadcast to every rank (``broadcast_buffers``). This wraps the
        compiled core (the strategy comes before compilation in the one order), so the
        broadcast is eager, outside the graph; evaluation and accumulation cores pass through."""
        if not self.broadcast_buffers:
            return core

        def then_buffers(module: Any, params: Any, buffers: Any, *args: Any) -> Any:
            self._stepped = False
            out = core(module, params, buffers, *args)
            if self._stepped:
                self._stepped = False
                _broadcast_buffers(module, buffers)
            return out

        return then_buffers

    # ------------------------------------------------------------------ the driver's collectives

    def shard(self, loader: Any, stage: str) -> Any:
        """This rank's shard of ``loader`` (in place), its whole lengths measured first for
        :meth:`agree_loaders`."""
        world = self.world_size
        if world == 1:
            return loader
        from engine import data

        self._measure(loader, stage)
        # Lightning's use_distributed_sampler: DistributedSampler(shuffle=True) for training
        # and DistributedSampler(shuffle=False) for evaluation, both padded by repeating the
        # order's first samples; prediction unpadded (its UnrepeatedDistributedSampler),
        # except where every rank must run as many batches (a sharded model's forward)
        pad = stage != "predict" or (
            self.evaluates_in_lockstep and not getattr(loader, "drop_last", False)
        )
        sharded = data.shard_loader(
            loader, self.global_rank, world, pad=pad, shuffle=stage == "train"
        )
        if sharded and pad and stage != "train":
            # what the padding repeats: samples, or whole batches of a custom batch sampler
            m = self._measured[-1]
            n, unit = (
                (m.samples, "sample")
                if getattr(loader, "batch_size", None) is not None
                else (m.batches, "batch")
            )
            k = -(n or 0) % world
            said = f"{k} {unit}{'es' if unit == 'batch' else 's'}" if k > 1 else f"{k} {unit}"
            self._measured[-1] = m._replace(repeated=said if k else "")
        if not sharded and not _already_sharded(loader):
            warnings.warn(
                f"DDP: the {stage} loader {type(loader).__name__} cannot be sharded (an "
                "iterable dataset, batch_size=None, or not a DataLoader): every rank reads "
                "all of it. Give it a map-style dataset with a batch_size, or shard it "
                "yourself by rank (trainer.global_rank, trainer.world_size)",
                stacklevel=3,
            )
        return loader

    def _measure(self, loader: Any, stage: str) -> None:
        index = sum(1 for x in self._measured if x.stage == stage)
        # a loader given for two stages is measured once, before either shard
        first = self._measured_ids.get(id(loader))
        length = (
            lengths.measure(loader, stage, index)
            if first is None
            else first._replace(stage=stage, idx=index)
        )
        self._measured_ids.setdefault(id(loader), length)
        self._measured.append(length)

    def agree_loaders(self) -> None:
        """Every rank's measures of the loaders :meth:`shard` took since the last call,
        gathered in one collective (``all_gather_object``; on every rank, even one that took
        none); a ``ValueError`` on every rank, naming each loader and each rank's lengths,
        when they differ (:mod:`engine.parallel.lengths`)."""
        mine, self._measured, self._measured_ids = self._measured, [], {}
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        message = lengths.disagreement(gathered)
        if message is not None:
            raise ValueError(f"{type(self).__name__}: {message}")
        message = lengths.repeated(gathered, dist.get_world_size())
        if message is not None and dist.get_rank() == 0:
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=3)

    def agree(self, flags: Sequence[bool | int]) -> tuple[bool | int, ...]:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return tuple(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        t = t.to(self._collective_device())
        with _watchdog.guard("the agreement on stopping (a check of the loop)"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            agreed = t.tolist()
        return tuple(
            bool(v) if isinstance(f, bool) else int(v) for f, v in zip(flags, agreed, strict=True)
        )

    def broadcast(self, obj: _T) -> _T:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        box = [obj]
        with _watchdog.guard("a broadcast of rank 0's value"):
            dist.broadcast_object_list(box, src=0, device=self._collective_device())
        return box[0]

    def barrier(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        with _watchdog.guard("a barrier (every rank waits for the others)"):
            if self._backend() == "nccl":
                dist.barrier(device_ids=[self._collective_device().index or 0])
            else:
                dist.barrier()

    @property
    def sync(self) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return _WatchedSync(distributed_sync())


class _WatchedSync:
    """The metrics' sync (:func:`engine.metrics.distributed_sync`) with each exchange under the
    watchdog: a rank that never joins is named instead of hanging the others."""

    def __init__(self, sync: Any) -> None:
        self._sync = sync
        self.world_size, self.rank = sync.world_size, sync.rank

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        with _watchdog.guard("the metrics' reduction over the ranks"):
            return self._sync.all_reduce(tensor, op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        with _watchdog.guard("the metrics' exchange of names over the ranks"):
            return self._sync.all_gather_object(obj)

    def __repr__(self) -> str:
        return repr(self._sync)


def _with_sync_batchnorm(state: TrainState) -> TrainState:
    """``state`` with its module's batch norms synced: torch's ``nn.SyncBatchNorm`` where the
    state is on CUDA, ours elsewhere; the same tensors under the same names."""
    module = state.module
    if module is None or not any(
        isinstance(m, _BatchNorm) and not isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm))
        for m in module.modules()
    ):
        return state
    tensors = (*state.params.values(), *state.buffers.values())
    if any(t.device.type == "cuda" for t in tensors):
        new = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    else:
        new = convert_sync_batchnorm(module)
    # the binder found the old layers' slots: the next call finds the new ones
    _step._binders.pop(module, None)
    return state if new is module else state.replace(module=new)


_buffer_names: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def _broadcast_buffers(module: nn.Module | None, buffers: dict[str, Tensor]) -> None:
    """Rank 0's floating buffers (the module's own: not the frozen parameters that travel
    with them) copied into ``buffers`` on every rank, flattened: one broadcast per dtype and
    device, none without such buffers."""
    if not buffers or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names = None
    if module is not None:
        names = _buffer_names.get(module)
        if names is None:
            names = _buffer_names[module] = frozenset(k for k, _ in module.named_buffers())
    tensors = [
        t
        for k, t in buffers.items()
        if (names is None or k in names) and isinstance(t, Tensor) and t.is_floating_point()
    ]
    if not tensors:
        return
    receive = dist.get_rank() != 0
    with torch.no_grad():
        for bucket in _buckets(tensors, float(2**40)):  # no size cap: one per dtype and device
            flat = _flatten_dense_tensors(bucket)
            dist.broadcast(flat, src=0)
            if receive:
                for t, v in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    t.copy_(v)


@contextlib.contextmanager
def _attempt_store(
    kwargs: dict[str, Any], timeout: datetime.timedelta
) -> Iterator[tuple[dict[str, Any], str]]:
    """``init_process_group``'s arguments with a store of this attempt's own: a client of
    torchrun's shared store under the prefix ``engine/attempt_<n>/``, ``n`` the attempt the
    ranks agree on (:func:`engine.parallel.elastic.agree`, the same on every node). torch
    joins every attempt's workers through the same keys of the shared store, so a restarted
    rank can read the previous attempt's gloo addresses or NCCL id and connect to a dead peer
    (pytorch/pytorch#135712: ``Gloo connectFullMesh failed ... Connection refused``, or a hang
    until the timeout). The join happens inside the ``with`` block (rank 0 answers the others
    until it ends)."""
    kwargs = dict(kwargs)
    where = kwargs.pop("init_method")
    if where == "env://":
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        kwargs.update(world_size=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]))
    else:
        host, _, port_text = where[len("tcp://") :].rpartition(":")
        host, port = host.strip("[]"), int(port_text)

    def connect() -> Any:
        return dist.TCPStore(host, port, kwargs["world_size"], is_master=False, timeout=timeout)

    with elastic.agree(connect, kwargs["rank"], kwargs["world_size"], timeout) as attempt:
        where = f"tcp://{_host(host)}:{port} (torchrun's shared store, attempt {attempt})"
        store = dist.PrefixStore(f"engine/attempt_{attempt}/", connect())
        yield {**kwargs, "store": store}, where


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _destroy() -> None:
    _watchdog.stop()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # at exit, a peer may be gone already
            dist.destroy_process_group()


def _already_sharded(loader: Any) -> bool:
    sampler = getattr(loader, "sampler", None)
    bs = getattr(loader, "batch_sampler", None)
    return isinstance(sampler, torch.utils.data.DistributedSampler) or isinstance(
        getattr(bs, "sampler", None), torch.utils.data.DistributedSampler
    )


def _host_carrier() -> torch.device | None:
    """The device that carries CPU tensors for a backend that cannot (NCCL: this rank's GPU);
    ``None`` when the backend takes them as they are (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _buckets(tensors: Sequence[Tensor], cap_mb: float) -> list[list[Tensor]]:
    """``tensors`` cut into buckets of one dtype and device, each up to ``cap_mb`` MiB (a tensor
    larger than that is a bucket of its own); the order within a kind is kept."""
    cap = int(cap_mb * 2**20)
    kinds: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        buckets = kinds.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and sizes.get(key, 0) + nbytes > cap:
            buckets.append([])
            sizes[key] = 0
        buckets[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [b for bs in kinds.values() for b in bs if b]


def _in_order(
    names: list[str], tensors: list[Tensor], buckets: list[list[Tensor]], reduced: list[Tensor]
) -> dict[str, Tensor]:
    """``reduced`` (in bucket order) by name, in the order of ``names``."""
    index = {id(t): n for n, t in zip(names, tensors, strict=True)}
    by_name = {
        index[id(t)]: r for t, r in zip((t for b in buckets for t in b), reduced, strict=True)
    }
    return {n: by_name[n] for n in names}
