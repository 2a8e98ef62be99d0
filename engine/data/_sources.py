"""Where a stage's batches come from: loaders and datamodules resolved, batches counted and
limited, the lookahead that knows the last batch, stateful loaders and their JSON state.

Any iterable of batches works (a ``torch.utils.data.DataLoader``, a list, a generator
factory); a *datamodule* is any object with ``train_dataloader()`` / ``val_dataloader()`` /
``test_dataloader()`` / ``predict_dataloader()`` methods.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.checkpoint import _tree

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
