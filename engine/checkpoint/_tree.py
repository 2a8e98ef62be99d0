"""Pytrees of tensors and plain values as JSON plus a flat tensor dict (private).

Checkpoints store ``TrainState.extra`` and ``TrainState.precision`` this way: the structure and
the plain leaves go into ``meta.json``, each tensor into ``tensors.pt`` under a key, and a JSON
``{"$tensor": key}`` marks where it goes back. A stateful loader's position is stored the same
way with its (small) tensors inline. Loading rebuilds the tree without running code.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["from_json", "to_json"]


def to_json(tree: Any, prefix: str, tensors: dict[str, Tensor] | None = None) -> Any:
    """``tree`` as JSON. Its tensors go into ``tensors`` under ``prefix/<path>`` — or, without
    ``tensors``, inline (base64 of their bytes: for small states such as a loader's position).

    Dicts, lists, tuples, tensors, bytes, numbers, strings, booleans and ``None`` are stored;
    anything else raises ``TypeError`` naming where it is.

    Example:
        >>> import torch
        >>> tensors = {}
        >>> doc = to_json({"ema": {"w": torch.ones(2)}, "n": 3, "t": (1.5, None)}, "extra", tensors)
        >>> doc["ema"], sorted(tensors)
        ({'w': {'$tensor': 'extra/ema/w'}}, ['extra/ema/w'])
        >>> back = from_json(doc, tensors)
        >>> back["ema"]["w"].tolist(), back["n"], back["t"]
        ([1.0, 1.0], 3, (1.5, None))
        >>> from_json(to_json({1: torch.arange(3)}, "pos")).popitem()
        (1, tensor([0, 1, 2]))
    """
    if isinstance(tree, Tensor):
        if tensors is not None:
            tensors[prefix] = tree.detach()
            return {"$tensor": prefix}
        t = tree.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "$data": base64.b64encode(raw).decode(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(tree, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in tree):
            return {k: to_json(v, f"{prefix}/{k}", tensors) for k, v in tree.items()}
        return {
            "$items": [
                [to_json(k, f"{prefix}/{i}.key", tensors), to_json(v, f"{prefix}/{i}", tensors)]
                for i, (k, v) in enumerate(tree.items())
            ]
        }
    if isinstance(tree, tuple):
        return {"$tuple": [to_json(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [to_json(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, bytes):
        return {"$bytes": base64.b64encode(tree).decode()}
    if isinstance(tree, float) and not math.isfinite(tree):
        return {"$float": repr(tree)}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(
        f"{prefix} is a {type(tree).__name__}, which a checkpoint cannot store without pickling "
        "code; keep tensors, numbers, strings, bytes, lists, tuples and dicts in it"
    )


def from_json(doc: Any, tensors: Mapping[str, Tensor] | None = None) -> Any:
    """The tree :func:`to_json` described, its tensors taken from ``tensors`` (or decoded)."""
    if isinstance(doc, list):
        return [from_json(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "$tensor" in doc:
        if tensors is None or doc["$tensor"] not in tensors:
            raise ValueError(f"{doc['$tensor']!r}: no such tensor was stored")
        return tensors[doc["$tensor"]]
    if "$data" in doc:
        raw = bytearray(base64.b64decode(doc["$data"], validate=True))
        dtype = getattr(torch, str(doc.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{doc.get('dtype')!r} is not a torch dtype")
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(dtype).reshape(doc["shape"]).clone()
    if "$tuple" in doc:
        return tuple(from_json(v, tensors) for v in doc["$tuple"])
    if "$items" in doc:
        return {from_json(k, tensors): from_json(v, tensors) for k, v in doc["$items"]}
    if "$bytes" in doc:
        return base64.b64decode(doc["$bytes"])
    if "$float" in doc:
        return float(doc["$float"])
    return {k: from_json(v, tensors) for k, v in doc.items()}
