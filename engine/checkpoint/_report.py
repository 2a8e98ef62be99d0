"""What ``checkpoint.inspect`` reports of a checkpoint's files (private): their sizes, the
layout, what was checked and whether it passed, and for a sharded checkpoint what its index
holds (engine/_shard_index.py), not only what ``meta.json`` claims."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine import _shard_index
from engine.checkpoint import _meta
from engine.checkpoint._hparams import _hparams_of
from engine.checkpoint._read import _verify_files, read_meta
from engine.errors import CheckpointError

__all__ = ["inspect"]


def checks(meta: Mapping[str, Any], sharded: bool) -> list[str]:
    """What verifying the checkpoint checks, in order, one phrase each."""
    n = len(meta.get("files") or {})
    done = [
        "meta.json: its own checksum, format version and schema",
        f"files: the {n} meta.json names, each a plain name and a regular file of the "
        "checkpoint (no link out of it), and no other file"
        if sharded
        else f"files: the {n} meta.json names, each a plain name and a regular file of the "
        "checkpoint (a link only to a file beside it)",
        "sizes: each file's size, as meta.json records it (before hashing)"
        if "sizes" in meta
        else "sizes: not recorded (format version < 5)",
        "checksums: each file's, as meta.json records it",
    ]
    if sharded:
        done.append(
            "index: shards/.metadata read without running code and checked against meta.json "
            "(the same tensors, shapes and dtypes; chunks that tile each tensor; each in a file "
            "meta.json names, inside its size)"
        )
    else:
        done.append("tensors.pt: read with torch.load(weights_only=True): no code runs")
    return done


def inspected(
    root: Path, meta: Mapping[str, Any], verify_files: Callable[[Path, Mapping[str, Any]], Any]
) -> dict[str, Any]:
    """The file-level part of ``checkpoint.inspect``'s summary; ``verify_files`` checks every
    file (and returns a sharded checkpoint's checked index)."""
    sharded = meta.get("layout") == _meta.SHARDED
    info: dict[str, Any] = {
        "size_bytes": sum(f.stat().st_size for f in root.iterdir() if f.is_file()),
        "layout": _meta.SHARDED if sharded else "full",
        "world_size": meta.get("world_size", 1),
        "tensors": meta.get("tensors") if sharded else None,
        "checked": checks(meta, sharded),
        "index": None,
    }
    if sharded and (root / _meta.SHARDS).is_dir() and not (root / _meta.SHARDS).is_symlink():
        shards = root / _meta.SHARDS
        info["size_bytes"] += sum(f.stat().st_size for f in shards.iterdir() if f.is_file())
    index = None
    try:
        index = verify_files(root, meta)
        info["verified"], info["problem"] = True, None
    except CheckpointError as e:
        info["verified"], info["problem"] = False, str(e)
    if sharded:
        try:  # what the index holds, also when it failed a check (read safely all the same)
            if index is None and _own_index(root, meta):
                index = _shard_index.read(root)
            info["index"] = None if index is None else _shard_index.describe(index)
        except Exception:  # unreadable or refused: "problem" says why
            info["index"] = None
    return info


def _own_index(root: Path, meta: Mapping[str, Any]) -> bool:
    """Whether ``shards/.metadata`` is the checkpoint's own file, of the size recorded (not
    through a link out of it): the only index inspect reads after a failed check."""
    shards = root / _meta.SHARDS
    if os.path.islink(shards) or os.path.realpath(shards) != os.path.join(
        os.path.realpath(root), _meta.SHARDS
    ):
        return False
    st = os.lstat(shards / _shard_index.INDEX)
    recorded = (meta.get("sizes") or {}).get(f"{_meta.SHARDS}/{_shard_index.INDEX}")
    return stat.S_ISREG(st.st_mode) and st.st_size == recorded


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """``shards/__0_0.distcp[0:3, 0:3]``: a chunk's file and the slice of the tensor it holds
    (``[]`` for a 0-dim tensor)."""
    dims = ", ".join(f"{o}:{o + s}" for o, s in zip(chunk["offsets"], chunk["sizes"], strict=True))
    return f"{chunk['file']}[{dims}]"


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
    info.update(inspected(root, meta, _verify_files))
    return info
