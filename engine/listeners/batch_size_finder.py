"""The batch-size search (Lightning's ``scale_batch_size``): its two strategies, what counts as
running out of memory, and :class:`BatchSizeFinder`, the listener that searches when a fit
starts.

Each trial trains a copy of the state for ``steps_per_trial`` optimizer steps on a loader of
the size tried (a ``DataLoader`` rebuilt with that ``batch_size``, or a datamodule's
``batch_size`` set and its ``train_dataloader()`` asked again); a trial that runs out of memory
fails. ``"power"`` doubles the size from ``init_val`` until a trial fails and keeps the last
that passed; ``"binsearch"`` doubles until a failure, then bisects between the last pass and
the failure, and finally takes off a ``margin``. The sizes tried, in order, are Lightning's (a
test runs both on the same failure threshold). :class:`engine.Tuner` runs the same search from
outside a fit.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from engine.data import resolve_loaders
from engine.events import EventRecord, Listener, Search, Trials
from engine.state import TrainState
from engine.task import Task

__all__ = [
    "BatchSizeFinder",
    "batch_size_search",
    "binsearch_scaling",
    "is_oom_error",
    "power_scaling",
    "with_batch_size",
]

SEARCH_MODES = ("power", "binsearch")

_OOM_MESSAGES = ("out of memory", "CUDNN_STATUS_NOT_SUPPORTED", "can't allocate memory")


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` says the device ran out of memory: ``torch.OutOfMemoryError``
    (``torch.cuda.OutOfMemoryError``), or a ``RuntimeError`` whose message says so (CUDA's
    "out of memory", cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``, the CPU allocator's "can't
    allocate memory": what Lightning's ``is_oom_error`` recognises, and other devices' "out of
    memory").

    Example:
        >>> from engine.listeners import is_oom_error
        >>> is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError) or not error.args:
        return False
    message = str(error.args[0])
    return any(m in message for m in _OOM_MESSAGES)


def _release_memory() -> None:
    """What a failed trial left, freed before the next (Lightning's garbage_collection_cuda)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


Trial = Callable[[int], None]


Length = int | Callable[[], int | None] | None


def _grow(size: int, new: int, length: Length, max_val: int) -> tuple[int, bool]:
    """The next size to try after ``size`` passed (Lightning's rule): none once ``size``
    reaches the dataset's length; capped at ``max_val``."""
    limit = length() if callable(length) else length
    if limit is not None and size >= limit:
        return size, False
    new = min(new, max_val)
    return new, new != size


def _failed(size: int, error: RuntimeError) -> None:
    """Re-raise an error that is no out-of-memory, or one at batch size 1 (nothing smaller to
    try)."""
    if not is_oom_error(error):
        raise error
    if size <= 1:
        raise RuntimeError(
            "scale_batch_size: even batch size 1 runs out of memory; make the model or its "
            "inputs smaller, or use a precision that holds less (precision='bf16-mixed')"
        ) from error
    _release_memory()


def power_scaling(
    trial: Trial,
    init_val: int = 2,
    max_trials: int = 25,
    *,
    max_val: int = 8192,
    dataset_length: Length = None,
) -> int:
    """``"power"``: double the size from ``init_val`` until a trial fails, and return the last
    size that passed (halve and go on when the first ones fail). At most ``max_trials``
    trials; a size reaching ``max_val`` (or the dataset's length) ends the search, as in
    Lightning, without a trial of its own at ``max_val``. ``dataset_length``: a number, or a
    function reading it (from the loader of the last trial).

    Example:
        >>> from engine.listeners.batch_size_finder import power_scaling
        >>> def trial(size):
        ...     if size > 40:
        ...         raise RuntimeError("CUDA out of memory")
        >>> power_scaling(trial, init_val=2)
        32
    """
    size, any_success = init_val, False
    for i in range(max_trials):
        if size >= max_val:
            break
        try:
            trial(size)
        except RuntimeError as error:
            _failed(size, error)
            size = int(size * 0.5)
            if any_success:
                break
            continue
        if i + 1 >= max_trials:
            break
        size, changed = _grow(size, int(size * 2.0), dataset_length, max_val)
        if not changed:
            break
        any_success = True
    return size


def binsearch_scaling(
    trial: Trial,
    init_val: int = 2,
    max_trials: int = 25,
    *,
    margin: float = 0.05,
    max_val: int = 8192,
    dataset_length: Length = None,
) -> int:
    """``"binsearch"``: double from ``init_val`` until a trial fails, then bisect between the
    last size that passed and the first that failed; return the largest that passed, less
    ``margin`` (``max(1, int(size * (1 - margin)))``). ``max_trials`` counts the trials that
    pass; ``max_val`` and the dataset's length end the search as in :func:`power_scaling`.

    Example:
        >>> from engine.listeners.batch_size_finder import binsearch_scaling
        >>> tried = []
        >>> def trial(size):
        ...     tried.append(size)
        ...     if size > 3:
        ...         raise RuntimeError("CUDA out of memory")
        >>> binsearch_scaling(trial, init_val=2, margin=0.0), tried   # 4 failed: bisected
        (3, [2, 4, 3])
    """
    low, high, passed, size = 1, None, 0, init_val
    while size < max_val:
        try:
            trial(size)
        except RuntimeError as error:
            _failed(size, error)
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
            continue
        passed += 1
        if passed >= max_trials:
            break
        low = size
        if high is not None and high - low <= 1:
            break
        target = (high + low) // 2 if high is not None else int(size * 2.0)
        size, changed = _grow(size, target, dataset_length, max_val)
        if not changed:
            break
    if margin > 0:
        size = max(1, int(size * (1 - margin)))
    return size


def with_batch_size(loader: Any, size: int) -> DataLoader:
    """``loader``, a ``torch.utils.data.DataLoader``, built again with ``batch_size=size``:
    the same dataset, sampler, collate function, workers and other arguments.

    Raises:
        TypeError: for anything else than a DataLoader, or one with a batch sampler of its
            own or ``batch_size=None`` (no size to change): give a datamodule with a
            ``batch_size`` attribute instead.
    """
    if type(loader) is not DataLoader or loader.batch_size is None:
        what = type(loader).__name__ if type(loader) is not DataLoader else "batch_size=None"
        raise TypeError(
            f"scale_batch_size rebuilds a torch DataLoader with another batch_size; this "
            f"loader ({what}) has no batch size to change: pass a datamodule whose "
            "train_dataloader() reads a batch_size attribute"
        )
    workers = loader.num_workers
    return DataLoader(
        loader.dataset,
        batch_size=size,
        sampler=loader.sampler,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


def _length(loader: Any) -> int | None:
    """The training dataset's length (what Lightning stops growing at), if it has one."""
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError, NotImplementedError):
        return None


def _check(
    mode: Any, steps_per_trial: Any, init_val: Any, max_trials: Any, margin: Any, max_val: Any
) -> str:
    if not isinstance(mode, str) or mode.lower() not in SEARCH_MODES:
        raise ValueError(f"mode must be 'power' or 'binsearch' (got {mode!r})")
    for name, value in (
        ("steps_per_trial", steps_per_trial),
        ("init_val", init_val),
        ("max_trials", max_trials),
        ("max_val", max_val),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (got {value!r})")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a float in [0, 1) (got {margin!r})")
    return mode.lower()


def batch_size_search(
    trials: Trials,
    task: Task,
    state: TrainState,
    loader_of: Callable[[int], Any],
    *,
    mode: str = "power",
    steps_per_trial: int = 3,
    init_val: int = 2,
    max_trials: int = 25,
    margin: float = 0.05,
    max_val: int = 8192,
    tried: list[int] | None = None,
) -> int:
    """Search as the module says, each trial a fit of ``steps_per_trial`` steps from a copy of
    ``state`` on ``loader_of(size)``; returns the size found. ``tried``, if given, gets each
    size tried, in order."""
    mode = _check(mode, steps_per_trial, init_val, max_trials, margin, max_val)
    state.check_alive("scale_batch_size")
    lengths: list[int | None] = []

    def trial(size: int) -> None:
        loader = loader_of(size)
        lengths.append(_length(loader))
        if tried is not None:
            tried.append(size)
        trials.fit(task, state.copy(), loader, steps=steps_per_trial)

    if mode == "power":
        search: Callable[..., int] = power_scaling
    else:
        search = functools.partial(binsearch_scaling, margin=margin)
    return search(trial, init_val, max_trials, max_val=max_val, dataset_length=lambda: lengths[-1])


class BatchSizeFinder(Listener):
    """Lightning's ``BatchSizeFinder`` callback: when the fit starts, the largest batch size
    whose trials do not run out of memory, set on the datamodule (its ``batch_arg_name``
    attribute), after which the fit proceeds with it: the fit fetches the datamodule's
    loaders again after the search, as Lightning's does. Like Lightning's, it needs the
    loaders to come from a datamodule; :meth:`engine.Tuner.scale_batch_size` also rebuilds a
    ``DataLoader`` passed directly. A fit resumed from a checkpoint does not search again: the
    size found before (kept in the checkpoint) is set on the datamodule.

    Args:
        mode: ``"power"`` or ``"binsearch"`` (see the module).
        steps_per_trial: optimizer steps per trial.
        init_val: the first size tried.
        max_trials: the most trials (``"binsearch"``: the most that pass).
        batch_arg_name: the datamodule attribute holding the batch size.
        margin: taken off the size ``"binsearch"`` finds.
        max_val: the largest size to consider.

    Attributes:
        optimal_batch_size: the size found (``init_val`` before a search).

    Example:
        >>> from engine.listeners import BatchSizeFinder
        >>> finder = BatchSizeFinder(mode="binsearch", init_val=8, max_trials=10)
    """

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        self._mode = _check(mode, steps_per_trial, init_val, max_trials, margin, max_val)
        self._steps_per_trial, self._init_val, self._max_trials = (
            steps_per_trial,
            init_val,
            max_trials,
        )
        self._batch_arg_name, self._margin, self._max_val = batch_arg_name, margin, max_val
        self.optimal_batch_size: int | None = init_val
        self._searched = False  # whether optimal_batch_size came from a search (checkpointed)

    def state_dict(self) -> dict[str, Any]:
        return {"optimal_batch_size": self.optimal_batch_size, "searched": self._searched}

    def load_state_dict(self, state: Any) -> None:
        self.optimal_batch_size = state.get("optimal_batch_size", self._init_val)
        self._searched = bool(state.get("searched", False))

    def on_fit_start(self, rec: EventRecord) -> Search | None:
        """Check the run, then ask for the search."""
        run, name = rec.run, self._batch_arg_name
        if run.config is not None and run.config.fast_dev_run:
            warnings.warn(
                "BatchSizeFinder: skipped, since fast_dev_run is on (as Lightning)",
                UserWarning,
                stacklevel=2,
            )
            return None
        dm = run.datamodule
        if dm is None or not hasattr(dm, name):
            raise ValueError(
                f"BatchSizeFinder sets the batch size on the datamodule the fit loads from, "
                f"and this fit has {'no datamodule' if dm is None else f'one without {name!r}'}"
                f": pass fit(datamodule=...) whose train_dataloader() reads self.{name} "
                "(batch_arg_name= names another attribute), or search a DataLoader with "
                "engine.Tuner(trainer).scale_batch_size(...)"
            )
        if run.world_size > 1:
            raise ValueError(
                f"BatchSizeFinder runs on one process; this run has {run.world_size} (as "
                "Lightning, which refuses distributed strategies)"
            )
        if run.ckpt_path is not None and self._searched:
            size = self.optimal_batch_size
            return Search(lambda trials: setattr(dm, name, size), name="BatchSizeFinder")
        if run.ckpt_path is not None or rec.state is None or run.task is None:
            return None
        return Search(functools.partial(self._search, run.task, rec.state, dm))

    def _search(self, task: Task, state: TrainState, dm: Any, trials: Trials) -> None:
        name = self._batch_arg_name

        def loader_of(size: int) -> Any:
            setattr(dm, name, size)
            return resolve_loaders("fit", None, dm, "train_dataloader")[0]

        size = batch_size_search(
            trials,
            task,
            state,
            loader_of,
            mode=self._mode,
            steps_per_trial=self._steps_per_trial,
            init_val=self._init_val,
            max_trials=self._max_trials,
            margin=self._margin,
            max_val=self._max_val,
        )
        setattr(dm, name, size)
        self.optimal_batch_size, self._searched = size, True
