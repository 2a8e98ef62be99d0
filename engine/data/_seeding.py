"""Data order and per-sample randomness as functions of the run's seed: :class:`SeededDataset`
(each sample seeded from ``(seed, epoch, index)``), :class:`ShuffleSampler` (each epoch's order
from ``(seed, epoch)``), and :func:`seed_shuffle`, which seeds a ``DataLoader``'s own
``RandomSampler`` the same way.
"""

from __future__ import annotations

import operator
import random
import sys
from collections.abc import Callable, Iterator, Sized
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import Dataset, Sampler

from engine.data._checks import SEEDS, check_index
from engine.data._sharding import _Shard, _shard_of
from engine.data._wrappers import _base, _user_batch_sampler
from engine.rng import derive_seed


class SampleKey(NamedTuple):
    """The key a :class:`ShuffleSampler` gives a :class:`SeededDataset`: the epoch a sample
    is drawn in and its index."""

    epoch: int
    idx: int


class SeededDataset(Dataset[Any]):
    """A map-style dataset whose per-sample randomness depends only on ``(seed, epoch, index)``.

    Each ``dataset[index]`` runs with torch's CPU generator, Python's ``random`` and (when it is
    imported) NumPy's global generator seeded from ``(seed, epoch, index)``, and restores them
    afterwards (in a ``DataLoader`` worker, whose generators nothing else reads between loads,
    it leaves them seeded; so it does in the training process during a fit, whose end puts
    the caller's back: the loader's ``collate_fn`` then draws on from the last sample's stream
    whatever ``num_workers`` is). Random augmentations therefore draw the same numbers for a sample
    whichever worker loads it — the batches do not depend on ``num_workers`` — and a resumed
    run redraws exactly what the uninterrupted one drew.

    Give it to a :class:`ShuffleSampler` (``ShuffleSampler(seeded_ds, seed=...)``), which then
    yields :class:`SampleKey` s carrying the epoch, so even persistent workers see the right
    epoch. Indexed by a plain int, it uses the epoch of its last :meth:`set_epoch` (the Trainer
    calls it before each epoch).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __len__(self): return 8
        ...     def __getitem__(self, i): return torch.rand(1) + i
        >>> ds = SeededDataset(Noisy(), seed=0)
        >>> def batches(workers):
        ...     sampler = ShuffleSampler(ds, seed=1)
        ...     return torch.cat(list(DataLoader(ds, batch_size=2, sampler=sampler,
        ...                                      num_workers=workers)))
        >>> torch.equal(batches(0), batches(2))
        True
    """

    def __init__(self, dataset: Any, *, seed: int = 0) -> None:
        if not callable(getattr(dataset, "__getitem__", None)):
            raise TypeError(
                f"SeededDataset wraps a map-style dataset (with __getitem__); got "
                f"{type(dataset).__name__}"
            )
        seed = check_index("SeededDataset", "seed", seed, limit=SEEDS)
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch that plain-int indices belong to."""
        epoch = check_index("SeededDataset.set_epoch", "epoch", epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | SampleKey | tuple[int, int]) -> Any:
        epoch, index = (key[0], key[1]) if isinstance(key, tuple) else (self.epoch, key)
        seed = derive_seed(self.seed, epoch, index, stream=SAMPLE)
        call = _seeded_batch if self._holding else _seeded_call
        return call(seed, operator.getitem, self.dataset, index)

    #: whether a fit holds this process's generators for the samples (:meth:`_hold`)
    _holding = False

    def _hold(self, holding: bool) -> None:
        """While ``holding`` (a fit over a loader of this dataset), a sample loaded in this
        process leaves the generators seeded, as in a worker, and the caller's states wait
        in ``_CALLERS`` for :func:`engine.data.restore_loader`: the ``collate_fn`` draws on
        from the last sample's stream whatever ``num_workers`` is."""
        self._holding = holding


SAMPLE = 4  # derive_seed stream of per-sample randomness (engine.rng has 0-2; 3 is data order)

_T = TypeVar("_T")


