"""Checkpoints: a versioned, verifiable on-disk form of a TrainState, written atomically.

A checkpoint is a directory::

    step=000120/
        meta.json      format version, engine/torch versions, counters, seed, metrics,
                       the optimizer state's scalar leaves, and a checksum per file
        tensors.pt     every tensor (params, buffers, accumulated grads, optimizer state)
                       as one flat ``{key: tensor}`` dict, loaded with weights_only=True

Writes go to a hidden temporary directory beside the target, every file is fsynced, then the
directory is renamed into place and its parent fsynced: a crash at any instant leaves earlier
checkpoints intact, and :func:`clean_leftovers` removes a half-written one. Loading verifies every
checksum before it returns anything and never executes code (``torch.load(weights_only=True)``;
a payload that needs more is refused).

The checksum is XXH3-128 over 8 MiB chunks (the XXH3-128 of the chunks' digests), so that the
chunks are hashed in parallel: while a save writes, and while a load reads. Checkpoints of format
versions 1 (one SHA-256 of the whole file) and 2 (SHA-256 over the same chunks) still load.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

try:
    import numpy as np
except ImportError:  # then every written byte is copied for hashing
    np = None  # type: ignore[assignment]
try:
    import fcntl
except ImportError:  # not POSIX: leftovers cannot be told from saves in progress
    fcntl = None  # type: ignore[assignment]

from engine import _meta, _tree
from engine._checksum import (
    _SCHEMES,
    _WRITER,
    _hash_mapped,
    _HashingWriter,
    _layout,
    _NoZipCrc,
    _start_checksum,
)
from engine._meta import FORMAT_VERSION
from engine._snapshot import _SNAPSHOTS, _host_empty, _Snapshot
from engine.errors import CheckpointError
from engine.optim.base import load_state_dict as load_opt_state
from engine.optim.base import state_dict as opt_state_dict
from engine.state import TrainState

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointIO",
    "clean_leftovers",
    "inspect",
    "load",
    "read_meta",
    "release_buffers",
    "remove",
    "save",
    "save_async",
    "verify",
    "wait",
]

META, TENSORS = "meta.json", "tensors.pt"
_TMP_PREFIX = ".tmp-ckpt-"
_ASIDE = "old-"  # _TMP_PREFIX + _ASIDE + id: where a checkpoint being replaced is moved aside
_LOCK = "lock-"  # _TMP_PREFIX + _LOCK + id: the lock a save holds while it writes (_Claim)
_DOOMED = "del-"  # _TMP_PREFIX + _DOOMED + id: a checkpoint being deleted (remove)


# --------------------------------------------------------------------------- saving


def _flatten(
    state: TrainState, weights_only: bool = False
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    for group in ("params", "buffers"):
        for k, t in getattr(state, group).items():
            tensors[f"{group}/{k}"] = t.detach()
    if weights_only:  # the model alone: no optimizer, accumulation or extra state
        return tensors, scalars
    for k, t in (state.grad_accum or {}).items():
        tensors[f"grad_accum/{k}"] = t.detach()
    for k, v in opt_state_dict(state.opt_state).items():
        if isinstance(v, Tensor):
            tensors[f"opt_state/{k}"] = v.detach()
        else:
            scalars[k] = v
    _tree_docs(state, tensors)  # the user's extra and the precision state
    return tensors, scalars


_TREES = ("extra", "precision")  # TrainState fields stored as JSON trees with tensor references


def _tree_docs(state: TrainState, tensors: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """``state.extra`` and ``state.precision`` as JSON; their tensors go into ``tensors``."""
    try:
        return {
            name: _tree.to_json(getattr(state, name), name, {} if tensors is None else tensors)
            for name in _TREES
        }
    except TypeError as e:
        raise CheckpointError(f"the state cannot be saved: {e}") from e


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(
    state: TrainState,
    scalars: Mapping[str, Any],
    metrics: Mapping[str, float] | None,
    extra: Mapping[str, Any] | None,
    fingerprint: bool,
    weights_only: bool = False,
) -> dict[str, Any]:
    """Everything ``meta.json`` records but the checksums (a copy: later changes don't leak in)."""
    return {
        "format": "engine.checkpoint",
        "format_version": FORMAT_VERSION,
        "engine_version": _engine_version(),
        "torch_version": torch.__version__,
        "step": state.step,
        "epoch": state.epoch,
        "batch_idx": state.batch_idx,
        "micro_step": state.micro_step,
        "seed": state.seed,
        # hashing every bit again costs as much as the write: only when asked (replay does)
        "fingerprint": state.fingerprint() if fingerprint and not weights_only else None,
        "num_params": state.num_params(),
        "weights_only": weights_only,  # then params and buffers only: it cannot resume a fit
        "has_grad_accum": state.grad_accum is not None and not weights_only,
        "trees": {} if weights_only else _tree_docs(state),  # TrainState.extra and .precision
        "opt_state_scalars": _jsonable(dict(scalars), "optimizer state"),
        "metrics": _jsonable(dict(metrics or {}), "metrics"),
        "extra": _jsonable(dict(extra or {}), "extra"),
    }


def _replaceable(target: Path) -> None:
    """Refuse to replace (and so delete) what is not a checkpoint: a file, or a directory with
    something in it but no ``meta.json``; and a target whose parent cannot be a directory.

    The target is looked at once (``lstat``, then its names): a pending asynchronous save to the
    same path may move the old checkpoint aside at any instant, and a directory gone by the
    time it is listed was a checkpoint being replaced.
    """
    try:
        mode: int | None = os.lstat(target).st_mode
    except OSError:  # not there (or its parent is no directory: refused below)
        mode = None
    if mode is not None:
        if not stat.S_ISDIR(mode):  # a file, or a symbolic link
            raise CheckpointError(
                f"{target} exists and is not a checkpoint directory; engine replaces only "
                "checkpoints: save to another path, or remove it yourself"
            )
        try:
            names = os.listdir(target)
        except FileNotFoundError:  # moved aside meanwhile by the write replacing it
            names = [META]
        if names and META not in names:
            raise CheckpointError(
                f"{target} is a directory with files but no {META}, not a checkpoint; engine "
                "replaces only checkpoints (and empty directories): save to another path"
            )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the directory of checkpoint {target}: {e}") from e


def _write(tensors: Mapping[str, Tensor], meta: Mapping[str, Any], target: Path) -> Path:
    """Write a checkpoint directory atomically and durably (see :func:`save`)."""
    _replaceable(target)
    with _Claim(target.parent) as claim:
        tmp, old = claim.path(""), None
        tmp.mkdir()
        try:
            with open(tmp / TENSORS, "wb") as raw:
                f = _HashingWriter(raw, tensors.values())  # hashes in parallel: no re-read
                with _NoZipCrc() as no_crc:
                    f.on_first_write = no_crc.restore
                    torch.save(dict(tensors), f)  # type: ignore[arg-type]  # a binary file
                raw.flush()
                os.fsync(raw.fileno())  # the last chunks hash meanwhile
                checksum = f.checksum()
            with open(tmp / META, "wb") as out:  # with its own checksum (engine/_meta.py)
                out.write(_meta.encode({**meta, "files": {TENSORS: checksum}}))
                out.flush()
                os.fsync(out.fileno())
            _fsync_dir(tmp)
            if target.exists():
                # replace: move the old one aside first, under its own name, so that at every
                # instant one complete checkpoint exists where clean_leftovers finds it (a crash
                # between these two renames leaves it aside; clean_leftovers puts it back)
                old = claim.path(_ASIDE)
                old.mkdir()
                os.replace(target, old / target.name)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
            _fsync_dir(target.parent)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and (old / target.name).exists():
                if not os.path.lexists(target):  # interrupted between the renames: put it back
                    os.replace(old / target.name, target)
                shutil.rmtree(old, ignore_errors=True)
            if isinstance(e, OSError):
                why = "the disk is full" if e.errno == errno.ENOSPC else str(e)
                raise CheckpointError(
                    f"could not write checkpoint {target}: {why}; earlier checkpoints are intact"
                ) from e
            raise
    return target


class _Claim:
    """A save's claim on its temporary names in a directory, held for the length of the write.

    ``.tmp-ckpt-lock-<id>`` is created first and locked (``flock``, released by the kernel when
    the writer's process dies, whatever its pid or pid namespace); the save's temporary
    directory ``.tmp-ckpt-<id>`` and the one it moves a replaced checkpoint into,
    ``.tmp-ckpt-old-<id>``, come after, and the lock file goes last. :func:`clean_leftovers`
    touches the names of an ``<id>`` only when it can take that lock itself.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __enter__(self) -> _Claim:
        while True:
            fd, lock = tempfile.mkstemp(prefix=_TMP_PREFIX + _LOCK, dir=self.directory)
            if fcntl is None:
                break
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: nobody else holds it
            try:  # unless a cleaner took it for a dead save's before it was locked: anew
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd, self.lock = fd, Path(lock)
        self.id = self.lock.name[len(_TMP_PREFIX + _LOCK) :]
        return self

    def path(self, kind: str) -> Path:
        return self.directory / f"{_TMP_PREFIX}{kind}{self.id}"

    def __exit__(self, *exc: object) -> None:
        self.lock.unlink(missing_ok=True)
        os.close(self.fd)


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
    weights_only: bool = False,
) -> Path:
    """Write ``state`` to the checkpoint directory ``path`` atomically and durably.

    Args:
        state: the state to save (read, not consumed).
        path: the checkpoint directory to create; an existing one is replaced atomically.
        metrics: host-side metrics to record in ``meta.json`` (floats).
        extra: JSON-serialisable data to record (listener states, data position, config).
        fingerprint: also record ``state.fingerprint()`` in ``meta.json`` (a second pass over
            every byte, as costly as the write itself).
        weights_only: save the model alone (parameters and buffers, with the counters), as
            Lightning's ``save_weights_only``: a smaller file that ``validate`` / ``test`` /
            ``predict`` and :meth:`TrainState.load_into` can use but a fit cannot resume from.

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: when writing fails (a full disk, say); the previous checkpoint at
            ``path``, if any, is left untouched and the temporary files are removed. Also when
            ``path`` exists and is not a checkpoint (a file, or a directory with files but no
            ``meta.json``): a save never deletes what it did not write.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import _tree, checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.adam(1e-3), seed=7)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/step=0")
        ...     back = checkpoint.load(path, state)
        ...     back.fingerprint() == state.fingerprint()
        True
    """
    state.check_alive("checkpoint.save()")
    _replaceable(Path(path))
    tensors, scalars = _flatten(state, weights_only)
    meta = _describe(state, scalars, metrics, extra, fingerprint, weights_only)
    return _write(tensors, meta, Path(path))


def _write_snapshot(
    snapshot: _Snapshot, meta: dict[str, Any], target: Path, view: TrainState | None
) -> Path:
    # Let save_async return first: it is about to, holding the GIL, and this thread, woken by
    # the submission, would otherwise take the GIL from it for a switch interval (5 ms).
    time.sleep(0.001)
    try:
        snapshot.ready()
        if view is not None:  # the snapshot holds the saved bits: hash them here, off the loop
            meta["fingerprint"] = view.fingerprint()
        return _write(snapshot.tensors, meta, target)
    finally:
        _SNAPSHOTS.give_back(snapshot)


def _snapshot_view(state: TrainState, snapshot: _Snapshot) -> TrainState:
    """``state`` with every tensor its fingerprint covers read from ``snapshot`` (host copies:
    for hashing only, nothing is moved back to a device)."""
    copies = snapshot.tensors
    leaves, spec = pytree.tree_flatten_with_path(state.opt_state)
    opt = [copies.get(f"opt_state/{pytree.keystr(path)}", leaf) for path, leaf in leaves]
    return state.replace(
        params={k: copies[f"params/{k}"] for k in state.params},
        buffers={k: copies[f"buffers/{k}"] for k in state.buffers},
        grad_accum=None
        if state.grad_accum is None
        else {k: copies[f"grad_accum/{k}"] for k in state.grad_accum},
        opt_state=pytree.tree_unflatten(opt, spec),
        _ownership=type(state._ownership)(),
    )


def save_async(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
    weights_only: bool = False,
) -> Future[Path]:
    """Snapshot ``state`` now and write it to ``path`` in the background.

    Only the snapshot (a copy of every tensor into host memory kept from the previous
    asynchronous save, see :func:`release_buffers`) blocks the caller; serialising, hashing and
    the fsyncs happen on one writer thread, so saves complete in the order they were asked for.
    Training may go on donating the live state's tensors meanwhile (on a GPU: on the stream that
    was current at the call, so that it runs after the copies). The returned future gives the
    path, or raises what :func:`save` would have; :func:`wait` waits for all of them.
    ``fingerprint=True`` records ``state.fingerprint()`` in ``meta.json`` as :func:`save` does,
    hashed from the snapshot on the writer thread, so it does not block the caller either;
    ``weights_only`` is :func:`save`'s.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     future = checkpoint.save_async(state, f"{d}/c")
        ...     checkpoint.read_meta(future.result())["step"]
        0
    """
    state.check_alive("checkpoint.save_async()")
    tensors, scalars = _flatten(state, weights_only)
    try:
        _replaceable(Path(path))  # here, so that the caller hears of it at once
        meta = _describe(state, scalars, metrics, extra, False, weights_only)
    except CheckpointError as e:
        failed: Future[Path] = Future()
        failed.set_exception(e)
        return failed
    snapshot = _SNAPSHOTS.take(tensors)
    try:
        view = _snapshot_view(state, snapshot) if fingerprint and not weights_only else None
        future = _WRITER.get().submit(_write_snapshot, snapshot, meta, Path(path), view)
        future.add_done_callback(partial(_give_back_if_cancelled, snapshot))
        return future
    except BaseException:
        _SNAPSHOTS.give_back(snapshot)
        raise


def _give_back_if_cancelled(snapshot: _Snapshot, future: Future[Path]) -> None:
    if future.cancelled():  # it never ran, so _write_snapshot did not return the buffers
        _SNAPSHOTS.give_back(snapshot)


def wait() -> None:
    """Block until every asynchronous save has finished (errors surface through the futures)."""
    writer = _WRITER.started()
    if writer is not None:
        writer.submit(lambda: None).result()


def release_buffers() -> None:
    """Free the host copy of the state that :func:`save_async` keeps for the next save.

    Asynchronous saves keep the buffers their last snapshot used (one state's worth of host
    memory) so that the next snapshot only copies; this drops them, and those of pending saves
    once they end. The next asynchronous save allocates afresh.
    """
    _SNAPSHOTS.release()


def remove(path: str | os.PathLike[str]) -> None:
    """Delete the checkpoint (or file) at ``path`` as safely as :func:`save` writes one.

    The checkpoint is first renamed to a hidden name beside it (``.tmp-ckpt-del-<id>``) and the
    rename made durable, then deleted: a crash at any instant leaves either the whole checkpoint
    under its name or nothing there, never a directory with some of its files (which would be
    refused when loaded and outrank valid checkpoints by its step). What a crash left under the
    hidden name, :func:`clean_leftovers` deletes. A missing ``path`` is not an error.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c")
        ...     checkpoint.remove(path)
        ...     sorted(os.listdir(d))
        []
    """
    target = Path(path)
    if target.is_symlink() or (os.path.lexists(target) and not target.is_dir()):
        target.unlink(missing_ok=True)
        return
    if not target.exists():
        return
    if not (target / META).is_file() and any(target.iterdir()):
        raise CheckpointError(
            f"{target} is a directory with files but no {META}, not a checkpoint; "
            "checkpoint.remove deletes only checkpoints"
        )
    with _Claim(target.parent) as claim:
        doomed = claim.path(_DOOMED)
        try:
            os.replace(target, doomed)
        except FileNotFoundError:  # removed meanwhile
            return
        _fsync_dir(target.parent)
        shutil.rmtree(doomed, ignore_errors=True)


def clean_leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove what interrupted saves left in ``directory``; returns the paths removed.

    A save writes into a hidden temporary directory beside its target and renames it into place;
    replacing a checkpoint first moves the old one aside, and :func:`remove` renames a
    checkpoint to a hidden name before deleting it. A process that died meanwhile leaves these
    behind. Those of saves still in progress (in this process or another: each holds a
    lock on a file of its own until it ends) are left alone. When a crash came between the two
    renames of a replacement, the name is free and both checkpoints are there: the new one,
    complete, takes the name if it verifies, else the old one is put back.
    """
    removed: list[Path] = []
    root = Path(directory)
    if not root.is_dir():
        return removed
    saves: dict[str, dict[str, Path]] = {}  # by save id: its leftovers, by kind
    for p in sorted(root.iterdir()):
        if p.name.startswith(_TMP_PREFIX):
            name = p.name[len(_TMP_PREFIX) :]
            kind = next((k for k in (_LOCK, _ASIDE, _DOOMED) if name.startswith(k)), "")
            saves.setdefault(name[len(kind) :], {})[kind] = p
    for id_, parts in saves.items():
        if _held(root / f"{_TMP_PREFIX}{_LOCK}{id_}"):
            continue  # a save in progress
        aside, new = parts.get(_ASIDE), parts.get("")
        for kept in list(aside.iterdir()) if aside is not None and aside.is_dir() else []:
            target = root / kept.name
            if os.path.lexists(target):  # the replacement took the name before the crash
                continue
            if new is not None and _complete_checkpoint(new):
                os.replace(new, target)  # the replacement was written in full: it wins
            else:
                os.replace(kept, target)
        for p in parts.values():
            if not os.path.lexists(p):  # the replacement, renamed into place above
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    if removed:
        _fsync_dir(root)
    return removed


