"""Sharded checkpoints (private): a TrainState whose tensors are DTensors, written by every rank
through ``torch.distributed.checkpoint`` (DCP) with the guarantees of ``engine.checkpoint``.

The layout (format version 6)::

    step=000120/
        meta.json          as for a full checkpoint, with "layout": "sharded", "world_size",
                           each tensor's global shape, dtype and placement ("tensors"), and a
                           checksum and size for every file under shards/
        shards/.metadata   DCP's index of the shards (which chunk of which tensor is where)
        shards/__0_0.distcp, __1_0.distcp, ...   each rank's shards (DCP's files)

A save is a collective: every rank flattens the state as ``tensors.pt`` would hold it (the same
keys: ``params/<name>``, ``opt_state/<path>``, ...), the ranks agree that they can, rank 0
claims a temporary directory beside the target and broadcasts its name, every rank writes its
shards there (``dcp.save``: files fsynced), the ranks agree that they all did, and rank 0
hashes the files, writes ``meta.json`` last, fsyncs and renames the directory into place, then
tells every rank how that ended. A failure on any rank fails the save on every rank; a rank
killed at any moment leaves no name behind (its peers' collectives fail, rank 0 removes the
temporary directory, or :func:`engine.checkpoint.clean_leftovers` does once rank 0 is gone).

Loading needs no process group: every file's checksum is verified first, DCP's ``.metadata``
is read by an unpickler that builds DCP's metadata classes and nothing else (no code runs from
a file), and ``dcp.load(no_dist=True)`` reads into the template's tensors: DTensors (on any
world size and mesh: DCP reads the chunks each rank's shard overlaps) or plain full tensors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from engine.checkpoint._checksum import _checksum, _start_checksum
from engine.checkpoint._files import (
    META,
    _Claim,
    _describe,
    _flatten,
    _fsync_dir,
    _publish,
    _replaceable,
    _short,
    _write_failed,
)
from engine.checkpoint._meta import (
    SHARDED,
    SHARDED_FORMAT_VERSION,
    SHARDS,
    encode,
    not_plain,
    shard_name,
)
from engine.errors import CheckpointError
from engine.optim.base import state_dict as opt_state_dict
from engine.parallel import _dcp_index, _watchdog
from engine.state import TrainState

__all__: list[str] = []

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # a full disk (or quota)


# --------------------------------------------------------------------------- saving


def _describe_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Any]:
    """Each tensor's global shape, dtype and placements (``None``: a plain tensor, the same on
    every rank)."""
    out = {}
    for key, t in tensors.items():
        placements = [repr(p) for p in t.placements] if isinstance(t, DTensor) else None
        out[key] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "placements": placements,
        }
    return out


def _agree(error: BaseException | None, target: Path, stage: str, group: Any = None) -> None:
    """Every rank's outcome of ``stage``, exchanged (a collective): raise on every rank if it
    failed on any, naming the ranks and their errors: a full disk on any rank first (called
    one on every rank, naming the rank), then this rank's own error."""
    world = dist.get_world_size()
    told: list[Any] = [None] * world
    mine = None if error is None else _dcp_index.one_line(error)  # never a nested traceback
    # an OSError's errno travels with it: a full disk is called one on every rank
    number = error.errno if isinstance(error, OSError) else None
    _exchange(dist.all_gather_object, target, stage, told, (mine, number), group=group)
    failed = [(r, m, n) for r, (m, n) in enumerate(told) if m is not None]
    full = next(((r, n) for r, _, n in failed if n in _FULL), None)
    if isinstance(error, (CheckpointError, KeyboardInterrupt, SystemExit)):
        raise error  # an interrupt passes through, once every rank knows the save failed
    if full is not None:  # a full disk on any rank is called one on every rank
        rank, number = full
        cause = (
            error
            if rank == dist.get_rank() and isinstance(error, OSError)
            else OSError(number, os.strerror(number))
        )
        what = {
            "writing its shards": f"rank {rank}'s shards",
            "creating its temporary directory": f"the temporary directory (rank {rank})",
        }.get(stage, "")
        raise _write_failed(target, cause, what, (target / META).is_file()) from error
    if error is not None:
        raise CheckpointError(
            f"the sharded save of {target} failed on rank {dist.get_rank()} {stage}: {mine}; "
            "nothing was written under its name"
        ) from error
    if failed:
        said = "; ".join(f"rank {r}: {m}" for r, m, _ in failed)
        raise CheckpointError(
            f"the sharded save of {target} failed {stage} on another rank ({said}); every "
            "rank stops the save and nothing was written under its name"
        )


