"""Where a loader resumes: :func:`position_loader` points a loader at an epoch and skips a
resumed epoch's first batches without loading them; :func:`restore_loader` undoes everything a
fit did to a loader.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from engine.data._batch_keys import _unkey
from engine.data._checks import check_index
from engine.data._seeding import _SEEDED, ShuffleSampler, _random_sampler
from engine.data._sharding import _shard_of, _ShardBatches, _unshard
from engine.data._sources import stateful
from engine.data._wrappers import _unskip, _Wrapper


class _SkipFirst(_Wrapper):
    """For one iteration of ``batch_sampler``: its sampler's order without the first ``skip``
    items (the rest of a resumed epoch).

    The sampler still runs through the skipped items, so whatever generator it draws from
    advances exactly as in the uninterrupted epoch; only the loading is left out. Iterating
    puts the sampler back, so the next pass over the same loader (a validation on the
    training loader, the next epoch) is a whole one.
    """

    one_pass = True

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.sampler, self.skip = batch_sampler, batch_sampler.sampler, skip

    def __iter__(self) -> Iterator[Any]:
        self.batch_sampler.sampler = self.sampler  # one pass only
        size = self.batch_sampler.batch_size
        if isinstance(self.sampler, _Wrapper) and self.skip % size == 0:
            return self.sampler.iter_from(self.skip // size)  # batch keys: skipped unkeyed
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:  # the whole epoch's, as ShuffleSampler's during a resumed epoch
        return len(self.sampler)


def _skip_by_index(loader: Any, batches: int) -> bool:
    """Make a map-style ``DataLoader`` skip its first ``batches`` batches without loading them:
    its ``BatchSampler`` draws the skipped indices and drops them, once. Not for loaders that
    restore their own position (``stateful``), iterable datasets or custom batch samplers."""
    bs = getattr(loader, "batch_sampler", None)
    if (
        type(bs) is not torch.utils.data.BatchSampler
        or stateful(loader)
        or isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
    ):
        return False
    bs.sampler = _SkipFirst(bs, batches * bs.batch_size)
    return True


def position_loader(loader: Any, epoch: int, skip_batches: int) -> bool:
    """Point ``loader`` at ``epoch`` and skip its first ``skip_batches`` batches if it can do so
    without loading them; returns whether it did the skipping.

    A ``DataLoader`` whose sampler has ``set_epoch`` (:class:`ShuffleSampler`,
    ``DistributedSampler``) gets the epoch, and so does its dataset when it has ``set_epoch``
    (:class:`SeededDataset`). One with :class:`ShuffleSampler` skips by starting it later; any
    other ``DataLoader`` over a map-style dataset with a ``batch_size`` skips by drawing the
    skipped batches' indices and dropping them, so no sample is loaded for them and the order
    that follows is the uninterrupted epoch's (:func:`restore_loader` puts its sampler back).
    A loader :func:`shard_loader` sharded skips by starting its shard at global position
    ``skip_batches * batch_size * world_size`` (``skip_batches * world_size`` global batches
    for a custom batch sampler): ``skip_batches`` counts this rank's batches. Other loaders
    (iterables, iterable datasets, custom batch samplers) cannot skip.

    Raises:
        ValueError: if ``epoch`` or ``skip_batches`` is not an int >= 0.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(10), batch_size=4)
        >>> position_loader(loader, epoch=0, skip_batches=1)
        True
        >>> [b.tolist() for b in loader]
        [[4, 5, 6, 7], [8, 9]]
        >>> restore_loader(loader); len([b for b in loader])
        3
    """
    epoch = check_index("position_loader", "epoch", epoch)
    skip_batches = check_index("position_loader", "skip_batches", skip_batches)
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if sampler is None and batch_sampler is not None:
        sampler = getattr(batch_sampler, "sampler", None)
    for obj in (sampler, getattr(loader, "dataset", None)):
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
    _unskip(loader)  # what skipped the last resumed epoch's first batches
    shard = _shard_of(loader)
    if isinstance(shard, _ShardBatches):  # sharded by whole batches: starts at a global batch
        shard.start = skip_batches * shard.world
        return True
    if shard is not None:  # it draws the base's whole order: the base starts at 0
        shard.start = skip_batches * shard.batch_sampler.batch_size * shard.world
        return True
    if not skip_batches:
        return True
    if isinstance(sampler, ShuffleSampler):
        size = getattr(batch_sampler, "batch_size", None) or getattr(loader, "batch_size", None)
        if size:
            sampler.set_start(skip_batches * size)
            return True
    return _skip_by_index(loader, skip_batches)


def restore_loader(loader: Any) -> None:
    """Undo what a fit did to ``loader``: :func:`seed_shuffle`'s generator (the sampler draws
    from torch's global generator again), :func:`seed_batches`' keys and dataset hook (and the
    global generators its batches held in this process go back to the states they had before
    the first), :func:`position_loader`'s skipping and :func:`shard_loader`'s shard, whichever
    of them were done and in whatever order."""
    s = _random_sampler(loader)
    if s is not None and getattr(s, _SEEDED, False):
        s.generator = None
        delattr(s, _SEEDED)
    _unskip(loader)
    _unkey(loader)
    _unshard(loader)
