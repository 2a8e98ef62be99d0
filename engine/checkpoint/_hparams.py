"""A run's hyperparameters in a checkpoint (private): recorded in ``meta.json``'s ``extra``
(:func:`_hparams_doc`, what JSON can hold) and read back (:func:`read_hparams`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

try:
    import numpy as np
except ImportError:  # then no value is a numpy scalar
    np = None  # type: ignore[assignment]

from engine.checkpoint._read import read_meta
from engine.errors import CheckpointError

__all__ = ["read_hparams"]


def _hparams_doc(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` as ``meta.json`` records them (tuples become lists, non-finite floats
    ``{"$float": ...}``); a value JSON cannot hold is refused, naming its key."""

    def walk(x: Any, where: str) -> Any:
        if np is not None and isinstance(x, np.generic):
            x = x.item()  # numpy scalars: their Python value
        if isinstance(x, float) and not math.isfinite(x):
            return {"$float": repr(x)}  # decoded by read_meta
        if x is None or isinstance(x, (str, bool, int, float)):
            return x
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            bad = next((k for k in x if not isinstance(k, str)), None)
            if bad is not None:
                raise CheckpointError(
                    f"hparams{where}: key {bad!r} is a {type(bad).__name__}; the keys of a "
                    "checkpoint's meta.json are strings: use str keys"
                )
            if set(x) == {"$float"}:
                raise CheckpointError(
                    f"hparams{where}: a dict whose only key is '$float' is how meta.json writes "
                    "a non-finite float; rename the key"
                )
            return {k: walk(v, f"{where}[{k!r}]") for k, v in x.items()}
        text = repr(x)
        raise CheckpointError(
            f"hparams{where} is a {type(x).__name__} ({text[:60]}{'...' if len(text) > 60 else ''}"
            "), which a checkpoint's meta.json cannot hold; record plain values in "
            "Task(hparams=...): numbers, strings, booleans, None, and lists and dicts of them "
            "(a class or object by its name or settings, say)"
        )

    if not isinstance(hparams, Mapping):
        raise CheckpointError(
            f"hparams must be a mapping such as a dict (got {type(hparams).__name__})"
        )
    return walk(hparams, "")


def _hparams_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    extra = meta.get("extra")
    found = extra.get("hparams") if isinstance(extra, Mapping) else None
    return dict(found) if isinstance(found, Mapping) else {}


def read_hparams(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The hyperparameters the run recorded in the checkpoint (``Task(hparams=...)``, as
    Lightning's ``save_hyperparameters``), from its verified ``meta.json``; ``{}`` if none.

    Values come back as JSON holds them: tuples as lists. ``tensors.pt`` is not read (see
    :func:`verify`).

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/c", extra={"hparams": {"width": 2}})
        ...     checkpoint.read_hparams(path)
        {'width': 2}
    """
    return _hparams_of(read_meta(path))
