"""``Tuner``: Lightning's ``Tuner(trainer)``, with ``lr_find`` and ``scale_batch_size``.

Lightning's tuner runs its searches inside ``trainer.fit`` (a callback, then a checkpoint
restored over what the search changed). Here each search is a run of trial fits on the
Trainer's flags (:class:`engine.driver.fitting.Trials`) from ``state.copy()``: the state given
is only read, and nothing is restored because nothing was changed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from engine.data import is_datamodule, resolve_loaders, setup_datamodule, teardown_datamodule
from engine.driver.fitting import Trials
from engine.listeners.batch_size_finder import BatchSizeFinder, batch_size_search, with_batch_size
from engine.listeners.lr_finder import LearningRateFinder, LRFinderResult, lr_search, updated_task
from engine.state import TrainState
from engine.task import Task
from engine.trainer import Trainer

__all__ = ["Tuner"]

METHODS = ("fit", "validate", "test", "predict")


class Tuner:
    """Lightning's ``Tuner``: ``Tuner(trainer).lr_find(...)`` and ``.scale_batch_size(...)``,
    each taking the task and the state where Lightning takes the model.

    The searches run on the Trainer's flags (precision, devices, accumulation, clipping,
    ``max_epochs``, ``limit_train_batches``) with no loggers, checkpoints, progress bar or
    listeners, from a copy of ``state``: the state is not consumed, and reads bitwise the same
    afterwards. Lightning's ``update_attr=True`` sets the model's ``lr``; here
    :attr:`LRFinderResult.task` is the task with the suggested rate (and
    :meth:`LRFinderResult.with_lr` the state, where the optimizer keeps its rate there).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> x = torch.randn(64, 4); y = x @ torch.randn(4, 1)
        >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
        ...                                    batch_size=8)
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.01))
        >>> state = task.init(torch.nn.Linear(4, 1), seed=0)
        >>> trainer = eg.Trainer(logger=False, enable_progress_bar=False)
        >>> found = eg.Tuner(trainer).lr_find(task, state, data, min_lr=1e-4, max_lr=1.0,
        ...                                   num_training=20)
        >>> len(found.results["lr"]), found.results["lr"][:2], found.results["lr"][-1]
        (20, [0.0001, 0.000251188643150958], 1.0)
        >>> found.task.lr == found.task_lr == found.suggestion()   # update_attr=True
        True
        >>> state.consumed           # the search trained a copy
        False
    """

    def __init__(self, trainer: Trainer) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"Tuner(trainer): pass an engine.Trainer (got {type(trainer).__name__}); "
                "the searches run on its flags"
            )
        self._trainer = trainer

    def lr_find(
        self,
        task: Task,
        state: TrainState,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinderResult | None:
        """A learning-rate range test: ``num_training`` steps from ``state.copy()`` with the
        rate rising from ``min_lr`` to ``max_lr`` on Lightning's grid, stopped once the
        smoothed loss passes ``early_stop_threshold`` times its best (``None``: never).

        Args:
            task, state: what to search with; the state is only read.
            train_dataloaders: the training loader (or a datamodule).
            val_dataloaders: accepted for Lightning's signature; the search does not validate.
            dataloaders: must be ``None`` (Lightning's rule for ``method="fit"``).
            datamodule: a datamodule to take the training loader from (set up and torn down
                around the search, as a fit would).
            method: ``"fit"``, the only one Lightning's finder takes.
            min_lr, max_lr, num_training, mode: the grid (:func:`engine.listeners.lr_grid`).
            early_stop_threshold: when to stop (see above).
            update_attr: put the suggested rate in :attr:`LRFinderResult.task` (Lightning sets
                the model's ``lr``).
            attr_name: the optimizer argument holding the rate (default ``"lr"``).

        Returns:
            An :class:`LRFinderResult` (``results``, ``suggestion()``, ``plot()``), or
            ``None`` under ``fast_dev_run`` (skipped with a warning, as Lightning).

        Raises:
            ValueError: for arguments Lightning refuses, and for a task whose optimizer
                records no learning rate to replace (:func:`engine.optim.with_learning_rate`).
        """
        if method != "fit":
            raise ValueError(
                f"lr_find(method={method!r}): method='fit' is the only one the learning-rate "
                "finder runs (as Lightning)"
            )
        self._check(train_dataloaders, val_dataloaders, dataloaders, method)
        self._no_listener(LearningRateFinder, "lr_find")
        if self._skipped("learning rate finder"):
            return None
        with self._train_loader(train_dataloaders, datamodule) as loader:
            found = lr_search(
                self._trials(),
                task,
                state,
                loader,
                min_lr=min_lr,
                max_lr=max_lr,
                num_training=num_training,
                mode=mode,
                early_stop_threshold=early_stop_threshold,
                attr_name=attr_name,
            )
        return updated_task(found, task) if update_attr else found

    def scale_batch_size(
        self,
        task: Task,
        state: TrainState,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """The largest training batch size whose trials of ``steps_per_trial`` steps (from
        ``state.copy()``) do not run out of memory (:func:`engine.listeners.is_oom_error`).

        The sizes are tried on a ``DataLoader`` given as ``train_dataloaders``, rebuilt with
        each ``batch_size``, or on a datamodule whose ``batch_arg_name`` attribute is set
        before its ``train_dataloader()`` is asked (it keeps the size found, as Lightning
        leaves it). ``"power"`` doubles from ``init_val`` until a trial fails; ``"binsearch"``
        then bisects, and takes ``margin`` off the result; both try Lightning's sizes in
        Lightning's order, and stop growing at the dataset's length and at ``max_val``.

        Returns:
            The size, or ``None`` under ``fast_dev_run`` (skipped with a warning, as
            Lightning).

        Raises:
            ValueError: for arguments Lightning refuses; for ``method`` other than ``"fit"``
                (engine searches the training batch size only); for several processes.
            RuntimeError: when even batch size 1 runs out of memory, or a trial fails for
                another reason (raised as it is).
        """
        self._check(train_dataloaders, val_dataloaders, dataloaders, method)
        if method != "fit":
            raise ValueError(
                f"scale_batch_size(method={method!r}): engine searches the training batch "
                "size (method='fit'); an evaluation's loaders take the size found, or any "
                "larger one, since evaluation keeps no gradients"
            )
        self._no_listener(BatchSizeFinder, "scale_batch_size")
        if self._skipped("batch size scaler"):
            return None
        if is_datamodule(train_dataloaders):
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and train_dataloaders is not None:
            raise ValueError("scale_batch_size: pass train_dataloaders or datamodule, not both")
        if datamodule is not None:
            if not hasattr(datamodule, batch_arg_name):
                raise ValueError(
                    f"scale_batch_size: the datamodule has no {batch_arg_name!r} attribute to "
                    "set; give it one that train_dataloader() reads, or name it with "
                    "batch_arg_name="
                )
            dm = datamodule

            def loader_of(size: int) -> Any:
                setattr(dm, batch_arg_name, size)
                return resolve_loaders("fit", None, dm, "train_dataloader")[0]

        else:
            given = _one(resolve_loaders("fit", train_dataloaders, None, "train_dataloader"))
            with_batch_size(given, 1)  # refuses a loader it cannot rebuild, before any trial

            def loader_of(size: int) -> Any:
                return with_batch_size(given, size)

        with self._set_up(datamodule):
            size = batch_size_search(
                self._trials(),
                task,
                state,
                loader_of,
                mode=mode,
                steps_per_trial=steps_per_trial,
                init_val=init_val,
                max_trials=max_trials,
                margin=margin,
                max_val=max_val,
            )
        if datamodule is not None:
            setattr(datamodule, batch_arg_name, size)  # the size found, as Lightning leaves it
        return size

    # ------------------------------------------------------------------ shared

    def _trials(self) -> Trials:
        trainer = self._trainer
        strategy = trainer.assembly.strategy
        if strategy.launcher is not None or strategy.world_size > 1:
            raise ValueError(
                f"Tuner runs its searches in one process; this Trainer runs "
                f"{trainer.num_devices * trainer.num_nodes} (strategy={trainer.strategy!r}). "
                "Tune with a one-process Trainer (devices=1) and pass what it found to this one"
            )
        return Trials(trainer.config, trainer.assembly, trainer)

    @staticmethod
    def _check(train: Any, val: Any, dataloaders: Any, method: str) -> None:
        """Lightning's checks of the loaders against ``method``."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)} (got {method!r})")
        if method == "fit" and dataloaders is not None:
            raise ValueError(
                "with method='fit' the tuner takes train_dataloaders (and val_dataloaders), "
                "not dataloaders"
            )
        if method != "fit" and (train is not None or val is not None):
            raise ValueError(
                f"with method={method!r} the tuner takes dataloaders, not train_dataloaders or "
                "val_dataloaders"
            )

    def _no_listener(self, kind: type, what: str) -> None:
        if any(isinstance(x, kind) for x in self._trainer.callbacks):
            raise ValueError(
                f"Tuner.{what}: the Trainer already has a {kind.__name__} listener, which "
                "searches when the fit starts; remove it to use the Tuner (as Lightning)"
            )

    def _skipped(self, what: str) -> bool:
        if self._trainer.config.fast_dev_run:
            warnings.warn(
                f"Skipping the {what} since fast_dev_run is on (as Lightning)",
                UserWarning,
                stacklevel=3,
            )
            return True
        return False

    @contextlib.contextmanager
    def _set_up(self, datamodule: Any) -> Iterator[None]:
        """A datamodule's ``prepare_data()`` / ``setup("fit")`` before the search and its
        ``teardown("fit")`` after, as around a fit."""
        if datamodule is None:
            yield
            return
        setup_datamodule(datamodule, "fit", self._trainer)
        try:
            yield
        finally:
            teardown_datamodule(datamodule, "fit")

    @contextlib.contextmanager
    def _train_loader(self, loaders: Any, datamodule: Any) -> Iterator[Any]:
        """The training loader, from ``loaders`` or a datamodule (set up around the search)."""
        if datamodule is None and is_datamodule(loaders):
            datamodule, loaders = loaders, None
        if datamodule is not None and loaders is not None:
            raise ValueError("lr_find: pass train_dataloaders or datamodule, not both")
        with self._set_up(datamodule):
            yield _one(resolve_loaders("fit", loaders, datamodule, "train_dataloader"))


def _one(found: list[Any]) -> Any:
    if len(found) != 1:
        raise ValueError(
            f"the tuner takes one training dataloader (got {len(found)}); pass "
            "train_dataloaders= or datamodule="
        )
    return found[0]
