"""What ``checkpoint.inspect`` reports of a checkpoint (private): its counters and metrics, and of
its files their sizes, the layout, what was checked and whether it passed. A strategy's layout
reports its own files (engine/checkpoint/_layouts.py: for a sharded checkpoint, what DCP's index
holds, not only what ``meta.json`` claims); the phrases and the outcome here are shared."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint import _layouts
from engine.checkpoint._hparams import _hparams_of
from engine.checkpoint._read import _verify_files, read_meta
from engine.errors import CheckpointError

__all__ = ["inspect"]


def checks(meta: Mapping[str, Any], files: str, content: str) -> list[str]:
    """What verifying the checkpoint checks, in order, one phrase each: ``files`` what each file
    ``meta.json`` names is checked to be, ``content`` how its data is read (the layout's)."""
    n = len(meta.get("files") or {})
    return [
        "meta.json: its own checksum, format version and schema",
        f"files: the {n} meta.json names, {files}",
        "sizes: each file's size, as meta.json records it (before hashing)"
        if "sizes" in meta
        else "sizes: not recorded (format version < 5)",
        "checksums: each file's, as meta.json records it",
        content,
    ]


def outcome(check: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """What ``check()`` returned (``None`` if it refused the checkpoint), and ``inspect``'s
    ``verified`` and ``problem``."""
    try:
        return check(), {"verified": True, "problem": None}
    except CheckpointError as e:
        return None, {"verified": False, "problem": str(e)}


def inspected(root: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The file-level part of ``checkpoint.inspect``'s summary of a full checkpoint."""
    info: dict[str, Any] = {
        "size_bytes": sum(f.stat().st_size for f in root.iterdir() if f.is_file()),
        "layout": "full",
        "world_size": meta.get("world_size", 1),
        "tensors": None,
        "checked": checks(
            meta,
            "each a plain name and a regular file of the checkpoint (a link only to a file "
            "beside it)",
            "tensors.pt: read with torch.load(weights_only=True): no code runs",
        ),
        "index": None,
    }
    info.update(outcome(lambda: _verify_files(root, meta))[1])
    return info


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
    # sizes, layout, what was checked and whether it passed; a strategy's layout its own (what a
    # sharded checkpoint's index holds)
    layout = _layouts.of_meta(meta)
    info.update(inspected(root, meta) if layout is None else layout.inspected(root, meta))
    return info
