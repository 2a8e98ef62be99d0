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

**Ranks.** Given a :class:`MetricSync` (:func:`distributed_sync` for ``torch.distributed``), an
epoch's reduction is reduced across ranks once, at the epoch's end, never per step: in evaluation
every tensor metric (``sync_all=True``), so N ranks give one process's values over the whole set;
in training those with ``LogOptions(sync_dist=True)`` (Lightning's flag), the others stay
rank-local as in Lightning. A step's value (``step_logged``) stays rank-local: Lightning reduces
it every step, which is the collective per step this design avoids. Metric objects sync
themselves: torchmetrics gathers its states in ``compute()`` when a process group is initialised.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

__all__ = [
    "STAGES",
    "LogOptions",
    "MetricReducer",
    "MetricSync",
    "distributed_sync",
    "is_metric_object",
    "metric_name",
]

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
        on_step: log each logging step's value (training: default ``True``; validation and
            test: default ``False``, ``True`` logs each batch's value, at the count of that
            loader's batches evaluated so far, as Lightning does).
        on_epoch: log the epoch's reduction (default ``True`` in training: ``<name>_epoch``,
            or the name alone with ``on_step=False``; in validation and test the name alone,
            or ``<name>_epoch`` beside ``<name>_step`` when ``on_step=True``). With both set
            explicitly the step value is ``<name>_step`` and the epoch's ``<name>_epoch``, as
            Lightning names them.
        prog_bar: show it in the progress bar.
        reduce_fx: ``"mean"`` (weighted by batch size), ``"sum"``, ``"max"`` or ``"min"``.
        sync_dist: reduce the training epoch's value across ranks (Lightning's ``sync_dist``):
            once, at the epoch's end; the step values stay rank-local. Evaluation metrics are
            reduced across ranks whatever this says (the whole set's values).

    Example:
        >>> LogOptions(on_step=False, prog_bar=True)
        LogOptions(on_step=False, on_epoch=None, prog_bar=True, reduce_fx=None, sync_dist=False)
        >>> LogOptions(sync_dist=1)
        Traceback (most recent call last):
        ...
        ValueError: LogOptions(sync_dist=1): pass True or False
    """

    on_step: bool | None = None
    on_epoch: bool | None = None
    prog_bar: bool = False
    reduce_fx: str | None = None
    sync_dist: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("on_step", "on_epoch"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"LogOptions({name}={value!r}): pass True, False or None")
        for name in ("prog_bar", "sync_dist"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"LogOptions({name}={value!r}): pass True or False")
        if self.reduce_fx is not None and self.reduce_fx not in _REDUCTIONS:
            raise ValueError(
                f"LogOptions(reduce_fx={self.reduce_fx!r}): pass one of {', '.join(_REDUCTIONS)}"
            )


_OPS = ("sum", "max", "min")


@runtime_checkable
class MetricSync(Protocol):
    """The collectives an epoch's reduction across ranks needs (:meth:`MetricReducer.compute`).

    :func:`distributed_sync` implements it for ``torch.distributed``; a strategy returns one, the
    Trainer hands it to the reducer. Every rank must call the same methods in the same order
    (they are collectives).

    Attributes:
        world_size: the number of ranks (1: nothing is reduced).
        rank: this rank's index, ``0 <= rank < world_size``.
    """

    world_size: int
    rank: int

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        """``tensor`` reduced elementwise over the ranks by ``op`` (``"sum"``, ``"max"`` or
        ``"min"``); a new tensor or ``tensor`` itself, on any device."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        ...


class _TorchDistributedSync:
    """:class:`MetricSync` over a ``torch.distributed`` process group (:func:`distributed_sync`)."""

    def __init__(self, group: Any, device: torch.device | None) -> None:
        import torch.distributed as dist

        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        backend = str(dist.get_backend(group))
        if device is None:
            # NCCL moves CUDA tensors only; gloo and the others move host tensors
            cuda_only = "nccl" in backend and ":" not in backend
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if cuda_only
                else torch.device("cpu")
            )
        self.device = device

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        import torch.distributed as dist

        if op not in _OPS:
            raise ValueError(f"all_reduce(op={op!r}): pass one of {', '.join(_OPS)}")
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        out = tensor.to(self.device, copy=True)  # never the caller's tensor, reduced in place
        dist.all_reduce(out, op=reduce_op[op], group=self.group)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def __repr__(self) -> str:
        return f"<distributed_sync rank {self.rank} of {self.world_size} on {self.device}>"


