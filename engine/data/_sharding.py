"""Sharding loaders across ranks: :func:`shard_loader` deals each epoch's order out to the
ranks (padded for training, uneven for evaluation) and :func:`shard_start` starts every rank's
shard at a global sample position, which carries over to another world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from engine.data._wrappers import (
    _base,
    _set_batch_sampler,
    _user_batch_sampler,
    _WrappedBatches,
    _Wrapper,
)

# the samplers Lightning replaces with a DistributedSampler over the dataset
_REPLACED = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)


def _dealt(n: int, world: int, pad: bool, drop_last: bool) -> int:
    """How many positions of an order of ``n`` items are dealt out to ``world`` ranks: padded
    up to a multiple of ``world`` (``pad``), cut down to one (``drop_last`` without ``pad``:
    every rank then drops the same number of batches), else all of them."""
    if pad:
        return -(-n // world) * world
    return n // world * world if drop_last else n


def _deal(order: list[Any], total: int, start: int, rank: int, world: int) -> list[Any]:
    """Positions ``start + rank, start + rank + world, ...`` below ``total`` of ``order``
    repeated from its start as often as it takes to reach ``total`` (DistributedSampler's
    padding)."""
    if total > len(order) and order:
        order = (order * -(-total // len(order)))[:total]
    return order[start + rank : total : world]


def _check_start(start: int, world: int, what: str) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % world:
        raise ValueError(
            f"a shard over {world} ranks starts at a global {what} position that is an int >= 0 "
            f"and a multiple of the world size {world} (got {start!r}); convert the position "
            "saved at another world size to a whole number of this world size's global batches"
        )


class _Shard(_Wrapper):
    """Wraps the sampler of a ``BatchSampler``: rank ``rank`` of ``world``'s share of its order.

    Each pass draws the wrapped sampler's whole order (the same on every rank: a seeded
    ``RandomSampler``, a :class:`ShuffleSampler`, a ``SequentialSampler``), pads or cuts it
    (:func:`_dealt`) and yields its global positions ``start + rank, start + rank + world, ...``
    ``start`` is a global position, a multiple of ``world``; the length is the rank's whole
    epoch's, as ``ShuffleSampler``'s during a resumed epoch.

    ``shuffle``: the order is ``DistributedSampler(shuffle=True)``'s instead, the permutation
    ``torch.randperm(n)`` drawn from a generator seeded with ``seed + epoch`` (:meth:`set_epoch`)
    of the dataset's indices (over a torch ``RandomSampler`` or ``SequentialSampler``, which it
    replaces) or of the wrapped sampler's order (Lightning's ``DistributedSamplerWrapper``).
    A sampler whose ``epoch_order`` is true (engine's :class:`ShuffleSampler`: already the
    epoch's seeded shuffle) keeps its own order.
    """

    def __init__(
        self,
        batch_sampler: Any,
        sampler: Any,
        rank: int,
        world: int,
        pad: bool,
        shuffle: bool = False,
    ) -> None:
        self.batch_sampler, self.sampler = batch_sampler, sampler
        self.rank, self.world, self.pad = rank, world, pad
        self.shuffle = shuffle
        self.seed, self.epoch = 0, 0
        self.start = 0

    def set_epoch(self, seed: int, epoch: int) -> None:
        """The epoch whose permutation a ``shuffle`` shard deals (``seed + epoch``, as
        ``DistributedSampler.set_epoch`` with ``DistributedSampler(seed=seed)``)."""
        self.seed, self.epoch = int(seed), int(epoch)

    def _total(self, n: int) -> int:
        return _dealt(n, self.world, self.pad, bool(self.batch_sampler.drop_last))

    def _replaces(self) -> bool:
        """Whether the order is a permutation of the dataset's indices (a ``shuffle`` shard
        over a torch ``RandomSampler`` or ``SequentialSampler``, as Lightning replaces them)."""
        return self.shuffle and type(self.sampler) in _REPLACED

    def _order(self) -> list[Any]:
        if not self.shuffle or getattr(_base(self.sampler), "epoch_order", False):
            return list(self.sampler)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self._replaces():
            return torch.randperm(len(self.sampler.data_source), generator=g).tolist()
        drawn = list(self.sampler)
        return [drawn[i] for i in torch.randperm(len(drawn), generator=g).tolist()]

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        total = self._total(len(order))
        return iter(_deal(order, total, self.start, self.rank, self.world))

    def __len__(self) -> int:
        n = len(self.sampler.data_source) if self._replaces() else len(self.sampler)
        return len(range(self.rank, self._total(n), self.world))


class _ShardBatches(_WrappedBatches):
    """A ``DataLoader``'s custom batch sampler, sharded: rank ``rank`` of ``world`` takes its
    batches ``start + rank, start + rank + world, ...`` (``pad``: repeated from the first batch
    up to a multiple of ``world``). ``start`` counts global batches."""

    def __init__(self, batch_sampler: Any, rank: int, world: int, pad: bool) -> None:
        self.batch_sampler = batch_sampler
        self.rank, self.world, self.pad = rank, world, pad
        self.start = 0

    def __iter__(self) -> Iterator[Any]:
        batches = list(self.batch_sampler)
        total = _dealt(len(batches), self.world, self.pad, False)
        return iter(_deal(batches, total, self.start, self.rank, self.world))

    def __len__(self) -> int:
        total = _dealt(len(self.batch_sampler), self.world, self.pad, False)
        return len(range(self.rank, total, self.world))


def _shard_of(loader: Any) -> _Shard | _ShardBatches | None:
    """The shard :func:`shard_loader` gave ``loader``, if any."""
    bs = getattr(loader, "batch_sampler", None)
    if isinstance(bs, _ShardBatches):
        return bs
    s = getattr(bs, "sampler", None)
    while isinstance(s, _Wrapper):
        if isinstance(s, _Shard):
            return s
        s = s.sampler
    return None


def shard_loader(
    loader: Any, rank: int, world_size: int, *, pad: bool, shuffle: bool = False
) -> bool:
    """Make ``loader`` yield rank ``rank`` of ``world_size``'s shard of each epoch's order, in
    place; returns whether it sharded. :func:`restore_loader` undoes it; a second call with the
    same arguments does nothing (other arguments start the shard again from the epoch's start).

    A ``DataLoader`` with torch's ``BatchSampler``: its sampler is wrapped to draw the whole
    order (the same on every rank: the Trainer's seeded ``RandomSampler``, a
    :class:`ShuffleSampler`, a ``SequentialSampler``) and keep its positions ``rank,
    rank + world_size, ...``, as ``DistributedSampler`` does: ``pad=True`` repeats the order's
    first samples until its length is a multiple of ``world_size`` (``DistributedSampler`` with
    ``drop_last=False``: training, where every rank takes part in every step); ``pad=False``
    gives uneven shards (``ceil`` or ``floor`` of ``n / world_size``: evaluation, where no
    sample is counted twice). The loader's ``drop_last`` drops each rank's partial last batch;
    without ``pad`` the order is first cut to a multiple of ``world_size``, so every rank has
    the same number of batches (the global partial batch is dropped). ``len(loader)`` is the
    rank's number of batches. The first ``k`` batches of every rank cover exactly the global
    positions ``[0, k * batch_size * world_size)`` of the order, whatever the world size, so a
    resume on another world size can start each new shard where it should
    (:func:`shard_start`); :func:`position_loader` skips a rank's first batches without
    loading them, and :func:`seed_batches` keys each batch by its global position.

    ``shuffle=True`` deals ``DistributedSampler(shuffle=True)``'s order instead, as Lightning's
    ``use_distributed_sampler`` does for training: each epoch the permutation seeded with
    ``seed + epoch`` (:func:`seed_shuffle` tells the shard both) of the dataset's indices, in
    place of a torch ``RandomSampler`` or ``SequentialSampler`` (whatever the loader's
    ``shuffle``), or of a custom sampler's order (Lightning's ``DistributedSamplerWrapper``); a
    sampler with ``epoch_order`` (:class:`ShuffleSampler`) is dealt as it is.

    With a custom batch sampler, whole batches are dealt out: rank ``rank`` takes batches
    ``rank, rank + world_size, ...`` (``pad=True``: repeated from the first batch).

    Left alone (returns ``False``): a loader whose sampler is a ``DistributedSampler`` already
    (the user's sharding), an iterable dataset, ``batch_size=None``, anything but a
    ``DataLoader`` (every rank then reads all of it).

    Raises:
        ValueError: if ``world_size`` is not an int >= 1 or ``rank`` not in
            ``[0, world_size)``.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from engine.data import restore_loader
        >>> loaders = [DataLoader(range(10), batch_size=2) for _ in range(3)]
        >>> [shard_loader(dl, rank, 3, pad=True) for rank, dl in enumerate(loaders)]
        [True, True, True]
        >>> [[b.tolist() for b in dl] for dl in loaders]
        [[[0, 3], [6, 9]], [[1, 4], [7, 0]], [[2, 5], [8, 1]]]
        >>> _ = shard_loader(loaders[2], 2, 3, pad=False); [b.tolist() for b in loaders[2]]
        [[2, 5], [8]]
        >>> restore_loader(loaders[0]); len(loaders[0])
        5
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (got {world_size!r})")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be an int in [0, {world_size}) for world_size={world_size} (got {rank!r})"
        )
    bs = _user_batch_sampler(loader)
    if (
        not isinstance(loader, torch.utils.data.DataLoader)
        or isinstance(loader.dataset, torch.utils.data.IterableDataset)
        or bs is None
    ):
        return False
    shard = _shard_of(loader)
    if shard is not None:
        if (shard.rank, shard.world, shard.pad) != (rank, world_size, pad):
            shard.rank, shard.world, shard.pad, shard.start = rank, world_size, pad, 0
        if isinstance(shard, _Shard):
            shard.shuffle = shuffle
        return True
    distributed = torch.utils.data.DistributedSampler
    if isinstance(loader.sampler, distributed) or isinstance(
        _base(getattr(bs, "sampler", None)), distributed
    ):
        return False  # the user's own sharding; position_loader gives it the epoch
    if type(bs) is not torch.utils.data.BatchSampler:
        _set_batch_sampler(loader, _ShardBatches(bs, rank, world_size, pad))
        return True
    parent: Any = bs  # the shard goes right above the base: it draws the whole order
    while isinstance(parent.sampler, _Wrapper):
        parent = parent.sampler
    parent.sampler = _Shard(bs, parent.sampler, rank, world_size, pad, shuffle)
    return True


