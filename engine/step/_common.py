"""What every step shares (private): the type aliases, the split of a loss function's output,
metrics cut from the graph, the module's train/eval mode, and the accelerator generators a step
seeds.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from engine.metrics import is_metric_object
from engine.state import TrainState

Batch = Any
Metrics = dict[str, Tensor]
LossFn = Callable[[Any, Batch], "Tensor | tuple[Tensor, Mapping[str, Any]]"]


def _split(out: Any, where: str) -> tuple[Tensor, Mapping[str, Any]]:
    if isinstance(out, Tensor):
        return out, {}
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], Tensor)
        and isinstance(out[1], Mapping)
    ):
        return out
    raise TypeError(
        f"{where} must return a scalar loss tensor or a (loss, metrics_dict) pair "
        f"(got {type(out).__name__}); e.g. `return F.cross_entropy(logits, y), {{'acc': acc}}`"
    )


def _detached(values: Mapping[str, Any]) -> Metrics:
    """Metrics as tensors cut from the graph (plain numbers become tensors; a metric object,
    such as a torchmetrics ``Metric``, passes as it is). Anything else cannot be logged and is
    named."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, Tensor):
            if v.numel() != 1 or v.is_complex():
                what = "complex" if v.is_complex() else f"of shape {tuple(v.shape)}"
                raise ValueError(
                    f"metric {k!r} is a tensor {what}; a logged metric is one real number: "
                    f"reduce it ({k}.mean()), or return a torchmetrics Metric for a "
                    "dataset-level value"
                )
            out[k] = v.detach()
        elif isinstance(v, numbers.Real):  # bools and numpy scalars too, as Lightning logs them
            out[k] = torch.as_tensor(float(v))
        elif is_metric_object(v):
            if callable(getattr(v, "keys", None)):  # a torchmetrics MetricCollection
                raise TypeError(
                    f"metric {k!r} is a collection of metrics; return each under its own name "
                    f"(`{{**collection}}` in the returned dict), as Lightning's log_dict does"
                )
            out[k] = v  # a metric object (torchmetrics): computed and reset per epoch
        else:
            raise TypeError(
                f"metric {k!r} is a {type(v).__name__} ({v!r:.60}), which cannot be logged: "
                "return numbers, one-element tensors or torchmetrics Metric objects"
            )
    return out


def _metrics(loss: Tensor, aux: Mapping[str, Any]) -> Metrics:
    return {"loss": loss.detach(), **_detached(aux)}


def _set_mode(module: nn.Module | None, training: bool) -> None:
    if module is not None and module.training != training:
        module.train(training)


def _cuda_devices(state: TrainState) -> tuple[int | str, ...]:
    """The accelerator generators a step on this state seeds besides the CPU's."""
    for p in state.params.values():
        return (p.get_device(),) if p.is_cuda else ("mps",) if p.is_mps else ()
    return ()