def _complete_checkpoint(path: Path) -> bool:
    try:
        verify(path)
    except CheckpointError:
        return False
    return True


def _held(lock: Path) -> bool:
    """Whether a save still holds ``lock`` (one of :class:`_Claim`'s files)."""
    if fcntl is None:
        return False  # no locks here (not POSIX): every leftover is taken for dead
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False  # gone: that save has just ended
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock if it was taken
    return False


# --------------------------------------------------------------------------- loading


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, verified: format, version, the type of every key and
    (from format version 4) the file's own checksum.

    Raises:
        CheckpointError: naming the file, and the key and the type expected where one is wrong.
    """
    meta_path = Path(path) / META
    try:
        raw = meta_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {META} is missing") from None
    except OSError as e:  # a directory in its place, no permission, an I/O error
        raise CheckpointError(f"{meta_path}: cannot be read ({e})") from e
    return _meta.decode(raw, meta_path)


def _materialize(
    mapped: Mapping[str, Tensor], devices: Mapping[str, torch.device]
) -> dict[str, Tensor]:
    """Copy tensors out of the file mapping into memory of their own, storages shared as saved.

    This is what ``torch.load`` does; a tensor bound for another device is copied there straight
    from the mapping.
    """
    copies: dict[tuple[int, int], Any] = {}
    out: dict[str, Tensor] = {}
    for key, t in mapped.items():
        device = devices.get(key)
        if device is not None and device.type != "cpu":
            out[key] = t.to(device)
            continue
        src = t.untyped_storage()
        ident = (src.data_ptr(), src.nbytes())
        dst = copies.get(ident)
        if dst is None:
            flat = _host_empty((src.nbytes(),), torch.uint8)
            _copy_bytes(flat, torch.empty(0, dtype=torch.uint8).set_(src))
            dst = copies[ident] = flat.untyped_storage()
        out[key] = torch.empty(0, dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())
    return out


def _copy_bytes(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for flat byte tensors, on this thread alone.

    ``copy_`` would split a large copy over torch's intra-op threads, which then contend with the
    hashing threads for the cores and wait for each other; numpy copies on this thread with the
    GIL released.
    """
    if np is None:
        dst.copy_(src)
    else:
        np.copyto(dst.numpy(), src.numpy())


