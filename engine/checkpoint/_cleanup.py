"""Removing checkpoints (private): :func:`remove`, as safely as a save writes one, and
:func:`clean_leftovers`, what interrupted saves, replacements and removals left behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: leftovers cannot be told from saves in progress
    fcntl = None  # type: ignore[assignment]

from engine.checkpoint._files import _ASIDE, _DOOMED, _LOCK, _TMP_PREFIX, META, _Claim, _fsync_dir
from engine.checkpoint._lock import _remove_stale_run_lock
from engine.checkpoint._read import verify
from engine.errors import CheckpointError

__all__ = ["clean_leftovers", "remove"]


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
