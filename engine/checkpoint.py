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

The checksum is SHA-256 over 8 MiB chunks (the SHA-256 of the chunks' SHA-256 digests), so that
the chunks are hashed in parallel: while a save writes, and while a load reads. Format version 1
recorded one SHA-256 of the whole file; such checkpoints still load.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import math
import mmap
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

try:
    import numpy as np
except ImportError:  # then every written byte is copied for hashing
    np = None  # type: ignore[assignment]

from engine import _tree
from engine.optim.base import load_state_dict as load_opt_state
from engine.optim.base import state_dict as opt_state_dict
from engine.state import TrainState

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "clean_leftovers",
    "inspect",
    "load",
    "read_meta",
    "release_buffers",
    "save",
    "save_async",
    "wait",
]

FORMAT_VERSION = 2
META, TENSORS = "meta.json", "tensors.pt"
_TMP_PREFIX = ".tmp-ckpt-"

_CHUNK = 8 << 20  # bytes per hashed chunk; part of the checksum's definition
_SCHEME = "sha256-chunks-8MiB"  # how meta.json names it: "sha256-chunks-8MiB:<hex>"
_INLINE = 1 << 16  # smaller writes are copied for hashing, not looked up among the tensors
_MAX_COPIED = 64 << 20  # bytes copied and not yet hashed, at most


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, of another format, or does not fit the state."""


# --------------------------------------------------------------------------- threads


class _Executor:
    """A lazily started thread pool, started afresh in a forked child (threads do not fork)."""

    def __init__(self, workers: Callable[[], int], name: str) -> None:
        self.workers = 0  # once started
        self._count, self._name = workers, name
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self.workers = self._count()
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self._name)
                self._pid = os.getpid()
            return self._pool

    def started(self) -> ThreadPoolExecutor | None:
        return self._pool if self._pid == os.getpid() else None


# Hashing threads: hashlib releases the GIL on buffers over 2 KiB, so chunks hash in parallel.
_HASHERS = _Executor(lambda: max(2, min(8, os.cpu_count() or 2)), "engine-checksum")
# One writer thread: asynchronous saves complete in the order they were asked for.
_WRITER = _Executor(lambda: 1, "engine-checkpoint")


# --------------------------------------------------------------------------- checksums


def _sha256(path: Path) -> str:
    """The SHA-256 of a whole file: the checksum format version 1 recorded."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _combine(digests: Iterable[bytes]) -> str:
    return f"{_SCHEME}:{hashlib.sha256(b''.join(digests)).hexdigest()}"


class _ChunkHasher:
    """SHA-256s a file's chunks on the hashing threads, as they become available.

    While the caller still works (writes the file, or copies the tensors out of it), at most one
    thread fewer than there are cores hashes, so that hashing does not slow the caller down;
    :meth:`result` lets every hashing thread in on what is left. The file's bytes are fed in
    order, as buffers that the caller keeps unchanged until :meth:`result` returns. The threads
    wait for nothing but this object's lock, so no use of the shared pool can deadlock.
    """

    def __init__(self) -> None:
        self.pos = 0  # bytes fed
        self.segments: list[Any] = []  # of the chunk being filled
        self.copied = 0  # bytes of it that the caller copied for hashing
        self.cond = threading.Condition()
        self.ready: deque[tuple[int, list[Any], int]] = deque()  # (chunk, segments, copied)
        self.digests: list[bytes | None] = []
        self.lanes = 0  # threads hashing for this file
        self.max_lanes = max(1, (os.cpu_count() or 1) - 1)
        self.unhashed_copies = 0  # bytes the caller copied for hashing, not hashed yet
        self.error: BaseException | None = None

    def feed(self, segment: Any, copied: bool = False) -> None:
        """Hash ``segment`` (a buffer of bytes) next; ``copied``: made only to be hashed."""
        data = memoryview(segment).cast("B")  # slices of it copy nothing
        n, offset = len(data), 0
        while offset < n:
            take = min(n - offset, _CHUNK - self.pos % _CHUNK)
            self.segments.append(data[offset : offset + take])
            if copied:
                self.copied += take
            offset, self.pos = offset + take, self.pos + take
            if self.pos % _CHUNK == 0:
                self._queue()

    def _queue(self) -> None:
        """Queue the chunk; wait while more than _MAX_COPIED copied bytes are queued."""
        with self.cond:
            self.ready.append((len(self.digests), self.segments, self.copied))
            self.digests.append(None)
            self.unhashed_copies += self.copied
            self.segments, self.copied = [], 0
            self._start_lanes()
            while self.unhashed_copies > _MAX_COPIED and self.error is None:
                self.cond.wait()  # hashing lags behind: let it catch up

    def _start_lanes(self) -> None:  # holding cond
        while self.lanes < min(self.max_lanes, len(self.ready)):
            self.lanes += 1
            _HASHERS.get().submit(self._lane)

    def _lane(self) -> None:
        while True:
            with self.cond:
                if not self.ready or self.error is not None:
                    self.lanes -= 1
                    self.cond.notify_all()
                    return
                index, segments, copied = self.ready.popleft()
            try:
                digest = _hash_segments(segments)
            except BaseException as e:
                with self.cond:
                    self.error = e
                continue
            with self.cond:
                self.digests[index] = digest
                self.unhashed_copies -= copied
                self.cond.notify_all()

    def result(self) -> str:
        """The checksum of what was fed, once it is all hashed."""
        if self.segments:
            self._queue()
        with self.cond:
            _HASHERS.get()
            self.max_lanes = _HASHERS.workers
            self._start_lanes()
            while self.lanes:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            return _combine(d for d in self.digests if d is not None)