def _verified_tensors(
    path: Path,
    meta: Mapping[str, Any],
    devices: Mapping[str, torch.device] | None = None,
    *,
    materialize: bool = True,
) -> dict[str, Tensor]:
    files = dict(meta.get("files", {}))
    if TENSORS not in files or not all(isinstance(d, str) for d in files.values()):
        raise CheckpointError(f"{path / META}: no valid checksum for {TENSORS}; it is damaged")
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing (the checkpoint is incomplete)")
    # One pass over the bytes, in parallel: this thread maps the file (weights_only=True cannot
    # run code whatever the bytes are) and copies the tensors out of the mapping while the
    # hashing threads checksum the same pages. Nothing is returned before every checksum has
    # matched.
    scheme = files[TENSORS].rpartition(":")[0]
    from_mapping = np is not None and scheme in _SCHEMES
    digests = {
        name: _start_checksum(path / name, d)
        for name, d in files.items()
        if not (from_mapping and name == TENSORS)
    }
    loaded: Any = None
    failure: Exception | None = None
    try:
        loaded = torch.load(path / TENSORS, map_location="cpu", weights_only=True, mmap=True)
        if from_mapping:
            layout = _layout(path / TENSORS, loaded) if isinstance(loaded, dict) else None
            digests[TENSORS] = (
                _hash_mapped(path / TENSORS, layout, scheme)
                if layout is not None
                else _start_checksum(path / TENSORS, files[TENSORS])
            )
        if materialize and isinstance(loaded, dict):
            loaded = _materialize(loaded, devices or {})
    except Exception as e:  # judged after the checksums: damage explains most failures
        failure = e
    for name, digest in files.items():
        if name not in digests:  # not hashed along the way: hash the file
            digests[name] = _start_checksum(path / name, digest)
    for name, digest in files.items():
        actual = digests[name]()
        if actual != digest:
            raise CheckpointError(
                f"{path / name}: checksum check failed ({digest.rpartition(':')[0] or 'sha256'} "
                f"expected {_short(digest)}..., got {_short(actual)}...); the file is truncated "
                "or damaged"
            )
    if failure is not None:  # intact bytes that the safe loader refuses: not only tensors
        raise CheckpointError(
            f"{path / TENSORS}: refused by the safe loader (weights_only=True): {failure}. "
            "engine never runs code while loading a checkpoint"
        ) from failure
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path / TENSORS}: expected a dict of tensors")
    return loaded


