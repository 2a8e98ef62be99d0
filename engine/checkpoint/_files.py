"""A checkpoint directory's contents and its atomic write primitives (private), shared by full
checkpoints (the rest of ``engine.checkpoint``) and sharded ones (``engine.parallel._dcp``); it
imports neither.

What a TrainState becomes on disk: its tensors as one flat ``{key: tensor}`` dict
(:func:`_flatten`: ``params/<name>``, ``opt_state/<path>``, ...) and the record ``meta.json``
holds but for the checksums (:func:`_describe`). How a save puts it there: the target must be a
checkpoint it may replace (:func:`_replaceable`), a :class:`_Claim` locks the save's temporary
names beside it, and :func:`_publish` renames the complete directory into place and makes the
rename durable (:func:`_fsync_dir`); :func:`_write_failed` is the error of a write that failed.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

try:
    import fcntl
except ImportError:  # not POSIX: leftovers cannot be told from saves in progress
    fcntl = None  # type: ignore[assignment]

from engine import _version
from engine.checkpoint import _tree
from engine.checkpoint._meta import FORMAT_VERSION
from engine.errors import CheckpointError
from engine.optim.base import state_dict as opt_state_dict
from engine.state import TrainState

META, TENSORS = "meta.json", "tensors.pt"
_TMP_PREFIX = ".tmp-ckpt-"
_ASIDE = "old-"  # _TMP_PREFIX + _ASIDE + id: where a checkpoint being replaced is moved aside
_LOCK = "lock-"  # _TMP_PREFIX + _LOCK + id: the lock a save holds while it writes (_Claim)
_DOOMED = "del-"  # _TMP_PREFIX + _DOOMED + id: a checkpoint being deleted (checkpoint.remove)


# ------------------------------------------------------------------- what a checkpoint holds


def _flatten(
    state: TrainState,
    weights_only: bool = False,
    rank_grad_accum: Sequence[Mapping[str, Tensor]] = (),
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    for group in ("params", "buffers"):
        for k, t in getattr(state, group).items():
            tensors[f"{group}/{k}"] = t.detach()
    if weights_only:  # the model alone: no optimizer, accumulation or extra state
        return tensors, scalars
    for k, t in (state.grad_accum or {}).items():
        tensors[f"grad_accum/{k}"] = t.detach()
    if rank_grad_accum and state.grad_accum is None:
        raise CheckpointError(
            "rank_grad_accum= gives the partial gradient sums of other ranks, but the state "
            "has none of its own (state.grad_accum is None: saved at an optimizer step)"
        )
    own = set(state.grad_accum or {})
    for rank, sums in enumerate(rank_grad_accum, start=1):
        if set(sums) != own:
            raise CheckpointError(
                f"rank_grad_accum[{rank - 1}] (rank {rank}'s partial gradient sums) names other "
                f"parameters than state.grad_accum: {sorted(set(sums) ^ own)}"
            )
        for k, t in sums.items():
            tensors[f"{_RANK_GRADS}{rank}/{k}"] = t.detach()
    for k, v in opt_state_dict(state.opt_state).items():
        if isinstance(v, Tensor):
            tensors[f"opt_state/{k}"] = v.detach()
        else:
            scalars[k] = v
    _tree_docs(state, tensors)  # the user's extra and the precision state
    return tensors, scalars


# the group of rank r's partial gradient sum (r >= 1; rank 0's is "grad_accum"): a data-parallel
# run saved inside an accumulation window, where each rank has summed its own micro-batches
_RANK_GRADS = "grad_accum@"

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


def _describe(
    state: TrainState,
    scalars: Mapping[str, Any],
    metrics: Mapping[str, float] | None,
    extra: Mapping[str, Any] | None,
    fingerprint: bool,
    weights_only: bool = False,
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
        "fingerprint": state.fingerprint() if fingerprint and not weights_only else None,
        "num_params": state.num_params(),
        "weights_only": weights_only,  # then params and buffers only: it cannot resume a fit
        "has_grad_accum": state.grad_accum is not None and not weights_only,
        "trees": {} if weights_only else _tree_docs(state),  # TrainState.extra and .precision
        "opt_state_scalars": _jsonable(dict(scalars), "optimizer state"),
        "metrics": _jsonable(dict(metrics or {}), "metrics"),
        "extra": _jsonable(dict(extra or {}), "extra"),
    }


def _engine_version() -> str:
    return _version.__version__


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


# --------------------------------------------------------------------- writing it atomically


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replaceable(target: Path) -> None:
    """Refuse to replace (and so delete) what is not a checkpoint: a file, or a directory with
    something in it but no ``meta.json``; and a target whose parent cannot be a directory.

    The target is looked at once (``lstat``, then its names): a pending asynchronous save to the
    same path may move the old checkpoint aside at any instant, and a directory gone by the
    time it is listed was a checkpoint being replaced; so was one listed without its
    ``meta.json`` while it was being deleted aside (the path then names another directory).
    """
    try:
        first = os.lstat(target)
    except OSError:  # not there (or its parent is no directory: refused below)
        first = None
    if first is not None:
        if not stat.S_ISDIR(first.st_mode):  # a file, or a symbolic link
            raise CheckpointError(
                f"{target} exists and is not a checkpoint directory; engine replaces only "
                "checkpoints: save to another path, or remove it yourself"
            )
        try:
            names = os.listdir(target)
        except FileNotFoundError:  # moved aside meanwhile by the write replacing it
            names = []
        # a listing without meta.json of a directory the path no longer names was read while a
        # pending write moved it aside and deleted it (meta.json first): a checkpoint, replaced
        if names and META not in names and not _replaced_since(target, first):
            raise CheckpointError(
                f"{target} is a directory with files but no {META}, not a checkpoint; engine "
                "replaces only checkpoints (and empty directories): save to another path"
            )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the directory of checkpoint {target}: {e}") from e


def _replaced_since(target: Path, first: os.stat_result) -> bool:
    """Whether ``target`` is no longer the directory ``first`` described (gone, or another)."""
    try:
        now = os.lstat(target)
    except OSError:
        return True
    return (now.st_dev, now.st_ino) != (first.st_dev, first.st_ino)


def _publish(claim: _Claim, tmp: Path, target: Path) -> None:
    """Rename the complete, fsynced checkpoint directory ``tmp`` to ``target`` (replacing a
    checkpoint there) and make the rename durable; on failure ``target`` is as it was."""
    old = None
    try:
        if target.exists():
            # replace: move the old one aside first, under its own name, so that at every
            # instant one complete checkpoint exists where clean_leftovers finds it (a crash
            # between these two renames leaves it aside; clean_leftovers puts it back)
            old = claim.path(_ASIDE)
            old.mkdir()
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        if old is not None and (old / target.name).exists():
            if not os.path.lexists(target):  # interrupted between the renames: put it back
                os.replace(old / target.name, target)
            shutil.rmtree(old, ignore_errors=True)
        raise


def _write_failed(target: Path, error: OSError, writing: str, existed: bool) -> CheckpointError:
    """The error of a save that could not write ``target`` (``writing``: the file it was at)."""
    full = error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    at = f" while writing {writing}" if writing else ""
    why = f"the disk is full ({error.strerror}{at})" if full else f"{error}{at}"
    kept = (
        f"nothing was replaced: the previous checkpoint at {target} is intact"
        if existed
        else "nothing was replaced: earlier checkpoints are intact"
    )
    todo = (
        f"free space on the file system of {target.parent}, or save elsewhere"
        if full
        else "check that the directory is writable, or save elsewhere"
    )
    return CheckpointError(
        f"could not write checkpoint {target}: {why}; {kept} and the partial files were "
        f"removed. {todo[0].upper()}{todo[1:]}"
    )


class _Claim:
    """A save's claim on its temporary names in a directory, held for the length of the write.

    ``.tmp-ckpt-lock-<id>`` is created first and locked (``flock``, released by the kernel when
    the writer's process dies, whatever its pid or pid namespace); the save's temporary
    directory ``.tmp-ckpt-<id>`` and the one it moves a replaced checkpoint into,
    ``.tmp-ckpt-old-<id>``, come after, and the lock file goes last.
    :func:`engine.checkpoint.clean_leftovers` touches the names of an ``<id>`` only when it can
    take that lock itself.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __enter__(self) -> _Claim:
        while True:
            fd, lock = tempfile.mkstemp(prefix=_TMP_PREFIX + _LOCK, dir=self.directory)
            if fcntl is None:
                break
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: nobody else holds it
            try:  # unless a cleaner took it for a dead save's before it was locked: anew
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd, self.lock = fd, Path(lock)
        self.id = self.lock.name[len(_TMP_PREFIX + _LOCK) :]
        return self

    def path(self, kind: str) -> Path:
        return self.directory / f"{_TMP_PREFIX}{kind}{self.id}"

    def __exit__(self, *exc: object) -> None:
        self.lock.unlink(missing_ok=True)
        os.close(self.fd)


def _read_own(file: Path) -> bytes:
    """The bytes of ``file``, a file of the checkpoint directory it is named in: a symbolic
    link is followed only to a file beside it (as for the files ``meta.json`` names)."""
    if file.is_symlink():
        real = os.path.realpath(file)
        if os.path.dirname(real) != os.path.realpath(file.parent):
            raise CheckpointError(
                f"{file}: a symbolic link to {real}, outside the checkpoint directory; a "
                "checkpoint reads only files of its own: refused"
            )
    return file.read_bytes()


def _short(checksum: str) -> str:
    """A checksum as error messages show it: the first 16 characters after its scheme."""
    return checksum.rpartition(":")[2][:16]
