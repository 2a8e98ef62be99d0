"""Reading a checkpoint's files, verified (private): :func:`read_meta`, the tensors of
``tensors.pt`` hashed while they are mapped and copied out (:func:`_materialize`), and
:func:`verify`: nothing is returned before every checksum has matched."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

try:
    import numpy as np
except ImportError:  # then the file is hashed apart from the mapping; torch copies
    np = None  # type: ignore[assignment]

from engine.checkpoint import _layouts, _meta
from engine.checkpoint._checksum import _SCHEMES, _hash_mapped, _layout, _start_checksum
from engine.checkpoint._files import META, TENSORS, _read_own, _short
from engine.checkpoint._snapshot import _host_empty
from engine.errors import CheckpointError

__all__ = ["read_meta", "verify"]


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, verified: format, version, the type of every key and
    (from format version 4) the file's own checksum.

    Raises:
        CheckpointError: naming the file, and the key and the type expected where one is wrong.
    """
    meta_path = Path(path) / META
    try:
        raw = _read_own(meta_path)  # not through a link out of the checkpoint
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {META} is missing") from None
    except OSError as e:  # a directory in its place, no permission, an I/O error
        raise CheckpointError(f"{meta_path}: cannot be read ({e})") from e
    return _meta.decode(raw, meta_path)


def _materialize(
    mapped: Mapping[str, Tensor], devices: Mapping[str, torch.device]
) -> dict[str, Tensor]:
    """Copy tensors out of the file mapping into memory of their own, storages shared as saved.

    This is what ``torch.load`` does; a tensor bound for another device is copied there straight
    from the mapping.
    """
    copies: dict[tuple[int, int], Any] = {}
    out: dict[str, Tensor] = {}
    for key, t in mapped.items():
        device = devices.get(key)
        if device is not None and device.type != "cpu":
            out[key] = t.to(device)
            continue
        src = t.untyped_storage()
        ident = (src.data_ptr(), src.nbytes())
        dst = copies.get(ident)
        if dst is None:
            flat = _host_empty((src.nbytes(),), torch.uint8)
            _copy_bytes(flat, torch.empty(0, dtype=torch.uint8).set_(src))
            dst = copies[ident] = flat.untyped_storage()
        out[key] = torch.empty(0, dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())
    return out