def _short(checksum: str) -> str:
    return checksum.rpartition(":")[2][:16]


def load(path: str | os.PathLike[str], template: TrainState) -> TrainState:
    """Load a checkpoint into a state shaped like ``template`` (same model and optimizer).

    The template supplies the structure (the module, the optimizer state's tree); every value
    comes from the checkpoint, verified first. From a ``weights_only`` checkpoint only the
    parameters, buffers and counters come; the optimizer state and ``extra`` are the template's.

    Raises:
        CheckpointError: if a file is missing or fails its checksum, the payload is not plain
            tensors, or the checkpoint does not fit the template (the message lists missing,
            unexpected and mis-shaped keys).
    """
    root = Path(path)
    meta = read_meta(root)
    device_of = {k: v.device for k, v in {**template.params, **template.buffers}.items()}
    devices = {
        f"{group}/{k}": d
        for group in ("params", "buffers", "grad_accum")
        for k, d in device_of.items()
    }
    for name in _TREES:  # a tree's tensors go where the template's are (else the CPU)
        shaped: dict[str, Tensor] = {}
        _tree.to_json(getattr(template, name), name, shaped)
        devices.update((k, t.device) for k, t in shaped.items())
    tensors = _verified_tensors(root, meta, devices)
    groups: dict[str, dict[str, Tensor]] = {"params": {}, "buffers": {}, "grad_accum": {}}
    opt: dict[str, Any] = dict(meta.get("opt_state_scalars", {}))
    in_trees: dict[str, Tensor] = {}
    for key, t in tensors.items():
        group, _, name = key.partition("/")
        if group == "opt_state":
            opt[name] = t
        elif group in groups:
            groups[group][name] = t
        elif group in _TREES:
            in_trees[key] = t.to(devices.get(key, "cpu"))
        else:
            raise CheckpointError(f"{root / TENSORS}: unknown entry {key!r}")
    trees = meta.get("trees", {})  # absent before format 2: the template's then
    try:
        restored = {
            name: _tree.from_json(trees[name], in_trees) for name in _TREES if name in trees
        }
    except (KeyError, ValueError, TypeError, RuntimeError) as e:  # a damaged tree
        raise CheckpointError(
            f"{root / META}: 'trees' (the state's extra and precision) cannot be rebuilt: {e}"
        ) from e
    if (  # a template without a precision state takes the checkpoint's, as it takes extra
        "precision" in restored
        and template.precision is not None
        and _shape_of(restored["precision"]) != _shape_of(template.precision)
    ):
        raise CheckpointError(
            f"{root}: the checkpoint's precision state ({_shape_of(restored['precision'])}) "
            f"does not fit the template's ({_shape_of(template.precision)}): it was saved under "
            "another precision (a loss scale comes with '16-mixed'). Resume with the precision "
            "it was saved with (its config records it), or load its weights alone"
        )
    _check_fit(root, "params", template.params, groups["params"])
    _check_fit(root, "buffers", template.buffers, groups["buffers"])
    params = {
        k: groups["params"][k].to(device_of[k]).requires_grad_(v.requires_grad)
        for k, v in template.params.items()
    }
    buffers = {k: groups["buffers"][k].to(device_of[k]) for k in template.buffers}
    grad_accum = (
        {k: groups["grad_accum"][k].to(device_of[k]) for k in template.params}
        if meta.get("has_grad_accum")
        else None
    )
    try:
        opt_state = (
            template.opt_state
            if meta.get("weights_only")
            else load_opt_state(template.opt_state, opt)
        )
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{root}: the optimizer state does not fit: {e}") from e
    return template.replace(
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        grad_accum=grad_accum,
        step=meta["step"],
        epoch=meta["epoch"],
        batch_idx=meta["batch_idx"],
        micro_step=meta["micro_step"],
        seed=meta["seed"],
        _ownership=type(template._ownership)(),
        **restored,
    )


