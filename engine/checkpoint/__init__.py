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

import contextlib
import errno
import json
import math
import os
import shutil
import socket
import stat
import sys
import threading
import time
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, overload

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

try:
    import numpy as np
except ImportError:  # then every written byte is copied for hashing
    np = None  # type: ignore[assignment]
try:
    import fcntl
except ImportError:  # not POSIX: leftovers cannot be told from saves in progress
    fcntl = None  # type: ignore[assignment]

from engine.checkpoint import _meta, _opt_fit, _report, _tree
from engine.checkpoint._checksum import (
    _SCHEMES,
    _WRITER,
    _hash_mapped,
    _HashingWriter,
    _layout,
    _NoZipCrc,
    _start_checksum,
)
from engine.checkpoint._files import (
    _ASIDE,
    _DOOMED,
    _LOCK,
    _RANK_GRADS,
    _TMP_PREFIX,
    _TREES,
    META,
    TENSORS,
    _Claim,
    _describe,
    _flatten,
    _fsync_dir,
    _publish,
    _read_own,
    _replaceable,
    _short,
    _write_failed,
)
from engine.checkpoint._meta import FORMAT_VERSION
from engine.checkpoint._snapshot import _SNAPSHOTS, _host_empty, _Snapshot
from engine.errors import CheckpointError
from engine.optim.base import load_state_dict as load_opt_state
from engine.state import TrainState

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointIO",
    "IncompatibleKeys",
    "clean_leftovers",
    "export",
    "from_lightning",
    "inspect",
    "load",
    "load_weights",
    "read_hparams",
    "read_meta",
    "release_buffers",
    "remove",
    "save",
    "save_async",
    "verify",
    "wait",
]

# --------------------------------------------------------------------------- saving


def _write(tensors: Mapping[str, Tensor], meta: Mapping[str, Any], target: Path) -> Path:
    """Write a checkpoint directory atomically and durably (see :func:`save`)."""
    _replaceable(target)
    existed = (target / META).is_file()
    with contextlib.ExitStack() as held:
        try:
            claim = held.enter_context(_Claim(target.parent))
        except OSError as e:  # no room for even its lock file
            raise _write_failed(target, e, "", existed) from e
        tmp = claim.path("")
        writer, writing = None, TENSORS
        try:
            tmp.mkdir()
            with open(tmp / TENSORS, "wb") as raw:
                writer = _HashingWriter(raw, tensors.values())  # hashes in parallel: no re-read
                with _NoZipCrc() as no_crc:
                    writer.on_first_write = no_crc.restore
                    torch.save(dict(tensors), writer)  # type: ignore[arg-type]  # a binary file
                raw.flush()
                os.fsync(raw.fileno())  # the last chunks hash meanwhile
                checksum = writer.checksum()
                size = os.fstat(raw.fileno()).st_size
            writing = META
            with open(
                tmp / META, "wb"
            ) as out:  # with its own checksum (engine/checkpoint/_meta.py)
                out.write(
                    _meta.encode({**meta, "files": {TENSORS: checksum}, "sizes": {TENSORS: size}})
                )
                out.flush()
                os.fsync(out.fileno())
            _fsync_dir(tmp)
            writing = ""
            _publish(claim, tmp, target)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            # torch.save reports a failed write as a RuntimeError of its own ("[enforce fail at
            # inline_container.cc] ... unexpected pos"): the OSError behind it says what failed
            cause = writer.error if isinstance(e, RuntimeError) and writer is not None else None
            if isinstance(e, OSError):
                cause = e
            if cause is not None:
                raise _write_failed(target, cause, writing, existed) from cause
            raise
    return target


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
    weights_only: bool = False,
    rank_grad_accum: Sequence[Mapping[str, Tensor]] = (),
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
        rank_grad_accum: a data-parallel run saved inside an accumulation window: the partial
            gradient sums of ranks 1, 2, ... (``state.grad_accum`` is rank 0's), each rank's
            own micro-batches summed before the step's all-reduce. ``load(path, template,
            rank=r)`` gives rank ``r`` its own, so every rank continues its window bitwise.

    A sharded state (any DTensor, ``strategy="fsdp"``) is saved by every rank of the process
    group together: call ``save`` on every rank with the same ``path`` (a collective). Each
    rank writes its own shards through ``torch.distributed.checkpoint`` into one temporary
    directory, and rank 0 writes ``meta.json`` (its ``metrics`` and ``extra``) last and renames
    the whole into place; a failure on any rank fails the save on every rank, and a rank killed
    meanwhile leaves nothing under ``path`` (see docs/checkpoints.md, "Sharded checkpoints").
    ``fingerprint=True`` records the fingerprint of the full (gathered) values.

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
    _is_state(state, path, "save")
    state.check_alive("checkpoint.save()")
    if state.sharded:  # a collective: every rank writes its shards (engine/_sharded.py)
        from engine import _sharded

        return _sharded.save(
            state,
            Path(path),
            metrics=metrics,
            extra=extra,
            fingerprint=fingerprint,
            weights_only=weights_only,
            rank_grad_accum=rank_grad_accum,
        )
    _replaceable(Path(path))
    tensors, scalars = _flatten(state, weights_only, rank_grad_accum)
    meta = _describe(state, scalars, metrics, extra, fingerprint, weights_only)
    meta["grad_accum_ranks"] = _ranks_held(state, weights_only, rank_grad_accum)
    return _write(tensors, meta, Path(path))


