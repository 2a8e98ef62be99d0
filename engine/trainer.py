"""The Trainer: Lightning's fit / validate / test / predict as a thin driver over pure steps.

The driver owns loop limits and the validation schedule, calls the steps built from a
:class:`~engine.task.Task`, keeps host-side metrics, and emits :class:`~engine.events.Event` s.
It never reaches inside a step, and no listener reaches into it: a listener reads ``rec.run``
(a read-only :class:`~engine.events.RunView`) and returns requests (``Stop``, ``Save``,
``Log``), which the driver carries out once the event has reached every listener. The loop
semantics (which batches train, when the optimizer steps, when validation runs, what
``global_step`` / ``current_epoch`` read) follow Lightning 2.x; ``tests/test_lightning_parity.py``
runs the same configurations through Lightning itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import torch

from engine import _resume, checkpoint, loop, optim, privacy, transforms
from engine._config import FlagViews, missing_attribute, warn_hyperparams_in_dtype
from engine._profiling import Profiler
from engine._resume import Checkpointer, RunRecord, SignalCatcher, _is
from engine.checkpoint._writable import check_writable
from engine.data import (
    count_batches,
    is_datamodule,
    limit_batches,
    order_outside_the_state,
    randomness_outside_the_state,
    resolve_loaders,
    restore_loader,
    setup_datamodule,
    teardown_datamodule,
)
from engine.events import (
    Emitter,
    Event,
    EventRecord,
    Log,
    RunView,
    Save,
    Stop,
    Transition,
    _moved,
)
from engine.loop import Phase
from engine.loop import evaluate as eval_loops
from engine.loop.fit import fit as fit_loop
from engine.loop.flags import resolve
from engine.loop.progress import Progress
from engine.optim import clip_by_global_norm, clip_by_value
from engine.parallel.environments import LAUNCHED_BY_VAR
from engine.parallel.select import select_strategy
from engine.state import TrainState
from engine.task import Task
from engine.transforms.devices import resolve_devices

__all__ = ["Trainer"]


class Trainer(FlagViews):
    """Lightning's ``Trainer``, as a driver of pure steps. Flags keep Lightning's names,
    defaults and meanings.

    ``fit`` returns the final :class:`TrainState`; ``validate`` / ``test`` return one dict of
    floats per dataloader; ``predict`` returns the outputs (a list per dataloader when there are
    several).

    Engine-specific: ``compile`` (``True`` or ``torch.compile`` options) compiles the train and
    eval steps; ``enable_journal`` (default ``True``, off with ``barebones`` and
    ``fast_dev_run``) adds a :class:`~engine.listeners.Journal`, so each fit leaves a run
    directory that :func:`engine.replay` can re-execute and check bitwise. The flags
    ``precision`` takes Lightning's six precisions and their aliases
    (:mod:`engine.transforms.precision`), ``accelerator`` / ``devices`` one CPU, CUDA or MPS
    device or several (:mod:`engine.transforms.devices`); ``plugins`` takes engine's precision
    transforms, placement, anomaly detection, :class:`~engine.privacy.DPSGD` and
    :class:`~engine.checkpoint.CheckpointIO`; ``strategy`` the data-parallel and fully sharded
    strategies (:mod:`engine.parallel`). Lightning 2.6's ``enable_autolog_hparams`` decides
    whether the task's ``hparams`` go to the loggers; its ``model_registry`` (an upload to
    Lightning AI's hosted registry) takes only ``None``.

    The flags are checked and resolved once, into ``trainer.config`` (a frozen
    :class:`~engine.loop.LoopConfig`: Lightning's defaults filled in, ``fast_dev_run`` and
    ``barebones`` applied); ``trainer.max_epochs`` and the other flags read it. When to validate
    and when to stop are the pure predicates of :mod:`engine.loop.schedule`, which the listeners
    ask too.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
        >>> data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(4)]
        >>> trainer = eg.Trainer(max_epochs=2, barebones=True)
        >>> state = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), train_dataloaders=data)
        >>> trainer.global_step, trainer.current_epoch
        (8, 2)
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        num_nodes: int = 1,
        precision: int | str | None = None,
        logger: Any = None,
        callbacks: Any = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        profiler: str | None = None,
        detect_anomaly: bool = False,
        barebones: bool = False,
        plugins: Any = None,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: str | os.PathLike[str] | None = None,
        compile: bool | Mapping[str, Any] = False,
        enable_journal: bool | None = None,
        enable_autolog_hparams: bool = True,
        model_registry: str | None = None,
    ) -> None:
        flags = {name: value for name, value in locals().items() if name != "self"}
        # every flag checked and resolved, once; the loop and the listeners read this record
        self.config = resolve(**flags)
        plugged = (
            ()
            if plugins is None
            else tuple(plugins)
            if isinstance(plugins, (list, tuple))
            else (plugins,)
        )
        # the step transforms and checkpoint IO the flags and plugins ask for (checked above)
        self._placement = next(
            (p for p in plugged if isinstance(p, transforms.SingleDevice)),
            transforms.SingleDevice(self.config.device),
        )
        self._anomaly = next(
            (p for p in plugged if isinstance(p, transforms.DetectAnomaly)),
            transforms.DetectAnomaly() if self.config.detect_anomaly else None,
        )
        self._precision = next(
            (
                p
                for p in plugged
                if isinstance(p, transforms.Transform)
                and not isinstance(
                    p,
                    (
                        transforms.SingleDevice,
                        transforms.DetectAnomaly,
                        transforms.Strategy,
                        privacy.DPSGD,
                    ),
                )
            ),
            None,
        ) or transforms.precision_transform(self.config.precision)
        # DP-SGD's per-example gradients (engine.privacy), in compose's privacy slot
        self._privacy = next((p for p in plugged if isinstance(p, privacy.DPSGD)), None)
        io = next((p for p in plugged if isinstance(p, checkpoint.CheckpointIO)), None)
        # how the work is spread over processes (engine.parallel): rank facts, sharding,
        # the gradients' reduction, the collectives at the loop's checks
        here = resolve_devices(accelerator, devices)
        self._processes = len(here)
        self._strategy = select_strategy(
            strategy,
            processes=len(here),
            num_nodes=num_nodes,
            devices=here,
            plugins=plugged,
            sync_batchnorm=sync_batchnorm,
        )
        # a strategy that places each rank (its local rank's device) does, unless a placement
        # was plugged in
        self._user_placement = any(isinstance(p, transforms.SingleDevice) for p in plugged)
        self._inside_launch = False  # a launcher's processes run the entry point itself
        self._sharded: list[Any] = []  # loaders this run sharded, put back when it ends
        # fast_dev_run and barebones log nowhere (a barebones logger is refused by resolve)
        quiet = self.config.fast_dev_run or self.config.barebones
        self.loggers = [] if quiet else self._build_loggers(logger)
        self.callbacks = self._build_callbacks(callbacks)

        # -- run state (host side)
        self.task: Task | None = None
        # the facade's record of the last state and progress the fit loop (engine.loop.fit)
        # handed it, for the listeners' view, `trainer.state` and checkpoints; the loop itself
        # keeps its own as locals and never reads these
        self._state: TrainState | None = None
        self._progress = Progress()
        self.stage: str | None = None
        self.sanity_checking = False
        self.num_val_batches: list[float] = []
        self.num_test_batches: list[float] = []
        self.num_predict_batches: list[float] = []
        self._val_loaded_at: int | None = None  # the epoch the val loaders were last fetched
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        # bumped whenever the metrics or should_stop change: the listeners' view is rebuilt then
        self._version = 0
        self._snapshots_of = -1  # the version of the metrics' snapshots below
        self._snapshots: tuple[Mapping[str, float], ...] = ()
        self._view: RunView | None = None  # the latest view of the run (_view_now, _batch_view)
        self._view_state: TrainState | None = None  # ... the state it was built for
        self._view_version = -1  # ... and the version
        # checkpoints: written, resolved, restored; handed the run's record on each call
        self._checkpointer = Checkpointer(self.callbacks, self.loggers, self.default_root_dir, io)
        self._signals = SignalCatcher()  # SIGTERM / SIGINT received during fit
        self._profiler = Profiler(self.config.profiler)
        self.ckpt_path: str | None = None  # the checkpoint the current run resumed from
        self.train_dataloader: Any = None  # what fit() trains on (Lightning's attribute)
        self.datamodule: Any = None  # the datamodule the current or last run was given
        self._emitter = Emitter(())  # rebuilt from the listeners by each run
        self._transforms = transforms.compose()  # the run's step transforms (_pipeline)
        self._log_step: int | None = None  # the step an evaluation's rows are logged at
        self._resolved: tuple[Any, Path | None] | None = None  # ckpt_path resolved early

    # ------------------------------------------------------------------ construction helpers

    def _build_loggers(self, logger: Any) -> list[Any]:
        if logger is False:
            return []
        if logger is None or logger is True:
            from engine.loggers import TensorBoardLogger

            return [TensorBoardLogger(self.default_root_dir)]
        # checked at construction (_config.check_loggers)
        return list(logger) if isinstance(logger, (list, tuple)) else [logger]

    def _build_callbacks(self, callbacks: Any) -> list[Any]:
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            callbacks = [callbacks]  # one listener, as Lightning takes one Callback
        listeners = list(callbacks or [])
        if self.enable_progress_bar and not any(_is(x, "ProgressBar") for x in listeners):
            from engine.listeners import ProgressBar

            listeners.append(ProgressBar())
        if self.enable_model_summary and not any(_is(x, "ModelSummary") for x in listeners):
            from engine.listeners import ModelSummary

            listeners.insert(0, ModelSummary())
        savers = [x for x in listeners if _is(x, "ModelCheckpoint")]
        if savers and not self.enable_checkpointing:
            raise ValueError(
                "Trainer(enable_checkpointing=False) was given a ModelCheckpoint in callbacks; "
                "drop one or the other"
            )
        if self.enable_checkpointing and not savers:
            from engine.listeners import ModelCheckpoint

            listeners.append(ModelCheckpoint())  # as Lightning: the latest, every epoch
        unjournaled = self._strategy.not_journaled
        if unjournaled and any(_is(x, "Journal") for x in listeners):
            raise ValueError(
                f"Trainer(callbacks=[Journal(...)]) with strategy {self._strategy!r}: "
                f"{unjournaled}; drop the Journal"
            )
        if self.enable_journal and unjournaled:
            warnings.warn(
                f"Trainer: no journal for this run (strategy {self._strategy!r}: "
                f"{unjournaled}); pass enable_journal=False to say so",
                stacklevel=3,
            )
        elif self.enable_journal and not any(_is(x, "Journal") for x in listeners):
            from engine.listeners import Journal

            listeners.append(Journal())  # the run directory's record, for replay
        if self.max_time is not None and not any(_is(x, "Timer") for x in listeners):
            from engine.listeners import Timer

            listeners.append(Timer(self.max_time, interval="step", verbose=False))
        # as Lightning's _reorder_callbacks: checkpoints are written last in each event, so they
        # hold the other listeners' state after this event (EarlyStopping's check included)
        return [x for x in listeners if not _is(x, "ModelCheckpoint")] + [
            x for x in listeners if _is(x, "ModelCheckpoint")
        ]

    # ------------------------------------------------------------------ read-only views

    @property
    def state(self) -> TrainState | None:
        """The latest state of the current or last run."""
        return self._state

    @property
    def should_stop(self) -> bool:
        """Whether a listener asked the current or last fit to stop (``engine.Stop``)."""
        return self._progress.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        raise AttributeError(
            f"trainer.should_stop = {value!r}: the loop's progress is not set from outside; a "
            "listener returns engine.Stop('why') from an event (Lightning's "
            "trainer.should_stop = True), which the driver carries out after the event"
        )

    @property
    def num_training_batches(self) -> float:
        """Training batches per epoch after ``limit_train_batches`` (the current epoch's)."""
        return self._progress.num_training_batches

    @property
    def profile(self) -> dict[str, list[float]]:
        """The simple profiler's timings of the last run, by action (``profiler="simple"``)."""
        return self._profiler.profile

    @property
    def root_device(self) -> torch.device:
        """The device the run lives on (Lightning's ``trainer.strategy.root_device``)."""
        return self._placement_now().device

    def _placement_now(self) -> transforms.SingleDevice:
        """The placement: the plugged one, else this rank's device (the strategy's: a
        spawned process learns its local rank only once it runs), else the flags'."""
        placed = None if self._user_placement else self._strategy.root_device
        if placed is None or placed == self._placement.device:
            return self._placement
        return transforms.SingleDevice(placed, transfer=self._placement.transfer)

    @property
    def num_devices(self) -> int:
        """The devices (processes) the run uses on each node (Lightning's
        ``trainer.num_devices``)."""
        return self._processes

    @property
    def world_size(self) -> int:
        """The processes of the run, on every node (the strategy's)."""
        return self._strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among them."""
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        """This process's node."""
        return self._strategy.node_rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0, the process that writes logs and checkpoints."""
        return self._strategy.is_global_zero

    @property
    def device_ids(self) -> list[int]:
        """The indices of the devices the run uses (Lightning's ``trainer.device_ids``)."""
        return [self.root_device.index or 0]

    @property
    def logger(self) -> Any:
        """The first logger, or ``None`` without one (Lightning's ``trainer.logger``)."""
        return self.loggers[0] if self.loggers else None

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        """The :class:`~engine.listeners.ModelCheckpoint` listeners, in order."""
        return [x for x in self.callbacks if _is(x, "ModelCheckpoint")]

    @property
    def checkpoint_callback(self) -> Any:
        """The first :class:`~engine.listeners.ModelCheckpoint`, or ``None`` (Lightning's
        ``trainer.checkpoint_callback``: its ``best_model_path``, ``last_model_path``...)."""
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callbacks(self) -> list[Any]:
        """The :class:`~engine.listeners.EarlyStopping` listeners, in order."""
        return [x for x in self.callbacks if _is(x, "EarlyStopping")]

    @property
    def early_stopping_callback(self) -> Any:
        """The first :class:`~engine.listeners.EarlyStopping`, or ``None`` (Lightning's
        ``trainer.early_stopping_callback``)."""
        found = self.early_stopping_callbacks
        return found[0] if found else None

    @property
    def progress_bar_callback(self) -> Any:
        """The :class:`~engine.listeners.ProgressBar`, or ``None``."""
        return next((x for x in self.callbacks if _is(x, "ProgressBar")), None)

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps the fit takes, as Lightning estimates them: ``max_steps`` when
        epochs are unlimited (``inf`` when both are); else ``ceil(num_training_batches /
        accumulate_grad_batches) * max(max_epochs, 1)``, capped by ``max_steps`` when it is set
        (an unsized training loader: ``max_steps``). It counts the whole run from step 0 under
        this Trainer's flags, so a resume that raised ``max_epochs`` reads the longer run.

        A schedule gets it without computing it: ``total_steps="auto"``
        (:class:`engine.optim.AutoLength`), resolved when the fit starts.

        Raises:
            RuntimeError: when epochs count and no fit has been given its training data yet
                (Lightning asks the module for its loader; engine's come with ``fit``).
        """
        config = self.config
        if config.max_epochs == -1:
            return math.inf if config.max_steps == -1 else config.max_steps
        if self.train_dataloader is None:
            raise RuntimeError(
                "trainer.estimated_stepping_batches counts the training batches, which a "
                "Trainer knows once fit() is given its data; read it during or after fit() "
                "(a schedule: total_steps='auto', resolved when the fit starts)"
            )
        batches = limit_batches(
            "train", count_batches(self.train_dataloader), config.limit_train_batches
        )
        if batches == math.inf:
            return config.max_steps
        steps = math.ceil(batches / config.accumulate_grad_batches) * max(config.max_epochs, 1)
        return min(steps, config.max_steps) if config.max_steps != -1 else steps

    def __getattr__(self, name: str) -> Any:
        # only for names not found otherwise: a Lightning attribute says what replaces it
        raise missing_attribute(type(self).__name__, name)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (Lightning's ``trainer.global_step``)."""
        return self._state.step if self._state is not None else 0

    @property
    def current_epoch(self) -> int:
        """Completed epochs; incremented after ``on_train_epoch_end`` (as in Lightning)."""
        return self._state.epoch if self._state is not None else 0

    @property
    def log_dir(self) -> str | None:
        """The first logger's directory, else ``default_root_dir``."""
        for lg in self.loggers:
            d = getattr(lg, "log_dir", None)
            if d:
                return str(d)
        return self.default_root_dir

    @property
    def run_dir(self) -> str | None:
        """The run directory the journal writes (see :func:`engine.replay`): the first logger's
        ``log_dir``, or ``<default_root_dir>/lightning_logs/version_N`` without one;
        ``None`` before a fit or without a journal."""
        for listener in self.callbacks:
            if _is(listener, "Journal") and listener.dirpath is not None:
                return str(listener.dirpath)
        return None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send host-side metrics to every logger and record them as logged/callback metrics.

        For the driver and for code outside events; a listener returns
        :class:`~engine.events.Log` instead.
        """
        self._log_row(metrics, step, run_row=step is None)

    def _log_row(self, metrics: Mapping[str, float], step: int | None, *, run_row: bool) -> None:
        """``log_metrics``; a row of the run's own (``run_row``) gets the epoch, an int, as
        Lightning adds it."""
        row = dict(metrics)
        if not row:  # as Lightning: no row for nothing
            return
        if step is None:
            step = self._row_step()
        if run_row:
            row.setdefault("epoch", self.current_epoch)
        if self.is_global_zero:  # one rank writes the run's logs
            for lg in self.loggers:
                lg.log_metrics(row, step)
        self.logged_metrics.update(row)
        self.callback_metrics.update(metrics)
        self._version += 1

    def _check_directories(self) -> None:
        """At fit start: check that every directory the run writes can be written (each named
        with the flag that set it). The directories are what the loggers and listeners say
        (``log_dir``, ``dirpath``), and ``default_root_dir`` when any of them may write under
        it. Nothing is created (see :meth:`_claim_directories`)."""
        found: list[tuple[str, str]] = []
        for lg in self.loggers:
            if getattr(lg, "log_dir", None):
                where = getattr(lg, "save_dir", lg.log_dir)
                found.append((str(lg.log_dir), f"{type(lg).__name__}(save_dir={where!r})"))
        for listener in self.callbacks:
            if getattr(listener, "dirpath", None) is not None:
                flag = f"{type(listener).__name__}(dirpath={os.fspath(listener.dirpath)!r})"
                found.append((os.fspath(listener.dirpath), flag))
        if self.loggers or any(hasattr(x, "dirpath") for x in self.callbacks):
            root = self.default_root_dir
            found.insert(0, (root, f"Trainer(default_root_dir={root!r})"))
        check_writable(found)

    def _claim_directories(self) -> None:
        """Claim the loggers' run directories (``claim()``: a version another process took
        meanwhile is not shared), once the fit's flags and data have been checked (a refused
        value leaves no directory behind) and before the listeners read ``log_dir``."""
        strategy = self._strategy
        if strategy.is_global_zero:
            for lg in self.loggers:
                if callable(getattr(lg, "claim", None)):
                    lg.claim()
        if strategy.world_size > 1:  # every rank names rank 0's directories
            versions = strategy.broadcast([getattr(lg, "version", None) for lg in self.loggers])
            for lg, version in zip(self.loggers, versions, strict=True):
                adopt = getattr(lg, "adopt", None)
                if callable(adopt) and not strategy.is_global_zero:
                    adopt(version)
            # the journal's run directory too (the first logger's, or one rank 0 claims): the
            # other ranks follow its journal, and join the save of its start checkpoint
            journals = [x for x in self.callbacks if _is(x, "Journal")]
            claimed = [
                j.claim(self.loggers, self.default_root_dir) if strategy.is_global_zero else None
                for j in journals
            ]
            for journal, path in zip(journals, strategy.broadcast(claimed), strict=True):
                journal.adopt(path)

    def _check_schedule(self, train_loader: Any, val_loaders: Sequence[Any]) -> None:
        """Raise what :func:`engine.loop.schedule.val_check_batch` raises for the fit's first
        epoch (the loop asks again each epoch: a reloaded loader may change its length)."""
        config = self.config
        batches = limit_batches("train", count_batches(train_loader), config.limit_train_batches)
        if batches == 0:  # the loop trains nothing and asks nothing
            return
        validates = any(
            limit_batches("val", count_batches(dl), config.limit_val_batches) for dl in val_loaders
        )
        loop.schedule.val_check_batch(config, batches, validates)

    def _row_step(self) -> int:
        """The step a row of the run's own is logged at: Lightning's (its loop's
        ``_batches_that_stepped``), the optimizer steps taken *before* the current batch's
        until that batch is done (its ``on_train_batch_end`` and its validation), the state's
        step otherwise. validate/test/predict from a checkpoint log at the step of the state
        given, not the checkpoint's (Lightning's global_step is the fit's): rows stay in step
        order."""
        if self._log_step is not None:
            return self._log_step
        state = self._state
        if state is None:
            return 0
        stepped = state.micro_step == 0 and state.step > 0  # this batch's optimizer step ran
        return state.step - 1 if self._progress.phase.mid_batch and stepped else state.step

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        filepath: str | os.PathLike[str],
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """Save the current state, the listeners' states and the loop position to ``filepath``.

        The checkpoint determines the rest of the run: ``fit(..., ckpt_path=filepath)`` continues
        it. See :func:`engine.checkpoint.save` for the format and the guarantees. With
        ``asynchronous=True`` only a snapshot blocks and the write happens in the background
        (:func:`engine.checkpoint.save_async`); returns a future of the path instead of the path.
        A run waits for its pending saves before it ends. ``weights_only=True`` saves the model
        alone (Lightning's meaning): ``validate`` / ``test`` / ``predict`` can start from it,
        ``fit`` cannot.

        For code outside events (after ``fit``, say). A listener returns
        :class:`~engine.events.Save` instead, which the driver carries out through this method
        once the event has reached every listener.

        Raises:
            RuntimeError: before a run, or when called while an event is being dispatched (from
                a handler that holds the trainer): return ``engine.Save(path)`` there.
        """
        if self._state is None:
            raise RuntimeError("save_checkpoint(): nothing to save yet; call fit() first")
        dispatching = self._emitter.dispatching
        if dispatching is not None:
            raise RuntimeError(
                f"trainer.save_checkpoint() was called while {dispatching.value} was being "
                "dispatched; a listener returns engine.Save(path) (with asynchronous=, "
                "weights_only=, replaces=) and the driver writes it once every listener has had "
                "the event, so the checkpoint holds all their states after it"
            )
        return self._checkpointer.save(
            filepath,
            self._announce_save,
            self._record,
            metrics=metrics,
            asynchronous=asynchronous,
            weights_only=weights_only,
        )

    def _announce_save(self, path: str, future: Future[Any] | None) -> None:
        self._emit(Event.ON_SAVE_CHECKPOINT, checkpoint_path=path, checkpoint_future=future)

    def _record(self) -> RunRecord:
        """The run as a checkpoint holds it (besides the listeners' states)."""
        assert self._state is not None
        return RunRecord(
            self._strategy.checkpoint_state(self._state),
            self._progress,
            self.stage,
            self.config,
            self.callback_metrics,
            self.logged_metrics,
            self.progress_bar_metrics,
            hparams=None if self.task is None else self.task.hparams,
            datamodule=_datamodule_state(self.datamodule),
            world_size=self.world_size,
            position_unit=_resume.position_unit(self.train_dataloader),
        )

    def _restore(self, ckpt_path: str | os.PathLike[str], template: TrainState) -> None:
        """Continue from the checkpoint ``ckpt_path`` names: its state, its listeners' states
        and, for a fit, the loop's position and the metrics."""
        saver = self._checkpointer
        early, self._resolved = self._resolved, None
        path = early[1] if early is not None and early[0] is ckpt_path else self._resolve(ckpt_path)
        if path is None:
            return
        if self.stage == "fit" and (path / checkpoint.META).is_file():  # else load says why
            self._check_precision(path)
            meta = checkpoint.read_meta(path)
            accumulate = (meta.get("extra", {}).get("config") or {}).get("accumulate_grad_batches")
            _resume.check_world(path, meta, world_size=self.world_size, accumulate=accumulate)
        self._state = saver.load(path, template, stage=self.stage, asked=ckpt_path)
        if self.stage == "fit" and (path / checkpoint.META).is_file():
            self._check_accumulation(path, self._state)
            self._check_privacy(path, self._state)
        self.ckpt_path = str(path)  # ModelCheckpoint never deletes the one a run resumed from
        new_reducer = None if self.task is None else self.task.reducer
        restored = saver.restore_run(
            path, stage=self.stage, progress=self._progress, new_reducer=new_reducer
        )
        if restored is not None:  # a fit continues: what its listeners had seen, they see
            for name, values in restored.metrics.items():
                setattr(self, name, values)
            self._version += 1
            # the epoch's position in this world size's batches (another's: converted)
            saved = checkpoint.read_meta(path).get("extra", {}).get("trainer", {})
            unit = _resume.position_unit(self.train_dataloader)
            self._state, self._progress = _resume.carry_position(
                path, self._state, restored.progress, saved, world_size=self.world_size, unit=unit
            )
        if early is None:
            self._restore_datamodule(path)
        self._emit(Event.ON_LOAD_CHECKPOINT, checkpoint_path=str(path))

    def _check_precision(self, path: Path) -> None:
        """A fit continues exactly only under the precision its checkpoint was saved with (the
        loss scale, the autocast dtype and the parameters' dtype are part of the run)."""
        config = checkpoint.read_meta(path).get("extra", {}).get("config") or {}
        saved = config.get("precision")
        with contextlib.suppress(ValueError):  # else a plugin of the user's own: its repr
            saved = transforms.canonical_precision(saved)
        if saved != self.precision:
            raise checkpoint.CheckpointError(
                f"fit(ckpt_path={str(path)!r}): the checkpoint was saved under precision "
                f"{saved!r} and this Trainer runs {self.precision!r}; a resumed fit continues "
                f"exactly only under the same one: Trainer(precision={saved!r}). To go on under "
                "another, start a new fit from its weights (checkpoint.load_weights(path, "
                "model), then task.init(model))"
            )

    def _check_privacy(self, path: Path, state: TrainState) -> None:
        """A DP-SGD fit continues only under DP-SGD, and DP-SGD continues only a fit that ran
        it: the checkpoint's ``extra["dpsgd"]`` (the noise multiplier, the sample rate and
        their history, which the accountant reads) says which it was."""
        held = privacy.KEY in state.extra
        if held and self._privacy is None:
            raise checkpoint.CheckpointError(
                f"fit(ckpt_path={str(path)!r}): the checkpoint was saved by a DP-SGD fit (its "
                "state holds extra['dpsgd']) and this Trainer has no DPSGD plugin; resume it "
                "with Trainer(plugins=[engine.privacy.DPSGD(...)]) (the checkpoint's numbers "
                "are kept)"
            )
        if not held and self._privacy is not None:
            raise checkpoint.CheckpointError(
                f"fit(ckpt_path={str(path)!r}): the checkpoint was saved by a fit without "
                f"DP-SGD and this Trainer has {self._privacy!r}; a resumed fit continues the "
                "run it resumes. To train it privately, start a new fit from its weights "
                "(checkpoint.load_weights(path, model), then task.init(model))"
            )

    def _check_accumulation(self, path: Path, state: TrainState) -> None:
        """A fit resumed inside an accumulation window continues that window: only under the
        ``accumulate_grad_batches`` it was saved with (its summed gradient holds
        ``micro_step`` micro-batches, each divided by that value). At a window boundary another
        value is allowed, as in Lightning: the next step comes where the new windows end."""
        config = checkpoint.read_meta(path).get("extra", {}).get("config") or {}
        saved = config.get("accumulate_grad_batches")
        now = self.accumulate_grad_batches
        if not state.micro_step or saved is None or saved == now:
            return
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved inside an accumulation "
            f"window, {state.micro_step} of accumulate_grad_batches={saved} micro-batches "
            f"after step {state.step} (batch {state.batch_idx} of epoch {state.epoch}), and "
            f"this Trainer accumulates {now}: the window's gradient, summed over micro-batches "
            f"each divided by {saved}, would be wrong. Resume with "
            f"Trainer(accumulate_grad_batches={saved}), or from a checkpoint saved at an "
            "optimizer step (a window boundary), where the value may change"
        )

    def _resolve(self, ckpt_path: str | os.PathLike[str]) -> Path | None:
        """The checkpoint ``ckpt_path`` names, rank 0's on every rank: ``"best"`` / ``"last"``
        are resolved by rank 0's listeners, whose ranking is the one its files follow, and an
        error resolving it is raised on every rank."""
        if self.world_size == 1:
            return self._checkpointer.resolve(ckpt_path)
        found: tuple[Path | None, BaseException | None] = (None, None)
        if self.is_global_zero:
            try:
                found = (self._checkpointer.resolve(ckpt_path), None)
            except (checkpoint.CheckpointError, ValueError, OSError) as e:
                found = (None, e)
        path, error = self._strategy.broadcast(found)
        if error is not None:
            raise error
        return path

    def _datamodule_first(self, ckpt_path: Any, datamodule: Any) -> None:
        """Lightning restores a datamodule's state before asking it for loaders: resolve the
        checkpoint now (once; the run's restore uses it) and give the datamodule its state."""
        self._resolved = None
        if ckpt_path is None or datamodule is None:
            return
        path = self._resolve(ckpt_path)
        self._resolved = (ckpt_path, path)
        if path is not None:
            self._restore_datamodule(path, datamodule)

    def _restore_datamodule(self, path: Path, datamodule: Any = None) -> None:
        datamodule = self.datamodule if datamodule is None else datamodule
        load = getattr(datamodule, "load_state_dict", None)
        if not callable(load) or not (path / checkpoint.META).is_file():
            return
        saved = checkpoint.read_meta(path).get("extra", {}).get("datamodule")
        if saved is not None:  # Lightning's restore_datamodule
            load(saved)

    # ------------------------------------------------------------------ events

    def _metric_snapshots(self) -> tuple[Mapping[str, float], ...]:
        """Immutable copies of the callback, logged and progress-bar metrics, made once per
        change (a copy per logging step, not per event)."""
        if self._snapshots_of != self._version:
            self._snapshots = tuple(
                MappingProxyType(dict(m))
                for m in (self.callback_metrics, self.logged_metrics, self.progress_bar_metrics)
            )
            self._snapshots_of = self._version
        return self._snapshots

    def _view_now(self) -> RunView:
        """The listeners' view of the run, built anew (for the events between batches, where
        anything in it may have changed: stage, batch counts, directories...)."""
        callback, logged, shown = self._metric_snapshots()
        state = self._state
        view = RunView(
            stage=self.stage or "",
            sanity_checking=self.sanity_checking,
            global_step=self.global_step,
            current_epoch=self.current_epoch,
            num_training_batches=self._progress.num_training_batches,
            num_val_batches=self.num_val_batches,
            num_test_batches=self.num_test_batches,
            num_predict_batches=self.num_predict_batches,
            should_stop=self._progress.should_stop,
            config=self.config,
            callback_metrics=callback,
            logged_metrics=logged,
            progress_bar_metrics=shown,
            default_root_dir=self.default_root_dir,
            log_dir=self.log_dir,
            run_dir=self.run_dir,
            task=self.task,
            ckpt_path=self.ckpt_path,
            loggers=self.loggers,
            train_dataloader=self.train_dataloader,
            datamodule=self.datamodule,
            world_size=self.world_size,
            global_rank=self.global_rank,
            local_rank=self.local_rank,
            node_rank=self.node_rank,
        )
        self._view, self._view_state, self._view_version = view, state, self._version
        return view

    def _batch_view(self) -> RunView:
        """The view for a batch event: the last one, moved to the current counters when the
        state changed (once a batch), built anew only when the metrics or should_stop did."""
        view = self._view
        if view is None or self._view_version != self._version:
            return self._view_now()
        state = self._state
        if state is not self._view_state and state is not None:
            view = self._view = _moved(view, state.step, state.epoch)
            self._view_state = state
        return view

    def _emit(self, event: Event, **fields: Any) -> None:
        """Emit an event between batches (the view of the run is built anew)."""
        if self._emitter.wants(event):
            self._dispatch(event, self._view_now(), fields)

    def _emit_batch(self, event: Event, **fields: Any) -> None:
        """Emit a batch event (the hot path: the view is reused within a batch)."""
        if self._emitter.wants(event):
            self._dispatch(event, self._batch_view(), fields)

    def _dispatch(self, event: Event, view: RunView, fields: dict[str, Any]) -> None:
        """``event`` to every listener, then the requests they made, carried out."""
        stage = "sanity_check" if self.sanity_checking else view.stage
        record = EventRecord(event, stage, self._state, view.callback_metrics, view, **fields)
        requests = self._emitter.emit(event, record)
        if requests:
            self._carry_out(event, requests)
        if self._checkpointer.in_flight:  # a failed save raises (not while one is raised)
            self._checkpointer.reap(wait=False, report=event is not Event.ON_EXCEPTION)

    def _carry_out(self, event: Event, requests: list[tuple[Any, Any]]) -> None:
        """The requests the listeners made in ``event``, now that every listener has had it:
        stops and logs in listener order, then the saves in listener order, so that every
        checkpoint saved in an event holds the run as the event left it (a stop asked for by a
        listener listed after the one saving included)."""
        saves, transitions = [], []
        for listener, request in requests:
            if isinstance(request, Save):
                saves.append((listener, request))
            elif isinstance(request, Transition):
                transitions.append((listener, request))
            elif isinstance(request, Stop):
                self._progress = self._progress._replace(should_stop=True)
                self._version += 1
            elif isinstance(request, Log):
                self.log_metrics(request.metrics, request.step)
        for listener, request in transitions:  # before the saves: checkpoints hold their effect
            self._transition(event, listener, request)
        if saves and event is Event.ON_SAVE_CHECKPOINT:
            raise RuntimeError(
                f"{type(saves[0][0]).__name__}.on_save_checkpoint returned {saves[0][1]!r}: a "
                "save requested while a save is being carried out would fire on_save_checkpoint "
                "again; save from another event"
            )
        for listener, request in saves:
            self._checkpointer.save_requested(listener, request, self.save_checkpoint)

    def _transition(self, event: Event, listener: Any, request: Transition) -> None:
        """Apply a listener's :class:`~engine.events.Transition` to the state, then announce it
        (``on_state_transition``: the journal records it for replay)."""
        who = f"{type(listener).__name__}.{event.value} returned {request!r}"
        if self.stage != "fit" or event in _STEP_EVENTS or event is Event.ON_STATE_TRANSITION:
            raise RuntimeError(
                f"{who}: a state transition applies between the steps of a fit (not inside a "
                "step, outside fit, or in answer to another transition)"
            )
        state = self._state
        assert state is not None
        new = request.fn(state)
        if not isinstance(new, TrainState):
            raise TypeError(f"{who}: its function returned {type(new).__name__}, not a TrainState")
        counters = ("step", "epoch", "batch_idx", "micro_step", "seed")
        changed = [c for c in counters if getattr(new, c) != getattr(state, c)]
        if changed or new.params.keys() != state.params.keys():
            raise ValueError(
                f"{who}: a transition changes values, not the run's position or structure; its "
                f"function changed {changed or 'the parameters names'}"
            )
        # the new state owns the tensors from here (they may be the old one's)
        self._state = new.replace(_ownership=type(state._ownership)())
        state._consume(f"Transition {request.name or request.fn!r}")
        self._version += 1
        self._emit(Event.ON_STATE_TRANSITION, transition=request, cause=event)

    @contextlib.contextmanager
    def _run(
        self,
        stage: str,
        task: Task,
        state: TrainState,
        ckpt_path: str | os.PathLike[str] | None,
        datamodule: Any = None,
    ) -> Iterator[None]:
        if not isinstance(task, Task):
            raise TypeError(f"task must be an engine.Task (got {type(task).__name__})")
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be an engine.TrainState (got {type(state).__name__}); build one "
                "with task.init(model, seed=...)"
            )
        state.check_alive(f"Trainer.{stage}()")
        self.task, self._state, self.stage = task, state, stage
        self._log_step = None if stage == "fit" else state.step
        self._progress = self._progress._replace(should_stop=False)
        self.ckpt_path = None  # set by _restore when this run resumes from a checkpoint
        # listeners whose work is a side effect of one process (the bar, the summary, the
        # journal: `rank_zero_only = True`) run on rank 0 only; the others decide on every rank
        zero = self.is_global_zero
        self._emitter = Emitter(
            [x for x in self.callbacks if zero or not getattr(x, "rank_zero_only", False)]
        )
        self._checkpointer.writes = zero  # rank 0 writes the replicated state's checkpoints
        self._checkpointer.optimizer = task.tx  # named in checkpoints, and by a misfit resume
        self._checkpointer.rank, self._checkpointer.world_size = self.global_rank, self.world_size
        stack = contextlib.ExitStack()
        stack.callback(self._unshard)
        if stage == "fit":
            stack.enter_context(self._signals.catching())
        if self.deterministic and self.root_device.type == "cuda":
            # cuBLAS is deterministic only with a fixed workspace (set before its first use)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if self.deterministic is not None:
            previous = torch.are_deterministic_algorithms_enabled()
            previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
            torch.use_deterministic_algorithms(
                bool(self.deterministic), warn_only=self.deterministic == "warn"
            )
            stack.callback(torch.use_deterministic_algorithms, previous, warn_only=previous_warn)
        benchmark = self.benchmark
        if benchmark is None and self.deterministic:
            benchmark = False  # as Lightning: cudnn's autotuner picks kernels by timing
        if benchmark is not None:
            previous_bm = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = benchmark
            stack.callback(setattr, torch.backends.cudnn, "benchmark", previous_bm)
        profiler = self._profiler.run(stage, self.log_dir or self.default_root_dir)
        stack.enter_context(profiler)
        # asynchronous saves land before the run returns (and then delete what they replace);
        # the host copy they keep for the next snapshot (one state's worth of memory) is not
        # kept past the run
        stack.callback(checkpoint.release_buffers)
        stack.push(self._checkpointer.reap_at_exit)
        stack.callback(checkpoint.wait)
        with stack:
            self._emit(Event.SETUP)
            try:
                # the run's step transforms; the state placed and cast once, before a
                # checkpoint is restored into it (so it is read straight into that form)
                self._transforms = self._pipeline(fit=stage == "fit")
                self._state = self._transforms.prepare(state, task.tx)
                if ckpt_path is not None:
                    self._restore(ckpt_path, self._state)
                yield
                # the run's last check: an asynchronous save that failed fails the run
                self._checkpointer.reap(wait=True)
                # no rank returns (or exits) while rank 0 still writes the run's last files
                self._strategy.barrier()
            except BaseException as e:
                self._emit(Event.ON_EXCEPTION, exception=e)
                for lg in self.loggers if zero else ():
                    if callable(getattr(lg, "finalize", None)):
                        lg.finalize(
                            "failed" if not isinstance(e, KeyboardInterrupt) else "interrupted"
                        )
                raise
            if datamodule is not None:  # Lightning: the datamodule's, then the listeners'
                teardown_datamodule(datamodule, stage)
            self._emit(Event.TEARDOWN)
            for lg in self.loggers if zero else ():
                if callable(getattr(lg, "finalize", None)):
                    lg.finalize("success")

    # ------------------------------------------------------------------ fit

    def fit(
        self,
        task: Task,
        state: TrainState,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | None = None,
    ) -> TrainState:
        """Train ``state`` and return the final state.

        Args:
            task: the loss, optimizer and evaluation functions.
            state: the initial state (consumed: the steps donate its tensors).
            train_dataloaders: an iterable of batches (or a datamodule).
            val_dataloaders: one iterable or a list of them.
            datamodule: an object with ``train_dataloader()`` / ``val_dataloader()`` methods.
            ckpt_path: resume from a checkpoint: a path, ``"last"`` or ``"best"`` (of the
                ``ModelCheckpoint`` listener). ``state`` then gives only the structure (model and
                optimizer); every value comes from the checkpoint.

        With ``devices=N`` and no launcher of its own (torchrun, SLURM), the Trainer starts the
        other processes: ``strategy="ddp"`` runs the script again in each (they reach this
        call and join), ``"ddp_spawn"`` runs this call in new processes and returns rank 0's
        final state here.
        """
        return self._launching(
            "_fit_entry", task, state, train_dataloaders, val_dataloaders, datamodule, ckpt_path
        )

    def _launching(self, entry: str, *args: Any) -> Any:
        """Run the entry point ``entry`` on every process of the run: started by the
        strategy's launcher where it has one (then rank 0's result comes back), else here,
        in the process group the strategy joins."""
        launcher = None if self._inside_launch else self._strategy.launcher
        if launcher is None:
            with self._signals.catching(entry == "_fit_entry"):  # from before the rendezvous
                self._strategy.setup()
                return getattr(self, entry)(*args)
        return launcher.launch(_launched, self, entry, args)

    def _fit_entry(
        self,
        task: Task,
        state: TrainState,
        train_dataloaders: Any,
        val_dataloaders: Any,
        datamodule: Any,
        ckpt_path: str | None,
    ) -> TrainState:
        self._check_directories()  # before any work: a directory that cannot be written says so
        if datamodule is None and is_datamodule(train_dataloaders):
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None:  # Lightning's protocol: before its loaders are asked for
            setup_datamodule(datamodule, "fit", self)
        self._datamodule_first(ckpt_path, datamodule)
        # the order Lightning asks a datamodule for them: the validation loaders first when a
        # sanity check will run on them (before training starts), else the training loader
        val_first = self.num_sanity_val_steps > 0 and self.limit_val_batches and ckpt_path is None
        if val_first:
            val_loaders = self._prepare_loaders(
                "val", resolve_loaders("fit", val_dataloaders, datamodule, "val_dataloader")
            )
        train_loaders = self._prepare_loaders(
            "train", resolve_loaders("fit", train_dataloaders, datamodule, "train_dataloader")
        )
        if len(train_loaders) != 1:
            raise ValueError(
                f"Trainer.fit() takes exactly one training dataloader (got {len(train_loaders)})"
            )
        if not val_first:
            val_loaders = self._prepare_loaders(
                "val", resolve_loaders("fit", val_dataloaders, datamodule, "val_dataloader")
            )
        self._strategy.agree_loaders()  # every rank built them alike (one collective)
        self.train_dataloader, self.datamodule = train_loaders[0], datamodule
        if order_outside_the_state(train_loaders[0]):
            warnings.warn(
                "the training DataLoader shuffles with a RandomSampler that draws from the "
                "generator you gave it, which is outside the run's state: a run resumed from a "
                "checkpoint or replayed will see other batches than this one. Leave out "
                "generator= (the Trainer then seeds the order from the state's seed and the "
                "epoch), or pass sampler=engine.data.ShuffleSampler(dataset, seed=...)",
                stacklevel=2,
            )
        if randomness_outside_the_state(train_loaders[0]):
            warnings.warn(
                "the training DataLoader loads in worker processes that the Trainer cannot "
                "seed (a custom batch sampler, batch_size=None, an iterable dataset, a loader "
                "with state_dict() or a dataset without an instance dict): random numbers its "
                "dataset draws there (random augmentation) are outside the run's state, so a run "
                "resumed from a checkpoint or replayed may see other batches. Wrap the dataset "
                "in engine.data.SeededDataset(dataset, seed=...) to seed each sample",
                stacklevel=2,
            )
        # what the first epoch's loop would refuse (val_check_interval longer than the epoch)
        # is refused before the loggers make their run directories
        self._check_schedule(train_loaders[0], val_loaders)
        self._claim_directories()
        self._progress = self._progress._replace(  # a checkpoint, if given, restores these
            total_batch_idx=0,
            phase=Phase.BETWEEN,
            resume_phase=None,
            data_position=None,
            resume_data_state=None,
            reducer=None,
        )
        with self._run("fit", task, state, ckpt_path, datamodule):
            self._fit(task, train_loaders[0], val_loaders, datamodule)
        if state._ownership.consumed_by == "train_step":
            state._ownership.consumed_by = "Trainer.fit"  # its error says what to use instead
        assert self._state is not None
        if self._signals.came:  # after the last epoch's end: nothing to stop
            self._signals.report_late(self.global_step, self.current_epoch)
        return self._state

    def _pipeline(self, *, fit: bool = False) -> transforms.Pipeline:
        """The step transforms the flags describe (``engine.transforms.compose``): a custom
        loop that composes the same gets this Trainer's results bitwise."""
        clip = None
        if self.gradient_clip_val:
            clip = (
                clip_by_global_norm if self.gradient_clip_algorithm == "norm" else clip_by_value
            )(float(self.gradient_clip_val))
        placement = self._placement_now()
        if self.task is not None and self.task.transfer_batch_to_device is not None:
            placement = transforms.SingleDevice(
                placement.device, transfer=self.task.transfer_batch_to_device
            )
        return transforms.compose(
            placement=placement,
            precision=self._precision,
            observe=self._observer() if fit else None,
            strategy=self._strategy,
            privacy=self._privacy,
            clip=clip,
            accumulate=self.accumulate_grad_batches,
            compile=self.compile,
            detect_anomaly=self._anomaly or False,
        )

    def _observer(self) -> transforms.Observe | None:
        """Lightning's hooks inside the step, where it calls them (after the forward pass, after
        backward, before the optimizer step), when a listener has them; else none, and the
        step stays one call (one graph under ``compile``)."""
        wanted = [e for e in _STEP_EVENTS if self._emitter.wants(e)]
        if not wanted:
            return None
        if self.task is not None and self.task.step_fn is not None:
            names = ", ".join(e.value for e in wanted)
            raise ValueError(
                f"listeners of {names} run inside a step the Trainer builds from loss_fn; a "
                "custom step_fn is the user's own, so call such code from inside it"
            )
        if self.compile:
            names = ", ".join(e.value for e in wanted)
            raise ValueError(
                f"Trainer(compile=...): listeners of {names} run inside the step, which "
                "compile=True makes one graph; drop compile or those listeners"
            )

        def at(event: Event, **fields: Any) -> None:
            assert self._state is not None
            self._emit_batch(event, batch_idx=self._state.batch_idx, **fields)

        def named(grads: Any) -> Mapping[str, Any]:
            assert self._state is not None
            return MappingProxyType(dict(zip(self._state.params, grads, strict=True)))

        return transforms.Observe(
            before_backward=(lambda loss: at(Event.ON_BEFORE_BACKWARD, loss=loss.detach()))
            if Event.ON_BEFORE_BACKWARD in wanted
            else None,
            after_backward=(lambda g: at(Event.ON_AFTER_BACKWARD, grads=named(g)))
            if Event.ON_AFTER_BACKWARD in wanted
            else None,
            before_optimizer_step=(
                lambda g: at(Event.ON_BEFORE_OPTIMIZER_STEP, grads=MappingProxyType(dict(g)))
            )
            if Event.ON_BEFORE_OPTIMIZER_STEP in wanted
            else None,
        )

    def _fit(self, task: Task, train_loader: Any, val_loaders: list[Any], dm: Any) -> None:
        if task.step_fn is not None:
            _check_custom_step(self)
        pipeline = self._transforms
        assert self._state is not None
        # the run's length, where a schedule asked for it (total_steps="auto"): the task the
        # fit runs (and the journal records, for replay) has it resolved
        task = self.task = _resolve_total_steps(task, self)
        if task.tx is not None:
            warn_hyperparams_in_dtype(
                task.tx,
                self._state.opt_state,
                self._state.params,
                f"the parameters' dtype under precision={self.precision!r}",
            )
        step = self._profiler.timed("train_step", task.train_step(transforms=pipeline))
        evaluate = (  # built only when there is something to validate (fit has no loaders
            # to add later), so a task without an evaluation function fits without one
            self._profiler.timed(
                "validation_step",
                task.eval_step(transforms=pipeline, inference_mode=self.inference_mode),
            )
            if val_loaders
            else None
        )
        self.num_val_batches = [
            limit_batches("val", count_batches(dl), self.limit_val_batches) for dl in val_loaders
        ]
        enable_validation = sum(self.num_val_batches) > 0
        if task.hparams:
            checkpoint._hparams_doc(task.hparams)  # a value checkpoints cannot hold: named now
            autolog = self.config.enable_autolog_hparams
            for lg in self.loggers if self.is_global_zero and autolog else ():
                lg.log_hyperparams(dict(task.hparams))
        self._emit(Event.ON_FIT_START)

        eval_run = None if evaluate is None else _EvalRun(self, evaluate)
        self._val_loaded_at = None
        sanity = [min(self.num_sanity_val_steps, n) for n in self.num_val_batches]
        if eval_run is not None and enable_validation and sum(sanity) > 0:
            self.sanity_checking = True  # the listeners' view says so, around the events too
            self._state, self._progress = eval_loops.sanity_check(
                eval_run, self._state, self._progress, val_loaders, sanity
            )
            self.sanity_checking = False
            self._val_loaded_at = self.current_epoch

        progress = self._progress
        if progress.reducer is None:  # else restored by a resume
            progress = progress._replace(reducer=task.reducer())
        run = _FitRun(self, step, eval_run, val_loaders, dm)
        self._state, self._progress = fit_loop(
            self.config,
            run,
            self._state,
            progress,
            train_loader=train_loader,
            datamodule=dm,
            enable_validation=enable_validation,
        )

    def _reload_val_loaders(self, val_loaders: list[Any], dm: Any) -> list[Any]:
        """Lightning's reload_dataloaders_every_n_epochs for validation: the loaders are fetched
        again when a validation starts at least n epochs after they were last fetched (the
        loaders fit() resolved count as fetched at their first use)."""
        n, epoch = self.reload_dataloaders_every_n_epochs, self.current_epoch
        if self._val_loaded_at is None:
            self._val_loaded_at = epoch
        elif n and dm is not None and epoch - self._val_loaded_at >= n:
            val_loaders = self._prepare_loaders(
                "val", resolve_loaders("fit", None, dm, "val_dataloader")
            )
            self._strategy.agree_loaders()
            self.num_val_batches = [
                limit_batches("val", count_batches(dl), self.limit_val_batches)
                for dl in val_loaders
            ]
            self._val_loaded_at = epoch
        return val_loaders

    # ------------------------------------------------------------------ metrics

    def _update_prog_bar(self, metrics: Mapping[str, float]) -> None:
        assert self.task is not None
        shown = self.task.shown
        for k, v in metrics.items():
            if k.endswith("_epoch") and (k.startswith("train/") or k.startswith("train_")):
                continue  # the bar shows the latest step values; epoch means go to the loggers
            name = k.split("/dataloader_idx_")[0]
            if name.endswith("_step"):
                name = name[: -len("_step")]
            if name in shown or name.split("/", 1)[-1] in shown:
                self.progress_bar_metrics[k] = v
        self._version += 1

    # ------------------------------------------------------------------ loaders

    def _prepare_loaders(self, stage: str, loaders: list[Any]) -> list[Any]:
        """The loaders of ``stage`` (``"train"``, ``"val"``, ``"test"``, ``"predict"``) as the
        run reads them: every resolved loader list passes through here before its batches are
        counted or read (fit's, the validation and training loaders
        ``reload_dataloaders_every_n_epochs`` fetches, validate's, test's and predict's). The
        strategy's seam (a data-parallel one gives each process its shard, in place: put back
        when the run ends, and measures it for ``strategy.agree_loaders()``, which each caller
        makes once its stages' loaders are ready); in one process, or with
        ``use_distributed_sampler=False``, the loaders as given."""
        if self._strategy.world_size == 1 or not self.use_distributed_sampler:
            return loaders
        out = [self._strategy.shard(dl, stage) for dl in loaders]
        self._sharded.extend(out)
        return out

    def _unshard(self) -> None:
        for loader in self._sharded:
            restore_loader(loader)
        self._sharded.clear()

    # ------------------------------------------------------------------ evaluation entry points

    def validate(
        self,
        task: Task,
        state: TrainState,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; returns one dict of metrics per dataloader."""
        return self._launching(
            "_eval_entry",
            "validate",
            "validation",
            task,
            state,
            dataloaders,
            datamodule,
            ckpt_path,
            verbose,
        )

    def test(
        self,
        task: Task,
        state: TrainState,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns one dict of metrics per dataloader."""
        return self._launching(
            "_eval_entry", "test", "test", task, state, dataloaders, datamodule, ckpt_path, verbose
        )

    def _eval_entry(
        self,
        stage: str,
        kind: str,
        task: Task,
        state: TrainState,
        dataloaders: Any,
        datamodule: Any,
        ckpt_path: str | None,
        verbose: bool,
    ) -> list[dict[str, float]]:
        method = "val_dataloader" if kind == "validation" else "test_dataloader"
        if datamodule is None and is_datamodule(dataloaders):
            datamodule, dataloaders = dataloaders, None
        if datamodule is not None:
            setup_datamodule(datamodule, stage, self)
        self.datamodule = datamodule
        self._datamodule_first(ckpt_path, datamodule)
        loaders = self._prepare_loaders(
            "val" if kind == "validation" else "test",
            resolve_loaders(stage, dataloaders, datamodule, method),
        )
        self._strategy.agree_loaders()
        if not loaders:
            raise ValueError(
                f"Trainer.{stage}() needs dataloaders= or a datamodule with {method}()"
            )
        limit = self.limit_val_batches if kind == "validation" else self.limit_test_batches
        limits = [limit_batches(kind, count_batches(dl), limit) for dl in loaders]
        if kind == "validation":
            self.num_val_batches = limits
        else:
            self.num_test_batches = limits
        with self._run(stage, task, state, ckpt_path, datamodule):
            step = self._profiler.timed(
                f"{kind}_step",
                (task.eval_step if kind == "validation" else task.test_step)(
                    transforms=self._transforms, inference_mode=self.inference_mode
                ),
            )
            assert self._state is not None  # placed by _run
            self._state, self._progress, results = eval_loops.evaluate(
                kind, _EvalRun(self, step), self._state, self._progress, loaders, limits, log=True
            )
        if verbose and not self.barebones:
            _print_results(stage, results)
        return results

    def predict(
        self,
        task: Task,
        state: TrainState,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
    ) -> list[Any] | None:
        """Run prediction; returns the outputs (a list per dataloader when there are several:
        under several processes, this rank's shard's)."""
        return self._launching(
            "_predict_entry", task, state, dataloaders, datamodule, return_predictions, ckpt_path
        )

    def _predict_entry(
        self,
        task: Task,
        state: TrainState,
        dataloaders: Any,
        datamodule: Any,
        return_predictions: bool | None,
        ckpt_path: str | None,
    ) -> list[Any] | None:
        if datamodule is None and is_datamodule(dataloaders):
            datamodule, dataloaders = dataloaders, None
        if datamodule is not None:
            setup_datamodule(datamodule, "predict", self)
        self.datamodule = datamodule
        self._datamodule_first(ckpt_path, datamodule)
        loaders = self._prepare_loaders(
            "predict", resolve_loaders("predict", dataloaders, datamodule, "predict_dataloader")
        )
        self._strategy.agree_loaders()
        if not loaders:
            raise ValueError(
                "Trainer.predict() needs dataloaders= or a datamodule with predict_dataloader()"
            )
        limits = [
            limit_batches("predict", count_batches(dl), self.limit_predict_batches)
            for dl in loaders
        ]
        self.num_predict_batches = limits
        keep = return_predictions is not False
        with self._run("predict", task, state, ckpt_path, datamodule):
            step = self._profiler.timed(
                "predict_step",
                task.predict_step(transforms=self._transforms, inference_mode=self.inference_mode),
            )
            assert self._state is not None  # placed by _run
            self._state, self._progress, outputs = eval_loops.predict(
                _EvalRun(self, step), self._state, self._progress, loaders, limits, keep=keep
            )
        if not keep:
            return None
        return outputs[0] if len(outputs) == 1 else outputs


def _launched(trainer: Trainer, entry: str, args: tuple[Any, ...]) -> Any:
    """An entry point in a process a launcher started (or in rank 0 of the launching one):
    it joins the run's process group and runs, without launching again."""
    trainer._inside_launch = True
    try:
        with trainer._signals.catching(entry == "_fit_entry"):  # from before the rendezvous
            trainer._strategy.setup()
            out = getattr(trainer, entry)(*args)
        if isinstance(out, TrainState) and os.environ.get(LAUNCHED_BY_VAR, "").startswith("spawn:"):
            # the caller of a spawned run has no process group to hold shards in: every rank
            # gathers, and rank 0's whole state goes back
            from engine.parallel.fsdp import full_state

            out = full_state(out)
        return out
    finally:
        trainer._inside_launch = False


class _Services:
    """What the Trainer's services to its loops share: each call records the state and
    progress the loop hands over (``trainer._state`` / ``trainer._progress``: the listeners'
    view, ``trainer.state`` and checkpoints read them) and returns them as the listeners'
    requests left them."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.move = trainer._transforms.move

    def emit(
        self, event: Event, state: TrainState, progress: Progress, **fields: Any
    ) -> tuple[TrainState, Progress]:
        return self._through(self.trainer._emit, event, state, progress, fields)

    def emit_batch(
        self, event: Event, state: TrainState, progress: Progress, **fields: Any
    ) -> tuple[TrainState, Progress]:
        if not self.trainer._emitter.wants(event):  # the hot path: nobody listens
            return state, progress
        return self._through(self.trainer._emit_batch, event, state, progress, fields)

    def _through(
        self, emit: Any, event: Event, state: TrainState, progress: Progress, fields: dict
    ) -> tuple[TrainState, Progress]:
        """Record what the loop handed over, emit, and hand back what the requests left."""
        t = self.trainer
        t._state, t._progress = state, progress
        emit(event, **fields)
        return t._state, t._progress


class _EvalRun(_Services):
    """The Trainer's services to one evaluation loop (:class:`engine.loop.evaluate.EvalServices`),
    around its evaluation or prediction ``step``."""

    def __init__(self, trainer: Trainer, step: Any) -> None:
        super().__init__(trainer)
        self._step = step

    def step(self, state: TrainState, batch: Any) -> Any:
        return self._step(state, batch)

    def reducer(self) -> Any:
        assert self.trainer.task is not None
        return self.trainer.task.reducer()

    def compute(self, reducer: Any) -> dict[str, float]:
        # every evaluation epoch's metrics, computed here: over every rank's shard (one
        # process's are the run's)
        return reducer.compute(self.trainer._strategy.sync, sync_all=True)

    def log(self, state: TrainState, progress: Progress, metrics: dict[str, float]) -> None:
        t = self.trainer
        t._state, t._progress = state, progress  # the row's step is the state's
        t.log_metrics(metrics)
        t._update_prog_bar(metrics)


class _FitRun(_Services):
    """The Trainer's services to one fit loop (:class:`engine.loop.fit.FitServices`); its
    validations run :func:`engine.loop.evaluate.evaluate` through ``eval_run``."""

    def __init__(
        self,
        trainer: Trainer,
        step: Any,
        eval_run: _EvalRun | None,
        val_loaders: list[Any],
        dm: Any,
    ) -> None:
        super().__init__(trainer)
        self.train_step, self.eval_run = step, eval_run
        self.val_loaders, self.dm = val_loaders, dm
        self.reported_nonfinite = False  # a non-finite training loss is reported once a fit
        # one process has nothing to agree with: its own stop and signal are the run's
        self.several = trainer._strategy.world_size > 1

    def reload_train_loader(self, state: TrainState, progress: Progress) -> Any:
        # the datamodule's train_dataloader() again (reload_dataloaders_every_n_epochs)
        loaders = self.trainer._prepare_loaders(
            "train", resolve_loaders("fit", None, self.dm, "train_dataloader")
        )
        self.trainer._strategy.agree_loaders()
        return loaders[0]

    def step(
        self, state: TrainState, progress: Progress, batch: Any, *, flush: bool
    ) -> tuple[TrainState, Progress, Mapping[str, torch.Tensor]]:
        t = self.trainer
        t._state, t._progress = state, progress  # the step's own events see the state it takes
        try:
            t._state, metrics = self.train_step(state, batch, flush=flush)
        except RuntimeError as e:
            if "Inference tensors" not in str(e):
                raise
            raise RuntimeError(
                f"{e}\nThe batch holds inference tensors: tensors made under "
                "torch.inference_mode(), such as the outputs of Trainer.predict (which predicts "
                "under it by default). Train on `t.clone()` of them, or predict with "
                "Trainer(inference_mode=False), whose outputs are ordinary tensors"
            ) from e
        return t._state, t._progress, metrics

    def log(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        t = self.trainer
        t._state = state
        # a training step's row, or the epoch's: Lightning logs both at the step before the
        # (last) batch's optimizer step, as the batch's validation rows
        t._log_row(metrics, max(state.step - 1, 0), run_row=True)
        t._update_prog_bar(metrics)
        reducer = t._progress.reducer
        loss = getattr(reducer, "host_loss", None)  # read with the logged values: no extra sync
        if loss is not None and not math.isfinite(loss) and not self.reported_nonfinite:
            self.reported_nonfinite = True  # once a fit: every later step is likely as bad
            what = "epoch's mean loss" if reducer.host_loss_of_epoch else "loss"
            warnings.warn(
                f"the training {what} is {loss} at global_step {state.step} (epoch "
                f"{state.epoch}). The loss is read on the host only to log it (every "
                f"log_every_n_steps={t.log_every_n_steps} steps), so the first non-finite step "
                "may be earlier: find it with Trainer(detect_anomaly=True) or `engine replay`; "
                "a lower learning rate, gradient_clip_val or a look at the data may help",
                RuntimeWarning,
                stacklevel=2,
            )

    def validate(self, state: TrainState, progress: Progress) -> tuple[TrainState, Progress]:
        t = self.trainer
        t._state, t._progress = state, progress
        self.val_loaders = t._reload_val_loaders(self.val_loaders, self.dm)
        assert self.eval_run is not None  # fit validates only with validation loaders
        state, progress, _ = eval_loops.evaluate(
            "validation",
            self.eval_run,
            state,
            progress,
            self.val_loaders,
            t.num_val_batches,
            log=True,
        )
        return state, progress

    def epoch_metrics(self, reducer: Any) -> dict[str, float]:
        # the training epoch's reductions; those logged with sync_dist over every rank's
        return reducer.epoch_logged(self.trainer._strategy.sync)

    def agree(self, state: TrainState, progress: Progress) -> Progress:
        t = self.trainer
        flags = (progress.should_stop, t._signals.offer())  # read once, before the collective
        stop, signalled = t._strategy.agree(flags) if self.several else flags
        t._signals.settle(signalled)  # every rank acts on what the ranks agreed, nothing later
        if stop != progress.should_stop:
            progress = progress._replace(should_stop=stop)
            t._progress = progress
            t._version += 1
        return progress

    def check(self, state: TrainState, progress: Progress) -> Progress:
        progress = self.agree(state, progress)
        t = self.trainer
        if t._signals.agreed is not None:
            t._state, t._progress = state, progress
            t._signals.stop(state, t.default_root_dir, t.save_checkpoint, t._strategy.barrier)
        return progress


def _datamodule_state(datamodule: Any) -> Mapping[str, Any] | None:
    """A datamodule's ``state_dict()`` for the checkpoint (Lightning saves it too), if it has
    one and it is not empty."""
    get = getattr(datamodule, "state_dict", None)
    state = get() if callable(get) else None
    return state or None


def _resolve_total_steps(task: Task, trainer: Trainer) -> Task:
    """``task`` with its ``total_steps="auto"`` schedules (:class:`engine.optim.AutoLength`)
    resolved to ``trainer.estimated_stepping_batches``; ``task`` itself without any."""
    tx = task.tx
    if (tx is None or not optim.has_deferred(tx)) and not isinstance(task.lr, optim.AutoLength):
        return task
    total = trainer.estimated_stepping_batches
    if isinstance(total, float) or total < 1:
        raise ValueError(
            f"total_steps='auto': the run's length is unknown "
            f"(trainer.estimated_stepping_batches = {total}, with max_epochs="
            f"{trainer.max_epochs}, max_steps={trainer.max_steps} and "
            f"{trainer.num_training_batches or 'unsized'} training batches); set max_steps, or "
            "max_epochs with a training loader that has a length, or pass total_steps=N"
        )
    lr = task.lr.resolve_total_steps(total) if isinstance(task.lr, optim.AutoLength) else task.lr
    return attrs.evolve(
        task, tx=None if tx is None else optim.resolve_total_steps(tx, total), lr=lr
    )


def _check_custom_step(trainer: Trainer) -> None:
    """The flags that act inside a step built from ``loss_fn`` cannot reach into a custom one."""
    for flag, value, on in (
        (
            "accumulate_grad_batches",
            trainer.accumulate_grad_batches,
            trainer.accumulate_grad_batches > 1,
        ),
        ("gradient_clip_val", trainer.gradient_clip_val, bool(trainer.gradient_clip_val)),
        ("compile", trainer.compile, bool(trainer.compile)),
    ):
        if on:
            raise ValueError(
                f"Trainer({flag}={value!r}) acts inside a train step built from loss_fn; the "
                "task's step_fn is its own step: accumulate, clip (optim.clip_by_global_norm in "
                "its optimizers) or compile inside it, and leave the flag at its default"
            )
    if trainer._privacy is not None:
        raise ValueError(
            f"Trainer(plugins=[{trainer._privacy!r}]) computes the gradients of a train step "
            "built from loss_fn; the task's step_fn is its own step: take per-example "
            "gradients inside it (engine.per_example_grads, engine.privacy.clip_and_sum and "
            "gaussian_noise), or give the task a loss_fn"
        )
    precision = trainer._precision
    if precision.overrides("wrap_grad"):
        raise ValueError(
            f"Trainer(precision={trainer.precision!r}) autocasts the forward pass of a train step "
            "built from loss_fn; the task's step_fn is its own step: enter torch.autocast "
            "inside it (and scale its float16 loss), or use a true precision such as "
            "'bf16-true', which casts the state and the batches the step_fn receives"
        )


_STEP_EVENTS = (Event.ON_BEFORE_BACKWARD, Event.ON_AFTER_BACKWARD, Event.ON_BEFORE_OPTIMIZER_STEP)


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    for i, r in enumerate(results):
        head = f"{stage} results" + (f" (dataloader {i})" if len(results) > 1 else "")
        print(head)
        for k, v in r.items():
            print(f"  {k:32s} {v:.6g}")