def _check_fit(
    root: Path, group: str, expected: Mapping[str, Tensor], got: Mapping[str, Tensor]
) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(got[k].shape)} {got[k].dtype}, model {tuple(v.shape)} {v.dtype}"
        for k, v in expected.items()
        if k in got and (got[k].shape != v.shape or got[k].dtype != v.dtype)
    )
    if (
        shapes
        and not missing
        and not unexpected
        and all(got[k].shape == v.shape for k, v in expected.items())
    ):
        dtypes = sorted(
            {
                f"{got[k].dtype} in the checkpoint, {v.dtype} in the template"
                for k, v in expected.items()
                if got[k].dtype != v.dtype
            }
        )
        raise CheckpointError(
            f"{root}: the checkpoint's {group} have other dtypes than the template's "
            f"({'; '.join(dtypes)}): it was saved under another precision. Resume with the "
            "precision it was saved with (its config records it), e.g. Trainer(precision="
            "'bf16-true') for bfloat16 parameters"
        )
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{root}: the checkpoint's {group} do not fit the model (missing: {missing}; "
            f"unexpected: {unexpected}; mis-shaped: {shapes}); was it saved from another model?"
        )


def _shape_of(tree: Any) -> Any:
    """A tree's structure, for comparing precision states: dict keys sorted (a checkpoint's
    JSON does not keep their order), tensors by dtype."""
    if isinstance(tree, Mapping):
        return {k: _shape_of(tree[k]) for k in sorted(tree)}
    if isinstance(tree, (list, tuple)):
        return [_shape_of(x) for x in tree]
    if isinstance(tree, Tensor):
        return str(tree.dtype).removeprefix("torch.")
    return type(tree).__name__


