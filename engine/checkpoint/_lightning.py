"""Starting from a Lightning checkpoint's weights (private): :func:`from_lightning`, its
``state_dict`` read with ``weights_only=True`` and its prefix found."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor, nn

from engine.checkpoint._weights import _compare, _listed, _misfit
from engine.errors import CheckpointError
from engine.state import TrainState

__all__ = ["from_lightning"]


def _module_keys(module: nn.Module) -> dict[str, str]:
    """``module.state_dict()``'s names (persistent buffers only; tied weights under each of
    their names) -> the name ``named_parameters`` / ``named_buffers`` give the tensor."""
    first: dict[int, str] = {}
    for name, t in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        first.setdefault(id(t), name)
    saved = module.state_dict(keep_vars=True)
    return {k: first[id(v)] for k, v in saved.items() if id(v) in first}


def _lightning_weights(path: Path) -> dict[str, Tensor]:
    """The ``state_dict`` of a Lightning ``.ckpt`` (or a plain state-dict file), read with
    ``weights_only=True``."""
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory: an engine checkpoint? Load it with checkpoint.load, or "
            "checkpoint.load_weights for the weights alone"
        )
    if zipfile.is_zipfile(path):  # torch.save's format: each entry carries a CRC-32
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise CheckpointError(
                f"{path}: the entry {damaged!r} fails its CRC-32: the file is damaged "
                "(a bit flipped on disk or in a copy); nothing was loaded from it"
            )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as e:  # the safe unpickler refused it, or not a torch file at all
        raise CheckpointError(
            f"{path}: refused by torch.load(weights_only=True): {e}. engine never runs code "
            "from a file; if you trust it, extract its weights yourself "
            "(torch.save(torch.load(f, weights_only=False)['state_dict'], 'weights.pt')) "
            "and pass that file"
        ) from e
    if isinstance(loaded, Mapping) and "state_dict" in loaded:
        loaded = loaded["state_dict"]
    elif not (isinstance(loaded, Mapping) and all(isinstance(v, Tensor) for v in loaded.values())):
        keys = sorted(map(str, loaded)) if isinstance(loaded, Mapping) else []
        raise CheckpointError(
            f"{path}: no 'state_dict' in it (keys: {_listed(keys)}); a Lightning checkpoint "
            "(trainer.save_checkpoint) or a plain state-dict file was expected"
        )
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path}: its 'state_dict' is a {type(loaded).__name__}, not a dict")
    wrong = sorted(str(k) for k, v in loaded.items() if not isinstance(v, Tensor))
    if wrong or not all(isinstance(k, str) for k in loaded):
        raise CheckpointError(
            f"{path}: its state_dict holds entries that are not tensors ({_listed(wrong)}); "
            "engine loads tensors only"
        )
    return dict(loaded)


def _strip(keys: Any, prefix: str) -> dict[str, str]:
    return {k[len(prefix) :]: k for k in keys if k.startswith(prefix)}


def _heads(keys: Any) -> list[str]:
    return sorted({k.partition(".")[0] + "." for k in keys if "." in k})


@overload
def from_lightning(
    ckpt_file: str | os.PathLike[str], into: TrainState, *, prefix: str | None = ...
) -> TrainState: ...


@overload
def from_lightning(
    ckpt_file: str | os.PathLike[str], into: nn.Module, *, prefix: str | None = ...
) -> nn.Module: ...


def from_lightning(
    ckpt_file: str | os.PathLike[str],
    into: TrainState | nn.Module,
    *,
    prefix: str | None = None,
) -> TrainState | nn.Module:
    """Start from the weights of a Lightning ``.ckpt``: its ``state_dict``, read with
    ``torch.load(weights_only=True)`` (nothing in the file runs).

    A LightningModule usually holds the network as an attribute, so its keys carry a prefix
    (``model.``, ``net.``); it is stripped. Weights only: Lightning's ``optimizer_states``,
    epoch and step are not read, so this starts training from the weights; it does not resume
    Lightning's run.

    Args:
        ckpt_file: the ``.ckpt`` file (``trainer.save_checkpoint(path)``); a plain state-dict
            file (``torch.save(module.state_dict(), f)``) works too.
        into: a fresh ``TrainState`` (``task.init(model)``): a new state with its parameters and
            buffers replaced is returned, its optimizer state and counters kept; or an
            ``nn.Module``, loaded in place and returned.
        prefix: the prefix to strip (``"model."``). By default it is found: none when the keys
            are the model's, else the shortest that every key shares and after which they are
            exactly the model's. With ``prefix=``, keys without it are ignored (other attributes
            of the LightningModule).

    Raises:
        CheckpointError: the file is refused by the safe loader or holds no state dict; the
            keys do not fit the model (naming missing, unexpected and mis-shaped ones, and
            the prefixes found); ``into`` is a state that has trained (the optimizer state
            would not belong to the weights).

    Example:
        >>> import tempfile, torch
        >>> from engine import checkpoint
        >>> net = torch.nn.Linear(3, 2)
        >>> with tempfile.TemporaryDirectory() as d:  # a .ckpt holds {"state_dict": ..., ...}
        ...     torch.save({"state_dict": {f"model.{k}": v for k, v in net.state_dict().items()},
        ...                 "optimizer_states": []}, f"{d}/last.ckpt")
        ...     model = checkpoint.from_lightning(f"{d}/last.ckpt", torch.nn.Linear(3, 2))
        >>> torch.equal(model.weight, net.weight)
        True
    """
    path = Path(ckpt_file)
    if isinstance(into, TrainState):
        into.check_alive("checkpoint.from_lightning()")
        if into.step or into.micro_step or into.epoch or into.batch_idx:
            raise CheckpointError(
                f"from_lightning({str(path)!r}): the state given has trained (step {into.step}, "
                f"epoch {into.epoch}); a Lightning checkpoint gives weights only, not an "
                "optimizer state that fits them. Pass a fresh state (task.init(model)) and "
                "train from those weights; resuming Lightning's run exactly is Lightning's job"
            )
        names = (
            _module_keys(into.module)
            if into.module is not None
            else {k: k for k in (*into.params, *into.buffers)}
        )
        tensors = {**into.params, **into.buffers}
        names = {k: n for k, n in names.items() if n in tensors}
    elif isinstance(into, nn.Module):
        names = _module_keys(into)
        tensors = dict(into.named_parameters())
        tensors.update(into.named_buffers())
    else:
        raise TypeError(
            f"from_lightning(into=...) takes a TrainState or an nn.Module (got "
            f"{type(into).__name__})"
        )
    saved = _lightning_weights(path)
    expected = {k: tensors[n] for k, n in names.items()}
    if prefix is None:
        first = next(iter(saved), "")
        shared = [first[: i + 1] for i, c in enumerate(first) if c == "."]
        shared = [p for p in shared if all(k.startswith(p) for k in saved)]
        fits = [p for p in ("", *shared) if set(_strip(saved, p)) == set(expected)]
        prefix = fits[0] if fits else (shared[0] if shared else "")
    chosen = _strip(saved, prefix)
    got = {k: saved[full] for k, full in chosen.items()}
    missing, unexpected, shapes = _compare(expected, got)
    if missing or unexpected or shapes:
        where = f"with prefix {prefix!r} stripped" if prefix else "with no prefix stripped"
        raise CheckpointError(
            f"{_misfit(path, missing, unexpected, shapes)} {where}. Its keys begin with "
            f"{_listed(_heads(saved))}: pass prefix= naming the LightningModule's attribute "
            "that holds this network (prefix='model.', say), or build the model the checkpoint "
            "was trained with"
        )
    if isinstance(into, nn.Module):
        with torch.no_grad():
            for k, t in expected.items():
                t.copy_(got[k])
        return into
    loaded = {names[k]: got[k] for k in expected}
    params = {
        k: loaded[k].to(v.device, v.dtype).requires_grad_(v.requires_grad) if k in loaded else v
        for k, v in into.params.items()
    }
    buffers = {
        k: loaded[k].to(v.device, v.dtype) if k in loaded else v for k, v in into.buffers.items()
    }
    return into.replace(params=params, buffers=buffers)
