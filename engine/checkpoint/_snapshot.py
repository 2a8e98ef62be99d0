"""Host buffers that asynchronous checkpoint saves copy a state into (private), kept and reused
from save to save so that a snapshot only copies.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

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
