"""Per-batch randomness: :func:`seed_batches` keys the first index of each batch with
``(seed, epoch, position)`` and hooks the dataset's ``__getitems__`` (and the workers' copies)
to load a keyed batch with the global generators seeded from the key;
:func:`randomness_outside_the_state` names the loaders it cannot reach.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from engine.data._checks import SEEDS, check_index
from engine.data._seeding import _CALLERS, SeededDataset, ShuffleSampler, _seeded_batch
from engine.data._sharding import _Shard
from engine.data._sources import stateful
from engine.data._wrappers import _unskip, _Wrapper
from engine.rng import derive_seed

BATCH = 6  # derive_seed stream of the randomness of a batch that seed_batches seeds


class _BatchKey(NamedTuple):
    """What :func:`seed_batches` gives the dataset in place of the first index of a batch:
    the index (``item``), the run's seed, the epoch and the index's position in the epoch."""

    item: Any
    seed: int
    epoch: int
    position: int


class _BatchKeys(_Wrapper):
    """Wraps the sampler of a ``BatchSampler``: the first index of each batch comes as a
    :class:`_BatchKey`, the others unchanged.

    Positions count from the start of the epoch: a ``_SkipFirst`` above this one starts it at
    its first kept batch (:meth:`iter_from`), and a :class:`ShuffleSampler` that starts later
    starts the count there too. Under a :class:`_Shard` they are global positions: the rank's batch
    ``j`` starts at ``start + rank + j * size * world``, so no two ranks key a batch alike.
    """

    def __init__(self, batch_sampler: Any, seed: int, epoch: int) -> None:
        self.batch_sampler, self.sampler = batch_sampler, batch_sampler.sampler
        self.seed, self.epoch = seed, epoch

    def __iter__(self) -> Iterator[Any]:
        return self.iter_from(0)

    def iter_from(self, batches: int) -> Iterator[Any]:
        """This pass without its first ``batches`` batches, without keying them: their
        indices are drawn from the sampler (whatever generator it draws from moves on as in a
        whole pass) and dropped, and the kept batches' positions are the whole pass's."""
        seed, epoch, size = self.seed, self.epoch, self.batch_sampler.batch_size
        s, position, stride = self.sampler, 0, size
        if isinstance(s, _Shard):
            position, stride = s.start + s.rank, size * s.world
        elif isinstance(s, ShuffleSampler):
            position = s.start
        it = iter(s)
        if batches:
            next(itertools.islice(it, batches * size, batches * size), None)
            position += batches * stride
        rest = size - 1

        def runs() -> Iterator[list[Any]]:  # the BatchSampler cuts consecutive runs of `size`
            nonlocal position
            for first in it:
                yield [_BatchKey(first, seed, epoch, position), *itertools.islice(it, rest)]
                position += stride

        # one Python resumption a batch, not one an index (~5 us a batch of 128)
        return itertools.chain.from_iterable(runs())

    def __len__(self) -> int:
        return len(self.sampler)


def _class_getitems(dataset: Any) -> Any:
    """The ``__getitems__`` that ``dataset``'s class defines (raw, before binding), or None."""
    for klass in type(dataset).__mro__:
        if "__getitems__" in vars(klass):
            return vars(klass)["__getitems__"]
    return None


class _BatchFetch:
    """The instance attribute ``__getitems__`` that :func:`seed_batches` gives a dataset.

    torch's map-style fetcher calls ``dataset.__getitems__(indices)`` for each batch when the
    dataset has one, in the main process and in the workers (which get a copy of the dataset,
    its instance dict included). A batch that starts with a :class:`_BatchKey` is loaded with
    the global generators seeded from ``(seed, epoch, position)`` and left so (see
    ``_seeded_batch``); others (plain indices: the loader iterated outside a fit) are loaded
    as without the hook.
    """

    def __init__(self, dataset: Any, previous: tuple[Any, ...]) -> None:
        # previous: () or (the instance attribute __getitems__ the hook shadows,); not a
        # sentinel object, which would not survive pickling to a spawned worker
        self.dataset, self.previous = dataset, previous

    def __call__(self, indices: Sequence[Any]) -> Any:
        first = indices[0] if len(indices) else None
        if type(first) is not _BatchKey:
            return self.fetch(indices)
        seed = derive_seed(first.seed, first.epoch, first.position, stream=BATCH)
        return _seeded_batch(seed, self.fetch, [first.item, *indices[1:]])

    def fetch(self, indices: Sequence[Any]) -> Any:
        """What torch's fetcher does without the hook."""
        ds = self.dataset
        if self.previous:
            getitems = self.previous[0]
        else:
            getitems = _class_getitems(ds)
            if hasattr(getitems, "__get__"):
                getitems = getitems.__get__(ds, type(ds))
        if getitems:
            return getitems(indices)
        return [ds[i] for i in indices]


