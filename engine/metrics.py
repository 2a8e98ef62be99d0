"""Reducing step metrics over an epoch without touching the host until the epoch ends."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["MetricReducer"]


class MetricReducer:
    """Running reductions of tensor metrics; :meth:`compute` syncs once, at the end.

    ``"mean"`` is weighted by batch size (Lightning's default), ``"sum"``, ``"max"`` and
    ``"min"`` are what they say.

    Example:
        >>> import torch
        >>> r = MetricReducer({"n": "sum"})
        >>> r.update({"loss": torch.tensor(1.0), "n": torch.tensor(3.0)}, batch_size=2)
        >>> r.update({"loss": torch.tensor(4.0), "n": torch.tensor(1.0)}, batch_size=1)
        >>> r.compute()
        {'loss': 2.0, 'n': 4.0}
    """

    def __init__(self, reduce: Mapping[str, str] | None = None) -> None:
        self.reduce = dict(reduce or {})
        self.values: dict[str, Tensor] = {}
        self.weights: dict[str, int] = {}

    def update(self, metrics: Mapping[str, Tensor], batch_size: int) -> None:
        with torch.no_grad():
            for k, v in metrics.items():
                how = self.reduce.get(k, "mean")
                v = v.detach().float()
                if v.ndim:
                    v = v.mean()
                old = self.values.get(k)
                if how == "mean":
                    v = v * batch_size
                    self.weights[k] = self.weights.get(k, 0) + batch_size
                if old is None:
                    self.values[k] = v
                elif how in ("mean", "sum"):
                    self.values[k] = old + v
                elif how == "max":
                    self.values[k] = torch.maximum(old, v)
                else:
                    self.values[k] = torch.minimum(old, v)

    def compute(self) -> dict[str, float]:
        if not self.values:
            return {}
        keys = list(self.values)
        # one host sync for all metrics
        host = torch.stack([self.values[k].to("cpu") for k in keys]).tolist()
        return {
            k: v / self.weights[k] if k in self.weights else v
            for k, v in zip(keys, host, strict=True)
        }

    def reset(self) -> None:
        self.values.clear()
        self.weights.clear()