def _copy_bytes(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for flat byte tensors, on this thread alone.

    ``copy_`` would split a large copy over torch's intra-op threads, which then contend with the
    hashing threads for the cores and wait for each other; numpy copies on this thread with the
    GIL released.
    """
    if np is None:
        dst.copy_(src)
    else:
        np.copyto(dst.numpy(), src.numpy())


def _verified_tensors(
    path: Path,
    meta: Mapping[str, Any],
    devices: Mapping[str, torch.device] | None = None,
    *,
    materialize: bool = True,
) -> dict[str, Tensor]:
    files = _own_files(path, meta)
    try:
        return _read_verified(path, files, devices, materialize)
    except OSError as e:  # unreadable (no permission, an I/O error): nothing is returned
        raise CheckpointError(
            f"{e.filename or path}: cannot be read ({e.strerror or e}); nothing was loaded "
            "from the checkpoint"
        ) from e


def _own_files(path: Path, meta: Mapping[str, Any]) -> dict[str, str]:
    """``meta.json``'s ``files`` (name -> checksum), each checked before a byte of it is read:
    a plain name (``engine/checkpoint/_meta.py`` checks that too), a regular file inside ``path`` (a
    symbolic link may point only to a file beside it) and, from format version 5, of the size
    recorded, so that a file swapped for a huge one is refused without hashing it."""
    files = dict(meta.get("files", {}))
    if TENSORS not in files or not all(isinstance(d, str) for d in files.values()):
        raise CheckpointError(f"{path / META}: no valid checksum for {TENSORS}; it is damaged")
    sizes = meta.get("sizes") or {}
    inside = os.path.realpath(path)
    for name in files:
        if not _meta.plain_name(name):
            raise CheckpointError(_meta.not_plain(path / META, name))
        file = path / name
        try:
            st = os.lstat(file)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(file)
                if os.path.dirname(real) != inside:
                    raise CheckpointError(
                        f"{file}: a symbolic link to {real}, outside the checkpoint directory; "
                        "a checkpoint reads only files of its own: refused (copy the file into "
                        "the checkpoint if it is one)"
                    )
                st = os.stat(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)") from None
        except OSError as e:
            raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from e
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{file}: not a regular file; the checkpoint is damaged")
        if name in sizes and st.st_size != sizes[name]:
            raise CheckpointError(
                f"{file}: {st.st_size} bytes, where meta.json records {sizes[name]}; the file is "
                "truncated, damaged or was replaced (refused before reading it)"
            )
    return files


def _read_verified(
    path: Path,
    files: Mapping[str, str],
    devices: Mapping[str, torch.device] | None,
    materialize: bool,
) -> dict[str, Tensor]:
    # One pass over the bytes, in parallel: this thread maps the file (weights_only=True cannot
    # run code whatever the bytes are) and copies the tensors out of the mapping while the
    # hashing threads checksum the same pages. Nothing is returned before every checksum has
    # matched.
    scheme = files[TENSORS].rpartition(":")[0]
    from_mapping = np is not None and scheme in _SCHEMES
    digests = {
        name: _start_checksum(path / name, d)
        for name, d in files.items()
        if not (from_mapping and name == TENSORS)
    }
    loaded: Any = None
    failure: Exception | None = None
    try:
        loaded = torch.load(path / TENSORS, map_location="cpu", weights_only=True, mmap=True)
        if from_mapping:
            layout = _layout(path / TENSORS, loaded) if isinstance(loaded, dict) else None
            digests[TENSORS] = (
                _hash_mapped(path / TENSORS, layout, scheme)
                if layout is not None
                else _start_checksum(path / TENSORS, files[TENSORS])
            )
        if materialize and isinstance(loaded, dict):
            loaded = _materialize(loaded, devices or {})
    except Exception as e:  # judged after the checksums: damage explains most failures
        failure = e
    for name, digest in files.items():
        if name not in digests:  # not hashed along the way: hash the file
            digests[name] = _start_checksum(path / name, digest)
    for name, digest in files.items():
        actual = digests[name]()
        if actual != digest:
            raise CheckpointError(
                f"{path / name}: checksum check failed ({digest.rpartition(':')[0] or 'sha256'} "
                f"expected {_short(digest)}..., got {_short(actual)}...); the file is truncated "
                "or damaged"
            )
    if failure is not None:  # intact bytes that the safe loader refuses: not only tensors
        raise CheckpointError(
            f"{path / TENSORS}: refused by the safe loader (weights_only=True): {failure}. "
            "engine never runs code while loading a checkpoint"
        ) from failure
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path / TENSORS}: expected a dict of tensors")
    return loaded


def verify(path: str | os.PathLike[str]) -> None:
    """Check every checksum of the checkpoint at ``path`` (``meta.json``'s own included) and
    its metadata's schema, without loading it into a state.

    Raises:
        CheckpointError: what :func:`load` would refuse the checkpoint for, naming the file.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c")
        ...     checkpoint.verify(path)
        ...     (path / "tensors.pt").write_bytes(b"damaged")
        ...     checkpoint.verify(path)
        Traceback (most recent call last):
        ...
        engine.errors.CheckpointError: .../tensors.pt: 7 bytes, where meta.json records ...
    """
    root = Path(path)
    _verify_files(root, read_meta(root))


def _verify_files(root: Path, meta: Mapping[str, Any]) -> Any:
    """Check every file; what a strategy's layout returns of its check (a sharded checkpoint's
    index, checked against meta.json) returned."""
    layout = _layouts.of_meta(meta)
    if layout is not None:
        return layout.verify(root, meta)
    _verified_tensors(root, meta, materialize=False)
    return None