def _exchange(collective: Any, target: Path, stage: str, *args: Any, **kwargs: Any) -> None:
    """``collective(*args, **kwargs)``; a rank that died or left (its connection closed) fails
    the save here, with a ``CheckpointError``, instead of a backend's ``RuntimeError``."""
    try:
        with _watchdog.guard(f"the sharded save's exchange {stage} ({target})"):
            collective(*args, **kwargs)
    except Exception as e:
        raise CheckpointError(
            f"the sharded save of {target} failed {stage}: another rank stopped answering "
            f"(it died or left the save: {type(e).__name__}: {e}); nothing was written under "
            "its name. A rank that died ends the run (its own output says why); if none did, "
            "every rank must call checkpoint.save with the same path"
        ) from e


def _require_group(target: Path) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            f"checkpoint.save({str(target)!r}): the state is sharded (DTensors) but no process "
            "group is initialized; a sharded state is saved by every rank of its process group "
            "together. Save from inside the run (every rank calls checkpoint.save)"
        )


def _prepare(
    state: TrainState,
    target: Path,
    *,
    metrics: Mapping[str, float] | None,
    extra: Mapping[str, Any] | None,
    fingerprint: bool,
    weights_only: bool,
    rank_grad_accum: Sequence[Mapping[str, Tensor]],
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors to write and ``meta.json``'s values (rank 0's), every rank agreeing that it
    can save to one path; the fingerprint of the full values when asked (a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem: BaseException | None = None
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {}
    try:
        if rank_grad_accum:
            raise CheckpointError(
                "rank_grad_accum= is for a replicated (data-parallel) state; a sharded state's "
                "accumulated gradients are DTensors, saved as its grad_accum"
            )
        _replaceable(target)  # every rank: a refusal is agreed on below
        tensors, scalars = _flatten(state, weights_only)
        if rank == 0:
            meta = _describe(state, scalars, metrics, extra, False, weights_only)
    except BaseException as e:
        problem = e
    _agree(problem, target, "before writing")
    paths: list[Any] = [None] * world  # one checkpoint: every rank must name the same path
    _exchange(dist.all_gather_object, target, "before writing", paths, os.path.abspath(target))
    if len(set(paths)) > 1:
        raise CheckpointError(
            f"checkpoint.save of a sharded state: the ranks name different paths "
            f"({', '.join(f'rank {r}: {p}' for r, p in enumerate(paths))}); every rank writes "
            "its shards into one checkpoint: call checkpoint.save with the same path on every "
            "rank"
        )
    if fingerprint and not weights_only:  # of the full values: a collective, every rank
        found: list[str] = []
        _exchange(lambda: found.append(state.fingerprint()), target, "fingerprinting")
        meta["fingerprint"] = found[0]
    meta.update(
        format_version=SHARDED_FORMAT_VERSION,
        layout=SHARDED,
        world_size=world,
        tensors=_describe_tensors(tensors),
        # the accumulated gradients are DTensors: every rank's share of the window is in them
        grad_accum_ranks=0 if weights_only or state.grad_accum is None else world,
    )
    return tensors, meta


def save(state: TrainState, target: Path, **kwargs: Any) -> Path:
    """:func:`engine.checkpoint.save` of a sharded state: a collective (see the module)."""
    _require_group(target)
    tensors, meta = _prepare(state, target, **kwargs)
    return _write(tensors, meta, target, None)


_SIDE: list[Any] = []  # [the default process group, the checkpoints' own gloo group over it]


def _side_group() -> Any:
    """A process group of the checkpoints' own (gloo, every rank), made at the first
    asynchronous save (a collective: every rank makes that save), so that the background
    writes' collectives never interleave with the training's on the default group."""
    world = dist.distributed_c10d._get_default_group()
    if not _SIDE or _SIDE[0] is not world:
        _SIDE[:] = [world, dist.new_group(backend="gloo", timeout=_watchdog.timeout())]
    return _SIDE[1]


def _snapshot(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A copy of this rank's part of every tensor (a DTensor stays one, of the same mesh and
    placements), for the background write: training may update the live ones meanwhile."""
    out: dict[str, Tensor] = {}
    for k, t in tensors.items():
        if isinstance(t, DTensor):
            out[k] = DTensor.from_local(
                t.to_local().detach().clone(),
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        else:
            out[k] = t.detach().clone()
    return out


def save_async(state: TrainState, target: Path, **kwargs: Any) -> Future[Path]:
    """:func:`engine.checkpoint.save_async` of a sharded state: the agreement, the
    fingerprint (when asked) and a copy of this rank's shards now; DCP's write, the checksums
    and the rename on the writer thread, their collectives on a gloo group of their own."""
    from engine.checkpoint._checksum import _WRITER

    _require_group(target)
    group = _side_group()
    tensors, meta = _prepare(state, target, **kwargs)
    return _WRITER.get().submit(_write, _snapshot(tensors), meta, target, group)


def _write(tensors: dict[str, Tensor], meta: dict[str, Any], target: Path, group: Any) -> Path:
    """Every rank's shards into rank 0's temporary directory, then rank 0's ``meta.json`` and
    rename; the collectives on ``group`` (``None``: the default group)."""
    import torch.distributed.checkpoint as dcp

    from engine.parallel import _dcp_faults

    rank = dist.get_rank()
    claim = None
    tmp: Path | None = None
    try:
        problem, name = None, None
        if rank == 0:
            try:
                claim = _Claim(target.parent).__enter__()
                tmp = claim.path("")
                (tmp / SHARDS).mkdir(parents=True)
                name = os.fspath(tmp)
            except BaseException as e:
                problem = e
        names: list[Any] = [name]
        stage = "creating its temporary directory"
        _exchange(dist.broadcast_object_list, target, stage, names, group=group)
        _agree(problem, target, stage, group)
        shards = Path(names[0]) / SHARDS
        problem = None
        noticed = None
        try:
            writer = dcp.FileSystemWriter(shards, sync_files=True, overwrite=False)
            # DCP's own call, not _dcp_index.dcp_call: _dcp_faults reads every rank's
            # failure from its CheckpointException, and _agree says it in one line
            noticed = _dcp_faults.noticing(writer)  # the OSError behind torch.save's own
            dcp.save(tensors, storage_writer=writer, process_group=group)
        except BaseException as e:
            noted = noticed.error if noticed is not None else None
            problem = _dcp_faults.cause(e, noted, dist.get_rank(group))
        _agree(problem, target, "writing its shards", group)
        outcome: list[Any] = [None]
        if rank == 0:
            assert tmp is not None and claim is not None
            try:
                _commit(meta, tmp, target, claim)
            except BaseException as e:
                failed = _failed(target, e)
                outcome = [str(failed)]  # a full disk is called one on every rank
                with contextlib.suppress(Exception):  # a peer gone meanwhile: this error first
                    dist.broadcast_object_list(outcome, src=0, group=group)
                raise failed from e
            # the checkpoint is in place: a peer gone by now does not undo it
            with contextlib.suppress(Exception):
                dist.broadcast_object_list(outcome, src=0, group=group)
        else:
            stage = "renaming it into place"
            _exchange(dist.broadcast_object_list, target, stage, outcome, group=group)
            if outcome[0] is not None:
                raise CheckpointError(f"rank 0 failed the sharded save: {outcome[0]}")
        return target
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if it was renamed
        if claim is not None:
            claim.__exit__(None, None, None)


def _failed(target: Path, e: BaseException) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, OSError):
        return _write_failed(target, e, META, (target / META).is_file())
    return CheckpointError(f"the sharded save of {target} failed on rank 0: {e}")


def _commit(meta: dict[str, Any], tmp: Path, target: Path, claim: Any) -> None:
    """Rank 0: hash the shards, write ``meta.json`` last, make it durable, rename it into
    place."""
    shards = tmp / SHARDS
    _fsync_dir(shards)
    names = sorted(p.name for p in shards.iterdir())
    files, sizes = {}, {}
    for n in names:
        files[f"{SHARDS}/{n}"] = _checksum(shards / n)
        sizes[f"{SHARDS}/{n}"] = os.path.getsize(shards / n)
    with open(tmp / META, "wb") as out:
        out.write(encode({**meta, "files": files, "sizes": sizes}))
        out.flush()
        os.fsync(out.fileno())
    _fsync_dir(tmp)
    _publish(claim, tmp, target)


# --------------------------------------------------------------------------- loading


def verify(root: Path, meta: Mapping[str, Any]) -> Any:
    """Check every file of the sharded checkpoint at ``root``: a name under ``shards/``, a
    regular file of the size recorded, its checksum; then DCP's index, read safely and checked
    against ``meta.json`` (engine/_dcp_index.py). Returns that index: the loaders hand it to
    DCP, which reads no other."""
    files = dict(meta["files"])
    sizes = meta.get("sizes") or {}
    inside = os.path.realpath(root / SHARDS)
    if os.path.islink(root / SHARDS) or inside != os.path.join(os.path.realpath(root), SHARDS):
        raise CheckpointError(
            f"{root / SHARDS}: a symbolic link to {inside}, outside the checkpoint directory; a "
            "checkpoint reads only files of its own: refused"
        )
    for name in files:
        if not shard_name(name):
            raise CheckpointError(not_plain(root / META, name))
        file = root / name
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)") from None
        except OSError as e:
            raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from e
        if stat.S_ISLNK(st.st_mode) or os.path.dirname(os.path.realpath(file)) != inside:
            raise CheckpointError(
                f"{file}: a symbolic link or outside {root / SHARDS}; a checkpoint reads only "
                "files of its own: refused"
            )
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{file}: not a regular file; the checkpoint is damaged")
        if name in sizes and st.st_size != sizes[name]:
            raise CheckpointError(
                f"{file}: {st.st_size} bytes, where meta.json records {sizes[name]}; the file is "
                "truncated, damaged or was replaced (refused before reading it)"
            )
    extra = sorted(p.name for p in (root / SHARDS).iterdir() if f"{SHARDS}/{p.name}" not in files)
    if extra:
        raise CheckpointError(
            f"{root / SHARDS}: holds files meta.json does not name ({extra}); the checkpoint "
            "was edited: refused"
        )
    # the index first (its checksum, then its entries against meta.json): a shard is read
    # (hashed, then loaded) only once the index is known to point into the checkpoint alone
    index_name = f"{SHARDS}/{_dcp_index.INDEX}"
    _checksums(root, {index_name: files[index_name]})
    index = _dcp_index.checked(root, meta)
    _checksums(root, {n: d for n, d in files.items() if n != index_name})
    return index


def _checksums(root: Path, files: Mapping[str, str]) -> None:
    """Each file's checksum against the one recorded (hashed in parallel)."""
    try:
        digests = {name: _start_checksum(root / name, d) for name, d in files.items()}
        for name, expected in files.items():
            actual = digests[name]()
            if actual != expected:
                raise CheckpointError(
                    f"{root / name}: checksum check failed ({expected.rpartition(':')[0]} "
                    f"expected {_short(expected)}..., got {_short(actual)}...); the "
                    "file is truncated or damaged"
                )
    except OSError as e:
        raise CheckpointError(f"{e.filename or root}: cannot be read ({e.strerror or e})") from e


def _reader(root: Path, index: Any) -> Any:
    """DCP's file reader of ``root``'s shards, handed ``index`` (checked by
    :func:`engine._dcp_index.checked`) instead of reading ``.metadata`` again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            index.storage_meta = StorageMeta(load_id=self.load_id)  # no path from the file
            return index

    return Reader(root / SHARDS)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"meta.json names an unknown dtype {name!r}; upgrade torch?")
    return dtype


def _read_into(root: Path, targets: dict[str, Tensor], index: Any) -> dict[str, Tensor]:
    """``dcp.load`` of the verified shards into ``targets`` (no process group, no
    collective), by the checked ``index``; any failure a ``CheckpointError``."""
    import torch.distributed.checkpoint as dcp

    if not targets:
        return targets
    with warnings.catch_warnings():  # "assuming ... a single process": what is asked for
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        _dcp_index.dcp_call(
            root,
            "reading the shards",
            dcp.load,
            targets,
            storage_reader=_reader(root, index),
            no_dist=True,
        )
    return targets


def _like(ref: Tensor | None, described: Mapping[str, Any], device: Any = None) -> Tensor:
    """An empty tensor for a checkpoint entry: like the template's ``ref`` (a DTensor keeps its
    mesh and placements) where its shape and dtype are the checkpoint's, else a plain one of
    the checkpoint's shape and dtype (a mismatch is then named by the fit checks)."""
    shape, dtype = torch.Size(described["shape"]), _dtype(described["dtype"])
    if ref is not None and ref.shape == shape and ref.dtype == dtype:
        return torch.empty_like(ref.detach(), requires_grad=False)
    return torch.empty(shape, dtype=dtype, device=device if device is not None else "cpu")


