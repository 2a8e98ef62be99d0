"""Which dataset indices each batch of a ``DataLoader`` holds, as it is read: what
``BasePredictionWriter`` hands ``write_on_batch_end`` (Lightning's ``batch_indices``).

:func:`record_batch_indices` puts a recorder around the loader's batch sampler (whatever the
run made of it: this rank's shard included); each index list the sampler yields is queued, and
the loop takes the oldest for each batch it receives. The batch sampler is iterated in the
main process even with worker processes (they are sent index lists), and batches arrive in
that order, so the queue stays in step however far the loader prefetches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.data._wrappers import _set_batch_sampler, _WrappedBatches


class _RecordBatches(_WrappedBatches):
    """A batch sampler that queues the index list of every batch it yields."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.drawn: deque[list[int]] = deque()

    def __iter__(self) -> Iterator[Any]:
        self.drawn.clear()  # a new pass: what the last one queued and nobody read goes
        for indices in self.batch_sampler:
            self.drawn.append([int(i) for i in indices])
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:  # drop_last, batch_size, sampler: the wrapped one's
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def record_batch_indices(loader: Any) -> Callable[[], list[int] | None]:
    """Record the dataset indices of each batch ``loader`` yields; returns a function that
    gives the next batch's (call it once per batch received, in order), or ``None`` for a
    loader whose batches have no indices to record (not a ``DataLoader``, an iterable dataset,
    ``batch_size=None``). :func:`stop_recording` puts the loader back.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(5), batch_size=2)
        >>> nxt = record_batch_indices(loader)
        >>> [(b.tolist(), nxt()) for b in loader]
        [([0, 1], [0, 1]), ([2, 3], [2, 3]), ([4], [4])]
        >>> stop_recording(loader)
    """
    bs = getattr(loader, "batch_sampler", None)
    if (
        not isinstance(loader, torch.utils.data.DataLoader)
        or isinstance(loader.dataset, torch.utils.data.IterableDataset)
        or bs is None
    ):
        return lambda: None
    recorder = bs if isinstance(bs, _RecordBatches) else _RecordBatches(bs)
    _set_batch_sampler(loader, recorder)

    def next_indices() -> list[int] | None:
        return recorder.drawn.popleft() if recorder.drawn else None

    return next_indices


def stop_recording(loader: Any) -> None:
    """Undo :func:`record_batch_indices` (nothing for a loader it did not change)."""
    bs = getattr(loader, "batch_sampler", None)
    if isinstance(bs, _RecordBatches):
        _set_batch_sampler(loader, bs.batch_sampler)
