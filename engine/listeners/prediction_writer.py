"""``BasePredictionWriter``: write predictions as they are made, Lightning's callback of that
name, on engine's events.

Subclass it and implement :meth:`BasePredictionWriter.write_on_batch_end` (``write_interval=
"batch"``), :meth:`BasePredictionWriter.write_on_epoch_end` (``"epoch"``) or both
(``"batch_and_epoch"``). Each receives the event's record instead of Lightning's ``(trainer,
pl_module)`` pair (``rec.run.global_rank`` names the rank), then Lightning's arguments: the
predictions and their **batch indices**, the dataset indices of each batch's samples, so that
under several processes (each predicting its shard, unpadded: every sample once) every rank
writes its own file and the predictions can be put back in dataset order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.events import EventRecord, Listener

__all__ = ["BasePredictionWriter"]

_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Listener):
    """Write predictions at each batch's end, at the prediction epoch's end, or both.

    Runs on every rank (not ``rank_zero_only``): under several processes each rank writes what
    it predicted, with its batches' dataset indices. For the epoch's end the predictions are
    kept (moved to the CPU) as they come, whatever ``Trainer.predict(return_predictions=...)``
    says, as Lightning keeps them for such a writer.

    Args:
        write_interval: ``"batch"`` (default), ``"epoch"`` or ``"batch_and_epoch"``.

    Raises:
        ValueError: for another ``write_interval``.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.listeners import BasePredictionWriter
        >>> class Keep(BasePredictionWriter):
        ...     def __init__(self):
        ...         super().__init__("epoch")
        ...     def write_on_epoch_end(self, rec, predictions, batch_indices):
        ...         self.written = (len(predictions), batch_indices)
        >>> task = eg.Task(lambda m, b: m(b).sum(), optim.sgd(0.1))
        >>> writer = Keep()
        >>> trainer = eg.Trainer(callbacks=[writer], logger=False, enable_progress_bar=False)
        >>> data = torch.utils.data.DataLoader(torch.ones(5, 2), batch_size=2)
        >>> _ = trainer.predict(task, task.init(torch.nn.Linear(2, 1)), data)
        >>> writer.written
        (3, [[[0, 1], [2, 3], [4]]])
    """

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise ValueError(
                f"BasePredictionWriter(write_interval={write_interval!r}): pass one of "
                f"{', '.join(repr(x) for x in _INTERVALS)}"
            )
        self.interval = write_interval
        self._predictions: list[list[Any]] = []
        self._indices: list[list[Any]] = []

    @property
    def _on_batch(self) -> bool:
        return self.interval in ("batch", "batch_and_epoch")

    @property
    def _on_epoch(self) -> bool:
        return self.interval in ("epoch", "batch_and_epoch")

    def write_on_batch_end(
        self,
        rec: EventRecord,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's ``prediction`` (the predict step's output); ``batch_indices`` are
        the dataset indices of its samples."""
        raise NotImplementedError(
            f"{type(self).__name__}: write_interval={self.interval!r} calls "
            "write_on_batch_end(rec, prediction, batch_indices, batch, batch_idx, "
            "dataloader_idx); implement it"
        )

    def write_on_epoch_end(
        self, rec: EventRecord, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        """Write the epoch's ``predictions`` (one list of batch outputs, or one per dataloader
        when there are several, as Lightning's) and ``batch_indices`` (per dataloader, per
        batch: the dataset indices)."""
        raise NotImplementedError(
            f"{type(self).__name__}: write_interval={self.interval!r} calls "
            "write_on_epoch_end(rec, predictions, batch_indices); implement it"
        )

    def on_predict_epoch_start(self, rec: EventRecord) -> None:
        self._predictions, self._indices = [], []

    def on_predict_batch_end(self, rec: EventRecord) -> None:
        assert rec.batch_idx is not None
        if self._on_batch:
            self.write_on_batch_end(
                rec, rec.outputs, rec.batch_indices, rec.batch, rec.batch_idx, rec.dataloader_idx
            )
        if self._on_epoch:
            while len(self._predictions) <= rec.dataloader_idx:
                self._predictions.append([])
                self._indices.append([])
            self._predictions[rec.dataloader_idx].append(_to_cpu(rec.outputs))
            self._indices[rec.dataloader_idx].append(rec.batch_indices)

    def on_predict_epoch_end(self, rec: EventRecord) -> None:
        if not self._on_epoch:
            return
        predictions, indices = self._predictions, self._indices
        self._predictions, self._indices = [], []
        self.write_on_epoch_end(
            rec, predictions[0] if len(predictions) == 1 else predictions, indices
        )


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it moved to the CPU (nested lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
