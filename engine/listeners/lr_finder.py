"""The learning-rate range test (Lightning's ``lr_find``): its grid, its recorder, its result,
and :class:`LearningRateFinder`, the listener that runs it when a fit starts.

The test trains a copy of the state for ``num_training`` optimizer steps with the learning rate
rising from ``min_lr`` to ``max_lr`` on Lightning's grid (:func:`lr_grid`), records each step's
loss smoothed as Lightning smooths it, stops once the smoothed loss passes
``early_stop_threshold`` times the best one, and suggests the rate where the smoothed loss falls
fastest (:meth:`LRFinderResult.suggestion`). The rate follows the grid as a schedule of the
task's own optimizer (:func:`engine.optim.with_learning_rate`): nothing is mutated, and the
state searched from is not touched (the trial trains ``state.copy()``).
:class:`engine.Tuner` runs the same search from outside a fit.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from engine.data import resolve_loaders
from engine.events import EventRecord, Listener, Search, Stop, Transition, Trials
from engine.optim.inject import InjectHyperparamsState, warm
from engine.optim.replacing import with_learning_rate
from engine.state import TrainState
from engine.task import Task

__all__ = ["MODES", "LRFinderResult", "LearningRateFinder", "lr_grid", "lr_search"]

MODES = ("exponential", "linear")


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive float (got {value!r})")
    return float(value)


def _check(min_lr: Any, max_lr: Any, num_training: Any, mode: Any) -> tuple[float, float, int, str]:
    lo, hi = _positive("min_lr", min_lr), _positive("max_lr", max_lr)
    if not hi > lo:
        raise ValueError(
            f"max_lr must be greater than min_lr (got min_lr={min_lr!r}, max_lr={max_lr!r})"
        )
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 1:
        raise ValueError(f"num_training must be a positive int (got {num_training!r})")
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ValueError(f"mode must be 'exponential' or 'linear' (got {mode!r})")
    return lo, hi, num_training, mode.lower()


def lr_grid(
    min_lr: float = 1e-8, max_lr: float = 1.0, num_training: int = 100, mode: str = "exponential"
) -> list[float]:
    """The learning rate of each step of the range test: Lightning's grid, float for float.

    Step 0 trains at ``min_lr``; step ``k >= 1`` at ``min_lr * (max_lr / min_lr) ** ((k + 1) /
    num_training)`` (``"exponential"``) or ``min_lr + (k + 1) / num_training * (max_lr -
    min_lr)`` (``"linear"``), so the last step trains at ``max_lr`` (Lightning's schedulers
    are stepped once before the first step reads them, and skip ``k = 1``'s value).

    Example:
        >>> from engine.listeners import lr_grid
        >>> lr_grid(1e-4, 1.0, 4)
        [0.0001, 0.01, 0.1, 1.0]
        >>> lr_grid(0.1, 0.5, 4, mode="linear")
        [0.1, 0.30000000000000004, 0.4, 0.5]
    """
    lo, hi, n, mode = _check(min_lr, max_lr, num_training, mode)
    grid = [lo]
    for k in range(1, n):
        r = (k + 1) / n
        grid.append(lo * (hi / lo) ** r if mode == "exponential" else lo + r * (hi - lo))
    return grid


@attrs.frozen
class _GridSchedule:
    """The grid as a schedule of the optimizer: ``grid[step - start]``, held at the ends."""

    grid: tuple[float, ...]
    start: int

    def __call__(self, step: int) -> float:
        k = min(max(step - self.start, 0), len(self.grid) - 1)
        return self.grid[k]


class _RangeRecorder(Listener):
    """A trial's listener: each optimizer step's rate and smoothed loss (Lightning's
    ``_LRCallback``); asks the trial to stop when the loss diverges."""

    def __init__(self, grid: Sequence[float], start: int, threshold: float | None, beta: float):
        self.grid, self.start, self.threshold, self.beta = grid, start, threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = 0.0
        self.best_loss = 0.0

    def on_train_batch_end(self, rec: EventRecord) -> Any:
        state = rec.state
        if state is None or state.micro_step:  # inside an accumulation window: no step yet
            return None
        step = state.step - self.start  # the search's optimizer steps so far, from 1
        self.lrs.append(self.grid[step - 1])
        loss = rec.outputs.get("loss") if isinstance(rec.outputs, Mapping) else None
        if loss is None:  # nothing to read: kept out of the suggestion, as Lightning does
            self.losses.append(math.nan)
            return None
        config = rec.run.config
        accumulate = config.accumulate_grad_batches if config is not None else 1
        if accumulate > 1:  # Lightning records its closure's loss, divided by the window
            loss = loss / accumulate
        current = float(loss)  # one host sync a step, as Lightning's .item()
        # the loss with momentum, bias-corrected as Lightning corrects it (its global step
        # after the update: this step's count from 1 for a search from step 0)
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * current
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        stop = None
        if self.threshold is not None and step > 1 and smoothed > self.threshold * self.best_loss:
            stop = Stop(f"the learning-rate search's loss diverged at step {step}")
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)
        return stop


class LRFinderResult:
    """What a learning-rate range test found (Lightning's ``_LRFinder``).

    Attributes:
        mode, lr_min, lr_max, num_training: the search's arguments.
        results: ``{"lr": [...], "loss": [...]}``, the rate and smoothed loss of each step
            taken (fewer than ``num_training`` when the loss diverged first).
        task: with ``update_attr=True`` (:meth:`engine.Tuner.lr_find`), the task whose
            optimizer uses the suggested rate; else ``None``.
        task_lr: that rate (``suggestion()`` with its defaults when the search ended).
        optimal_idx: the index in ``results`` of the last suggestion, or ``None``.

    Example:
        >>> from engine.listeners import LRFinderResult
        >>> found = LRFinderResult("exponential", 1e-3, 1.0, 4)
        >>> found.results = {"lr": [1e-3, 1e-2, 1e-1, 1.0], "loss": [1.0, 0.99, 0.5, 0.45]}
        >>> found.suggestion(skip_begin=0, skip_end=0)      # the loss falls fastest there
        0.1
    """

    def __init__(
        self, mode: str, lr_min: float, lr_max: float, num_training: int, *, name: str = "lr"
    ) -> None:
        self.mode, self.lr_min, self.lr_max = mode, lr_min, lr_max
        self.num_training, self.name = num_training, name
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        self.task: Task | None = None
        self.task_lr: float | None = None
        self.optimal_idx: int | None = None

    def __repr__(self) -> str:
        return (
            f"LRFinderResult(mode={self.mode!r}, lr_min={self.lr_min}, lr_max={self.lr_max}, "
            f"steps={len(self.results['lr'])}/{self.num_training})"
        )

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate where the smoothed loss falls fastest: the most negative gradient of the
        loss with respect to the rate, over the finite losses left after dropping
        ``skip_begin`` steps at the start and ``skip_end`` at the end (Lightning's rule, in
        float32 as Lightning computes it). ``None``, with a warning, when fewer than two points
        are left. (Lightning's slice drops everything for ``skip_end=0``; here it drops
        nothing.)"""
        for arg, value in (("skip_begin", skip_begin), ("skip_end", skip_end)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"suggestion({arg}={value!r}): pass an int >= 0")
        n = len(self.results["loss"])
        idx = torch.arange(n)[skip_begin : max(n - skip_end, 0)]
        losses = torch.tensor(self.results["loss"])[idx]
        lrs = torch.tensor(self.results["lr"])[idx]
        finite = torch.isfinite(losses)
        if int(finite.sum()) < 2:
            warnings.warn(
                f"no learning rate suggested: {int(finite.sum())} finite loss(es) left of the "
                f"search's {n} steps after skip_begin={skip_begin}, skip_end={skip_end}; "
                "search longer (num_training), with more batches, or skip fewer",
                RuntimeWarning,
                stacklevel=2,
            )
            self.optimal_idx = None
            return None
        slope = torch.gradient(losses[finite], spacing=[lrs[finite]])[0]
        self.optimal_idx = int(idx[finite][int(torch.argmin(slope))])
        return self.results["lr"][self.optimal_idx]

    def with_lr(self, state: TrainState) -> TrainState:
        """``state`` with the suggested rate where its optimizer keeps the rate in the state (an
        ``optim.inject_hyperparams`` optimizer), ``state`` itself otherwise; call it either way
        with :attr:`task` (``task, state = found.task, found.with_lr(state)``). The new state
        shares its tensors (and its fate) with ``state``.

        Raises:
            ValueError: before a suggestion was made (``update_attr=False``, or none was
                possible).
        """
        if self.task is None or self.task_lr is None:
            raise ValueError(
                "with_lr: there is no suggested rate to set (the search ran with "
                "update_attr=False, or could not suggest one); pick one from results and set it "
                "with optim.with_learning_rate (and optim.set_hyperparams for an injected rate)"
            )
        if not _injected(state.opt_state, self.name):
            return state
        return set_injected_lr(state, name=self.name, lr=self.task_lr)

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss against the rate (log-scaled for ``"exponential"``) on a matplotlib figure,
        the suggestion marked in red with ``suggest=True``; returns the figure (``ax``'s, when
        given). ``show=True`` shows it through pyplot.

        Raises:
            ImportError: when matplotlib is not installed (``pip install matplotlib``).
        """
        try:
            import matplotlib  # noqa: F401 (optional: only plots need it)
        except ImportError:
            raise ImportError(
                "LRFinderResult.plot needs matplotlib, which is not installed: "
                "pip install matplotlib (results['lr'] and results['loss'] hold the curve)"
            ) from None
        if ax is None:
            if show:
                import matplotlib.pyplot as plt

                fig, ax = plt.subplots()
            else:  # no pyplot: the figure is not kept in pyplot's registry
                from matplotlib.figure import Figure

                fig = Figure()
                ax = fig.subplots()
        else:
            fig = ax.figure
        lrs, losses = self.results["lr"], self.results["loss"]
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self.optimal_idx is not None:
            i = self.optimal_idx
            ax.plot(lrs[i], losses[i], markersize=10, marker="o", color="red")
        if show:
            import matplotlib.pyplot as plt

            plt.show()
        return fig


def lr_search(
    trials: Trials,
    task: Task,
    state: TrainState,
    train_dataloader: Any,
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    attr_name: str = "",
    beta: float = 0.98,
) -> LRFinderResult:
    """Run the range test as a trial fit (see the module) and return what it found; ``state``
    is only read (the trial trains a copy).

    ``attr_name`` names the optimizer argument that holds the rate (``"lr"`` by default).

    Raises:
        ValueError: for arguments out of range, a task whose optimizer records no such
            argument, or a task with a ``step_fn`` (its own optimizers, out of reach).
    """
    lo, hi, n, mode = _check(min_lr, max_lr, num_training, mode)
    if early_stop_threshold is not None:
        _positive("early_stop_threshold", early_stop_threshold)
    if not isinstance(attr_name, str):
        raise TypeError(f"attr_name must be a str (got {attr_name!r})")
    name = attr_name or "lr"
    if task.step_fn is not None or task.tx is None:
        raise ValueError(
            "lr_find: the task has its own step_fn, whose optimizers the search cannot reach; "
            "search on a Task(loss_fn, tx) of the same model and loss"
        )
    state.check_alive("lr_find")
    grid = lr_grid(lo, hi, n, mode)
    schedule = _GridSchedule(tuple(grid), state.step)
    searching = attrs.evolve(task, tx=with_learning_rate(task.tx, schedule, name=name), lr=schedule)
    recorder = _RangeRecorder(grid, state.step, early_stop_threshold, beta)
    trials.fit(searching, state.copy(), train_dataloader, steps=n, listeners=[recorder])
    found = LRFinderResult(mode, lo, hi, n, name=name)
    found.results = {"lr": recorder.lrs, "loss": recorder.losses}
    return found


def _injected(opt_state: Any, name: str) -> int:
    """How many injected-hyperparameter states in ``opt_state`` hold ``name``."""
    is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
    leaves = pytree.tree_leaves(opt_state, is_leaf=is_leaf)
    return sum(isinstance(x, InjectHyperparamsState) and name in x.hyperparams for x in leaves)


def set_injected_lr(state: TrainState, *, name: str, lr: float) -> TrainState:
    """``state`` with every injected ``name`` hyperparameter set to ``lr`` (the tensors shared:
    a :class:`~engine.events.Transition`'s function, and :meth:`LRFinderResult.with_lr`)."""

    def setting(x: Any) -> Any:
        if isinstance(x, InjectHyperparamsState) and name in x.hyperparams:
            return InjectHyperparamsState({**x.hyperparams, name: float(lr)}, x.inner)
        return x

    is_leaf = lambda x: isinstance(x, InjectHyperparamsState)  # noqa: E731
    opt_state = pytree.tree_map(setting, state.opt_state, is_leaf=is_leaf)
    warm(opt_state)  # built now, outside any compiled step
    return state.replace(opt_state=opt_state)


def updated_task(found: LRFinderResult, task: Task) -> LRFinderResult:
    """``found`` with :attr:`~LRFinderResult.task` set to ``task`` using its suggestion (if
    there is one): Lightning's ``update_attr=True``."""
    lr = found.suggestion()
    if lr is not None:
        assert task.tx is not None
        tx = with_learning_rate(task.tx, lr, name=found.name)
        found.task, found.task_lr = attrs.evolve(task, tx=tx, lr=lr), lr
    return found


class LearningRateFinder(Listener):
    """Lightning's ``LearningRateFinder`` callback: a learning-rate range test when the fit
    starts, on a copy of the state, after which the fit proceeds (with the suggested rate,
    when ``update_attr``).

    The search runs as a :class:`~engine.events.Search` in ``on_fit_start``: trial fits on the
    Trainer's own flags, with no loggers or other listeners, before the sanity check. With
    ``update_attr=True`` (Lightning's default) the fit goes on at the suggested rate, set by a
    :class:`~engine.events.Transition` in ``on_train_start``, before the first step (journaled
    after the start state's checkpoint, so a replay sets it too): the rate must be state, so
    the optimizer is built with ``optim.inject_hyperparams(...)(lr=...)``, as for
    ``ReduceLROnPlateau``. (Outside a fit, :meth:`engine.Tuner.lr_find` returns a task with
    the rate instead, for any optimizer.) A fit resumed from a checkpoint does not search
    again: its state holds the rate set before.

    Args:
        min_lr, max_lr, num_training_steps, mode, early_stop_threshold: the search (see
            :func:`lr_grid`; the search stops once the smoothed loss passes
            ``early_stop_threshold`` times the best, ``None`` never).
        update_attr: go on at the suggested rate.
        attr_name: the optimizer argument holding the rate (default ``"lr"``).

    Attributes:
        optimal_lr: the :class:`LRFinderResult` of the last search (``None`` before one).

    Raises:
        ValueError: for arguments out of range; at the fit's start, with ``update_attr=True``
            and an optimizer whose rate is not in its state.

    Example:
        >>> from engine.listeners import LearningRateFinder
        >>> finder = LearningRateFinder(min_lr=1e-5, max_lr=1.0, num_training_steps=50)
    """

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        self._min_lr, self._max_lr, self._num_training_steps, self._mode = _check(
            min_lr, max_lr, num_training_steps, mode
        )
        if early_stop_threshold is not None:
            _positive("early_stop_threshold", early_stop_threshold)
        self._early_stop_threshold = early_stop_threshold
        self._update_attr = bool(update_attr)
        self._attr_name = attr_name
        self.optimal_lr: LRFinderResult | None = None
        self._pending: Transition | None = None  # the rate found, set when training starts

    def on_fit_start(self, rec: EventRecord) -> Search | None:
        """Check the run, then ask for the search."""
        run, state, task = rec.run, rec.state, rec.run.task
        if run.config is not None and run.config.fast_dev_run:
            warnings.warn(
                "LearningRateFinder: skipped, since fast_dev_run is on (as Lightning)",
                UserWarning,
                stacklevel=2,
            )
            return None
        if run.ckpt_path is not None or state is None or task is None:
            return None  # resumed: the checkpoint's state holds the rate found before
        _single(run.world_size, "LearningRateFinder")
        name = self._attr_name or "lr"
        if self._update_attr and not _injected(state.opt_state, name):
            raise ValueError(
                f"LearningRateFinder(update_attr=True) goes on fitting at the rate it finds, "
                f"which a listener can only set in the state: build the optimizer with "
                f"optim.inject_hyperparams, e.g. tx=optim.inject_hyperparams(optim.adamw)"
                f"({name}=1e-3); or pass update_attr=False and read "
                "listener.optimal_lr.suggestion(), or use engine.Tuner(trainer).lr_find(...), "
                "which returns a task with the rate for any optimizer"
            )
        return Search(
            functools.partial(self._search, task, state, run.train_dataloader, run.datamodule)
        )

    def _search(self, task: Task, state: TrainState, loader: Any, dm: Any, trials: Trials) -> Any:
        if dm is not None:  # asked now, as Lightning's search asks: a BatchSizeFinder listed
            # before this one has set the size the fit will train with
            loader = resolve_loaders("fit", None, dm, "train_dataloader")[0]
        self.optimal_lr = found = lr_search(
            trials,
            task,
            state,
            loader,
            min_lr=self._min_lr,
            max_lr=self._max_lr,
            num_training=self._num_training_steps,
            mode=self._mode,
            early_stop_threshold=self._early_stop_threshold,
            attr_name=self._attr_name,
        )
        lr = found.suggestion() if self._update_attr else None
        if lr is not None:
            fn = functools.partial(set_injected_lr, name=found.name, lr=lr)
            self._pending = Transition(fn, name=f"LearningRateFinder: {found.name}={lr!r}")
        return None

    def on_train_start(self, rec: EventRecord) -> Transition | None:
        """Set the rate found: in the fit's first event after ``on_fit_start``, whose
        checkpoint of the start state (the journal's) holds the state before it (a replay
        starts there and applies the transition again)."""
        pending, self._pending = self._pending, None
        return pending


def _single(world_size: int, who: str) -> None:
    if world_size > 1:
        raise ValueError(
            f"{who} runs on one process; this run has {world_size}. Tune in a one-process run "
            "(Trainer(devices=1)) and pass what it found to the distributed one"
        )
