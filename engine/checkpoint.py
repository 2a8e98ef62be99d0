"""Checkpoints: a versioned, verifiable on-disk form of a TrainState, written atomically.

A checkpoint is a directory::

    step=000120/
        meta.json      format version, engine/torch versions, counters, seed, metrics,
                       the optimizer state's scalar leaves, and a SHA-256 per file
        tensors.pt     every tensor (params, buffers, accumulated grads, optimizer state)
                       as one flat ``{key: tensor}`` dict, loaded with weights_only=True

Writes go to a hidden temporary directory beside the target, every file is fsynced, then the
directory is renamed into place and its parent fsynced: a crash at any instant leaves earlier
checkpoints intact, and :func:`clean_leftovers` removes a half-written one. Loading verifies every
checksum before it unpickles anything and never executes code (``torch.load(weights_only=True)``;
a payload that needs more is refused).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

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
    "save",
    "save_async",
    "wait",
]

FORMAT_VERSION = 1
META, TENSORS = "meta.json", "tensors.pt"
_TMP_PREFIX = ".tmp-ckpt-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, of another format, or does not fit the state."""


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
    return tensors, scalars


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _HashingWriter(io.RawIOBase):
    """A write-only file that forwards to ``raw`` and SHA-256s what passes through."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.hash.update(b)
        n = self.raw.write(b)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.adam(1e-3), seed=7)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/step=0")
        ...     back = checkpoint.load(path, state)
        ...     back.fingerprint() == state.fingerprint()
        True
    """
    state.check_alive("checkpoint.save()")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors, scalars = _flatten(state)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
    try:
        with open(tmp / TENSORS, "wb") as raw:
            f = _HashingWriter(raw)  # checksum the bytes as they are written: no re-read
            torch.save(tensors, f)  # type: ignore[arg-type]  # a binary file object
            raw.flush()
            os.fsync(raw.fileno())
        meta = {
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
            "opt_state_scalars": _jsonable(scalars, "optimizer state"),
            "metrics": _jsonable(dict(metrics or {}), "metrics"),
            "extra": _jsonable(dict(extra or {}), "extra"),
            "files": {TENSORS: f.hexdigest()},
        }
        with open(tmp / META, "w") as out:
            json.dump(meta, out, indent=2, sort_keys=True)
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


_WRITER: ThreadPoolExecutor | None = None


def save_async(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Future[Path]:
    """Snapshot ``state`` now and write it to ``path`` in the background.

    Only the snapshot (a copy of every tensor) blocks the caller; hashing, serialising and the
    fsyncs happen on one writer thread, so saves complete in the order they were asked for.
    Training may go on donating the live state's tensors meanwhile. The returned future gives
    the path, or raises what :func:`save` would have; :func:`wait` waits for all of them.

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
    global _WRITER
    snapshot = state.copy()
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-checkpoint")
    return _WRITER.submit(save, snapshot, path, metrics=metrics, extra=extra)


def wait() -> None:
    """Block until every asynchronous save has finished (errors surface through the futures)."""
    if _WRITER is not None:
        _WRITER.submit(lambda: None).result()


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


def _verified_tensors(path: Path, meta: Mapping[str, Any]) -> dict[str, Tensor]:
    files = dict(meta.get("files", {}))
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing (the checkpoint is incomplete)")
    # Hash on a second thread while the safe loader reads: weights_only=True cannot run code
    # whatever the bytes are, and nothing is returned before every checksum has matched. On
    # two cores this makes a verified load cost about what the slower of the two costs.
    with ThreadPoolExecutor(max_workers=1) as pool:
        digests = {name: pool.submit(_sha256, path / name) for name in files}
        loaded: Any = None
        failure: Exception | None = None
        try:
            loaded = torch.load(path / TENSORS, map_location="cpu", weights_only=True)
        except Exception as e:  # judged after the checksums: damage explains most failures
            failure = e
        for name, digest in files.items():
            actual = digests[name].result()
            if actual != digest:
                raise CheckpointError(
                    f"{path / name}: SHA-256 check failed (expected {digest[:16]}..., got "
                    f"{actual[:16]}...); the file is truncated or damaged"
                )
    if failure is not None:  # intact bytes that the safe loader refuses: not only tensors
        raise CheckpointError(
            f"{path / TENSORS}: refused by the safe loader (weights_only=True): {failure}. "
            "engine never runs code while loading a checkpoint"
        ) from failure
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path / TENSORS}: expected a dict of tensors")
    return loaded


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
    tensors = _verified_tensors(root, meta)
    groups: dict[str, dict[str, Tensor]] = {"params": {}, "buffers": {}, "grad_accum": {}}
    opt: dict[str, Any] = dict(meta.get("opt_state_scalars", {}))
    for key, t in tensors.items():
        group, _, name = key.partition("/")
        if group == "opt_state":
            opt[name] = t
        elif group in groups:
            groups[group][name] = t
        else:
            raise CheckpointError(f"{root / TENSORS}: unknown entry {key!r}")
    _check_fit(root, "params", template.params, groups["params"])
    _check_fit(root, "buffers", template.buffers, groups["buffers"])
    device_of = {k: v.device for k, v in {**template.params, **template.buffers}.items()}
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
        _verified_tensors(root, meta)
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
