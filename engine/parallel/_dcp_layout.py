"""The sharded checkpoint layout (private): FSDP's checkpoints, written and read through
``torch.distributed.checkpoint`` (engine/parallel/_dcp.py), behind the checkpoint code's seam
(:class:`engine.checkpoint._layouts.Layout`). ``engine.parallel`` registers it under
``"sharded"`` when it is imported (:func:`register`).

What ``checkpoint.inspect`` reports of a sharded checkpoint's files is this layout's too: the
shards' sizes, and what DCP's index holds (engine/parallel/_dcp_index.py), not only what
``meta.json`` claims.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch import Tensor

from engine.checkpoint import _layouts, _report
from engine.checkpoint._meta import SHARDED, SHARDS
from engine.parallel import _dcp_index
from engine.state import TrainState

__all__: list[str] = []


def _io() -> Any:
    """engine/parallel/_dcp.py, imported when a sharded checkpoint is first used: it imports
    torch's DTensor and DCP (~0.4 s), which a process that never shards does not pay for (and
    where ``TrainState.sharded`` stays one lookup in ``sys.modules``)."""
    from engine.parallel import _dcp

    return _dcp


class DCPLayout:
    """:class:`engine.checkpoint._layouts.Layout` of a sharded state and checkpoint: each method
    the function of engine/parallel/_dcp.py of its name (``inspected``: its own)."""

    def save(self, state: TrainState, target: Path, **kwargs: Any) -> Path:
        return _io().save(state, target, **kwargs)

    def save_async(self, state: TrainState, target: Path, **kwargs: Any) -> Future[Path]:
        return _io().save_async(state, target, **kwargs)

    def verify(self, root: Path, meta: Mapping[str, Any]) -> Any:
        return _io().verify(root, meta)

    def read(self, root: Path, meta: Mapping[str, Any], template: TrainState) -> dict[str, Tensor]:
        return _io().read(root, meta, template)

    def read_weights(
        self, root: Path, meta: Mapping[str, Any], devices: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        return _io().read_weights(root, meta, devices)

    def placed_like(self, template: TrainState, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return _io().placed_like(template, tensors)

    def inspected(self, root: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
        """The file-level part of ``checkpoint.inspect``'s summary: with the shards' sizes, the
        tensors ``meta.json`` describes, and what the index holds, read safely also when a
        check failed."""
        info: dict[str, Any] = {
            "size_bytes": sum(f.stat().st_size for f in root.iterdir() if f.is_file()),
            "layout": SHARDED,
            "world_size": meta.get("world_size", 1),
            "tensors": meta.get("tensors"),
            "checked": _report.checks(
                meta,
                "each a plain name and a regular file of the checkpoint (no link out of it), and "
                "no other file",
                "index: shards/.metadata read without running code and checked against "
                "meta.json (the same tensors, shapes and dtypes; chunks that tile each tensor; "
                "each in a file meta.json names, inside its size)",
            ),
            "index": None,
        }
        if (root / SHARDS).is_dir() and not (root / SHARDS).is_symlink():
            shards = root / SHARDS
            info["size_bytes"] += sum(f.stat().st_size for f in shards.iterdir() if f.is_file())
        index, verified = _report.outcome(lambda: self.verify(root, meta))
        info.update(verified)
        try:  # what the index holds, also when it failed a check (read safely all the same)
            if index is None and _own_index(root, meta):
                index = _dcp_index.read(root)
            info["index"] = None if index is None else _dcp_index.describe(index)
        except Exception:  # unreadable or refused: "problem" says why
            info["index"] = None
        return info


def _own_index(root: Path, meta: Mapping[str, Any]) -> bool:
    """Whether ``shards/.metadata`` is the checkpoint's own file, of the size recorded (not
    through a link out of it): the only index inspect reads after a failed check."""
    shards = root / SHARDS
    if os.path.islink(shards) or os.path.realpath(shards) != os.path.join(
        os.path.realpath(root), SHARDS
    ):
        return False
    st = os.lstat(shards / _dcp_index.INDEX)
    recorded = (meta.get("sizes") or {}).get(f"{SHARDS}/{_dcp_index.INDEX}")
    return stat.S_ISREG(st.st_mode) and st.st_size == recorded


def register() -> None:
    """Make this the checkpoint layout of sharded states and checkpoints (``"sharded"``)."""
    _layouts.register(SHARDED, DCPLayout())