def _takes_hook(dataset: Any) -> bool:
    """Whether ``dataset`` can take an instance attribute ``__getitems__`` that torch will find:
    it has an instance dict and its class no data descriptor of that name."""
    if not isinstance(getattr(dataset, "__dict__", None), dict):
        return False
    attr = _class_getitems(dataset)
    return not (hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__"))


def _hook(dataset: Any) -> bool:
    """Give ``dataset`` a :class:`_BatchFetch` (unless it has one); returns whether it has."""
    if not _takes_hook(dataset):
        return False
    d = dataset.__dict__
    previous = (d["__getitems__"],) if "__getitems__" in d else ()
    if previous and isinstance(previous[0], _BatchFetch):
        return True
    fetch = d["__getitems__"] = _BatchFetch(dataset, previous)
    if getattr(dataset, "__getitems__", None) is not fetch:  # a __getattribute__ of its own
        _unhook(dataset)
        return False
    return True


def _unhook(dataset: Any) -> None:
    d = getattr(dataset, "__dict__", None)
    fetch = d.get("__getitems__") if isinstance(d, dict) else None
    if isinstance(fetch, _BatchFetch):
        if fetch.previous:
            d["__getitems__"] = fetch.previous[0]  # type: ignore[index]
        else:
            del d["__getitems__"]  # type: ignore[union-attr]


class _HookWorkers:
    """A loader's ``worker_init_fn`` while :func:`seed_batches` keys it: hooks the worker's copy
    of the dataset if the copy came without the hook (a dataset that pickles without its
    instance dict, under spawn or forkserver), then runs the user's ``worker_init_fn``."""

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            _hook(info.dataset)
        if self.init is not None:
            self.init(worker_id)


# persistent worker pools started while their dataset was hooked (they keep the hook)
_HOOKED_WORKERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _batches_seedable(loader: Any) -> bool:
    """Whether :func:`seed_batches` takes ``loader``: a ``DataLoader`` over a map-style dataset
    (not a :class:`SeededDataset`, which seeds each sample itself) that can take the hook, whose
    batches torch's own ``BatchSampler`` cuts, and which does not restore its own position."""
    dataset = getattr(loader, "dataset", None)
    return (
        isinstance(loader, torch.utils.data.DataLoader)
        and type(loader.batch_sampler) is torch.utils.data.BatchSampler
        and not stateful(loader)
        and not isinstance(dataset, (torch.utils.data.IterableDataset, SeededDataset))
        and _takes_hook(dataset)
    )


def randomness_outside_the_state(loader: Any) -> bool:
    """Whether random numbers that ``loader``'s dataset draws in worker processes are outside
    the run's state: a ``DataLoader`` with workers that :func:`seed_batches` leaves alone (a
    custom batch sampler, ``batch_size=None``, an iterable dataset, a loader with
    ``state_dict()``, a dataset without an instance dict) over a dataset that is not a
    :class:`SeededDataset` and runs code of its own (not a list, a tensor...).

    Example:
        >>> from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset
        >>> ds = TensorDataset(torch.arange(8.0))
        >>> randomness_outside_the_state(DataLoader(ds, batch_size=2, num_workers=2))
        False
        >>> class Pairs(BatchSampler): ...
        >>> custom = Pairs(SequentialSampler(ds), batch_size=2, drop_last=False)
        >>> randomness_outside_the_state(DataLoader(ds, batch_sampler=custom, num_workers=2))
        True
        >>> randomness_outside_the_state(DataLoader(SeededDataset(ds), batch_sampler=custom,
        ...                                         num_workers=2))
        False
    """
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.num_workers == 0:
        return False
    ds = loader.dataset
    runs_code = isinstance(ds, torch.utils.data.IterableDataset) or isinstance(
        getattr(type(ds), "__getitem__", None), types.FunctionType
    )
    return runs_code and not isinstance(ds, SeededDataset) and not _batches_seedable(loader)


def seed_batches(loader: Any, seed: int, epoch: int) -> bool:
    """Make the randomness of each batch ``loader`` loads in epoch ``epoch`` a function of
    ``(seed, epoch, position of the batch in the epoch)``; returns whether it did.
    :func:`restore_loader` undoes it.

    The loader's ``BatchSampler`` draws from a sampler that gives the first index of each batch
    as a key carrying the seed, the epoch and its position, and the dataset gets an instance
    attribute ``__getitems__`` that, for a batch so keyed, loads it (with the class's
    ``__getitems__``, else item by item) with torch's CPU generator, Python's ``random`` and
    NumPy's global generator seeded once from those, and leaves them so: the loader's
    ``collate_fn`` draws on from the batch's own stream. A dataset (or a ``collate_fn``) that
    draws random numbers (random augmentation, MixUp) then draws the same ones whichever
    process loads the batch, whatever ``num_workers`` is and in a resumed run. Batches without
    a key (the loader iterated outside the fit) load unseeded, as before.

    With ``num_workers=0`` the batches load in this process, so from the first keyed batch
    until :func:`restore_loader` the process's global generators are the batches': code that
    runs between two batches draws on from the last one's stream (a function of the run's
    seed, so a resumed run redraws it too), and :func:`restore_loader` (which a fit calls when
    it ends) puts back the states they had before the first batch. With workers, this
    process's generators are left alone.

    Left alone (returns ``False``): a :class:`SeededDataset` (it seeds each sample itself; as
    keyed batches do, its samples leave this process's generators seeded until
    :func:`restore_loader`), a custom batch sampler, ``batch_size=None``, an iterable
    dataset, a loader with ``state_dict()``, a dataset without an instance dict, anything but
    a ``DataLoader``.

    Raises:
        ValueError: if ``seed`` is not an int in ``[0, 2**63)`` or ``epoch`` not one >= 0.

    Example:
        >>> from torch.utils.data import DataLoader, Dataset
        >>> from engine.data import restore_loader
        >>> class Noisy(Dataset):
        ...     def __len__(self): return 6
        ...     def __getitem__(self, i): return torch.rand(1) + i
        >>> loader = DataLoader(Noisy(), batch_size=2)
        >>> seed_batches(loader, seed=0, epoch=1)
        True
        >>> first = torch.cat(list(loader))
        >>> _ = seed_batches(loader, seed=0, epoch=1)
        >>> torch.equal(torch.cat(list(loader)), first)
        True
        >>> restore_loader(loader)
        >>> "__getitems__" in vars(loader.dataset), type(loader.batch_sampler.sampler).__name__
        (False, 'SequentialSampler')
    """
    seed = check_index("seed_batches", "seed", seed, limit=SEEDS)
    epoch = check_index("seed_batches", "epoch", epoch)
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, SeededDataset) and isinstance(loader, torch.utils.data.DataLoader):
        dataset._hold(True)  # its samples hold this process's generators, as keyed batches do
        return False
    if not _batches_seedable(loader):
        return False
    _unskip(loader)  # what skipped the last resumed epoch's first batches
    bs = loader.batch_sampler
    keys = bs.sampler
    if not isinstance(keys, _BatchKeys):
        if not _hook(loader.dataset):
            return False
        keys = bs.sampler = _BatchKeys(bs, seed, epoch)
        if loader.num_workers > 0 and not isinstance(loader.worker_init_fn, _HookWorkers):
            loader.worker_init_fn = _HookWorkers(loader.worker_init_fn)
        workers = getattr(loader, "_iterator", None)  # persistent workers from before the fit
        if workers is not None and workers not in _HOOKED_WORKERS:
            shutdown = getattr(workers, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()  # their copy of the dataset has no hook: start new ones
            loader._iterator = None
    keys.seed, keys.epoch = seed, epoch
    return True


def _unkey(loader: Any) -> None:
    """Undo :func:`seed_batches`."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, SeededDataset) and dataset._holding:
        dataset._hold(False)
        _CALLERS.give_back()
    bs = getattr(loader, "batch_sampler", None)
    keys = getattr(bs, "sampler", None)
    if not isinstance(keys, _BatchKeys):
        return
    bs.sampler = keys.sampler  # type: ignore[union-attr]
    _unhook(loader.dataset)
    _CALLERS.give_back()  # the main process's generators: the caller's again
    if isinstance(loader.worker_init_fn, _HookWorkers):
        loader.worker_init_fn = loader.worker_init_fn.init
    workers = getattr(loader, "_iterator", None)
    if workers is not None:  # persistent workers started during the fit keep the hook
        _HOOKED_WORKERS.add(workers)
