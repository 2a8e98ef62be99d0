"""Dataloader plumbing for the Trainer: resolving sources, counting batches, limits, lookahead.

Any iterable of batches works (a ``torch.utils.data.DataLoader``, a list, a generator
factory); a *datamodule* is any object with ``train_dataloader()`` / ``val_dataloader()`` /
``test_dataloader()`` / ``predict_dataloader()`` methods.
"""

from __future__ import annotations

import itertools
import math
import operator
import random
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import Dataset, Sampler

from engine import _tree
from engine.rng import derive_seed

__all__ = [
    "SampleKey",
    "SeededDataset",
    "ShuffleSampler",
    "count_batches",
    "datamodule_loaders",
    "is_datamodule",
    "limit_batches",
    "lookahead",
    "order_outside_the_state",
    "position_loader",
    "randomness_outside_the_state",
    "resolve_loaders",
    "restore_loader",
    "seed_batches",
    "seed_shuffle",
    "setup_datamodule",
    "shard_loader",
    "shard_start",
    "state_from_json",
    "state_to_json",
    "stateful",
    "teardown_datamodule",
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
        dataloaders = datamodule_loaders(datamodule, method, stage)
    elif dataloaders is not None and is_datamodule(dataloaders):  # passed positionally
        dataloaders = datamodule_loaders(dataloaders, method, stage)
    if dataloaders is None:
        return []
    loaders = list(dataloaders) if _is_many(dataloaders) else [dataloaders]
    for i, dl in enumerate(loaders):
        if not isinstance(dl, Iterable):
            raise ValueError(
                f"{stage} dataloader {i} is a {type(dl).__name__}, which is not iterable; pass a "
                "DataLoader or any iterable of batches"
            )
    return loaders


_LOADER_METHODS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` serves loaders as a datamodule does (a ``*_dataloader()`` method)."""
    return not isinstance(obj, Iterable) and any(
        callable(getattr(obj, m, None)) for m in _LOADER_METHODS
    )


def _lightning_default(obj: Any, method: str) -> bool:
    """Whether ``obj``'s ``method`` is Lightning's placeholder (``LightningDataModule`` defines
    every ``*_dataloader`` to raise until a subclass overrides it)."""
    owner = next((c for c in type(obj).__mro__ if method in vars(c)), None)
    return owner is not None and owner.__module__.split(".")[0] in (
        "pytorch_lightning",
        "lightning",
    )


def datamodule_loaders(datamodule: Any, method: str, stage: str) -> Any:
    """``datamodule.method()``, or ``None`` when the datamodule has no such loader; an
    ``AttributeError`` it raises names the ``setup`` call that should have made what it reads."""
    fn = getattr(datamodule, method, None)
    if not callable(fn) or _lightning_default(datamodule, method):
        return None
    try:
        return fn()
    except AttributeError as e:
        name = type(datamodule).__name__
        called = (
            f"the Trainer called {name}.setup({_SETUP_STAGE.get(stage, stage)!r}) before it, as "
            "Lightning does: create there what it reads"
            if callable(getattr(datamodule, "setup", None))
            else f"{name} has no setup(stage) method: give it one that creates what it reads "
            "(Lightning's DataModule protocol), or build it before passing it"
        )
        raise AttributeError(f"{name}.{method}() failed ({e}); {called}") from e


# Lightning's stage names for setup(stage) / teardown(stage), by Trainer entry point
_SETUP_STAGE = {"fit": "fit", "validate": "validate", "test": "test", "predict": "predict"}


def setup_datamodule(datamodule: Any, stage: str, trainer: Any = None) -> None:
    """Lightning's DataModule protocol at the start of a stage: ``prepare_data()`` (download,
    tokenize: once per call, in this process), then ``setup(stage)``. A
    ``LightningDataModule`` (an object with a ``trainer`` attribute still ``None``) gets
    ``trainer``, as Lightning sets it, for code that reads the flags (``self.trainer.max_epochs``).
    """
    if trainer is not None and getattr(datamodule, "trainer", False) is None:
        datamodule.trainer = trainer
    for name, args in (("prepare_data", ()), ("setup", (_SETUP_STAGE[stage],))):
        hook = getattr(datamodule, name, None)
        if callable(hook):
            hook(*args)


def teardown_datamodule(datamodule: Any, stage: str) -> None:
    """Lightning's DataModule protocol at the end of a stage: ``teardown(stage)``."""
    hook = getattr(datamodule, "teardown", None)
    if callable(hook):
        hook(_SETUP_STAGE[stage])


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


def lookahead(
    loader: Iterable[Any], limit: float, *, snapshot: Any = None
) -> Iterator[tuple[int, Any, bool, Any]]:
    """Yield ``(index, batch, is_last, position)`` for at most ``limit`` batches.

    ``is_last`` is known one batch early (the next batch is fetched before the current one is
    yielded), as Lightning's data fetcher does, so an iterable without a length still gets its
    last partial accumulation window stepped. With ``snapshot`` (a stateful loader's
    ``state_dict``), ``position`` is the loader's state right after ``batch`` was drawn — taken
    before the next batch is fetched — else ``None``.
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
        position = snapshot() if snapshot is not None else None
        if i + 1 >= limit:
            yield i, current, True, position
            return
        try:
            nxt = next(it)
        except StopIteration:
            yield i, current, True, position
            return
        yield i, current, False, position
        current = nxt
        i += 1


def stateful(loader: Any) -> bool:
    """Whether ``loader`` saves and restores its own position (``state_dict()`` and
    ``load_state_dict()``, as torchdata's ``StatefulDataLoader`` does)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def state_to_json(obj: Any) -> Any:
    """A loader's ``state_dict`` as JSON (tensors, bytes, tuples, non-string keys and
    non-finite floats encoded), so it can ride in a checkpoint's ``meta.json`` and load without
    running code.

    Example:
        >>> import torch
        >>> state = {"pos": 3, "rng": torch.tensor([1, 2], dtype=torch.uint8), "t": (1, 2.5)}
        >>> back = state_from_json(state_to_json(state))
        >>> back["pos"], back["rng"].tolist(), back["t"]
        (3, [1, 2], (1, 2.5))
    """
    return _tree.to_json(obj, "loader state")


def state_from_json(doc: Any) -> Any:
    """The inverse of :func:`state_to_json`."""
    return _tree.from_json(doc)


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


class SampleKey(NamedTuple):
    """The key a :class:`ShuffleSampler` gives a :class:`SeededDataset`: the epoch a sample
    is drawn in and its index."""

    epoch: int
    idx: int


class SeededDataset(Dataset[Any]):
    """A map-style dataset whose per-sample randomness depends only on ``(seed, epoch, index)``.

    Each ``dataset[index]`` runs with torch's CPU generator, Python's ``random`` and (when it is
    imported) NumPy's global generator seeded from ``(seed, epoch, index)``, and restores them
    afterwards. Random augmentations therefore draw the same numbers for a sample whichever
    worker loads it — the batches do not depend on ``num_workers`` — and a resumed run redraws
    exactly what the uninterrupted one drew.

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
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch that plain-int indices belong to."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | SampleKey | tuple[int, int]) -> Any:
        epoch, index = (key[0], key[1]) if isinstance(key, tuple) else (self.epoch, key)
        seed = derive_seed(self.seed, epoch, index, stream=SAMPLE)
        return _seeded_call(seed, operator.getitem, self.dataset, index)


SAMPLE = 4  # derive_seed stream of per-sample randomness (engine.rng has 0-2; 3 is data order)

_T = TypeVar("_T")


def _seeded_call(seed: int, fn: Callable[..., _T], *args: Any, swap_numpy: bool = False) -> _T:
    """``fn(*args)`` with torch's CPU generator, Python's ``random`` and (when it is imported)
    NumPy's global generator seeded from ``seed``; their states are put back afterwards.

    ``swap_numpy``: rather than save and restore the state of NumPy's global bit generator
    (50 us, most of the cost), set it aside and seed a spare one in its place (2 us). Its state
    is then untouched, but the legacy normal sampler's cache (one pending value of
    ``np.random.randn`` after an odd count) is dropped.
    """
    nprandom: Any = getattr(sys.modules.get("numpy"), "random", None)  # only if imported
    swap = swap_numpy and hasattr(nprandom, "set_bit_generator")
    py_state = random.getstate()
    gen = torch.random.default_generator
    torch_state = gen.get_state()
    if swap:
        np_saved = nprandom.get_bit_generator()
        if not _SPARE_NUMPY:
            _SPARE_NUMPY.append(nprandom.MT19937())
        nprandom.set_bit_generator(_SPARE_NUMPY[0])
    elif nprandom is not None:
        np_state = nprandom.get_state()
    try:
        gen.manual_seed(seed)
        random.seed(seed)
        if nprandom is not None:
            nprandom.seed(seed % 2**32)  # legacy seeding, of the spare one when swapped
        return fn(*args)
    finally:
        gen.set_state(torch_state)
        random.setstate(py_state)
        if swap:
            nprandom.set_bit_generator(np_saved)
        elif nprandom is not None:
            nprandom.set_state(np_state)


_SPARE_NUMPY: list[Any] = []  # this process's spare bit generator for _seeded_call(swap_numpy)


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
        self.keyed = isinstance(data_source, SeededDataset)
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

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
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
    s = _random_sampler(loader)
    if s is None or not _seedable(s):
        return False
    s.generator = torch.Generator().manual_seed(derive_seed(seed, epoch, 0, stream=SHUFFLE))
    setattr(s, _SEEDED, True)
    return True


def restore_loader(loader: Any) -> None:
    """Undo what a fit did to ``loader``: :func:`seed_shuffle`'s generator (the sampler draws
    from torch's global generator again), :func:`seed_batches`' keys and dataset hook,
    :func:`position_loader`'s skipping and :func:`shard_loader`'s shard, whichever of them were
    done and in whatever order."""
    s = _random_sampler(loader)
    if s is not None and getattr(s, _SEEDED, False):
        s.generator = None
        delattr(s, _SEEDED)
    _unskip(loader)
    _unkey(loader)
    _unshard(loader)


def _unshard(loader: Any) -> None:
    """Undo :func:`shard_loader`: take its wrapper out of the chain, wherever it is."""
    bs = getattr(loader, "batch_sampler", None)
    if isinstance(bs, _ShardBatches):
        _set_batch_sampler(loader, bs.batch_sampler)
        return
    parent = bs
    while isinstance(getattr(parent, "sampler", None), _WRAPPERS):
        child = parent.sampler  # type: ignore[union-attr]
        if isinstance(child, _Shard):
            parent.sampler = child.sampler  # type: ignore[union-attr]
            return
        parent = child


class _SkipFirst(Sampler[Any]):
    """For one iteration of ``batch_sampler``: its sampler's order without the first ``skip``
    items (the rest of a resumed epoch).

    The sampler still runs through the skipped items, so whatever generator it draws from
    advances exactly as in the uninterrupted epoch; only the loading is left out. Iterating
    puts the sampler back, so the next pass over the same loader (a validation on the
    training loader, the next epoch) is a whole one.
    """

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.sampler, self.skip = batch_sampler, batch_sampler.sampler, skip

    def __iter__(self) -> Iterator[Any]:
        self.batch_sampler.sampler = self.sampler  # one pass only
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


def _unskip(loader: Any) -> None:
    """Put back a sampler :func:`_skip_by_index` wrapped and nothing iterated since."""
    bs = getattr(loader, "batch_sampler", None)
    if isinstance(getattr(bs, "sampler", None), _SkipFirst):
        bs.sampler = bs.sampler.sampler  # type: ignore[union-attr]


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


# ---------------------------------------------------------------- sharding across ranks


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


class _Shard(Sampler[Any]):
    """Wraps the sampler of a ``BatchSampler``: rank ``rank`` of ``world``'s share of its order.

    Each pass draws the wrapped sampler's whole order (the same on every rank: a seeded
    ``RandomSampler``, a :class:`ShuffleSampler`, a ``SequentialSampler``), pads or cuts it
    (:func:`_dealt`) and yields its global positions ``start + rank, start + rank + world, ...``
    ``start`` is a global position, a multiple of ``world``; the length is the rank's whole
    epoch's, as ``ShuffleSampler``'s during a resumed epoch.
    """

    def __init__(self, batch_sampler: Any, sampler: Any, rank: int, world: int, pad: bool) -> None:
        self.batch_sampler, self.sampler = batch_sampler, sampler
        self.rank, self.world, self.pad = rank, world, pad
        self.start = 0

    def _total(self, n: int) -> int:
        return _dealt(n, self.world, self.pad, bool(self.batch_sampler.drop_last))

    def __iter__(self) -> Iterator[Any]:
        order = list(self.sampler)
        total = self._total(len(order))
        return iter(_deal(order, total, self.start, self.rank, self.world))

    def __len__(self) -> int:
        return len(range(self.rank, self._total(len(self.sampler)), self.world))


class _ShardBatches(Sampler[Any]):
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
    while isinstance(s, _WRAPPERS):
        if isinstance(s, _Shard):
            return s
        s = s.sampler
    return None


def _user_batch_sampler(loader: Any) -> Any:
    """``loader``'s batch sampler as the user made it (through :class:`_ShardBatches`)."""
    bs = getattr(loader, "batch_sampler", None)
    return bs.batch_sampler if isinstance(bs, _ShardBatches) else bs


def _set_batch_sampler(loader: Any, batch_sampler: Any) -> None:
    """Give a ``DataLoader`` another batch sampler (its ``__setattr__`` refuses it after
    ``__init__``), also to its persistent workers' iterator, which keeps the one it started
    with."""
    object.__setattr__(loader, "batch_sampler", batch_sampler)
    workers = getattr(loader, "_iterator", None)
    if workers is not None and hasattr(workers, "_index_sampler"):
        workers._index_sampler = batch_sampler


def shard_loader(loader: Any, rank: int, world_size: int, *, pad: bool) -> bool:
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
    while isinstance(parent.sampler, _WRAPPERS):
        parent = parent.sampler
    parent.sampler = _Shard(bs, parent.sampler, rank, world_size, pad)
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


# ---------------------------------------------------------------- per-batch randomness

BATCH = 6  # derive_seed stream of the randomness of a batch that seed_batches seeds


class _BatchKey(NamedTuple):
    """What :func:`seed_batches` gives the dataset in place of the first index of a batch:
    the index (``item``), the run's seed, the epoch and the index's position in the epoch."""

    item: Any
    seed: int
    epoch: int
    position: int


class _BatchKeys(Sampler[Any]):
    """Wraps the sampler of a ``BatchSampler``: the first index of each batch comes as a
    :class:`_BatchKey`, the others unchanged.

    Positions count from the start of the epoch: a :class:`_SkipFirst` above this one drops the
    keyed items of the skipped batches, and a :class:`ShuffleSampler` that starts later starts
    the count there too. Under a :class:`_Shard` they are global positions: the rank's batch
    ``j`` starts at ``start + rank + j * size * world``, so no two ranks key a batch alike.
    """

    def __init__(self, batch_sampler: Any, seed: int, epoch: int) -> None:
        self.batch_sampler, self.sampler = batch_sampler, batch_sampler.sampler
        self.seed, self.epoch = seed, epoch

    def __iter__(self) -> Iterator[Any]:
        seed, epoch, size = self.seed, self.epoch, self.batch_sampler.batch_size
        s, position, stride = self.sampler, 0, size
        if isinstance(s, _Shard):
            position, stride = s.start + s.rank, size * s.world
        elif isinstance(s, ShuffleSampler):
            position = s.start
        it = iter(s)
        for first in it:  # the BatchSampler cuts consecutive runs of `size`
            yield _BatchKey(first, seed, epoch, position)
            yield from itertools.islice(it, size - 1)
            position += stride

    def __len__(self) -> int:
        return len(self.sampler)


_WRAPPERS = (_SkipFirst, _BatchKeys, _Shard)  # what a fit puts around a BatchSampler's sampler


def _base(sampler: Any) -> Any:
    """``sampler`` without the wrappers a fit put around it."""
    while isinstance(sampler, _WRAPPERS):
        sampler = sampler.sampler
    return sampler


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
    the global generators seeded from ``(seed, epoch, position)`` and restored afterwards;
    others (plain indices: the loader iterated outside a fit) are loaded as without the hook.
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
        return _seeded_call(seed, self.fetch, [first.item, *indices[1:]], swap_numpy=True)

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
    NumPy's global generator seeded once from those and puts them back afterwards. A dataset
    that draws random numbers (random augmentation) then draws the same ones whichever process
    loads the batch, whatever ``num_workers`` is and in a resumed run. Batches without a key (the
    loader iterated outside the fit) load unseeded, as before.

    Left alone (returns ``False``): a :class:`SeededDataset` (it seeds each sample itself), a
    custom batch sampler, ``batch_size=None``, an iterable dataset, a loader with
    ``state_dict()``, a dataset without an instance dict, anything but a ``DataLoader``.

    Example:
        >>> from torch.utils.data import DataLoader, Dataset
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
    bs = getattr(loader, "batch_sampler", None)
    keys = getattr(bs, "sampler", None)
    if not isinstance(keys, _BatchKeys):
        return
    bs.sampler = keys.sampler  # type: ignore[union-attr]
    _unhook(loader.dataset)
    if isinstance(loader.worker_init_fn, _HookWorkers):
        loader.worker_init_fn = loader.worker_init_fn.init
    workers = getattr(loader, "_iterator", None)
    if workers is not None:  # persistent workers started during the fit keep the hook
        _HOOKED_WORKERS.add(workers)