# --------------------------------------------------------------------------- inspection


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a checkpoint: counters, metrics, sizes, format, and whether it verifies.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     info = checkpoint.inspect(checkpoint.save(state, f"{d}/c"))
        >>> info["step"], info["num_params"], info["verified"]
        (0, 8, True)
    """
    root = Path(path)
    meta = read_meta(root)
    info: dict[str, Any] = {
        k: meta.get(k)
        for k in (
            "step",
            "epoch",
            "batch_idx",
            "micro_step",
            "seed",
            "num_params",
            "format_version",
            "engine_version",
            "torch_version",
            "metrics",
            "fingerprint",
            "weights_only",
        )
    }
    info["size_bytes"] = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    try:
        _verified_tensors(root, meta, materialize=False)
        info["verified"], info["problem"] = True, None
    except CheckpointError as e:
        info["verified"], info["problem"] = False, str(e)
    return info


def verify(path: str | os.PathLike[str]) -> None:
    """Check every checksum of the checkpoint at ``path`` (``meta.json``'s own included) and
    its metadata's schema, without loading it into a state.

    Raises:
        CheckpointError: what :func:`load` would refuse the checkpoint for, naming the file.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c")
        ...     checkpoint.verify(path)
        ...     (path / "tensors.pt").write_bytes(b"damaged")
        ...     checkpoint.verify(path)
        Traceback (most recent call last):
        ...
        engine.errors.CheckpointError: .../tensors.pt: checksum check failed (...
    """
    root = Path(path)
    _verified_tensors(root, read_meta(root), materialize=False)


def _engine_version() -> str:
    from engine import __version__

    return __version__


def _jsonable(value: Any, what: str) -> Any:
    def check(x: Any) -> Any:
        if isinstance(x, Tensor) and x.numel() == 1:
            x = x.item()
        if isinstance(x, float) and not math.isfinite(x):
            return {"$float": repr(x)}  # JSON has no NaN/inf; decoded by read_meta
        if isinstance(x, (str, int, float, bool)) or x is None:
            return x
        raise CheckpointError(
            f"{what}: {type(x).__name__} values cannot go in meta.json; pass numbers, strings, "
            "lists and dicts of them"
        )

    return pytree.tree_map(check, value)


# --------------------------------------------------------------------------- the Trainer's IO


class CheckpointIO:
    """How a Trainer writes, reads and deletes its checkpoints (Lightning's ``CheckpointIO``
    plugin): ``Trainer(plugins=[MyIO()])``. Each method does what the module function of its
    name does; override one to add to it (copy a saved checkpoint to other storage, say), and
    call the base method to keep the format's guarantees (atomic, verified).

    Example:
        >>> import shutil
        >>> class Mirrored(CheckpointIO):  # keeps a second copy of every synchronous save
        ...     def __init__(self, mirror):
        ...         self.mirror = mirror
        ...     def save(self, state, path, **kwargs):
        ...         out = super().save(state, path, **kwargs)
        ...         shutil.copytree(out, f"{self.mirror}/{out.name}", dirs_exist_ok=True)
        ...         return out
    """

    def save(self, state: TrainState, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """:func:`save` (``metrics``, ``extra``, ``fingerprint``, ``weights_only``)."""
        return save(state, path, **kwargs)

    def save_async(
        self, state: TrainState, path: str | os.PathLike[str], **kwargs: Any
    ) -> Future[Path]:
        """:func:`save_async`."""
        return save_async(state, path, **kwargs)

    def load(self, path: str | os.PathLike[str], template: TrainState) -> TrainState:
        """:func:`load`."""
        return load(path, template)

    def remove(self, path: str | os.PathLike[str]) -> None:
        """:func:`remove`."""
        remove(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
