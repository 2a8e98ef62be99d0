"""Step metrics: their names and logging options, and their reduction over an epoch without
touching the host until the epoch ends.

**Names.** A metric a step function returns is logged under the name you wrote when that name
says its stage (``val_loss``, ``val/acc``, ``train_loss``: it starts with ``train``, ``val``,
``test`` or ``predict`` followed by ``_`` or ``/``), as Lightning's ``self.log("val_loss", ...)``
is; a bare name (``loss``, ``acc``) gets the stage as a prefix: ``val/loss``.

**Options.** :class:`LogOptions` per metric (``Task(log_options=...)``) are ``self.log``'s
``on_step``, ``on_epoch``, ``prog_bar`` and ``reduce_fx``.

**Metric objects.** A torchmetrics ``Metric`` (anything with ``update``, ``compute`` and
``reset``) returned as a metric's value is not reduced batch by batch: the function updates it,
and at the epoch's end its ``compute()`` is logged and it is ``reset()``, so a dataset-level
AUROC or F1 is exact. Its state lives in the object, outside the :class:`~engine.TrainState`:
checkpoints do not hold it (a resumed epoch's metric object starts from that batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

__all__ = ["STAGES", "LogOptions", "MetricReducer", "is_metric_object", "metric_name"]

STAGES = ("train", "val", "test", "predict")


def is_metric_object(value: Any) -> bool:
    """Whether ``value`` accumulates over batches itself (a torchmetrics ``Metric``)."""
    return not isinstance(value, Tensor) and all(
        callable(getattr(value, m, None)) for m in ("update", "compute", "reset")
    )


def metric_name(stage: str, key: str) -> str:
    """The name a metric is logged under (see the module's docstring).

    Example:
        >>> metric_name("val", "loss"), metric_name("val", "val_loss")
        ('val/loss', 'val_loss')
        >>> metric_name("train", "val/acc"), metric_name("test", "validity")
        ('val/acc', 'test/validity')
    """
    head = key.split("/", 1)[0].split("_", 1)[0]
    if head in STAGES and len(key) > len(head) and key[len(head)] in "_/":
        return key
    return f"{stage}/{key}"


_REDUCTIONS = ("mean", "sum", "max", "min")


@attrs.frozen
class LogOptions:
    """How one metric is logged: Lightning's ``self.log`` options.

    Args:
        on_step: log each logging step's value (training; default ``True``).
        on_epoch: log the epoch's reduction (default ``True`` in training: ``<name>_epoch``,
            or the name alone with ``on_step=False``;
            evaluation always reduces over the epoch). With both set explicitly the step value
            is ``<name>_step`` and the epoch's ``<name>_epoch``, as Lightning names them.
        prog_bar: show it in the progress bar.
        reduce_fx: ``"mean"`` (weighted by batch size), ``"sum"``, ``"max"`` or ``"min"``.

    Example:
        >>> LogOptions(on_step=False, prog_bar=True)
        LogOptions(on_step=False, on_epoch=None, prog_bar=True, reduce_fx=None)
    """

    on_step: bool | None = None
    on_epoch: bool | None = None
    prog_bar: bool = False
    reduce_fx: str | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("on_step", "on_epoch"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"LogOptions({name}={value!r}): pass True, False or None")
        if not isinstance(self.prog_bar, bool):
            raise ValueError(f"LogOptions(prog_bar={self.prog_bar!r}): pass True or False")
        if self.reduce_fx is not None and self.reduce_fx not in _REDUCTIONS:
            raise ValueError(
                f"LogOptions(reduce_fx={self.reduce_fx!r}): pass one of {', '.join(_REDUCTIONS)}"
            )


def _loss_renamed(metrics: Mapping[str, Any]) -> bool:
    """Whether a metric other than ``"loss"`` is the loss itself (the same tensor, detached:
    its storage), as in ``return loss, {"train_loss": loss}``."""
    loss = metrics.get("loss")
    if not isinstance(loss, Tensor):
        return False
    ptr = loss.untyped_storage().data_ptr()
    return any(
        k != "loss"
        and isinstance(v, Tensor)
        and v.untyped_storage().data_ptr() == ptr
        and v.storage_offset() == loss.storage_offset()
        and v.shape == loss.shape
        for k, v in metrics.items()
    )


class MetricReducer:
    """Reductions of tensor metrics over an epoch; :meth:`compute` syncs once, at the end.

    ``"mean"`` is weighted by batch size (Lightning's default), ``"sum"``, ``"max"`` and
    ``"min"`` are what they say. Updates only append to a buffer; every ``fold_every`` steps
    the buffer is folded into running totals with one stacked kernel per metric, so the
    per-step cost is a list append rather than a kernel launch per metric.

    Example:
        >>> import torch
        >>> r = MetricReducer({"n": "sum"})
        >>> r.update({"loss": torch.tensor(1.0), "n": torch.tensor(3.0)}, batch_size=2)
        >>> r.update({"loss": torch.tensor(4.0), "n": torch.tensor(1.0)}, batch_size=1)
        >>> r.compute()
        {'loss': 2.0, 'n': 4.0}
    """

    def __init__(
        self,
        reduce: Mapping[str, str] | None = None,
        fold_every: int = 256,
        *,
        options: Mapping[str, LogOptions] | None = None,
    ) -> None:
        self.options = dict(options or {})
        self.reduce = {
            **dict(reduce or {}),
            **{k: o.reduce_fx for k, o in self.options.items() if o.reduce_fx is not None},
        }
        self.fold_every = fold_every
        self._step_names: dict[tuple[str, ...], list[tuple[str, str | None]]] = {}
        self.pending: list[tuple[Mapping[str, Tensor], int]] = []
        self.values: dict[str, Tensor] = {}
        self.weights: dict[str, int] = {}
        self.objects: dict[str, Any] = {}  # metric objects: they accumulate themselves
        # the returned loss is also a metric of the user's own name (``{"train_loss": loss}``):
        # then it is logged under that name only, as Lightning logs what self.log names
        self._loss_renamed: bool | None = None
        #: the loss the last step_logged / epoch_logged read on the host (None: not read)
        self.host_loss: float | None = None
        self.host_loss_of_epoch = False  # ... the epoch's reduction, not a step's value

    def update(self, metrics: Mapping[str, Any], batch_size: int) -> None:
        if self._loss_renamed is None:  # the first step's metrics decide (no host sync)
            self._loss_renamed = _loss_renamed(metrics)
        if any(not isinstance(v, Tensor) for v in metrics.values()):
            tensors = {}
            for k, v in metrics.items():
                if isinstance(v, Tensor):
                    tensors[k] = v
                else:
                    self.objects[k] = v
            metrics = tensors
        self.pending.append((metrics, batch_size))
        if len(self.pending) >= self.fold_every:
            self._fold()

    def _fold(self) -> None:
        pending, self.pending = self.pending, []
        keys = dict.fromkeys(k for m, _ in pending for k in m)
        with torch.no_grad():
            for k in keys:
                rows = [(m[k], n) for m, n in pending if k in m]
                ts = [t.detach() for t, _ in rows]
                if any(t.ndim for t in ts):
                    ts = [t.float().mean() for t in ts]
                v = torch.stack(ts).float()
                how = self.reduce.get(k, "mean")
                if how == "mean":
                    sizes = torch.tensor([n for _, n in rows], dtype=v.dtype, device=v.device)
                    part = (v * sizes).sum()
                    self.weights[k] = self.weights.get(k, 0) + sum(n for _, n in rows)
                elif how == "sum":
                    part = v.sum()
                elif how == "max":
                    part = v.max()
                else:
                    part = v.min()
                acc = self.values.get(k)
                if acc is None:
                    self.values[k] = part
                elif how in ("mean", "sum"):
                    self.values[k] = acc + part
                elif how == "max":
                    self.values[k] = torch.maximum(acc, part)
                else:
                    self.values[k] = torch.minimum(acc, part)

    def compute(self) -> dict[str, float]:
        """The epoch's values (one host sync); metric objects are computed, then reset."""
        self._fold()
        out: dict[str, float] = {}
        if self.values:
            keys = list(self.values)
            # one host sync for all metrics
            host = torch.stack([self.values[k].to("cpu") for k in keys]).tolist()
            out = {
                k: v / self.weights[k] if k in self.weights else v
                for k, v in zip(keys, host, strict=True)
            }
        for k, obj in self.objects.items():
            value = obj.compute()
            one = isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex()
            if one or isinstance(value, (int, float)):
                out[k] = float(value)
            else:
                shown = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value)
                raise ValueError(
                    f"metric {k!r}: its compute() gave {shown}, not one number; log one number "
                    "per name (e.g. average='macro', or one Metric per class under its own name)"
                )
            obj.reset()
        self.objects.clear()
        return out

    # -- the training loop's names (see the module's docstring)

    def step_logged(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """A training step's metrics on the host, named for the loggers (one transfer for all);
        those with ``on_step=False`` and metric objects are left out. The step's ``"loss"`` is
        read in the same transfer, logged or not, and kept as :attr:`host_loss` (the driver
        reports a non-finite one)."""
        keys = tuple(metrics)
        names = self._step_names.get(keys)
        if names is None:
            if self._loss_renamed is None:
                self._loss_renamed = _loss_renamed(metrics)
            names = self._step_names[keys] = [
                (k, None if k == "loss" and self._loss_renamed else self._step_name(k))
                for k in keys
                if isinstance(metrics[k], Tensor)
                and (k == "loss" or self._step_name(k) is not None)
            ]
        if not names:
            self.host_loss = None
            return {}
        values = torch.stack([metrics[k].detach().float() for k, _ in names]).tolist()
        self.host_loss_of_epoch = False
        self.host_loss = next(
            (v for (k, _), v in zip(names, values, strict=True) if k == "loss"), None
        )
        return {n: v for (_, n), v in zip(names, values, strict=True) if n is not None}

    def epoch_logged(self) -> dict[str, float]:
        """The training epoch's reductions (:meth:`compute`), named for the loggers:
        ``<name>_epoch`` (the name alone for ``on_step=False``, as Lightning names a metric
        logged per epoch only); those with ``on_epoch=False`` are left out. The loss's
        reduction is kept as :attr:`host_loss`, logged or not."""
        out = {}
        computed = self.compute()
        self.host_loss, self.host_loss_of_epoch = computed.get("loss"), True
        for k, v in computed.items():
            options = self.options.get(k)
            if options is not None and options.on_epoch is False:
                continue
            if k == "loss" and self._loss_renamed:
                continue
            name = metric_name("train", k)
            # epoch values only (on_step=False): the name as written, as Lightning logs it
            only_epoch = options is not None and options.on_step is False
            out[name if only_epoch else f"{name}_epoch"] = v
        return out

    def _step_name(self, key: str) -> str | None:
        options = self.options.get(key)
        if options is not None and options.on_step is False:
            return None
        name = metric_name("train", key)
        both = options is not None and options.on_step is True and options.on_epoch is True
        return f"{name}_step" if both else name

    def state_dict(self) -> dict[str, Any]:
        """The running totals and the unfolded buffer as plain floats (exact for float32), so
        a resumed epoch folds at the same places and reduces to the same bits."""
        return {
            "values": {k: float(v) for k, v in self.values.items()},
            "weights": dict(self.weights),
            "pending": [
                [{k: float(t.detach().float().mean()) for k, t in m.items()}, n]
                for m, n in self.pending
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.values = {k: torch.tensor(v, dtype=torch.float32) for k, v in state["values"].items()}
        self.weights = {k: int(v) for k, v in state["weights"].items()}
        self.pending = [
            ({k: torch.tensor(v, dtype=torch.float32) for k, v in m.items()}, int(n))
            for m, n in state["pending"]
        ]

    def reset(self) -> None:
        self.pending.clear()
        self.values.clear()
        self.weights.clear()
        self.objects.clear()
