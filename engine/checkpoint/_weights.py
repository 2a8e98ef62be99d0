"""A checkpoint's weights for inference and for other tools (private): no optimizer template, no
resume. :func:`load_weights` into a module or a dict of tensors, :func:`export` to a plain
state-dict file."""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, overload

import torch
from torch import Tensor, nn

from engine.checkpoint import _layouts
from engine.checkpoint._files import _Claim, _fsync_dir
from engine.checkpoint._read import _materialize, _verified_tensors, read_meta
from engine.errors import CheckpointError

__all__ = ["IncompatibleKeys", "export", "load_weights"]


class IncompatibleKeys(NamedTuple):
    """What :func:`load_weights` with ``strict=False`` did not load (as ``load_state_dict``
    reports it): names ``into`` has that the checkpoint lacks, and the reverse."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _verified_weights(
    root: Path,
    meta: Mapping[str, Any],
    devices: Mapping[str, torch.device] | None = None,
    *,
    materialize: bool = True,
) -> dict[str, Tensor]:
    """The checkpoint's parameters and buffers by name, every checksum verified first; the
    optimizer state and the rest of ``tensors.pt`` are hashed but never copied out of the file.
    ``devices``: by ``params/<name>`` / ``buffers/<name>`` key, where each tensor goes. With
    ``materialize=False`` they are views of the mapped file (verified: copy out of them)."""
    layout = _layouts.of_meta(meta)
    if layout is not None:  # a strategy's files (a sharded checkpoint: gathered on this process)
        return layout.read_weights(root, meta, devices or {})
    mapped = _verified_tensors(root, meta, materialize=False)
    picked = {k: t for k, t in mapped.items() if k.partition("/")[0] in ("params", "buffers")}
    del mapped  # the rest of the file is never copied
    if materialize:
        picked = _materialize(picked, devices or {})
    return {k.partition("/")[2]: t for k, t in picked.items()}


def _compare(
    expected: Mapping[str, Tensor], got: Mapping[str, Tensor]
) -> tuple[list[str], list[str], list[str]]:
    """Missing keys, unexpected keys and shape mismatches (dtypes are cast, as
    ``load_state_dict`` does)."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(
        f"{k} (checkpoint {_dims(got[k])}, model {_dims(v)})"
        for k, v in expected.items()
        if k in got and got[k].shape != v.shape
    )
    return missing, unexpected, shapes