def _hash_segments(segments: list[Any]) -> bytes:
    h = hashlib.sha256()
    for segment in segments:
        h.update(segment)  # releases the GIL: chunks hash in parallel
    return h.digest()


def _start_checksum(path: Path, expected: str) -> Callable[[], str]:
    """Start hashing ``path`` in the scheme of ``expected``; the result gives its checksum.

    The chunked scheme hashes the chunks in parallel straight from the page cache; a bare hex
    digest (format version 1) is one SHA-256 of the whole file, on one thread.
    """
    scheme, sep, _ = expected.rpartition(":")
    if not sep:
        return _HASHERS.get().submit(_sha256, path).result
    if scheme != _SCHEME:
        raise CheckpointError(
            f"{path}: unknown checksum scheme {scheme!r} in {META}; upgrade engine to verify it"
        )
    hasher = _ChunkHasher()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            # unmapped when the last view of it goes; checkpoints are never modified in place
            hasher.feed(memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)))
    return hasher.result


def _checksum(path: Path) -> str:
    """The checksum of a file in the current scheme."""
    return _start_checksum(path, f"{_SCHEME}:")()


class _HashingWriter(io.RawIOBase):
    """A write-only file that forwards to ``raw`` and checksums what passes through.

    ``torch.save`` hands each storage's bytes to ``write`` as a view of the storage's own memory.
    Those of ``tensors`` (which the caller keeps alive and unchanged until the save ends) are
    hashed from the tensors, on the hashing threads, while this thread goes on writing and then
    fsyncs: the file is never read back and no data is copied. Any other bytes (record headers,
    a storage torch copied first) are copied, a bounded amount at a time, since a caller may
    reuse a buffer once ``write`` returns.
    """

    def __init__(self, raw: Any, tensors: Iterable[Tensor]) -> None:
        self.raw = raw
        self.pos = 0
        self.owned: dict[int, memoryview] = {}  # address -> the storage's bytes
        if np is not None:
            for t in tensors:
                storage = t.untyped_storage()
                if t.device.type == "cpu" and storage.nbytes() >= _INLINE:
                    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
                    self.owned[storage.data_ptr()] = whole.numpy().data
        self.hasher = _ChunkHasher()
        self.on_first_write: Callable[[], None] | None = None

    def writable(self) -> bool:
        return True

    def _view_of_owned(self, data: memoryview) -> memoryview | None:
        if len(data) < _INLINE or np is None:
            return None
        owner = self.owned.get(np.frombuffer(data, dtype=np.uint8).ctypes.data)
        return owner[: len(data)] if owner is not None and len(data) <= len(owner) else None

    def write(self, b: Any) -> int:
        if self.on_first_write is not None:
            self.on_first_write()
            self.on_first_write = None
        with memoryview(b) as view, view.cast("B") as data:
            self.raw.write(data)
            n = len(data)
            owned = self._view_of_owned(data)
            self.hasher.feed(bytes(data) if owned is None else owned, copied=owned is None)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def checksum(self) -> str:
        """The file's checksum, once every chunk is hashed (call after the last write)."""
        return self.hasher.result()


