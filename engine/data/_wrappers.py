"""The loader-wrapper protocol (private): what a fit puts around a ``DataLoader``'s samplers.

A fit changes a ``DataLoader`` in place, and :func:`engine.data.restore_loader` undoes it: the
sampler of its ``BatchSampler`` gets a chain of wrappers (the per-batch keys of
``_batch_keys``, the skip of a resumed epoch's first batches of ``_position``, the rank's shard
of ``_sharding``), and a custom batch sampler may be replaced by a wrapped one (the shard of
whole batches). Each wrapper declares itself here, so each module finds the others' wrappers in
the chain without importing them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

from torch.utils.data import Sampler


class _Wrapper(Sampler[Any]):
    """A sampler a fit puts around the sampler of a ``BatchSampler`` (``batch_sampler``): it
    draws from ``sampler``, the next one down the chain."""

    batch_sampler: Any
    sampler: Any
    #: it puts ``sampler`` back in its place when iterated (one pass only)
    one_pass: ClassVar[bool] = False

    def iter_from(self, batches: int) -> Iterator[Any]:
        """This pass without its first ``batches`` batches (the skip of a resumed epoch); a
        wrapper that can drop them for less than drawing them through itself says how."""
        return itertools.islice(iter(self), batches * self.batch_sampler.batch_size, None)


class _WrappedBatches(Sampler[Any]):
    """A batch sampler a fit puts in a ``DataLoader`` in place of the user's own, which it
    draws from (``batch_sampler``)."""

    batch_sampler: Any


def _base(sampler: Any) -> Any:
    """``sampler`` without the wrappers a fit put around it."""
    while isinstance(sampler, _Wrapper):
        sampler = sampler.sampler
    return sampler


def _unskip(loader: Any) -> None:
    """Put back a sampler a one-pass wrapper (the skip of a resumed epoch's first batches,
    ``_position._skip_by_index``) wrapped and nothing iterated since."""
    bs = getattr(loader, "batch_sampler", None)
    s = getattr(bs, "sampler", None)
    if isinstance(s, _Wrapper) and s.one_pass:
        bs.sampler = s.sampler  # type: ignore[union-attr]


def _user_batch_sampler(loader: Any) -> Any:
    """``loader``'s batch sampler as the user made it (through a :class:`_WrappedBatches`)."""
    bs = getattr(loader, "batch_sampler", None)
    return bs.batch_sampler if isinstance(bs, _WrappedBatches) else bs


def _set_batch_sampler(loader: Any, batch_sampler: Any) -> None:
    """Give a ``DataLoader`` another batch sampler (its ``__setattr__`` refuses it after
    ``__init__``), also to its persistent workers' iterator, which keeps the one it started
    with."""
    object.__setattr__(loader, "batch_sampler", batch_sampler)
    workers = getattr(loader, "_iterator", None)
    if workers is not None and hasattr(workers, "_index_sampler"):
        workers._index_sampler = batch_sampler