def _dims(t: Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _listed(keys: list[str], most: int = 10) -> str:
    shown = ", ".join(keys[:most])
    return f"[{shown}, ... ({len(keys) - most} more)]" if len(keys) > most else f"[{shown}]"


def _misfit(source: object, missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    found = [
        f"{what}: {_listed(keys)}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes))
        if keys
    ]
    return f"{source}: its weights do not fit the model ({'; '.join(found)})"


@overload
def load_weights(
    path: str | os.PathLike[str],
    into: nn.Module,
    *,
    strict: bool = ...,
    device: str | torch.device | None = ...,
) -> IncompatibleKeys: ...


@overload
def load_weights(
    path: str | os.PathLike[str],
    into: Mapping[str, Tensor],
    *,
    strict: bool = ...,
    device: str | torch.device | None = ...,
) -> dict[str, Tensor]: ...


def load_weights(
    path: str | os.PathLike[str],
    into: nn.Module | Mapping[str, Tensor],
    *,
    strict: bool = True,
    device: str | torch.device | None = None,
) -> IncompatibleKeys | dict[str, Tensor]:
    """Load a checkpoint's parameters and buffers for inference: no optimizer template needed.

    Reads ``params/*`` and ``buffers/*`` of any checkpoint (full or ``weights_only``), after
    verifying every checksum as :func:`load` does; the optimizer state is never copied out.

    Args:
        path: the checkpoint directory.
        into: an ``nn.Module``, whose parameters and buffers are overwritten in place (values
            cast to their dtypes, as ``load_state_dict`` does); or a mapping of name to tensor
            giving the names and shapes, for a pure-function model: a new dict is returned.
        strict: every name of ``into`` must be in the checkpoint and the reverse. With
            ``strict=False`` the names that match are loaded, the others are reported (a module:
            in the returned :class:`IncompatibleKeys`; a mapping: in a warning, its missing
            entries kept from ``into``). A shape mismatch is refused either way.
        device: for a mapping, where the returned tensors go (as ``torch.load``'s
            ``map_location``); by default where the tensor of ``into`` each one replaces is. A
            module's tensors are overwritten where they are (as ``load_state_dict`` does),
            straight from the mapped file: no second copy of the weights is made.

    Returns:
        For a module, :class:`IncompatibleKeys` (empty lists when strict); for a mapping, a new
        ``{name: tensor}`` dict with the dtypes of ``into``'s tensors.

    Raises:
        CheckpointError: a file missing or damaged, or weights that do not fit ``into``
            (naming the missing, unexpected and mis-shaped keys).

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.adam(1e-3))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c")
        ...     model = torch.nn.Linear(3, 2)
        ...     checkpoint.load_weights(path, model)
        ...     weights = checkpoint.load_weights(path, {"weight": torch.empty(2, 3),
        ...                                              "bias": torch.empty(2)})
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        >>> torch.equal(model.weight, state.params["weight"]), sorted(weights)
        (True, ['bias', 'weight'])
    """
    root = Path(path)
    if isinstance(into, nn.Module):
        targets: dict[str, Tensor] = dict(into.named_parameters())
        targets.update(into.named_buffers())
    elif isinstance(into, Mapping):
        targets = dict(into)
        wrong = [
            k for k, v in targets.items() if not isinstance(k, str) or not isinstance(v, Tensor)
        ]
        if wrong:
            raise TypeError(
                f"load_weights(into=...): a mapping must hold str -> Tensor; entry {wrong[0]!r} "
                f"holds a {type(targets[wrong[0]]).__name__}"
            )
    else:
        raise TypeError(
            f"load_weights(into=...) takes an nn.Module or a dict of tensors (got "
            f"{type(into).__name__}); to restore a whole TrainState use checkpoint.load"
        )
    meta = read_meta(root)
    to = None if device is None else torch.device(device)
    devices = {
        f"{group}/{k}": to or t.device
        for group in ("params", "buffers")
        for k, t in targets.items()
    }
    # a module is copied into straight from the mapped file: no second copy of the weights
    in_place = isinstance(into, nn.Module)
    weights = _verified_weights(root, meta, devices, materialize=not in_place)
    missing, unexpected, shapes = _compare(targets, weights)
    if shapes or (strict and (missing or unexpected)):
        hint = (
            "was it saved from another model? A shape mismatch is refused even with strict=False"
            if shapes
            else "was it saved from another model? strict=False loads the names that match and "
            "reports the others"
        )
        raise CheckpointError(f"{_misfit(root, missing, unexpected, shapes)}; {hint}")
    if isinstance(into, nn.Module):
        with torch.no_grad():
            for k, t in targets.items():
                if k in weights:
                    t.copy_(weights[k])
        return IncompatibleKeys(missing, unexpected)
    if missing or unexpected:
        warnings.warn(
            f"load_weights({str(root)!r}, strict=False): missing (kept from `into`): "
            f"{_listed(missing)}; unexpected (not loaded): {_listed(unexpected)}",
            stacklevel=2,
        )
    return {
        k: (weights[k] if k in weights else t.detach()).to(to or t.device, t.dtype)
        for k, t in targets.items()
    }


def export(
    path: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the checkpoint's weights to one file anyone can load without engine.

    The file is ``torch.save`` of a plain ``{name: tensor}`` state dict (parameters and buffers,
    on the CPU, contiguous, each with a storage of its own), so
    ``module.load_state_dict(torch.load(out_file, weights_only=True))`` restores the model. It
    is written atomically (a temporary file beside it, fsynced, renamed into place); the
    checkpoint is verified first.

    Args:
        path: the checkpoint directory (full or ``weights_only``).
        out_file: the file to write; an existing file is replaced.
        dtype: cast the floating-point tensors to it (``torch.bfloat16``, say); others are kept.

    Returns:
        ``out_file`` as a path.

    Raises:
        CheckpointError: the checkpoint is damaged, ``out_file`` lies inside it or is a
            directory, or writing fails.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = checkpoint.export(checkpoint.save(state, f"{d}/c"), f"{d}/model.pt")
        ...     plain = torch.load(out, weights_only=True)
        >>> torch.nn.Linear(3, 2).load_state_dict(plain)
        <All keys matched successfully>
    """
    root, out = Path(path), Path(out_file)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"export(dtype=...) must be a floating-point torch.dtype (got {dtype!r})")
    if out.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(
            f"export: {out} lies inside the checkpoint {root}; write the file elsewhere"
        )
    if out.is_dir():
        raise CheckpointError(f"export: {out} is a directory; name the file to write")
    weights = _verified_weights(root, read_meta(root))
    plain: dict[str, Tensor] = {}
    for k, t in weights.items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if (
            not t.is_contiguous()
            or t.storage_offset()
            or (t.untyped_storage().nbytes() != t.numel() * t.element_size())
        ):  # a view, or a storage shared with others: a copy of its own
            t = t.clone(memory_format=torch.contiguous_format)
        plain[k] = t
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"export: cannot create the directory of {out}: {e}") from e
    with _Claim(out.parent) as claim:
        tmp = claim.path("")
        try:
            with open(tmp, "wb") as f:
                torch.save(plain, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
            _fsync_dir(out.parent)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                why = "the disk is full" if e.errno == errno.ENOSPC else str(e)
                raise CheckpointError(f"could not write {out}: {why}") from e
            raise
    return out
