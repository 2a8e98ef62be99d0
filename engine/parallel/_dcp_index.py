"""A sharded checkpoint's index (private): DCP's ``shards/.metadata``, read safely and checked
against ``meta.json`` before any shard is read; and every call into DCP, its failures made
engine's.

The index says where each chunk of each tensor lies: a ``relative_path`` (a file name under
``shards/``), an offset and a length in that file. ``meta.json`` is checked (its checksum, every
file's size and checksum) before the index is trusted, but its checksums are unkeyed: anyone
can recompute them. So the index is checked against ``meta.json`` as an attacker's file:

* every entry names a plain file name that ``meta.json``'s ``files`` lists (as
  ``shards/<name>``, not the index itself), and a byte range inside that file's recorded size;
  no stream transform (DCP's compression extensions: engine writes none);
* the index describes exactly the tensors ``meta.json`` does: the same keys, each with the
  shape and dtype recorded, and chunks that tile the tensor (inside its shape, no overlap,
  every element covered), each chunk stored once.

:func:`checked` returns the index so checked; the loaders hand that very object to DCP (the file
is not read twice). :func:`dcp_call` wraps a call into DCP: its ``CheckpointException`` (a
``BaseException`` whose message is a nested traceback) and any other failure become one
:class:`~engine.errors.CheckpointError` naming the checkpoint and the first cause;
``KeyboardInterrupt`` and ``SystemExit`` pass through unchanged.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from engine.checkpoint._meta import SHARDS, plain_name
from engine.errors import CheckpointError

__all__: list[str] = []

INDEX = ".metadata"  # DCP's index file, in shards/
_T = TypeVar("_T")


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths; anything else
    in ``.metadata`` is refused, so no code from a file runs (its bytes are verified first)."""

    _CLASSES: ClassVar[dict[str, set[str]]] = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
        "torch": {"Size"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read(root: Path) -> Any:
    """DCP's ``shards/.metadata`` of the checkpoint at ``root``, unpickled safely (see
    :class:`_IndexUnpickler`); its contents not yet checked (:func:`checked` does)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = root / SHARDS / INDEX
    try:
        index = _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as e:
        raise CheckpointError(
            f"{path}: refused: {e}. engine reads only DCP's tensor metadata from it and never "
            "runs code from a file"
        ) from e
    if not isinstance(index, Metadata) or not all(
        isinstance(m, TensorStorageMetadata) for m in index.state_dict_metadata.values()
    ):
        raise CheckpointError(f"{path}: not an index of tensors written by engine; refused")
    return index


def checked(root: Path, meta: Mapping[str, Any]) -> Any:
    """The index of the sharded checkpoint at ``root``, read safely and checked against its
    ``meta.json`` (``meta``, already verified with its files' sizes and checksums): see the
    module. Nothing under ``shards/`` but the index is opened.

    Raises:
        CheckpointError: naming the checkpoint, the index entry and the path or value that is
            wrong.
    """
    index = read(root)
    check = _Check(root, meta)
    try:
        check.index(index)
    except CheckpointError:
        raise
    except Exception as e:  # a value of another type where DCP's classes hold one
        raise check.refuse("(its structure)", f"malformed ({one_line(e)})") from e
    return index


def _volume(sizes: Any) -> int:
    return math.prod(int(n) for n in sizes)


def _ints(xs: Any, n: int) -> bool:
    return (
        isinstance(xs, (torch.Size, tuple, list))
        and len(xs) == n
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    )


class _Check:
    """The checks of :func:`checked`, each failure a ``CheckpointError`` of :meth:`refuse`."""

    def __init__(self, root: Path, meta: Mapping[str, Any]) -> None:
        self.root, self.meta = root, meta
        self.path = root / SHARDS / INDEX

    def refuse(self, entry: str, problem: str) -> CheckpointError:
        return CheckpointError(
            f"{self.root}: the sharded index {self.path}, entry {entry}: {problem}; the index "
            "and meta.json disagree (the checkpoint was edited or is damaged): refused before "
            "reading any shard"
        )

    def index(self, index: Any) -> None:
        described: Mapping[str, Any] = self.meta["tensors"]
        held = index.state_dict_metadata
        missing, unknown = sorted(set(described) - set(held)), sorted(set(held) - set(described))
        if missing or unknown:
            raise self.refuse(
                repr((unknown or missing)[0]),
                f"the index holds tensors meta.json does not describe ({unknown}) or lacks some "
                f"it does ({missing})",
            )
        chunks: set[tuple[str, tuple[int, ...]]] = set()
        for key, md in held.items():
            chunks |= self.tensor(key, md, described[key])
        self.storage(index.storage_data, chunks)
        if index.planner_data is not None and not isinstance(index.planner_data, dict):
            raise self.refuse("planner_data", f"{type(index.planner_data).__name__}, not a dict")

    def tensor(self, key: str, md: Any, described: Mapping[str, Any]) -> set[Any]:
        """``key``'s description in the index against meta.json's; its chunks, checked to tile
        the tensor."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

        shape = tuple(described["shape"])
        props = md.properties
        if not isinstance(props, TensorProperties) or props.dtype != getattr(
            torch, described["dtype"], None
        ):
            dtype = getattr(props, "dtype", None)
            raise self.refuse(
                repr(key), f"dtype {dtype}, where meta.json records {described['dtype']}"
            )
        if props.layout is not torch.strided:
            raise self.refuse(repr(key), f"layout {props.layout}, not a dense tensor's")
        if not _ints(md.size, len(md.size)) or tuple(md.size) != shape:
            raise self.refuse(
                repr(key), f"shape {list(md.size)}, where meta.json records {list(shape)}"
            )
        seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for chunk in md.chunks:
            at = f"{key!r} (chunk at {list(getattr(chunk, 'offsets', ()))})"
            if not (
                isinstance(chunk, ChunkStorageMetadata)
                and _ints(chunk.offsets, len(shape))
                and _ints(chunk.sizes, len(shape))
                and all(
                    o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, shape, strict=True)
                )
            ):
                raise self.refuse(
                    at,
                    f"a chunk of sizes {list(getattr(chunk, 'sizes', ()))} that does not lie "
                    f"inside the tensor's shape {list(shape)}",
                )
            seen.append((tuple(chunk.offsets), tuple(chunk.sizes)))
        pair = _overlapping(seen, shape)
        if pair is not None:
            a, b = (list(seen[i][0]) for i in pair)
            raise self.refuse(f"{key!r} (chunk at {a})", f"the chunk overlaps the one at {b}")
        if sum(_volume(s) for _, s in seen) != _volume(shape):
            raise self.refuse(
                repr(key),
                f"its chunks cover {sum(_volume(s) for _, s in seen)} of the "
                f"{_volume(shape)} elements of shape {list(shape)}",
            )
        return {(key, o) for o, _ in seen}

    def storage(self, storage: Any, chunks: set[tuple[str, tuple[int, ...]]]) -> None:
        """Where each chunk lies: one entry per chunk, in a file of this checkpoint, inside its
        recorded size."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if not isinstance(storage, dict):
            raise self.refuse("storage_data", f"{type(storage).__name__}, not a dict")
        files, sizes = self.meta["files"], self.meta.get("sizes") or {}
        data = sorted(n for n in files if n != f"{SHARDS}/{INDEX}")
        stored: set[tuple[str, tuple[int, ...]]] = set()
        for where, info in storage.items():
            if not isinstance(where, MetadataIndex) or not isinstance(info, _StorageInfo):
                raise self.refuse(repr(where), "not a chunk's storage record")
            chunk = (where.fqn, tuple(where.offset or ()))
            entry = f"{where.fqn!r} (chunk at {list(chunk[1])})"
            rel = info.relative_path
            name = f"{SHARDS}/{rel}" if isinstance(rel, str) else None
            if not plain_name(rel) or name not in files or rel == INDEX:
                raise self.refuse(
                    entry,
                    f"its relative_path {rel!r} is not a plain file name of this checkpoint "
                    f"(meta.json's files under {SHARDS}/: {data}); a checkpoint reads only its "
                    "own files",
                )
            if chunk not in chunks:
                raise self.refuse(entry, "no tensor of the index has a chunk there")
            stored.add(chunk)
            offset, length = info.offset, info.length
            size = sizes.get(name)
            if not (_ints((offset, length), 2) and (size is None or offset + length <= size)):
                raise self.refuse(
                    entry,
                    f"bytes {offset!r}..+{length!r} of {self.root / name}, outside the file "
                    f"({size} bytes recorded in meta.json)",
                )
            if info.transform_descriptors:
                raise self.refuse(
                    entry,
                    f"stream transforms {list(info.transform_descriptors)} (engine writes none)",
                )
        if stored != chunks:
            key, at = sorted(chunks - stored)[0]
            raise self.refuse(f"{key!r} (chunk at {list(at)})", "no storage record for the chunk")


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: Any) -> Any:
    """The indices ``(i, j)`` of two boxes (offsets, sizes) inside ``shape`` that share an
    element, or None. Row slabs (FSDP's ``Shard(0)``: each box spans every other dimension)
    are sorted and compared with their neighbours; other boxes pair by pair, vectorized a block
    of rows at a time (a tensor saved by thousands of ranks has thousands of chunks)."""
    n, dims = len(boxes), len(shape)
    if n < 2:
        return None
    if dims and all(s[1:] == tuple(shape[1:]) for _, s in boxes):
        order = sorted((o[0], o[0] + s[0], i) for i, (o, s) in enumerate(boxes) if s[0])
        for (_, end, i), (begin, _, j) in itertools.pairwise(order):
            if begin < end:
                return i, j
        return None
    lo = torch.tensor([o for o, _ in boxes], dtype=torch.int64).reshape(n, dims)
    hi = lo + torch.tensor([s for _, s in boxes], dtype=torch.int64).reshape(n, dims)
    for start in range(0, n, 256):
        rows = slice(start, min(start + 256, n))
        inter = torch.minimum(hi[rows, None], hi[None]) - torch.maximum(lo[rows, None], lo[None])
        shared = inter.clamp(min=0).prod(-1)  # (rows, n): elements in common; itself too
        own = torch.arange(rows.start, rows.stop)
        shared[own - start, own] = 0
        found = shared.nonzero()
        if len(found):
            return start + int(found[0, 0]), int(found[0, 1])
    return None


def describe(index: Any) -> dict[str, Any]:
    """What the index holds, for ``engine inspect``: each tensor's shape and dtype and where
    each chunk lies (file, byte offset and length, the chunk's offsets and sizes)."""
    where: dict[tuple[str, tuple[int, ...]], Any] = {
        (k.fqn, tuple(k.offset or ())): v for k, v in (index.storage_data or {}).items()
    }
    out: dict[str, Any] = {}
    for key, md in sorted(index.state_dict_metadata.items()):
        chunks = []
        for c in md.chunks:
            info = where.get((key, tuple(c.offsets)))
            chunks.append(
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "file": None if info is None else f"{SHARDS}/{info.relative_path}",
                    "bytes": None if info is None else [info.offset, info.length],
                }
            )
        dtype = str(md.properties.dtype).removeprefix("torch.")
        out[key] = {"shape": list(md.size), "dtype": dtype, "chunks": chunks}
    return out


# --------------------------------------------------------------------------- calls into DCP


def first_cause(error: BaseException) -> BaseException:
    """The exception behind DCP's ``CheckpointException`` (the lowest rank's, unwrapped to the
    first that is not one)."""
    from torch.distributed.checkpoint.api import CheckpointException

    while isinstance(error, CheckpointException) and error.failures:
        rank = min(error.failures)
        error = error.failures[rank][0]
    return error


def one_line(error: BaseException) -> str:
    """``Type: message``, the message's first line (at most 300 characters)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 300 else f"{text[:300]}..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def dcp_call(
    root: Path, doing: str, fn: Callable[..., _T], *args: Any, then: str = "", **kwargs: Any
) -> _T:
    """``fn(*args, **kwargs)``, a call into DCP for the checkpoint at ``root``: any failure a
    ``CheckpointError`` naming ``root``, ``doing`` and the first cause in one line (the cause
    chained; ``then`` ends the message); ``KeyboardInterrupt`` and ``SystemExit`` pass through,
    also from inside DCP's ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        cause = first_cause(e)
        if isinstance(cause, (KeyboardInterrupt, SystemExit)):
            raise cause from None
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(
            f"{root}: {doing} failed in torch.distributed.checkpoint: {one_line(cause)}{then}"
        ) from cause