# --------------------------------------------------------------------------- memory

_MADV_POPULATE_WRITE, _PAGE = 23, mmap.PAGESIZE
_madvise: Any = None


def _host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    """``torch.empty`` on the host, its pages mapped up front in one system call (Linux).

    Fresh memory is otherwise mapped at first touch, one page fault per 4 KiB page; for a
    checkpoint-sized buffer those faults cost more than the copy that fills it.
    ``MADV_POPULATE_WRITE`` (Linux 5.14+) does the same work without a fault per page. Elsewhere
    it is skipped; either way the contents are the same (undefined until written).
    """
    global _madvise
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes >= 1 << 20 and sys.platform == "linux":
        if _madvise is None:
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], int
                _madvise = fn
            except (OSError, AttributeError):
                _madvise = False
        if _madvise:
            start = -(-t.data_ptr() // _PAGE) * _PAGE
            stop = (t.data_ptr() + nbytes) // _PAGE * _PAGE
            if stop > start and _madvise(start, stop - start, _MADV_POPULATE_WRITE) != 0:
                _madvise = False  # an older kernel: not again
    return t


# --------------------------------------------------------------------------- saving


def _flatten(state: TrainState) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    for group in ("params", "buffers"):
        for k, t in getattr(state, group).items():
            tensors[f"{group}/{k}"] = t.detach()
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


class _NoZipCrc:
    """Turns off the zip CRC-32s ``torch.save`` computes, for the one call being started.

    The checksum in ``meta.json`` covers every byte of the file, so the zip format's own CRC-32
    of each record is redundant, and it costs ``torch.save`` about 40% of its time; ``torch.load``
    does not read it (``zip -T`` would report it wrong). The option is global and read when
    ``torch.save`` opens its writer, before the first write: it is restored at that first write
    (:meth:`restore`), or on exit. Saves here take turns for that instant.
    """

    _lock = threading.Lock()

    def __enter__(self) -> _NoZipCrc:
        self.held = False
        options = getattr(torch.serialization, "set_crc32_options", None)
        if options is not None:  # torch >= 2.6
            self._lock.acquire()
            self.held = True
            self.previous = torch.serialization.get_crc32_options()
            options(False)
        return self

    def restore(self) -> None:
        if self.held:
            self.held = False
            torch.serialization.set_crc32_options(self.previous)
            self._lock.release()

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _meta(
    state: TrainState,
    scalars: Mapping[str, Any],
    metrics: Mapping[str, float] | None,
    extra: Mapping[str, Any] | None,
    fingerprint: bool,
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
        "fingerprint": state.fingerprint() if fingerprint else None,
        "num_params": state.num_params(),
        "has_grad_accum": state.grad_accum is not None,
        "trees": _tree_docs(state),  # TrainState.extra and .precision
        "opt_state_scalars": _jsonable(dict(scalars), "optimizer state"),
        "metrics": _jsonable(dict(metrics or {}), "metrics"),
        "extra": _jsonable(dict(extra or {}), "extra"),
    }


def _write(tensors: Mapping[str, Tensor], meta: Mapping[str, Any], target: Path) -> Path:
    """Write a checkpoint directory atomically and durably (see :func:`save`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
    try:
        with open(tmp / TENSORS, "wb") as raw:
            f = _HashingWriter(raw, tensors.values())  # hashes in parallel: no re-read
            with _NoZipCrc() as no_crc:
                f.on_first_write = no_crc.restore
                torch.save(dict(tensors), f)  # type: ignore[arg-type]  # a binary file object
            raw.flush()
            os.fsync(raw.fileno())  # the last chunks hash meanwhile
            checksum = f.checksum()
        with open(tmp / META, "w") as out:
            json.dump({**meta, "files": {TENSORS: checksum}}, out, indent=2, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        _fsync_dir(tmp)
        if target.exists():
            # replace: move the old one aside first so that at every instant one complete
            # checkpoint exists under a known name
            old = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX + "old-", dir=target.parent))
            os.replace(target, old / "ckpt")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            why = "the disk is full" if e.errno == errno.ENOSPC else str(e)
            raise CheckpointError(
                f"could not write checkpoint {target}: {why}; earlier checkpoints are intact"
            ) from e
        raise
    return target


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
) -> Path:
    """Write ``state`` to the checkpoint directory ``path`` atomically and durably.

    Args:
        state: the state to save (read, not consumed).
        path: the checkpoint directory to create; an existing one is replaced atomically.
        metrics: host-side metrics to record in ``meta.json`` (floats).
        extra: JSON-serialisable data to record (listener states, data position, config).
        fingerprint: also record ``state.fingerprint()`` in ``meta.json`` (a second pass over
            every byte, as costly as the write itself).

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: when writing fails (a full disk, say); the previous checkpoint at
            ``path``, if any, is left untouched and the temporary files are removed.

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
    tensors, scalars = _flatten(state)
    return _write(tensors, _meta(state, scalars, metrics, extra, fingerprint), Path(path))


class _Snapshot:
    """Host copies of a state's tensors, made for one asynchronous save at a time."""

    def __init__(self, tensors: Mapping[str, Tensor], signature: tuple[Any, ...]) -> None:
        self.signature = signature
        self.tensors = {k: _buffer_for(t) for k, t in tensors.items()}
        self.events: list[Any] = []
        self.generation = 0

    def fill(self, tensors: Mapping[str, Tensor]) -> None:
        cuda = set()
        for k, t in tensors.items():
            self.tensors[k].copy_(t, non_blocking=t.device.type == "cuda")
            if t.device.type == "cuda":
                cuda.add(t.device)
        # copies from a GPU are queued on its current stream: the writer waits for them, and
        # later work on that stream (the next step updating these tensors) runs after them
        self.events = [torch.cuda.current_stream(d).record_event() for d in cuda]

    def ready(self) -> None:
        for event in self.events:
            event.synchronize()


def _buffer_for(t: Tensor) -> Tensor:
    if t.device.type == "cuda":  # page-locked: the copy from the GPU runs without blocking
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return _host_empty(t.shape, t.dtype)


class _SnapshotBuffers:
    """The host memory that asynchronous saves copy a state into, reused from save to save.

    A fresh buffer costs a page fault per page at its first write, many times the cost of the
    copy itself, so the set of buffers a finished write used is kept (one set, the latest) and
    the next snapshot of a state of the same shapes only copies. A set is lent to exactly one
    pending write and returned when that write ends, so a snapshot never overwrites a buffer a
    write still reads: a save asked for while the previous one is in flight gets a second set.
    A state of other shapes (or dtypes, devices, keys) drops the kept set and allocates anew.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: _Snapshot | None = None
        self._generation = 0  # sets lent before the last release() are not kept

    def take(self, tensors: Mapping[str, Tensor]) -> _Snapshot:
        signature = tuple((k, t.shape, t.dtype, t.device) for k, t in tensors.items())
        with self._lock:
            snapshot, self._idle = self._idle, None  # lent out, or dropped: shapes changed
            generation = self._generation
        if snapshot is None or snapshot.signature != signature:
            snapshot = None  # free the old set before allocating the new one
            snapshot = _Snapshot(tensors, signature)
        snapshot.generation = generation
        snapshot.fill(tensors)
        return snapshot

    def give_back(self, snapshot: _Snapshot) -> None:
        with self._lock:
            if snapshot.generation == self._generation:
                self._idle = snapshot

    def release(self) -> None:
        with self._lock:
            self._idle = None
            self._generation += 1


_SNAPSHOTS = _SnapshotBuffers()


def _write_snapshot(snapshot: _Snapshot, meta: Mapping[str, Any], target: Path) -> Path:
    # Let save_async return first: it is about to, holding the GIL, and this thread, woken by
    # the submission, would otherwise take the GIL from it for a switch interval (5 ms).
    time.sleep(0.001)
    try:
        snapshot.ready()
        return _write(snapshot.tensors, meta, target)
    finally:
        _SNAPSHOTS.give_back(snapshot)


def save_async(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Future[Path]:
    """Snapshot ``state`` now and write it to ``path`` in the background.

    Only the snapshot (a copy of every tensor into host memory kept from the previous
    asynchronous save, see :func:`release_buffers`) blocks the caller; serialising, hashing and
    the fsyncs happen on one writer thread, so saves complete in the order they were asked for.
    Training may go on donating the live state's tensors meanwhile (on a GPU: on the stream that
    was current at the call, so that it runs after the copies). The returned future gives the
    path, or raises what :func:`save` would have; :func:`wait` waits for all of them.

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
    tensors, scalars = _flatten(state)
    try:
        meta = _meta(state, scalars, metrics, extra, fingerprint=False)
    except CheckpointError as e:
        failed: Future[Path] = Future()
        failed.set_exception(e)
        return failed
    snapshot = _SNAPSHOTS.take(tensors)
    try:
        return _WRITER.get().submit(_write_snapshot, snapshot, meta, Path(path))
    except BaseException:
        _SNAPSHOTS.give_back(snapshot)
        raise


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