def _ranks_held(
    state: TrainState, weights_only: bool, rank_grad_accum: Sequence[Mapping[str, Tensor]]
) -> int:
    """How many ranks' partial gradient sums a checkpoint holds (0: none, at a step)."""
    if weights_only or state.grad_accum is None:
        return 0
    return 1 + len(rank_grad_accum)


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


def _is_state(state: Any, path: Any, fn: str) -> None:
    if not isinstance(state, TrainState):
        swapped = " (the arguments swapped?)" if isinstance(path, TrainState) else ""
        raise TypeError(
            f"checkpoint.{fn}(state, path) takes the TrainState first (got a "
            f"{type(state).__name__}){swapped}; checkpoint.load(path, template) is the other way"
        )


def save_async(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
    weights_only: bool = False,
    rank_grad_accum: Sequence[Mapping[str, Tensor]] = (),
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
    ``weights_only`` and ``rank_grad_accum`` are :func:`save`'s.

    A sharded state (DTensors: ``strategy="fsdp"``) is saved by every rank together, as by
    :func:`save` (a collective: call it on every rank, in the same order as the other
    saves): the ranks' agreement, the fingerprint (a gather) and a copy of this rank's shards
    happen in the call; ``torch.distributed.checkpoint``'s write, the checksums, ``meta.json``
    and the rename on the writer thread, whose collectives run on a gloo process group of the
    checkpoints' own (made by the first such save), so they never interleave with the
    training's.

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
    _is_state(state, path, "save_async")
    state.check_alive("checkpoint.save_async()")
    if state.sharded:  # every rank writes its shards (engine/_sharded.py)
        from engine import _sharded

        try:
            return _sharded.save_async(
                state,
                Path(path),
                metrics=metrics,
                extra=extra,
                fingerprint=fingerprint,
                weights_only=weights_only,
                rank_grad_accum=rank_grad_accum,
            )
        except CheckpointError as e:
            failed_now: Future[Path] = Future()
            failed_now.set_exception(e)
            return failed_now
    tensors, scalars = _flatten(state, weights_only, rank_grad_accum)
    try:
        _replaceable(Path(path))  # here, so that the caller hears of it at once
        meta = _describe(state, scalars, metrics, extra, False, weights_only)
        meta["grad_accum_ranks"] = _ranks_held(state, weights_only, rank_grad_accum)
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
    behind, and the lock file (``.engine-run.lock``) of the run that owned the directory.
    Those of saves still in progress (in this process or another: each holds a
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
    stale = _remove_stale_run_lock(root)
    if stale is not None:
        removed.append(stale)
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


# --------------------------------------------------------------------------- a run's directory

RUN_LOCK = ".engine-run.lock"  # in a checkpoint directory while a run saves there (_RunLock)
_RUN_LOCKS: dict[str, list[Any]] = {}  # this process's: directory -> [fd, holders, created]
_RUN_LOCKS_OF = [os.getpid()]  # a forked child holds none of its parent's
_RUN_LOCKS_GUARD = threading.Lock()


class _RunLock:
    """A live run's claim on a checkpoint directory, so that a second run saving there is
    refused rather than deleting and overwriting the first one's checkpoints.

    The claim is an ``flock`` on ``<directory>/.engine-run.lock``, a file holding the owner's
    pid, host and start time (for the refusal's message). The kernel drops the lock when the
    owner's process dies, so the lock of a dead run is taken over by the next; the file is
    deleted while the lock is held, on release, and by :func:`clean_leftovers` once its owner is
    gone (a run that locks the file just deleted sees it is no longer the one at the name, and
    starts anew). The listeners of one process share its claim (several ``ModelCheckpoint`` of
    one run may save into one directory). Without ``flock`` (not POSIX) the file alone is the
    claim, and one naming a dead pid of this host is taken over.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.key: str | None = None

    def acquire(self) -> None:
        """Claim the directory (created if need be) for this process.

        Raises:
            CheckpointError: another live process holds it, naming the directory and the owner.
        """
        if self.key is not None:
            return
        key = os.path.realpath(self.directory)
        with _RUN_LOCKS_GUARD:
            if _RUN_LOCKS_OF[0] != os.getpid():
                _RUN_LOCKS.clear()
                _RUN_LOCKS_OF[0] = os.getpid()
            held = _RUN_LOCKS.get(key)
            if held is None:
                created = not self.directory.is_dir()
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise CheckpointError(
                        f"cannot create the checkpoint directory {self.directory}: {e}"
                    ) from e
                held = _RUN_LOCKS[key] = [self._take(), 0, created]
            held[1] += 1
        self.key = key

    def release(self) -> None:
        """Give the claim up (the lock file is deleted once no listener of this process holds
        it; the directory too if the claim created it and it is empty)."""
        key, self.key = self.key, None
        if key is None:
            return
        with _RUN_LOCKS_GUARD:
            held = _RUN_LOCKS.get(key) if _RUN_LOCKS_OF[0] == os.getpid() else None
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del _RUN_LOCKS[key]
            fd, _, created = held
            with contextlib.suppress(OSError):  # while holding it: see the class
                os.unlink(self.directory / RUN_LOCK)
            os.close(fd)
            if created:
                with contextlib.suppress(OSError):  # not empty: checkpoints were saved
                    os.rmdir(self.directory)

    def _take(self) -> int:
        lock = self.directory / RUN_LOCK
        while True:
            try:
                if fcntl is None:
                    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    break
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except FileExistsError:  # without flock: a live owner, or a dead one's file
                if _owner_alive(lock):
                    raise CheckpointError(self._refusal(lock)) from None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            except OSError as e:
                raise CheckpointError(
                    f"cannot create the lock file {lock} of the checkpoint directory: {e}"
                ) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise CheckpointError(self._refusal(lock)) from None
            try:  # unless it was deleted (released, or cleaned) before it was locked: anew
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv[:4],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        return fd

    def _refusal(self, lock: Path) -> str:
        owner = _read_owner(lock)
        who = (
            f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('started')}"
            if owner
            else "its owner not recorded yet"
        )
        return (
            f"{self.directory} is the checkpoint directory of another live run ({who}; its "
            f"lock file {lock}). Two runs saving into one directory delete and overwrite each "
            "other's checkpoints: give this run another dirpath (ModelCheckpoint(dirpath=...)), "
            "or wait for that run to end (the lock of a run that died is taken over)"
        )


def _read_owner(lock: Path) -> dict[str, Any]:
    for _ in range(20):  # the owner writes it right after it locks: a moment
        try:
            owner = json.loads(lock.read_text())
            if isinstance(owner, dict):
                return owner
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    return {}


def _owner_alive(lock: Path) -> bool:
    """Without ``flock``: whether the lock file names a live process (one of another host is
    taken for alive: it cannot be asked)."""
    owner = _read_owner(lock)
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return bool(owner) or os.path.lexists(lock)
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, someone else's
        return True
    return True


def _remove_stale_run_lock(root: Path) -> Path | None:
    """Delete the lock file of a run that is gone (see :class:`_RunLock`)."""
    lock = root / RUN_LOCK
    if fcntl is None or not os.path.lexists(lock):
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(lock).st_ino != os.fstat(fd).st_ino:
            return None
        os.unlink(lock)  # while holding it
        return lock
    except OSError:  # held: a live run's
        return None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- loading


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, verified: format, version, the type of every key and
    (from format version 4) the file's own checksum.

    Raises:
        CheckpointError: naming the file, and the key and the type expected where one is wrong.
    """
    meta_path = Path(path) / META
    try:
        raw = _read_own(meta_path)  # not through a link out of the checkpoint
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
    files = _own_files(path, meta)
    try:
        return _read_verified(path, files, devices, materialize)
    except OSError as e:  # unreadable (no permission, an I/O error): nothing is returned
        raise CheckpointError(
            f"{e.filename or path}: cannot be read ({e.strerror or e}); nothing was loaded "
            "from the checkpoint"
        ) from e


def _own_files(path: Path, meta: Mapping[str, Any]) -> dict[str, str]:
    """``meta.json``'s ``files`` (name -> checksum), each checked before a byte of it is read:
    a plain name (``engine/checkpoint/_meta.py`` checks that too), a regular file inside ``path`` (a
    symbolic link may point only to a file beside it) and, from format version 5, of the size
    recorded, so that a file swapped for a huge one is refused without hashing it."""
    files = dict(meta.get("files", {}))
    if TENSORS not in files or not all(isinstance(d, str) for d in files.values()):
        raise CheckpointError(f"{path / META}: no valid checksum for {TENSORS}; it is damaged")
    sizes = meta.get("sizes") or {}
    inside = os.path.realpath(path)
    for name in files:
        if not _meta.plain_name(name):
            raise CheckpointError(_meta.not_plain(path / META, name))
        file = path / name
        try:
            st = os.lstat(file)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(file)
                if os.path.dirname(real) != inside:
                    raise CheckpointError(
                        f"{file}: a symbolic link to {real}, outside the checkpoint directory; "
                        "a checkpoint reads only files of its own: refused (copy the file into "
                        "the checkpoint if it is one)"
                    )
                st = os.stat(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)") from None
        except OSError as e:
            raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from e
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{file}: not a regular file; the checkpoint is damaged")
        if name in sizes and st.st_size != sizes[name]:
            raise CheckpointError(
                f"{file}: {st.st_size} bytes, where meta.json records {sizes[name]}; the file is "
                "truncated, damaged or was replaced (refused before reading it)"
            )
    return files


def _read_verified(
    path: Path,
    files: Mapping[str, str],
    devices: Mapping[str, torch.device] | None,
    materialize: bool,
) -> dict[str, Tensor]:
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


def load(path: str | os.PathLike[str], template: TrainState, *, rank: int = 0) -> TrainState:
    """Load a checkpoint into a state shaped like ``template`` (same model and optimizer).

    The template supplies the structure (the module, the optimizer state's tree); every value
    comes from the checkpoint, verified first. From a ``weights_only`` checkpoint only the
    parameters, buffers and counters come; the optimizer state and ``extra`` are the template's.

    ``rank``: the data-parallel rank the state is for. A checkpoint saved inside an
    accumulation window by ``r`` ranks holds each rank's partial gradient sum (see
    :func:`save`'s ``rank_grad_accum``); rank ``rank`` gets its own as ``grad_accum``. Every
    other value is the same on every rank.

    Raises:
        CheckpointError: if a file is missing or fails its checksum, the payload is not plain
            tensors, or the checkpoint does not fit the template (the message lists missing,
            unexpected and mis-shaped keys); or if it was saved inside an accumulation window
            and holds no partial gradient sum for ``rank``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"load(rank={rank!r}): pass the rank, an int >= 0")
    root = Path(path)
    meta = read_meta(root)
    if meta.get("layout") == _meta.SHARDED:  # torch.distributed.checkpoint's files
        from engine import _sharded

        return _assemble(root, meta, template, _sharded.read(root, meta, template), 0)
    mine = "grad_accum" if rank == 0 else f"{_RANK_GRADS}{rank}"
    device_of = {k: v.device for k, v in {**template.params, **template.buffers}.items()}
    devices = {
        f"{group}/{k}": d for group in ("params", "buffers", mine) for k, d in device_of.items()
    }
    for name in _TREES:  # a tree's tensors go where the template's are (else the CPU)
        shaped: dict[str, Tensor] = {}
        _tree.to_json(getattr(template, name), name, shaped)
        devices.update((k, t.device) for k, t in shaped.items())
    tensors = _verified_tensors(root, meta, devices)
    if template.sharded:  # a full checkpoint resumed sharded: each rank takes its shards
        from engine import _sharded

        tensors = _sharded.placed_like(template, tensors)
    return _assemble(root, meta, template, tensors, rank)


def _assemble(
    root: Path,
    meta: Mapping[str, Any],
    template: TrainState,
    tensors: Mapping[str, Tensor],
    rank: int,
) -> TrainState:
    """The state that ``tensors`` (by checkpoint key, verified) and ``meta`` describe, shaped
    like ``template``; ``rank``'s partial gradient sum as its ``grad_accum``."""
    mine = "grad_accum" if rank == 0 else f"{_RANK_GRADS}{rank}"
    device_of = {k: v.device for k, v in {**template.params, **template.buffers}.items()}
    devices: dict[str, Any] = {}
    for name in _TREES:
        shaped: dict[str, Tensor] = {}
        _tree.to_json(getattr(template, name), name, shaped)
        devices.update((k, t.device) for k, t in shaped.items())
    groups: dict[str, dict[str, Tensor]] = {"params": {}, "buffers": {}, "grad_accum": {}}
    opt: dict[str, Any] = dict(meta.get("opt_state_scalars", {}))
    in_trees: dict[str, Tensor] = {}
    for key, t in tensors.items():
        group, _, name = key.partition("/")
        if group == mine:  # this rank's partial gradient sum
            groups["grad_accum"][name] = t
        elif group == "opt_state":
            opt[name] = t
        elif group.startswith(_RANK_GRADS) or group == "grad_accum":  # another rank's
            continue
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
    if meta.get("has_grad_accum") and not groups["grad_accum"]:
        held = meta.get("grad_accum_ranks", 1)
        raise CheckpointError(
            f"{root}: saved inside an accumulation window (micro_step {meta['micro_step']}) "
            f"with the partial gradient sums of {held} rank{'s' * (held != 1)}, none of them "
            f"rank {rank}'s: a data-parallel rank continues only its own window. Resume on the "
            "world size it was saved on, or from a checkpoint saved at an optimizer step"
        )
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
    except (KeyError, ValueError) as e:  # another optimizer's state: say whose, and what to do
        raise _opt_fit.refuse(root, meta, template.opt_state, opt, e) from e
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
    """A summary of a checkpoint: counters, metrics, sizes, format, what was checked
    (``checked``), whether it verifies, and what a sharded index holds (``index``).

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
    info["hparams"] = _hparams_of(meta)
    # sizes, layout, what was checked and whether it passed, what a sharded index holds
    info.update(_report.inspected(root, meta, _verify_files))
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
        engine.errors.CheckpointError: .../tensors.pt: 7 bytes, where meta.json records ...
    """
    root = Path(path)
    _verify_files(root, read_meta(root))


def _verify_files(root: Path, meta: Mapping[str, Any]) -> Any:
    """Check every file; a sharded checkpoint's index, checked against meta.json, returned."""
    if meta.get("layout") == _meta.SHARDED:
        from engine import _sharded

        return _sharded.verify(root, meta)
    _verified_tensors(root, meta, materialize=False)
    return None


# --------------------------------------------------------------------------- weights for
# inference and for other tools: no optimizer template, no resume


class IncompatibleKeys(NamedTuple):
    """What :func:`load_weights` with ``strict=False`` did not load (as ``load_state_dict``
    reports it): names ``into`` has that the checkpoint lacks, and the reverse."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _verified_weights(
    root: Path,
    meta: Mapping[str, Any],
    devices: Mapping[str, torch.device] | None = None,
    *,
    materialize: bool = True,
) -> dict[str, Tensor]:
    """The checkpoint's parameters and buffers by name, every checksum verified first; the
    optimizer state and the rest of ``tensors.pt`` are hashed but never copied out of the file.
    ``devices``: by ``params/<name>`` / ``buffers/<name>`` key, where each tensor goes. With
    ``materialize=False`` they are views of the mapped file (verified: copy out of them)."""
    if meta.get("layout") == _meta.SHARDED:  # gathered from the shards, on this process
        from engine import _sharded

        return _sharded.read_weights(root, meta, devices or {})
    mapped = _verified_tensors(root, meta, materialize=False)
    picked = {k: t for k, t in mapped.items() if k.partition("/")[0] in ("params", "buffers")}
    del mapped  # the rest of the file is never copied
    if materialize:
        picked = _materialize(picked, devices or {})
    return {k.partition("/")[2]: t for k, t in picked.items()}


def _compare(
    expected: Mapping[str, Tensor], got: Mapping[str, Tensor]
) -> tuple[list[str], list[str], list[str]]:
    """Missing keys, unexpected keys and shape mismatches (dtypes are cast, as
    ``load_state_dict`` does)."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(
        f"{k} (checkpoint {_dims(got[k])}, model {_dims(v)})"
        for k, v in expected.items()
        if k in got and got[k].shape != v.shape
    )
    return missing, unexpected, shapes


def _dims(t: Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _listed(keys: list[str], most: int = 10) -> str:
    shown = ", ".join(keys[:most])
    return f"[{shown}, ... ({len(keys) - most} more)]" if len(keys) > most else f"[{shown}]"


def _misfit(source: object, missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    found = [
        f"{what}: {_listed(keys)}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes))
        if keys
    ]
    return f"{source}: its weights do not fit the model ({'; '.join(found)})"


@overload
def load_weights(
    path: str | os.PathLike[str],
    into: nn.Module,
    *,
    strict: bool = ...,
    device: str | torch.device | None = ...,
) -> IncompatibleKeys: ...


@overload
def load_weights(
    path: str | os.PathLike[str],
    into: Mapping[str, Tensor],
    *,
    strict: bool = ...,
    device: str | torch.device | None = ...,
) -> dict[str, Tensor]: ...


def load_weights(
    path: str | os.PathLike[str],
    into: nn.Module | Mapping[str, Tensor],
    *,
    strict: bool = True,
    device: str | torch.device | None = None,
) -> IncompatibleKeys | dict[str, Tensor]:
    """Load a checkpoint's parameters and buffers for inference: no optimizer template needed.

    Reads ``params/*`` and ``buffers/*`` of any checkpoint (full or ``weights_only``), after
    verifying every checksum as :func:`load` does; the optimizer state is never copied out.

    Args:
        path: the checkpoint directory.
        into: an ``nn.Module``, whose parameters and buffers are overwritten in place (values
            cast to their dtypes, as ``load_state_dict`` does); or a mapping of name to tensor
            giving the names and shapes, for a pure-function model: a new dict is returned.
        strict: every name of ``into`` must be in the checkpoint and the reverse. With
            ``strict=False`` the names that match are loaded, the others are reported (a module:
            in the returned :class:`IncompatibleKeys`; a mapping: in a warning, its missing
            entries kept from ``into``). A shape mismatch is refused either way.
        device: for a mapping, where the returned tensors go (as ``torch.load``'s
            ``map_location``); by default where the tensor of ``into`` each one replaces is. A
            module's tensors are overwritten where they are (as ``load_state_dict`` does),
            straight from the mapped file: no second copy of the weights is made.

    Returns:
        For a module, :class:`IncompatibleKeys` (empty lists when strict); for a mapping, a new
        ``{name: tensor}`` dict with the dtypes of ``into``'s tensors.

    Raises:
        CheckpointError: a file missing or damaged, or weights that do not fit ``into``
            (naming the missing, unexpected and mis-shaped keys).

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.adam(1e-3))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c")
        ...     model = torch.nn.Linear(3, 2)
        ...     checkpoint.load_weights(path, model)
        ...     weights = checkpoint.load_weights(path, {"weight": torch.empty(2, 3),
        ...                                              "bias": torch.empty(2)})
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        >>> torch.equal(model.weight, state.params["weight"]), sorted(weights)
        (True, ['bias', 'weight'])
    """
    root = Path(path)
    if isinstance(into, nn.Module):
        targets: dict[str, Tensor] = dict(into.named_parameters())
        targets.update(into.named_buffers())
    elif isinstance(into, Mapping):
        targets = dict(into)
        wrong = [
            k for k, v in targets.items() if not isinstance(k, str) or not isinstance(v, Tensor)
        ]
        if wrong:
            raise TypeError(
                f"load_weights(into=...): a mapping must hold str -> Tensor; entry {wrong[0]!r} "
                f"holds a {type(targets[wrong[0]]).__name__}"
            )
    else:
        raise TypeError(
            f"load_weights(into=...) takes an nn.Module or a dict of tensors (got "
            f"{type(into).__name__}); to restore a whole TrainState use checkpoint.load"
        )
    meta = read_meta(root)
    to = None if device is None else torch.device(device)
    devices = {
        f"{group}/{k}": to or t.device
        for group in ("params", "buffers")
        for k, t in targets.items()
    }
    # a module is copied into straight from the mapped file: no second copy of the weights
    in_place = isinstance(into, nn.Module)
    weights = _verified_weights(root, meta, devices, materialize=not in_place)
    missing, unexpected, shapes = _compare(targets, weights)
    if shapes or (strict and (missing or unexpected)):
        hint = (
            "was it saved from another model? A shape mismatch is refused even with strict=False"
            if shapes
            else "was it saved from another model? strict=False loads the names that match and "
            "reports the others"
        )
        raise CheckpointError(f"{_misfit(root, missing, unexpected, shapes)}; {hint}")
    if isinstance(into, nn.Module):
        with torch.no_grad():
            for k, t in targets.items():
                if k in weights:
                    t.copy_(weights[k])
        return IncompatibleKeys(missing, unexpected)
    if missing or unexpected:
        warnings.warn(
            f"load_weights({str(root)!r}, strict=False): missing (kept from `into`): "
            f"{_listed(missing)}; unexpected (not loaded): {_listed(unexpected)}",
            stacklevel=2,
        )
    return {
        k: (weights[k] if k in weights else t.detach()).to(to or t.device, t.dtype)
        for k, t in targets.items()
    }


def export(
    path: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the checkpoint's weights to one file anyone can load without engine.

    The file is ``torch.save`` of a plain ``{name: tensor}`` state dict (parameters and buffers,
    on the CPU, contiguous, each with a storage of its own), so
    ``module.load_state_dict(torch.load(out_file, weights_only=True))`` restores the model. It
    is written atomically (a temporary file beside it, fsynced, renamed into place); the
    checkpoint is verified first.

    Args:
        path: the checkpoint directory (full or ``weights_only``).
        out_file: the file to write; an existing file is replaced.
        dtype: cast the floating-point tensors to it (``torch.bfloat16``, say); others are kept.

    Returns:
        ``out_file`` as a path.

    Raises:
        CheckpointError: the checkpoint is damaged, ``out_file`` lies inside it or is a
            directory, or writing fails.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = checkpoint.export(checkpoint.save(state, f"{d}/c"), f"{d}/model.pt")
        ...     plain = torch.load(out, weights_only=True)
        >>> torch.nn.Linear(3, 2).load_state_dict(plain)
        <All keys matched successfully>
    """
    root, out = Path(path), Path(out_file)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"export(dtype=...) must be a floating-point torch.dtype (got {dtype!r})")
    if out.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(
            f"export: {out} lies inside the checkpoint {root}; write the file elsewhere"
        )
    if out.is_dir():
        raise CheckpointError(f"export: {out} is a directory; name the file to write")
    weights = _verified_weights(root, read_meta(root))
    plain: dict[str, Tensor] = {}
    for k, t in weights.items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if (
            not t.is_contiguous()
            or t.storage_offset()
            or (t.untyped_storage().nbytes() != t.numel() * t.element_size())
        ):  # a view, or a storage shared with others: a copy of its own
            t = t.clone(memory_format=torch.contiguous_format)
        plain[k] = t
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"export: cannot create the directory of {out}: {e}") from e
    with _Claim(out.parent) as claim:
        tmp = claim.path("")
        try:
            with open(tmp, "wb") as f:
                torch.save(plain, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
            _fsync_dir(out.parent)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                why = "the disk is full" if e.errno == errno.ENOSPC else str(e)
                raise CheckpointError(f"could not write {out}: {why}") from e
            raise
    return out


# ------------------------------------------------------------------ hyperparameters


def _hparams_doc(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` as ``meta.json`` records them (tuples become lists, non-finite floats
    ``{"$float": ...}``); a value JSON cannot hold is refused, naming its key."""

    def walk(x: Any, where: str) -> Any:
        if np is not None and isinstance(x, np.generic):
            x = x.item()  # numpy scalars: their Python value
        if isinstance(x, float) and not math.isfinite(x):
            return {"$float": repr(x)}  # decoded by read_meta
        if x is None or isinstance(x, (str, bool, int, float)):
            return x
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            bad = next((k for k in x if not isinstance(k, str)), None)
            if bad is not None:
                raise CheckpointError(
                    f"hparams{where}: key {bad!r} is a {type(bad).__name__}; the keys of a "
                    "checkpoint's meta.json are strings: use str keys"
                )
            if set(x) == {"$float"}:
                raise CheckpointError(
                    f"hparams{where}: a dict whose only key is '$float' is how meta.json writes "
                    "a non-finite float; rename the key"
                )
            return {k: walk(v, f"{where}[{k!r}]") for k, v in x.items()}
        text = repr(x)
        raise CheckpointError(
            f"hparams{where} is a {type(x).__name__} ({text[:60]}{'...' if len(text) > 60 else ''}"
            "), which a checkpoint's meta.json cannot hold; record plain values in "
            "Task(hparams=...): numbers, strings, booleans, None, and lists and dicts of them "
            "(a class or object by its name or settings, say)"
        )

    if not isinstance(hparams, Mapping):
        raise CheckpointError(
            f"hparams must be a mapping such as a dict (got {type(hparams).__name__})"
        )
    return walk(hparams, "")


def _hparams_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    extra = meta.get("extra")
    found = extra.get("hparams") if isinstance(extra, Mapping) else None
    return dict(found) if isinstance(found, Mapping) else {}


def read_hparams(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The hyperparameters the run recorded in the checkpoint (``Task(hparams=...)``, as
    Lightning's ``save_hyperparameters``), from its verified ``meta.json``; ``{}`` if none.

    Values come back as JSON holds them: tuples as lists. ``tensors.pt`` is not read (see
    :func:`verify`).

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c", extra={"hparams": {"width": 2}})
        ...     checkpoint.read_hparams(path)
        {'width': 2}
    """
    return _hparams_of(read_meta(path))


# ------------------------------------------------------------------ from Lightning


def _module_keys(module: nn.Module) -> dict[str, str]:
    """``module.state_dict()``'s names (persistent buffers only; tied weights under each of
    their names) -> the name ``named_parameters`` / ``named_buffers`` give the tensor."""
    first: dict[int, str] = {}
    for name, t in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        first.setdefault(id(t), name)
    saved = module.state_dict(keep_vars=True)
    return {k: first[id(v)] for k, v in saved.items() if id(v) in first}


def _lightning_weights(path: Path) -> dict[str, Tensor]:
    """The ``state_dict`` of a Lightning ``.ckpt`` (or a plain state-dict file), read with
    ``weights_only=True``."""
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory: an engine checkpoint? Load it with checkpoint.load, or "
            "checkpoint.load_weights for the weights alone"
        )
    if zipfile.is_zipfile(path):  # torch.save's format: each entry carries a CRC-32
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise CheckpointError(
                f"{path}: the entry {damaged!r} fails its CRC-32: the file is damaged "
                "(a bit flipped on disk or in a copy); nothing was loaded from it"
            )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as e:  # the safe unpickler refused it, or not a torch file at all
        raise CheckpointError(
            f"{path}: refused by torch.load(weights_only=True): {e}. engine never runs code "
            "from a file; if you trust it, extract its weights yourself "
            "(torch.save(torch.load(f, weights_only=False)['state_dict'], 'weights.pt')) "
            "and pass that file"
        ) from e
    if isinstance(loaded, Mapping) and "state_dict" in loaded:
        loaded = loaded["state_dict"]
    elif not (isinstance(loaded, Mapping) and all(isinstance(v, Tensor) for v in loaded.values())):
        keys = sorted(map(str, loaded)) if isinstance(loaded, Mapping) else []
        raise CheckpointError(
            f"{path}: no 'state_dict' in it (keys: {_listed(keys)}); a Lightning checkpoint "
            "(trainer.save_checkpoint) or a plain state-dict file was expected"
        )
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path}: its 'state_dict' is a {type(loaded).__name__}, not a dict")
    wrong = sorted(str(k) for k, v in loaded.items() if not isinstance(v, Tensor))
    if wrong or not all(isinstance(k, str) for k in loaded):
        raise CheckpointError(
            f"{path}: its state_dict holds entries that are not tensors ({_listed(wrong)}); "
            "engine loads tensors only"
        )
    return dict(loaded)


def _strip(keys: Any, prefix: str) -> dict[str, str]:
    return {k[len(prefix) :]: k for k in keys if k.startswith(prefix)}


def _heads(keys: Any) -> list[str]:
    return sorted({k.partition(".")[0] + "." for k in keys if "." in k})


@overload
def from_lightning(
    ckpt_file: str | os.PathLike[str], into: TrainState, *, prefix: str | None = ...
) -> TrainState: ...


@overload
def from_lightning(
    ckpt_file: str | os.PathLike[str], into: nn.Module, *, prefix: str | None = ...
) -> nn.Module: ...


def from_lightning(
    ckpt_file: str | os.PathLike[str],
    into: TrainState | nn.Module,
    *,
    prefix: str | None = None,
) -> TrainState | nn.Module:
    """Start from the weights of a Lightning ``.ckpt``: its ``state_dict``, read with
    ``torch.load(weights_only=True)`` (nothing in the file runs).

    A LightningModule usually holds the network as an attribute, so its keys carry a prefix
    (``model.``, ``net.``); it is stripped. Weights only: Lightning's ``optimizer_states``,
    epoch and step are not read, so this starts training from the weights; it does not resume
    Lightning's run.

    Args:
        ckpt_file: the ``.ckpt`` file (``trainer.save_checkpoint(path)``); a plain state-dict
            file (``torch.save(module.state_dict(), f)``) works too.
        into: a fresh ``TrainState`` (``task.init(model)``): a new state with its parameters and
            buffers replaced is returned, its optimizer state and counters kept; or an
            ``nn.Module``, loaded in place and returned.
        prefix: the prefix to strip (``"model."``). By default it is found: none when the keys
            are the model's, else the shortest that every key shares and after which they are
            exactly the model's. With ``prefix=``, keys without it are ignored (other attributes
            of the LightningModule).

    Raises:
        CheckpointError: the file is refused by the safe loader or holds no state dict; the
            keys do not fit the model (naming missing, unexpected and mis-shaped ones, and
            the prefixes found); ``into`` is a state that has trained (the optimizer state
            would not belong to the weights).

    Example:
        >>> import tempfile, torch
        >>> from engine import checkpoint
        >>> net = torch.nn.Linear(3, 2)
        >>> with tempfile.TemporaryDirectory() as d:  # a .ckpt holds {"state_dict": ..., ...}
        ...     torch.save({"state_dict": {f"model.{k}": v for k, v in net.state_dict().items()},
        ...                 "optimizer_states": []}, f"{d}/last.ckpt")
        ...     model = checkpoint.from_lightning(f"{d}/last.ckpt", torch.nn.Linear(3, 2))
        >>> torch.equal(model.weight, net.weight)
        True
    """
    path = Path(ckpt_file)
    if isinstance(into, TrainState):
        into.check_alive("checkpoint.from_lightning()")
        if into.step or into.micro_step or into.epoch or into.batch_idx:
            raise CheckpointError(
                f"from_lightning({str(path)!r}): the state given has trained (step {into.step}, "
                f"epoch {into.epoch}); a Lightning checkpoint gives weights only, not an "
                "optimizer state that fits them. Pass a fresh state (task.init(model)) and "
                "train from those weights; resuming Lightning's run exactly is Lightning's job"
            )
        names = (
            _module_keys(into.module)
            if into.module is not None
            else {k: k for k in (*into.params, *into.buffers)}
        )
        tensors = {**into.params, **into.buffers}
        names = {k: n for k, n in names.items() if n in tensors}
    elif isinstance(into, nn.Module):
        names = _module_keys(into)
        tensors = dict(into.named_parameters())
        tensors.update(into.named_buffers())
    else:
        raise TypeError(
            f"from_lightning(into=...) takes a TrainState or an nn.Module (got "
            f"{type(into).__name__})"
        )
    saved = _lightning_weights(path)
    expected = {k: tensors[n] for k, n in names.items()}
    if prefix is None:
        first = next(iter(saved), "")
        shared = [first[: i + 1] for i, c in enumerate(first) if c == "."]
        shared = [p for p in shared if all(k.startswith(p) for k in saved)]
        fits = [p for p in ("", *shared) if set(_strip(saved, p)) == set(expected)]
        prefix = fits[0] if fits else (shared[0] if shared else "")
    chosen = _strip(saved, prefix)
    got = {k: saved[full] for k, full in chosen.items()}
    missing, unexpected, shapes = _compare(expected, got)
    if missing or unexpected or shapes:
        where = f"with prefix {prefix!r} stripped" if prefix else "with no prefix stripped"
        raise CheckpointError(
            f"{_misfit(path, missing, unexpected, shapes)} {where}. Its keys begin with "
            f"{_listed(_heads(saved))}: pass prefix= naming the LightningModule's attribute "
            "that holds this network (prefix='model.', say), or build the model the checkpoint "
            "was trained with"
        )
    if isinstance(into, nn.Module):
        with torch.no_grad():
            for k, t in expected.items():
                t.copy_(got[k])
        return into
    loaded = {names[k]: got[k] for k in expected}
    params = {
        k: loaded[k].to(v.device, v.dtype).requires_grad_(v.requires_grad) if k in loaded else v
        for k, v in into.params.items()
    }
    buffers = {
        k: loaded[k].to(v.device, v.dtype) if k in loaded else v for k, v in into.buffers.items()
    }
    return into.replace(params=params, buffers=buffers)


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
        """:func:`save` (``metrics``, ``extra``, ``fingerprint``, ``weights_only``,
        ``rank_grad_accum``)."""
        return save(state, path, **kwargs)

    def save_async(
        self, state: TrainState, path: str | os.PathLike[str], **kwargs: Any
    ) -> Future[Path]:
        """:func:`save_async`."""
        return save_async(state, path, **kwargs)

    def load(self, path: str | os.PathLike[str], template: TrainState, **kwargs: Any) -> TrainState:
        """:func:`load` (``rank``: passed by a Trainer only on a data-parallel rank > 0)."""
        return load(path, template, **kwargs)

    def remove(self, path: str | os.PathLike[str]) -> None:
        """:func:`remove`."""
        remove(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