def shard_start(loader: Any, global_position: int) -> bool:
    """Start the current epoch of a loader :func:`shard_loader` sharded at sample
    ``global_position`` of the epoch's (padded) order: each rank's shard continues from there,
    and the samples before it are never loaded. Returns ``False`` for a loader that is not
    sharded by samples (not sharded, or sharded by whole batches: its positions count
    batches, see :func:`position_loader`).

    Call it after :func:`position_loader` (which starts the shard at the rank's
    ``skip_batches``). ``global_position`` must be a multiple of the world size; a multiple of
    ``batch_size * world_size`` keeps each rank's batches those of an uninterrupted run on
    this world size. Run on ``W`` ranks for ``k`` batches each, an epoch is at global position
    ``k * batch_size * W``; on ``W'`` ranks it continues at the same position.

    Raises:
        ValueError: if ``global_position`` is negative or not a multiple of the world size.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> two = [DataLoader(range(12), batch_size=2) for _ in range(2)]
        >>> for rank, dl in enumerate(two):
        ...     _ = shard_loader(dl, rank, 2, pad=True)
        >>> [next(iter(dl)).tolist() for dl in two]  # one batch each: positions [0, 4)
        [[0, 2], [1, 3]]
        >>> one = DataLoader(range(12), batch_size=2)
        >>> _ = shard_loader(one, 0, 1, pad=True); shard_start(one, 4)
        True
        >>> [b.tolist() for b in one]  # the rest on one rank
        [[4, 5], [6, 7], [8, 9], [10, 11]]
    """
    shard = _shard_of(loader)
    if not isinstance(shard, _Shard):
        return False
    _check_start(global_position, shard.world, "sample")
    shard.start = global_position
    return True


def _unshard(loader: Any) -> None:
    """Undo :func:`shard_loader`: take its wrapper out of the chain, wherever it is."""
    bs = getattr(loader, "batch_sampler", None)
    if isinstance(bs, _ShardBatches):
        _set_batch_sampler(loader, bs.batch_sampler)
        return
    parent = bs
    while isinstance(getattr(parent, "sampler", None), _Wrapper):
        child = parent.sampler  # type: ignore[union-attr]
        if isinstance(child, _Shard):
            parent.sampler = child.sampler  # type: ignore[union-attr]
            return
        parent = child