def clean_leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove half-written checkpoints an interrupted save left in ``directory``."""
    removed = []
    root = Path(directory)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


# --------------------------------------------------------------------------- loading


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, validated for format and version."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a checkpoint: {META} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e}); the file is damaged") from e
    if meta.get("format") != "engine.checkpoint":
        raise CheckpointError(f"{meta_path}: not an engine checkpoint")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format version {version!r} is newer than this engine reads "
            f"({FORMAT_VERSION}); upgrade engine"
        )
    return _decode(meta)


def _decode(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"$float"}:
            return float(x["$float"])
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return x


def _layout(path: Path, mapped: Mapping[str, Tensor]) -> list[tuple[int, Any]] | None:
    """Where in the file each storage ``torch.load(mmap=True)`` mapped lies: ``(offset,
    storage)`` in file order, or None where that cannot be told for certain.

    The offsets come from the zip's own headers; they must match the storages one for one
    (sizes equal, addresses a constant apart: one mapping of the whole file), or None.
    """
    storages = {}
    for t in mapped.values():
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage
    records = []
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as f:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) == 3 and parts[1] == "data" and info.file_size:
                    if info.compress_type != zipfile.ZIP_STORED:
                        return None
                    f.seek(info.header_offset)
                    header = f.read(30)  # the local header: its name and extra field lengths
                    if len(header) < 30 or header[:4] != b"PK\x03\x04":
                        return None
                    name_len, extra_len = struct.unpack("<HH", header[26:30])
                    offset = info.header_offset + 30 + name_len + extra_len
                    records.append((offset, info.file_size))
    except (OSError, zipfile.BadZipFile, struct.error, ValueError):
        return None
    records.sort()
    addresses = sorted(storages)
    if not records or len(records) != len(addresses):
        return None
    base, end = addresses[0] - records[0][0], 0
    for address, (offset, size) in zip(addresses, records, strict=True):
        if address - offset != base or storages[address].nbytes() != size or offset < end:
            return None
        end = offset + size
    return [(offset, storages[a]) for a, (offset, _) in zip(addresses, records, strict=True)]


def _hash_mapped(path: Path, layout: list[tuple[int, Any]]) -> Callable[[], str]:
    """Start hashing ``path`` from the storages ``torch.load(mmap=True)`` mapped (see
    :func:`_layout`), reading only the few bytes between them: the pages the tensors are then
    copied from are read from memory once, and page-mapped once."""
    hasher = _ChunkHasher()
    with open(path, "rb") as f:
        size, pos = os.fstat(f.fileno()).st_size, 0
        for offset, storage in layout:
            if offset > pos:
                f.seek(pos)
                hasher.feed(f.read(offset - pos), copied=True)
            hasher.feed(torch.empty(0, dtype=torch.uint8).set_(storage).numpy().data)
            pos = offset + storage.nbytes()
        if size > pos:
            f.seek(pos)
            hasher.feed(f.read(size - pos), copied=True)
    return hasher.result


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
    from_mapping = np is not None and files[TENSORS].startswith(_SCHEME + ":")
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
                _hash_mapped(path / TENSORS, layout)
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
                f"{path / name}: SHA-256 check failed (expected {_short(digest)}..., got "
                f"{_short(actual)}...); the file is truncated or damaged"
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
    comes from the checkpoint, verified first.

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
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{root}: extra / precision state refers to a missing {e}") from e
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
        opt_state = load_opt_state(template.opt_state, opt)
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
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{root}: the checkpoint's {group} do not fit the model (missing: {missing}; "
            f"unexpected: {unexpected}; mis-shaped: {shapes}); was it saved from another model?"
        )


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
        )
    }
    info["size_bytes"] = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    try:
        _verified_tensors(root, meta, materialize=False)
        info["verified"], info["problem"] = True, None
    except CheckpointError as e:
        info["verified"], info["problem"] = False, str(e)
    return info


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
