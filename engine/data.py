"""Dataloader plumbing for the Trainer: resolving sources, counting batches, limits, lookahead.

Any iterable of batches works (a ``torch.utils.data.DataLoader``, a list, a generator
factory); a *datamodule* is any object with ``train_dataloader()`` / ``val_dataloader()`` /
``test_dataloader()`` / ``predict_dataloader()`` methods.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = [
    "ShuffleSampler",
    "count_batches",
    "limit_batches",
    "lookahead",
    "position_loader",
    "resolve_loaders",
]

INF = math.inf


def resolve_loaders(
    stage: str, dataloaders: Any, datamodule: Any, method: str
) -> list[Iterable[Any]]:
    """The list of dataloaders for a stage, from explicit ones or a datamodule's ``method``.

    Several dataloaders are passed as a list of loaders (``DataLoader`` s or any iterables that
    are not themselves lists); a plain list of batches is one loader.

    Raises:
        ValueError: when both or neither are given (where one is required), or an object is not
            iterable.
    """
    if dataloaders is not None and datamodule is not None:
        raise ValueError(f"pass either dataloaders or datamodule to Trainer.{stage}(), not both")
    if datamodule is not None:
        fn = getattr(datamodule, method, None)
        if not callable(fn):
            return []
        dataloaders = fn()
    if dataloaders is None:
        return []
    if hasattr(dataloaders, method) and callable(getattr(dataloaders, method)):
        # a datamodule passed positionally
        dataloaders = getattr(dataloaders, method)()
    loaders = list(dataloaders) if _is_many(dataloaders) else [dataloaders]
    for i, dl in enumerate(loaders):
        if not isinstance(dl, Iterable):
            raise ValueError(
                f"{stage} dataloader {i} is a {type(dl).__name__}, which is not iterable; pass a "
                "DataLoader or any iterable of batches"
            )
    return loaders


def _is_many(obj: Any) -> bool:
    """Whether ``obj`` is a list of dataloaders rather than one list of batches.

    A list counts as several dataloaders when every item is a loader-like iterable: not a
    tensor, tuple, list, dict or string (those are batches).
    """
    if not isinstance(obj, (list, tuple)) or not obj:
        return False
    batch_like = (torch.Tensor, tuple, list, dict, str, bytes)
    return all(isinstance(x, Iterable) and not isinstance(x, batch_like) for x in obj)


def count_batches(loader: Iterable[Any]) -> float:
    """``len(loader)``, or ``inf`` for an iterable without a length."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return INF


def limit_batches(stage: str, length: float, limit: int | float) -> float:
    """Lightning's rule for ``limit_{stage}_batches``: an int caps the count, a float is a
    fraction of a sized loader.

    Example:
        >>> limit_batches("train", 10, 0.25), limit_batches("val", 10, 3)
        (2, 3)
    """
    if length == 0:
        return 0
    if isinstance(limit, int):
        return min(length, limit)
    if length != INF:
        n = int(length * limit)
        if n == 0 and limit > 0.0:
            raise ValueError(
                f"limit_{stage}_batches={limit} of a {stage} dataloader with {int(length)} batches "
                f"is less than one batch; use at least limit_{stage}_batches={1.0 / length} or an "
                "int"
            )
        return n
    if limit != 1.0:
        raise ValueError(
            f"limit_{stage}_batches={limit}: a {stage} dataloader without a length (an iterable "
            f"dataset) takes limit_{stage}_batches=1.0 or an int number of batches"
        )
    return INF


def lookahead(loader: Iterable[Any], limit: float) -> Iterator[tuple[int, Any, bool]]:
    """Yield ``(index, batch, is_last)`` for at most ``limit`` batches.

    ``is_last`` is known one batch early (the next batch is fetched before the current one is
    yielded), as Lightning's data fetcher does, so an iterable without a length still gets its
    last partial accumulation window stepped.
    """
    if limit <= 0:
        return
    it = iter(loader)
    try:
        current = next(it)
    except StopIteration:
        return
    i = 0
    while True:
        if i + 1 >= limit:
            yield i, current, True
            return
        try:
            nxt = next(it)
        except StopIteration:
            yield i, current, True
            return
        yield i, current, False
        current = nxt
        i += 1


def batch_size(batch: Any) -> int:
    """The size of a batch: the first dimension of its first tensor (Lightning's rule), else 1."""
    stack: list[Any] = [batch]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            return int(x.shape[0]) if x.ndim else 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, Sequence) and not isinstance(x, str):
            stack.extend(x)
    return 1


class ShuffleSampler(Sampler[int]):
    """A sampler whose order in epoch ``e`` is a pure function of ``(seed, e)``.

    The Trainer calls :meth:`set_epoch` before each epoch and, when it resumes mid-epoch,
    :meth:`set_start` so the skipped samples are never loaded. Use it with a map-style dataset:
    ``DataLoader(ds, batch_size=32, sampler=ShuffleSampler(ds, seed=0))``.

    Example:
        >>> s = ShuffleSampler(range(6), seed=1)
        >>> s.set_epoch(0); first = list(s)
        >>> s.set_epoch(0); s.set_start(4); list(s) == first[4:]
        True
        >>> s.set_epoch(1); list(s) != first
        True
    """

    def __init__(self, data_source: Sized | int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order and start at its beginning."""
        self.epoch = epoch
        self.start = 0

    def set_start(self, index: int) -> None:
        """Start the current epoch at sample ``index`` (the samples before it are skipped)."""
        if not 0 <= index <= self.n:
            raise ValueError(f"start index must lie in [0, {self.n}] (got {index})")
        self.start = index

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        from engine.rng import derive_seed

        g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, 0, stream=3))
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start :])

    def __len__(self) -> int:
        return self.n


def position_loader(loader: Any, epoch: int, skip_batches: int) -> bool:
    """Point ``loader`` at ``epoch`` and skip its first ``skip_batches`` batches if it can do so
    without loading them; returns whether it did the skipping.

    A ``DataLoader`` whose sampler has ``set_epoch`` (:class:`ShuffleSampler`,
    ``DistributedSampler``) gets the epoch; one with :class:`ShuffleSampler` also skips.
    """
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if sampler is None and batch_sampler is not None:
        sampler = getattr(batch_sampler, "sampler", None)
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    if skip_batches and isinstance(sampler, ShuffleSampler):
        size = getattr(batch_sampler, "batch_size", None) or getattr(loader, "batch_size", None)
        if size:
            sampler.set_start(skip_batches * size)
            return True
    return skip_batches == 0