def _template_leaves(template: TrainState) -> dict[str, Tensor]:
    """The template's tensor for each checkpoint key it has one for."""
    refs: dict[str, Tensor] = {}
    for k, t in template.params.items():
        refs[f"params/{k}"] = t
        refs[f"grad_accum/{k}"] = (template.grad_accum or {}).get(k, t)
    refs.update((f"buffers/{k}", t) for k, t in template.buffers.items())
    for k, v in opt_state_dict(template.opt_state).items():
        if isinstance(v, Tensor):
            refs[f"opt_state/{k}"] = v
    return refs


def read(root: Path, meta: Mapping[str, Any], template: TrainState) -> dict[str, Tensor]:
    """The sharded checkpoint's tensors by key, verified, each read into a tensor like the
    template's (its DTensor's shards, or the full value) — for ``checkpoint.load``."""
    index = verify(root, meta)
    refs = _template_leaves(template)
    targets = {k: _like(refs.get(k), d) for k, d in meta["tensors"].items()}
    return _read_into(root, targets, index)


def read_weights(
    root: Path, meta: Mapping[str, Any], devices: Mapping[str, Any]
) -> dict[str, Tensor]:
    """The parameters and buffers of the sharded checkpoint, gathered in full on this process
    (by name), verified first — for ``load_weights`` and ``export``."""
    index = verify(root, meta)
    targets = {
        k: _like(None, d, devices.get(k))
        for k, d in meta["tensors"].items()
        if k.partition("/")[0] in ("params", "buffers")
    }
    return {k.partition("/")[2]: t for k, t in _read_into(root, targets, index).items()}


def placed_like(template: TrainState, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` (full values, by checkpoint key) with each one whose template tensor is a
    DTensor sharded like it, locally: every rank read the same file, so no communication."""
    refs = _template_leaves(template)
    out = dict(tensors)
    for k, t in tensors.items():
        ref = refs.get(k)
        if isinstance(ref, DTensor) and not isinstance(t, DTensor) and t.shape == ref.shape:
            out[k] = distribute_tensor(
                t.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None
            )
    return out
