"""Paths that a file names, kept inside the directory they belong to (private).

A ModelCheckpoint's state, restored from a checkpoint's ``meta.json``, names checkpoints by
path (``best_k_models``, ``best_model_path``, ...); the listener loads from them
(``ckpt_path="best"``) and deletes them (a checkpoint that left the top k). A checkpoint may
have been edited and re-signed by anyone (its checksums are unkeyed), so such a path is taken
only where it names an entry directly in the listener's directory, where it writes every
checkpoint.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

__all__: list[str] = []


def directly_in(path: Any, directory: Any) -> bool:
    """Whether ``path`` names an entry directly inside ``directory`` (``..`` and links of the
    directories above it resolved; the entry itself may be a link, which a removal unlinks)."""
    if not isinstance(path, str) or not path or not isinstance(directory, str):
        return False
    name = os.path.normpath(os.path.abspath(path))
    return os.path.realpath(os.path.dirname(name)) == os.path.realpath(directory)


_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


def confined(state: Mapping[str, Any], dirpath: Any) -> tuple[dict[str, Any], bool]:
    """``state`` (from a checkpoint's ``meta.json``) without the paths that do not lie directly
    in its ``dirpath``, where a ModelCheckpoint writes every checkpoint (a path from a file is
    never one to load from or to delete outside that directory), and whether any was."""
    out = dict(state)
    outside = [out[k] for k in _PATHS if out.get(k) and not directly_in(out[k], dirpath)]
    for k in _PATHS:
        if out.get(k) and not directly_in(out[k], dirpath):
            out[k] = ""
    models = out.get("best_k_models")
    if isinstance(models, Mapping):
        outside += [p for p in models if not directly_in(p, dirpath)]
        out["best_k_models"] = {p: v for p, v in models.items() if directly_in(p, dirpath)}
    if outside:
        warnings.warn(
            f"ModelCheckpoint: the checkpoint's state names paths outside its directory "
            f"{dirpath!r} ({', '.join(map(repr, outside))}); they are left out (never loaded "
            "or removed): the checkpoint was edited",
            UserWarning,
            stacklevel=3,
        )
    return out, bool(outside)