def _seeded_call(seed: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with torch's CPU generator, Python's ``random`` and (when it is imported)
    NumPy's global generator seeded from ``seed``; their states are put back afterwards.

    In a ``DataLoader`` worker they are seeded and left so: a worker's generators serve its
    loads alone, and each load seeds them first, so putting them back buys nothing there.
    """
    nprandom: Any = getattr(sys.modules.get("numpy"), "random", None)  # only if imported
    if _worker_info() is not None:
        _seed_globals(seed, nprandom)
        return fn(*args)
    py_state = random.getstate()
    gen = torch.random.default_generator
    torch_state = gen.get_state()
    np_state = None if nprandom is None else nprandom.get_state()
    try:
        _seed_globals(seed, nprandom)
        return fn(*args)
    finally:
        gen.set_state(torch_state)
        random.setstate(py_state)
        if np_state is not None:
            nprandom.set_state(np_state)


def _seed_globals(seed: int, nprandom: Any) -> None:
    """Seed torch's CPU generator, Python's ``random`` and, if imported, NumPy's global one."""
    torch.random.default_generator.manual_seed(seed)
    random.seed(seed)
    if nprandom is not None:
        nprandom.seed(seed % 2**32)


class _CallersStreams:
    """The caller's states of this process's global generators while seeded batches hold them.

    In the main process each keyed batch seeds torch's CPU generator, Python's ``random`` and
    NumPy's global generator and leaves them so, as a worker does: its ``collate_fn`` and the
    code that runs before the next batch draw on from the batch's stream. :meth:`take` sets the
    caller's states aside at the first such batch (NumPy's when it is first seen imported);
    :meth:`give_back` puts them back (:func:`engine.data.restore_loader`, which a fit calls
    when it ends). Once a fit, not once a batch: Python's state alone is 625 ints each way.
    """

    def __init__(self) -> None:
        self.torch: torch.Tensor | None = None
        self.python: Any = None
        self.numpy: Any = None

    def take(self, nprandom: Any) -> None:
        if self.torch is None:
            self.torch = torch.random.default_generator.get_state()
            self.python = random.getstate()
        if self.numpy is None and nprandom is not None:
            self.numpy = nprandom.get_state()

    def give_back(self) -> None:
        if self.torch is not None:
            torch.random.default_generator.set_state(self.torch)
            random.setstate(self.python)
            self.torch = self.python = None
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
            self.numpy = None


_CALLERS = _CallersStreams()  # the main process's: generators are global to a process


def _seeded_batch(seed: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with torch's CPU generator, Python's ``random`` and (when it is imported)
    NumPy's global generator seeded from ``seed``, and left so: in the main process the
    caller's states wait in :data:`_CALLERS` until :meth:`_CallersStreams.give_back`."""
    nprandom: Any = getattr(sys.modules.get("numpy"), "random", None)  # only if imported
    if _worker_info() is None:
        _CALLERS.take(nprandom)
    _seed_globals(seed, nprandom)
    return fn(*args)


_worker_info = torch.utils.data.get_worker_info


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

    #: Already each epoch's own order: a data-parallel training shard deals it as it is (a
    #: torch sampler's order is replaced by ``DistributedSampler``'s, as Lightning does).
    epoch_order = True

    def __init__(self, data_source: Sized | int, *, seed: int = 0, shuffle: bool = True) -> None:
        seed = check_index("ShuffleSampler", "seed", seed, limit=SEEDS)
        if not isinstance(shuffle, bool):
            raise TypeError(f"ShuffleSampler(shuffle={shuffle!r}): shuffle must be True or False")
        if isinstance(data_source, int):
            check_index("ShuffleSampler", "data_source", data_source)  # a count of samples
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        self.keyed = isinstance(data_source, SeededDataset)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order and start at its beginning."""
        epoch = check_index("ShuffleSampler.set_epoch", "epoch", epoch)
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
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, 0, stream=3))
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[Any]:
        order = self.order()[self.start :]
        if self.keyed:  # a SeededDataset: tell it the epoch with each index
            return iter([SampleKey(self.epoch, i) for i in order])
        return iter(order)

    def __len__(self) -> int:
        return self.n


SHUFFLE = 5  # derive_seed stream of the order a RandomSampler draws when the Trainer seeds it
_SEEDED = "_engine_seeded"  # marks a RandomSampler whose generator the Trainer put there


def _random_sampler(loader: Any) -> torch.utils.data.RandomSampler | None:
    batch_sampler = _user_batch_sampler(loader)
    for s in (getattr(loader, "sampler", None), _base(getattr(batch_sampler, "sampler", None))):
        if isinstance(s, torch.utils.data.RandomSampler):
            return s
    return None


def order_outside_the_state(loader: Any) -> bool:
    """Whether ``loader`` shuffles with a ``RandomSampler`` that draws from a generator the user
    gave it, which is not part of the run's state (so a resume or a replay sees other batches).

    A ``RandomSampler`` without a generator of its own (``DataLoader(..., shuffle=True)``) is
    not: the Trainer seeds it from ``(seed, epoch)`` each epoch (:func:`seed_shuffle`).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> order_outside_the_state(DataLoader(range(8), shuffle=True))
        False
        >>> g = torch.Generator().manual_seed(0)
        >>> order_outside_the_state(DataLoader(range(8), shuffle=True, generator=g))
        True
        >>> order_outside_the_state(DataLoader(range(8), sampler=ShuffleSampler(8, seed=0)))
        False
    """
    s = _random_sampler(loader)
    return s is not None and not _seedable(s)


def _seedable(s: torch.utils.data.RandomSampler) -> bool:
    """Whether :func:`seed_shuffle` may give ``s`` its generator: no generator of the user's, and
    torch's own ``__iter__`` (a subclass's order may not read ``.generator`` at all)."""
    return type(s).__iter__ is torch.utils.data.RandomSampler.__iter__ and (
        s.generator is None or getattr(s, _SEEDED, False)
    )


def seed_shuffle(loader: Any, seed: int, epoch: int) -> bool:
    """Make the ``RandomSampler`` of ``loader``, if it has one without a generator of its own,
    draw epoch ``epoch``'s order from a generator seeded with ``(seed, epoch)``; returns whether
    it did. :func:`restore_loader` puts the sampler back as it was.

    ``DataLoader(..., shuffle=True)`` otherwise seeds each epoch's order from torch's global
    generator, which no checkpoint holds. Seeded, the order is a pure function of the run's seed
    and the epoch, so a resumed or replayed run sees the same batches.

    A loader :func:`shard_loader` sharded with ``shuffle=True`` (a data-parallel training
    loader) is told the epoch too: its order is ``DistributedSampler(seed=seed)``'s after
    ``set_epoch(epoch)``, the permutation seeded with ``seed + epoch``, as Lightning's.

    Raises:
        ValueError: if ``seed`` is not an int in ``[0, 2**63)`` or ``epoch`` not one >= 0.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from engine.data import restore_loader
        >>> loader = DataLoader(range(6), shuffle=True)
        >>> seed_shuffle(loader, seed=0, epoch=1)
        True
        >>> first = [int(b) for b in loader]
        >>> _ = torch.rand(3)  # moves the global generator on, which no longer matters
        >>> _ = seed_shuffle(loader, seed=0, epoch=1)
        >>> [int(b) for b in loader] == first
        True
        >>> restore_loader(loader)
        >>> loader.sampler.generator is None
        True
    """
    seed = check_index("seed_shuffle", "seed", seed, limit=SEEDS)
    epoch = check_index("seed_shuffle", "epoch", epoch)
    shard = _shard_of(loader)
    if isinstance(shard, _Shard):  # a data-parallel training shard: DistributedSampler's order
        shard.set_epoch(seed, epoch)
    s = _random_sampler(loader)
    if s is None or not _seedable(s):
        return False
    s.generator = torch.Generator().manual_seed(derive_seed(seed, epoch, 0, stream=SHUFFLE))
    setattr(s, _SEEDED, True)
    return True
