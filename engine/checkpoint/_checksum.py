"""Checksums of checkpoint files (private): XXH3-128 over 8 MiB chunks, hashed on worker
threads while a file is written (from the tensors' own memory) or read (from mapped pages).

A chunked checksum lets several cores hash one file; the hash and the chunk size are part of its
definition (``xxh3-128-chunks-8MiB:<hex>`` in ``meta.json``). Older formats are still verified:
version 2 used SHA-256 over the same chunks (``sha256-chunks-8MiB:<hex>``), version 1 one SHA-256
of the whole file (a bare hex digest, :func:`_sha256`).
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import struct
import threading
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor

from engine.errors import CheckpointError

try:
    import numpy as np
except ImportError:  # then every written byte is copied for hashing
    np = None  # type: ignore[assignment]

__all__: list[str] = []

_CHUNK = 8 << 20  # bytes per hashed chunk; part of the checksum's definition
_SCHEME = "xxh3-128-chunks-8MiB"  # how meta.json names it: "xxh3-128-chunks-8MiB:<hex>"
# chunked schemes by name -> a new hash object of their hash; the first is the one written
_SCHEMES: dict[str, Callable[[], Any]] = {
    _SCHEME: xxhash.xxh3_128,  # format version 3; xxhash >= 4 hashes without holding the GIL
    "sha256-chunks-8MiB": hashlib.sha256,  # format version 2
}
_INLINE = 1 << 16  # smaller writes are copied for hashing, not looked up among the tensors
_MAX_COPIED = 64 << 20  # bytes copied and not yet hashed, at most


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


# Hashing threads: xxhash (>= 4) and hashlib release the GIL, so chunks hash in parallel.
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


def _combine(scheme: str, digests: Iterable[bytes]) -> str:
    h = _SCHEMES[scheme]()
    h.update(b"".join(digests))
    return f"{scheme}:{h.hexdigest()}"


class _ChunkHasher:
    """Hashes a file's chunks on the hashing threads, as they become available.

    While the caller still works (writes the file, or copies the tensors out of it), at most one
    thread fewer than there are cores hashes, so that hashing does not slow the caller down;
    :meth:`result` lets every hashing thread in on what is left. The file's bytes are fed in
    order, as buffers that the caller keeps unchanged until :meth:`result` returns. The threads
    wait for nothing but this object's lock, so no use of the shared pool can deadlock.
    """

    def __init__(self, scheme: str = _SCHEME) -> None:
        self.scheme, self.new = scheme, _SCHEMES[scheme]
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
                digest = _hash_segments(self.new(), segments)
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
            return _combine(self.scheme, (d for d in self.digests if d is not None))


def _hash_segments(h: Any, segments: list[Any]) -> bytes:
    for segment in segments:
        h.update(segment)  # releases the GIL: chunks hash in parallel
    return h.digest()


def _start_checksum(path: Path, expected: str) -> Callable[[], str]:
    """Start hashing ``path`` in the scheme of ``expected``; the result gives its checksum.

    A chunked scheme hashes the chunks in parallel straight from the page cache; a bare hex
    digest (format version 1) is one SHA-256 of the whole file, on one thread.
    """
    scheme, sep, _ = expected.rpartition(":")
    if not sep:
        return _HASHERS.get().submit(_sha256, path).result
    if scheme not in _SCHEMES:
        raise CheckpointError(
            f"{path}: unknown checksum scheme {scheme!r} in meta.json; upgrade engine to verify it"
        )
    hasher = _ChunkHasher(scheme)
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
        # the first error of a write to ``raw``: torch.save reports it as a RuntimeError of its
        # own ("unexpected pos"), which does not say that the disk is full
        self.error: OSError | None = None

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
            try:
                self.raw.write(data)
            except OSError as e:
                self.error = self.error or e
                raise
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


def _hash_mapped(path: Path, layout: list[tuple[int, Any]], scheme: str) -> Callable[[], str]:
    """Start hashing ``path`` from the storages ``torch.load(mmap=True)`` mapped (see
    :func:`_layout`), reading only the few bytes between them: the pages the tensors are then
    copied from are read from memory once, and page-mapped once."""
    hasher = _ChunkHasher(scheme)
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