def distributed_sync(group: Any = None, *, device: torch.device | str | None = None) -> MetricSync:
    """A :class:`MetricSync` over ``torch.distributed`` (its default group, or ``group``).

    Args:
        group: the process group (``None``: the default one, ``init_process_group``'s).
        device: where the packed metrics are reduced (``None``: the current CUDA device under
            NCCL, the host under gloo and the other backends).

    Raises:
        RuntimeError: no process group is initialised (call ``init_process_group`` first).

    Example:
        >>> import torch.distributed as dist
        >>> dist.is_initialized() or distributed_sync()
        Traceback (most recent call last):
        ...
        RuntimeError: distributed_sync(): no process group is initialised; call ...
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "distributed_sync(): no process group is initialised; call "
            "torch.distributed.init_process_group first (or pass sync=None on one process)"
        )
    return _TorchDistributedSync(group, None if device is None else torch.device(device))


def _blank(obj: Any) -> Any:
    """A reset copy of a metric object, on the host (for a rank that never saw it)."""
    blank = copy.deepcopy(obj)
    blank.reset()
    # torchmetrics gathers an empty list state as an empty *float* tensor, which the other
    # ranks' integer targets mismatch in its all_gather (gloo aborts): make it an empty tensor
    # of the donor's dtype and trailing shape instead
    for name, default in getattr(blank, "_defaults", {}).items():
        state = getattr(obj, name, None)
        if isinstance(default, list) and state and isinstance(state[0], Tensor):
            setattr(blank, name, [state[0].new_empty((0, *state[0].shape[1:]))])
    to = getattr(blank, "to", None)
    return to("cpu") if callable(to) else blank


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
                device = ts[-1].device  # a resumed epoch's restored rows are on the host
                if any(t.device != device for t in ts):
                    ts = [t.to(device) for t in ts]
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

    def compute(
        self, sync: MetricSync | None = None, *, sync_all: bool = False
    ) -> dict[str, float]:
        """The epoch's values (one host sync); metric objects are computed, then reset.

        Args:
            sync: the ranks to reduce over; ``None`` or a ``world_size`` of 1: this process's
                values alone, without a collective.
            sync_all: reduce every tensor metric across the ranks (evaluation: the whole set's
                values); otherwise only those with ``LogOptions(sync_dist=True)`` (training,
                as Lightning does), the others stay rank-local.

        Across ranks, ``"mean"`` is the sum of ``value * batch_size`` over every rank's batches
        divided by the sum of their sizes, ``"sum"`` the sum, ``"max"`` / ``"min"`` the global
        ones: the values of one process over the union of the ranks' batches (up to the order
        of summation). The synced metrics are packed in sorted key order: one ``"sum"``
        collective carries every mean's and sum's total, each mean's batch count and a 0/1
        "has it" count for the others (float64, so the counts stay exact); one ``"max"`` and one
        ``"min"`` follow only when such metrics are synced. A rank that lacks a metric (no
        batches at all, or steps that never returned it) packs the neutral element: 0 with
        weight 0, ``-inf``, ``+inf``; a metric no rank has is left out. The key set is agreed
        without a collective in training (the ``sync_dist`` options, the same on every rank);
        in evaluation (``sync_all``) the keys come from the batches, so one ``all_gather_object``
        of the key names comes first: a rank with zero batches still learns them. A metric
        object is not packed: its own ``compute()`` syncs (torchmetrics does when a process
        group is initialised); a rank without it (zero batches) gets a reset copy from the
        lowest rank that has it (one more ``all_gather_object``, only then), so that it takes
        part in the metric's collectives instead of leaving the others waiting.

        Raises:
            ValueError: a metric object's ``compute()`` is not one number; a name is a tensor
                on one rank and a metric object on another.

        Example:
            A fake of two ranks holding the same values (its sum doubles, max / min keep):

            >>> import torch
            >>> class Twice:
            ...     world_size, rank, calls = 2, 0, []
            ...     def all_reduce(self, tensor, op):
            ...         self.calls.append(op)
            ...         return tensor * 2 if op == "sum" else tensor
            ...     def all_gather_object(self, obj):
            ...         self.calls.append("gather")
            ...         return [obj, obj]
            >>> r = MetricReducer({"n": "sum", "hi": "max"})
            >>> r.update({"loss": torch.tensor(3.0), "n": torch.tensor(2.0),
            ...           "hi": torch.tensor(5.0)}, batch_size=4)
            >>> sync = Twice()
            >>> r.compute(sync, sync_all=True)
            {'loss': 3.0, 'n': 4.0, 'hi': 5.0}
            >>> sync.calls
            ['gather', 'sum', 'max']
        """
        self._fold()
        if sync is None or sync.world_size <= 1:
            out = self._host(list(self.values))
            objects = list(self.objects.items())
            blanks: set[str] = set()
        else:
            out, objects, blanks = self._synced(sync, sync_all)
        for k, obj in objects:
            with warnings.catch_warnings():
                if k in blanks:  # a rank without batches: torchmetrics warns of no update()
                    warnings.filterwarnings("ignore", message=".*before the ``update``")
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

    def _host(self, keys: Sequence[str]) -> dict[str, float]:
        """This rank's reductions of ``keys`` on the host (one transfer for all)."""
        if not keys:
            return {}
        host = torch.stack([self.values[k].to("cpu") for k in keys]).tolist()
        return {
            k: v / self.weights[k] if k in self.weights else v
            for k, v in zip(keys, host, strict=True)
        }

    def _synced(
        self, sync: MetricSync, sync_all: bool
    ) -> tuple[dict[str, float], list[tuple[str, Any]], set[str]]:
        """The epoch's tensor values with the synced ones reduced across ranks, in this rank's
        order (then the names only other ranks had); the metric objects to compute, in the same
        order on every rank; the names of those that are reset copies (see :meth:`compute`)."""
        blanks: set[str] = set()
        if sync_all:
            keys, objects, blanks = self._agree_keys(sync)
        else:
            keys = sorted(k for k, o in self.options.items() if o.sync_dist)
            objects = list(self.objects.items())  # first-seen order: the same steps everywhere
        synced = set(keys)
        reduced = self._all_reduce(keys, sync)
        local = self._host([k for k in self.values if k not in synced])
        out = {
            k: reduced[k] if k in synced else local[k]
            for k in self.values
            if k in reduced or k in local
        }
        out.update((k, reduced[k]) for k in keys if k in reduced and k not in out)
        return out, objects, blanks

    def _all_reduce(self, keys: Sequence[str], sync: MetricSync) -> dict[str, float]:
        """``keys`` (sorted, the same on every rank) reduced across the ranks: one collective
        per reduction kind present (see :meth:`compute` for the packing)."""
        if not keys:
            return {}
        device = next((v.device for v in self.values.values()), torch.device("cpu"))
        if device.type == "mps":  # no float64 there; the sync moves the packing where it goes
            device = torch.device("cpu")
        f64 = torch.float64
        kinds = [self.reduce.get(k, "mean") for k in keys]

        def packed(how: tuple[str, ...], missing: float) -> Tensor:
            return torch.stack(
                [
                    self.values[k].to(device, f64)
                    if k in self.values
                    else torch.tensor(missing, dtype=f64, device=device)
                    for k, h in zip(keys, kinds, strict=True)
                    if h in how
                ]
            )

        # per key: a mean's batch count, else whether this rank has it (a count of ranks)
        counts = [
            float(self.weights.get(k, 0)) if h == "mean" else float(k in self.values)
            for k, h in zip(keys, kinds, strict=True)
        ]
        parts = [torch.tensor(counts, dtype=f64).to(device)]
        if any(h in ("mean", "sum") for h in kinds):
            parts.insert(0, packed(("mean", "sum"), 0.0))
        results = [sync.all_reduce(torch.cat(parts), "sum")]
        order = [k for k, h in zip(keys, kinds, strict=True) if h in ("mean", "sum")]
        for how, missing in (("max", -math.inf), ("min", math.inf)):
            if how in kinds:
                results.append(sync.all_reduce(packed((how,), missing), how))
        # one transfer; laid out as packed: the sums' totals, the counts, the maxima, the minima
        host = torch.cat([t.to(results[0].device, f64) for t in results]).tolist()
        n_sum = len(order)
        count = dict(zip(keys, host[n_sum : n_sum + len(keys)], strict=True))
        order += [k for k, h in zip(keys, kinds, strict=True) if h == "max"]
        order += [k for k, h in zip(keys, kinds, strict=True) if h == "min"]
        total = dict(zip(order, host[:n_sum] + host[n_sum + len(keys) :], strict=True))
        out: dict[str, float] = {}
        for k, how in zip(keys, kinds, strict=True):
            if count[k] > 0:  # else no rank has it
                out[k] = total[k] / count[k] if how == "mean" else total[k]
        return out

    def _agree_keys(self, sync: MetricSync) -> tuple[list[str], list[tuple[str, Any]], set[str]]:
        """The tensor metric names every rank has between them (sorted), the metric objects in
        the same order on every rank (a reset copy where this rank had none) and the names of
        those copies: one ``all_gather_object``, two if some rank lacks a metric object."""
        gathered = sync.all_gather_object((sorted(self.values), sorted(self.objects)))
        tensor_keys = sorted({k for t, _ in gathered for k in t})
        object_keys = sorted({k for _, o in gathered for k in o})
        mixed = sorted(set(tensor_keys) & set(object_keys))
        if mixed:  # every rank sees the same gathered names, so every rank raises
            raise ValueError(
                f"metric {mixed[0]!r} is a tensor on some ranks and a metric object on others; "
                "return the same kind of value for a name on every rank"
            )
        lacked = [k for k in object_keys if any(k not in o for _, o in gathered)]
        blanks: set[str] = set()
        if lacked:
            donor = {k: next(r for r, (_, o) in enumerate(gathered) if k in o) for k in lacked}
            given = {k: _blank(self.objects[k]) for k in lacked if donor[k] == sync.rank}
            received = sync.all_gather_object(given)
            device = getattr(sync, "device", None)
            for k in lacked:
                if k not in self.objects:
                    obj = received[donor[k]][k]
                    self.objects[k] = obj.to(device) if device is not None else obj
                    blanks.add(k)
        return tensor_keys, [(k, self.objects[k]) for k in object_keys], blanks

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

    def epoch_logged(self, sync: MetricSync | None = None) -> dict[str, float]:
        """The training epoch's reductions (:meth:`compute`), named for the loggers:
        ``<name>_epoch`` (the name alone for ``on_step=False``, as Lightning names a metric
        logged per epoch only); those with ``on_epoch=False`` are left out. The loss's
        reduction is kept as :attr:`host_loss`, logged or not.

        Args:
            sync: the ranks; metrics with ``LogOptions(sync_dist=True)`` (the loss too, under
                ``"loss"``) are reduced across them, the others stay rank-local. Every rank
                must call it at the same epoch end (it is a collective).

        Example:
            >>> import torch
            >>> class Twice:  # two ranks with the same values
            ...     world_size, rank = 2, 0
            ...     def all_reduce(self, tensor, op):
            ...         return tensor * 2 if op == "sum" else tensor
            ...     def all_gather_object(self, obj):
            ...         return [obj, obj]
            >>> r = MetricReducer({"n": "sum", "m": "sum"},
            ...                   options={"n": LogOptions(on_step=False, sync_dist=True)})
            >>> r.update({"loss": torch.tensor(0.5), "n": torch.tensor(3.0),
            ...           "m": torch.tensor(3.0)}, batch_size=8)
            >>> r.epoch_logged(Twice())
            {'train/loss_epoch': 0.5, 'train/n': 6.0, 'train/m_epoch': 3.0}
        """
        out = {}
        computed = self.compute(sync)
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

    # -- the evaluation loops' names (Lightning's defaults there: epoch values only)

    def eval_step_logged(self, prefix: str, metrics: Mapping[str, Any]) -> dict[str, float]:
        """An evaluation batch's values of the metrics logged per step there
        (``LogOptions(on_step=True)``), on the host in one transfer, named as Lightning names
        them: ``<prefix>/<name>_step``, or the name alone with ``on_epoch=False``. Empty (and
        no transfer) when no metric asks for step values, the default.

        Example:
            >>> r = MetricReducer(options={"loss": LogOptions(on_step=True)})
            >>> r.eval_step_logged("val", {"loss": torch.tensor(0.5), "acc": torch.tensor(1.0)})
            {'val/loss_step': 0.5}
        """
        names = [
            (k, n)
            for k, v in metrics.items()
            if isinstance(v, Tensor) and (n := self._eval_step_name(prefix, k)) is not None
        ]
        if not names:
            return {}
        values = torch.stack([metrics[k].detach().float() for k, _ in names]).tolist()
        return {n: v for (_, n), v in zip(names, values, strict=True)}

    def eval_epoch_name(self, prefix: str, key: str) -> str | None:
        """The name an evaluation epoch's value of ``key`` is logged under: the name alone (the
        default, on the epoch only), ``<name>_epoch`` when it is logged per step too, ``None``
        with ``on_epoch=False`` (step values only), as Lightning names them."""
        options = self.options.get(key)
        name = metric_name(prefix, key)
        if options is None or options.on_step is not True:
            return name
        return None if options.on_epoch is False else f"{name}_epoch"

    def _eval_step_name(self, prefix: str, key: str) -> str | None:
        options = self.options.get(key)
        if options is None or options.on_step is not True:
            return None
        name = metric_name(prefix, key)
        return name if options.on_epoch is False else f"{name}_step"

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
