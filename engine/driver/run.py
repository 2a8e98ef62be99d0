"""The one owner of a call's mutable record: a :class:`Run`.

One ``fit`` / ``validate`` / ``test`` / ``predict`` call makes one Run, which holds what changes
during it: the state and progress as the loop last handed them over, the logged, callback and
progress-bar metrics, the listeners' view (rebuilt only when something in it changed), the
emitter, the checkpointer, and the world's facts and collectives. The loops reach it through
their services (:mod:`engine.driver.services`, over :meth:`Run.emit` / :meth:`Run.emit_batch`):
each call hands over the loop's values and gets back the ones the listeners' requests left. An
event goes loop → Run → listeners → Run (requests carried out: stops, logs, transitions, saves)
→ loop. The Trainer keeps the last Run and reads it; nothing else writes it.

What Lightning's Trainer keeps between calls (the metrics, the last state, the batch counts, the
datamodule) a Run takes over from the previous one (``previous``).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any

from engine import transforms
from engine.data import (
    count_batches,
    limit_batches,
    resolve_loaders,
    restore_loader,
    shard_loader,
)
from engine.driver._signals import SignalCatcher
from engine.driver.assembly import Assembly, is_a
from engine.driver.checkpointer import Checkpointer, RunRecord
from engine.events import (
    Emitter,
    Event,
    EventRecord,
    Log,
    RunView,
    Save,
    Search,
    Stop,
    Transition,
    _collect,
    _moved,
)
from engine.parallel.positions import position_unit
from engine.plan.config import LoopConfig
from engine.plan.progress import Phase, Progress
from engine.state import TrainState

__all__ = ["Run"]

#: the events fired inside a step (transforms.Observe): no transition answers them
STEP_EVENTS = (Event.ON_BEFORE_BACKWARD, Event.ON_AFTER_BACKWARD, Event.ON_BEFORE_OPTIMIZER_STEP)


DISTRIBUTED, LOADER = "distributed", "loader"  # a fit's training orders (Run.train_order)


class Run:
    """What one call of a Trainer changes, and the only code that changes it."""

    def __init__(
        self,
        config: LoopConfig,
        assembly: Assembly,
        loggers: Sequence[Any],
        callbacks: Sequence[Any],
        *,
        stage: str | None = None,
        previous: Run | None = None,
        signals: SignalCatcher | None = None,
        facade: Any = None,
    ) -> None:
        self.config, self.assembly = config, assembly
        self.strategy = assembly.strategy
        self.loggers, self.callbacks = list(loggers), list(callbacks)
        # the Trainer, handed only to a LightningDataModule as its ``trainer`` (Lightning's
        # protocol: its code reads the flags there); nothing of the driver reads it. Held weakly:
        # the Trainer holds its last Run, and a cycle would keep the run's loaders (and their
        # worker processes) alive until a garbage collection, long after the Trainer is gone
        self._facade = None if facade is None else weakref.ref(facade)
        self.stage = stage
        self.sanity_checking = False
        #: SIGTERM / SIGINT received during the call (a fit stops on them)
        self.signals = signals if signals is not None else SignalCatcher()
        p = previous
        # what Lightning's Trainer keeps from one call to the next
        self.task: Any = p.task if p else None
        self.state: TrainState | None = p.state if p else None
        #: the task and final state of this Trainer's last fit (validate/test/predict called
        #: without them use these, as Lightning's use the fitted model)
        self.fitted: tuple[Any, TrainState] | None = p.fitted if p else None
        self.progress: Progress = p.progress if p else Progress()
        self.callback_metrics: dict[str, float] = p.callback_metrics if p else {}
        self.logged_metrics: dict[str, float] = p.logged_metrics if p else {}
        self.progress_bar_metrics: dict[str, float] = p.progress_bar_metrics if p else {}
        self.num_val_batches: list[float] = p.num_val_batches if p else []
        self.num_test_batches: list[float] = p.num_test_batches if p else []
        self.num_predict_batches: list[float] = p.num_predict_batches if p else []
        self.train_dataloader: Any = p.train_dataloader if p else None
        self.datamodule: Any = p.datamodule if p else None
        self.ckpt_path: str | None = p.ckpt_path if p else None
        self.pipeline: transforms.Pipeline = p.pipeline if p else transforms.compose()
        self.emitter: Emitter = p.emitter if p else Emitter(())
        # checkpoints: written, resolved, restored; handed this record on each call
        self.checkpointer = Checkpointer(
            self.callbacks, self.loggers, config.default_root_dir, assembly.checkpoint_io
        )
        self.log_step: int | None = None  # the step an evaluation's rows are logged at
        self.log_epoch: int | None = None  # ... and the epoch they carry
        self._eval_seen: dict[tuple[str, int], int] = {}  # evaluation batches logged per step
        self.val_loaded_at: int | None = None  # the epoch the val loaders were last fetched
        self._resolved: tuple[Any, Any] | None = None  # ckpt_path resolved early
        self._sharded: list[Any] = []  # loaders this run sharded, put back when it ends
        #: the training order of this fit (:meth:`prepare_loaders`): ``"distributed"`` or
        #: ``"loader"``; a resumed fit continues its checkpoint's (:meth:`use_train_order`)
        self.train_order: str | None = None
        # bumped whenever the metrics or should_stop change: the listeners' view is rebuilt then
        self._version = 0
        self._snapshots_of = -1  # the version of the metrics' snapshots below
        self._snapshots: tuple[Mapping[str, float], ...] = ()
        self._view: RunView | None = None  # the latest view of the run
        self._view_state: TrainState | None = None  # ... the state it was built for
        self._view_version = -1  # ... and the version
        # trial fits on this run's flags, for a listener's Search (set when a fit begins)
        self.trials: Any = None
        self.searched = False  # a Search ran in this call (the fit fetches its loaders again)

    @property
    def facade(self) -> Any:
        """The Trainer this run is a call of (``None`` once it is gone)."""
        return None if self._facade is None else self._facade()

    def __getstate__(self) -> dict[str, Any]:
        # a launcher pickles the Trainer, and with it its last Run: not the weak reference
        return {**self.__dict__, "_facade": None}

    # ------------------------------------------------------------------ the run's start

    def begin(self, task: Any, state: TrainState) -> None:
        """The call's task and initial state; the listeners that run on this rank."""
        self.task, self.state = task, state
        self.log_step = None if self.stage == "fit" else state.step
        self.log_epoch = None if self.stage == "fit" else state.epoch
        self.progress = self.progress._replace(should_stop=False)
        self.ckpt_path = None  # set by restore when this run resumes from a checkpoint
        # listeners whose work is a side effect of one process (the bar, the summary, the
        # journal: `rank_zero_only = True`) run on rank 0 only; the others decide on every rank
        zero = self.is_global_zero
        self.emitter = Emitter(
            [x for x in self.callbacks if zero or not getattr(x, "rank_zero_only", False)]
        )
        saver = self.checkpointer
        saver.writes = zero  # rank 0 writes the replicated state's checkpoints
        saver.optimizer = task.tx  # named in checkpoints, and by a misfit resume
        saver.rank, saver.world_size = self.global_rank, self.world_size

    def begin_fit(self, task: Any, trials: Any = None) -> None:
        """The task the fit runs: the call's, with its schedules' length resolved
        (``total_steps="auto"``); and the trial fits a listener's
        :class:`~engine.events.Search` runs."""
        self.task, self.trials = task, trials

    def evaluating(self, datamodule: Any) -> None:
        """The datamodule an evaluation or prediction was given (``trainer.datamodule``)."""
        self.datamodule = datamodule

    def use(self, pipeline: transforms.Pipeline, state: TrainState) -> None:
        """The run's step transforms, and the state they prepared (placed, cast, sharded)."""
        self.pipeline, self.state = pipeline, state

    def fitting(self, train_loader: Any, datamodule: Any) -> None:
        """What a fit trains on (Lightning's ``trainer.train_dataloader`` / ``datamodule``),
        and its loop position cleared (a checkpoint, if given, restores it)."""
        self.train_dataloader, self.datamodule = train_loader, datamodule
        self.progress = self.progress._replace(
            total_batch_idx=0,
            phase=Phase.BETWEEN,
            resume_phase=None,
            data_position=None,
            resume_data_state=None,
            reducer=None,
        )

    def refetched(self, train_loader: Any) -> None:
        """The training loader fetched again after a search at the fit's start."""
        self.train_dataloader = train_loader
        self._version += 1

    def resolved_early(self, resolved: tuple[Any, Any] | None) -> tuple[Any, Any] | None:
        """Keep ``(ckpt_path, path)``, a checkpoint resolved before the run's context (for a
        datamodule's state, Lightning's order), for the restore to use; returns what was kept
        before."""
        before, self._resolved = self._resolved, resolved
        return before

    def sanity_check_starts(self) -> None:
        """The fit's sanity check runs: the listeners' view says so, around its events too."""
        self.sanity_checking = True

    def sanity_check_ended(self, state: TrainState, progress: Progress) -> None:
        """The sanity check's state and progress; its loaders count as fetched now."""
        self.sanity_checking = False
        self.hand_over(state, progress)
        self.val_loaders_fetched(self.current_epoch)

    def val_loaders_fetched(self, epoch: int | None) -> None:
        """The epoch the validation loaders were last fetched (``None``: not yet), which
        ``reload_dataloaders_every_n_epochs`` counts from."""
        self.val_loaded_at = epoch

    def resumed(
        self,
        path: str,
        state: TrainState,
        progress: Progress | None = None,
        metrics: Mapping[str, dict[str, float]] | None = None,
    ) -> None:
        """The state (and, for a fit, the progress and the metrics its listeners had seen) a
        checkpoint restored."""
        self.state, self.ckpt_path = state, path
        if progress is not None:
            self.progress = progress
        for name, values in (metrics or {}).items():
            getattr(self, name).clear()
            getattr(self, name).update(values)
        self._version += 1

    # ------------------------------------------------------------------ the world

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (one collective; ``obj`` itself in one process)."""
        return self.strategy.broadcast(obj) if self.world_size > 1 else obj

    def barrier(self) -> None:
        self.strategy.barrier()

    def prepare_loaders(self, stage: str, loaders: list[Any]) -> list[Any]:
        """The loaders of ``stage`` (``"train"``, ``"val"``, ``"test"``, ``"predict"``) as the
        run reads them: every resolved loader list passes through here before its batches are
        counted or read. The strategy's seam (a data-parallel one gives each process its shard,
        in place: put back when the run ends, and measured for ``strategy.agree_loaders()``,
        which each caller makes once its stages' loaders are ready); in one process, or with
        ``use_distributed_sampler=False``, the loaders as given."""
        dealt = self.config.use_distributed_sampler
        if stage == "train" and self.train_order is None:
            self.train_order = DISTRIBUTED if self.world_size > 1 and dealt else LOADER
        if self.world_size == 1 or not dealt:
            if stage == "train" and dealt and self.train_order == DISTRIBUTED:
                return [self._in_train_order(dl) for dl in loaders]
            return loaders
        out = [self.strategy.shard(dl, stage) for dl in loaders]
        self._sharded.extend(out)
        if stage == "train" and self.train_order == LOADER:
            out = [self._in_train_order(dl) for dl in out]
        return out

    def use_train_order(self, order: str) -> None:
        """Continue the training order a checkpoint's fit had (``"distributed"``: Lightning's
        ``DistributedSampler(shuffle=True)`` order, which a data-parallel fit deals; ``"loader"``:
        the loader's own, a one-process fit's), whatever this run's world size: a fit resumed on
        another world size sees each sample of the interrupted epoch once, and the epochs after
        in the same order as the interrupted run would have."""
        if order not in (DISTRIBUTED, LOADER) or order == self.train_order:
            return
        self.train_order = order
        if self.train_dataloader is not None and self.config.use_distributed_sampler:
            self._in_train_order(self.train_dataloader)

    def _in_train_order(self, loader: Any) -> Any:
        """``loader`` sharded over this run's ranks in :attr:`train_order` (one rank too)."""
        shuffle = self.train_order == DISTRIBUTED
        dealt = shard_loader(loader, self.global_rank, self.world_size, pad=True, shuffle=shuffle)
        if dealt and not any(x is loader for x in self._sharded):
            self._sharded.append(loader)
        return loader

    def unshard(self) -> None:
        for loader in self._sharded:
            restore_loader(loader)
        self._sharded.clear()

    def reload_val_loaders(self, val_loaders: list[Any], dm: Any) -> list[Any]:
        """Lightning's reload_dataloaders_every_n_epochs for validation: the loaders are fetched
        again when a validation starts at least n epochs after they were last fetched (the
        loaders fit() resolved count as fetched at their first use)."""
        n, epoch = self.config.reload_dataloaders_every_n_epochs, self.current_epoch
        if self.val_loaded_at is None:
            self.val_loaded_at = epoch
        elif n and dm is not None and epoch - self.val_loaded_at >= n:
            val_loaders = self.prepare_loaders(
                "val", resolve_loaders("fit", None, dm, "val_dataloader")
            )
            self.strategy.agree_loaders()
            self.count_batches("val", val_loaders)
            self.val_loaded_at = epoch
        return val_loaders

    def count_batches(self, kind: str, loaders: Sequence[Any]) -> list[float]:
        """The batches of each of ``kind``'s loaders after its ``limit_*_batches``, recorded
        as ``num_val_batches`` / ``num_test_batches`` / ``num_predict_batches``."""
        limit = getattr(self.config, f"limit_{'val' if kind == 'validation' else kind}_batches")
        counts = [limit_batches(kind, count_batches(dl), limit) for dl in loaders]
        name = {"validation": "val", "val": "val"}.get(kind, kind)
        setattr(self, f"num_{name}_batches", counts)
        return counts

    # ------------------------------------------------------------------ where the run is

    @property
    def global_step(self) -> int:
        return self.state.step if self.state is not None else 0

    @property
    def current_epoch(self) -> int:
        return self.state.epoch if self.state is not None else 0

    @property
    def log_dir(self) -> str | None:
        """The first logger's directory, else ``default_root_dir``."""
        for lg in self.loggers:
            d = getattr(lg, "log_dir", None)
            if d:
                return str(d)
        return self.config.default_root_dir

    @property
    def run_dir(self) -> str | None:
        """The journal's run directory, or ``None`` before a fit or without a journal."""
        for listener in self.callbacks:
            if is_a(listener, "Journal") and listener.dirpath is not None:
                return str(listener.dirpath)
        return None

    # ------------------------------------------------------------------ the loops' services

    def emit(
        self, event: Event, state: TrainState, progress: Progress, **fields: Any
    ) -> tuple[TrainState, Progress]:
        """``event`` between batches, with the state and progress the loop hands over; returns
        them as the listeners' requests left them."""
        self.state, self.progress = state, progress
        self.announce(event, **fields)
        return self.state, self.progress

    def emit_batch(
        self, event: Event, state: TrainState, progress: Progress, **fields: Any
    ) -> tuple[TrainState, Progress]:
        """A batch event (the hot path: nothing is recorded when nobody listens)."""
        if not self.emitter.wants(event):
            return state, progress
        self.state, self.progress = state, progress
        self.announce_batch(event, **fields)
        return self.state, self.progress

    def fit_ended(self) -> None:
        """Record the fit's task and final state: the later calls' defaults."""
        assert self.state is not None
        self.fitted = (self.task, self.state)

    def hand_over(self, state: TrainState, progress: Progress | None = None) -> None:
        """Record the loop's current values (what a step's own events and a save read)."""
        self.state = state
        if progress is not None:
            self.progress = progress

    def agreed_stop(self, stop: bool) -> Progress:
        """The progress with ``should_stop`` as every rank agreed it."""
        if stop != self.progress.should_stop:
            self.progress = self.progress._replace(should_stop=stop)
            self._version += 1
        return self.progress

    # ------------------------------------------------------------------ events

    def announce(self, event: Event, **fields: Any) -> None:
        """Emit an event between batches (the view of the run is built anew)."""
        if self.emitter.wants(event):
            self._dispatch(event, self._view_now(), fields)

    def announce_batch(self, event: Event, **fields: Any) -> None:
        """Emit a batch event (the view is reused within a batch)."""
        if self.emitter.wants(event):
            self._dispatch(event, self._batch_view(), fields)

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
        strategy = self.strategy
        view = RunView(
            stage=self.stage or "",
            sanity_checking=self.sanity_checking,
            global_step=self.global_step,
            current_epoch=self.current_epoch,
            num_training_batches=self.progress.num_training_batches,
            num_val_batches=self.num_val_batches,
            num_test_batches=self.num_test_batches,
            num_predict_batches=self.num_predict_batches,
            should_stop=self.progress.should_stop,
            config=self.config,
            callback_metrics=callback,
            logged_metrics=logged,
            progress_bar_metrics=shown,
            default_root_dir=self.config.default_root_dir,
            log_dir=self.log_dir,
            run_dir=self.run_dir,
            task=self.task,
            ckpt_path=self.ckpt_path,
            loggers=self.loggers,
            train_dataloader=self.train_dataloader,
            datamodule=self.datamodule,
            world_size=strategy.world_size,
            global_rank=strategy.global_rank,
            local_rank=strategy.local_rank,
            node_rank=strategy.node_rank,
        )
        self._view, self._view_state, self._view_version = view, self.state, self._version
        return view

    def _batch_view(self) -> RunView:
        """The view for a batch event: the last one, moved to the current counters when the
        state changed (once a batch), built anew only when the metrics or should_stop did."""
        view = self._view
        if view is None or self._view_version != self._version:
            return self._view_now()
        state = self.state
        if state is not self._view_state and state is not None:
            view = self._view = _moved(view, state.step, state.epoch)
            self._view_state = state
        return view

    def _dispatch(self, event: Event, view: RunView, fields: dict[str, Any]) -> None:
        """``event`` to every listener, then the requests they made, carried out."""
        stage = "sanity_check" if self.sanity_checking else view.stage
        record = EventRecord(event, stage, self.state, view.callback_metrics, view, **fields)
        requests = self.emitter.emit(event, record)
        if requests:
            self._carry_out(event, requests)
        if self.checkpointer.in_flight:  # a failed save raises (not while one is raised)
            self.checkpointer.reap(wait=False, report=event is not Event.ON_EXCEPTION)

    def _carry_out(self, event: Event, requests: list[tuple[Any, Any]]) -> None:
        """The requests the listeners made in ``event``, now that every listener has had it:
        searches first (their trial fits, then the requests they return join the event's),
        stops and logs in listener order, then the saves in listener order, so that every
        checkpoint saved in an event holds the run as the event left it (a stop asked for by a
        listener listed after the one saving included)."""
        requests = self._searches(event, requests)
        saves, transitions = [], []
        for listener, request in requests:
            if isinstance(request, Save):
                saves.append((listener, request))
            elif isinstance(request, Transition):
                transitions.append((listener, request))
            elif isinstance(request, Stop):
                self.progress = self.progress._replace(should_stop=True)
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
            self.checkpointer.save_requested(listener, request, self.save_checkpoint)

    def _searches(self, event: Event, requests: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """The event's requests with each :class:`~engine.events.Search` run (in listener
        order, before the others are carried out) and replaced by the requests it returned."""
        if not any(isinstance(r, Search) for _, r in requests):
            return requests
        out: list[tuple[Any, Any]] = []
        for listener, request in requests:
            if not isinstance(request, Search):
                out.append((listener, request))
                continue
            who = f"{type(listener).__name__}.{event.value} returned {request!r}"
            if (
                self.stage != "fit"
                or self.trials is None
                or self.sanity_checking
                or event in STEP_EVENTS
                or event in (Event.ON_STATE_TRANSITION, Event.ON_SAVE_CHECKPOINT)
            ):
                raise RuntimeError(
                    f"{who}: a search runs trial fits between the steps of a fit (from "
                    "on_fit_start on; not inside a step, the sanity check, outside fit, or in "
                    "answer to a transition or a save)"
                )
            self.searched = True
            made = request.fn(self.trials)
            if made is not None:
                found: list[tuple[Any, Any]] = []
                _collect(found, request.fn, event, made)
                if any(isinstance(r, Search) for _, r in found):
                    raise RuntimeError(f"{who}: its function returned another Search")
                out.extend((listener, r) for _, r in found)
        return out

    def _transition(self, event: Event, listener: Any, request: Transition) -> None:
        """Apply a listener's :class:`~engine.events.Transition` to the state, then announce it
        (``on_state_transition``: the journal records it for replay)."""
        who = f"{type(listener).__name__}.{event.value} returned {request!r}"
        if self.stage != "fit" or event in STEP_EVENTS or event is Event.ON_STATE_TRANSITION:
            raise RuntimeError(
                f"{who}: a state transition applies between the steps of a fit (not inside a "
                "step, outside fit, or in answer to another transition)"
            )
        state = self.state
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
        self.state = new.replace(_ownership=type(state._ownership)())
        state._consume(f"Transition {request.name or request.fn!r}")
        self._version += 1
        self.announce(Event.ON_STATE_TRANSITION, transition=request, cause=event)

    # ------------------------------------------------------------------ metrics

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """``Trainer.log_metrics``: rows of the run's own (no ``step``) get the epoch."""
        self.log_row(metrics, step, run_row=step is None)

    def log_row(self, metrics: Mapping[str, float], step: int | None, *, run_row: bool) -> None:
        """A row to every logger (rank 0's), recorded as logged and callback metrics; a row of
        the run's own (``run_row``) gets the epoch, an int, as Lightning adds it."""
        row = dict(metrics)
        if not row:  # as Lightning: no row for nothing
            return
        if step is None:
            step = self._row_step()
        if run_row:  # validate/test/predict from a checkpoint: the state given's epoch, as
            # the step (Lightning's is its fit loop's: after a fit, the fit's, not the best's)
            row.setdefault(
                "epoch", self.current_epoch if self.log_epoch is None else self.log_epoch
            )
        if self.is_global_zero:  # one rank writes the run's logs
            for lg in self.loggers:
                lg.log_metrics(row, step)
        self.logged_metrics.update(row)
        self.callback_metrics.update(metrics)
        self._version += 1

    def eval_batches_seen(self, kind: str, dataloader_idx: int) -> int:
        """How many batches of this evaluation loader (``kind``: validation or test) had step
        values logged before this one in the call: the step of its step rows, Lightning's."""
        key = (kind, dataloader_idx)
        seen = self._eval_seen.get(key, 0)
        self._eval_seen[key] = seen + 1
        return seen

    def _row_step(self) -> int:
        """The step a row of the run's own is logged at: Lightning's (its loop's
        ``_batches_that_stepped``), the optimizer steps taken *before* the current batch's
        until that batch is done (its ``on_train_batch_end`` and its validation), the state's
        step otherwise. validate/test/predict from a checkpoint log at the step of the state
        given, not the checkpoint's (Lightning's global_step is the fit's): rows stay in step
        order."""
        if self.log_step is not None:
            return self.log_step
        state = self.state
        if state is None:
            return 0
        stepped = state.micro_step == 0 and state.step > 0  # this batch's optimizer step ran
        return state.step - 1 if self.progress.phase.mid_batch and stepped else state.step

    def show(self, metrics: Mapping[str, float]) -> None:
        """The metrics the task shows on the progress bar (``Task(shown=...)``)."""
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

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        filepath: str | os.PathLike[str],
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """``Trainer.save_checkpoint`` (see there)."""
        if self.state is None:
            raise RuntimeError("save_checkpoint(): nothing to save yet; call fit() first")
        dispatching = self.emitter.dispatching
        if dispatching is not None:
            raise RuntimeError(
                f"trainer.save_checkpoint() was called while {dispatching.value} was being "
                "dispatched; a listener returns engine.Save(path) (with asynchronous=, "
                "weights_only=, replaces=) and the driver writes it once every listener has had "
                "the event, so the checkpoint holds all their states after it"
            )
        return self.checkpointer.save(
            filepath,
            self._announce_save,
            self.record,
            metrics=metrics,
            asynchronous=asynchronous,
            weights_only=weights_only,
        )

    def _announce_save(self, path: str, future: Future[Any] | None) -> None:
        self.announce(Event.ON_SAVE_CHECKPOINT, checkpoint_path=path, checkpoint_future=future)

    def record(self) -> RunRecord:
        """The run as a checkpoint holds it (besides the listeners' states)."""
        assert self.state is not None
        return RunRecord(
            self.strategy.checkpoint_state(self.state),
            self.progress,
            self.stage,
            self.config,
            self.callback_metrics,
            self.logged_metrics,
            self.progress_bar_metrics,
            hparams=None if self.task is None else self.task.hparams,
            datamodule=_datamodule_state(self.datamodule),
            world_size=self.world_size,
            position_unit=position_unit(self.train_dataloader),
            train_order=self.train_order,
        )


def _datamodule_state(datamodule: Any) -> Mapping[str, Any] | None:
    """A datamodule's ``state_dict()`` for the checkpoint (Lightning saves it too), if it has
    one and it is not empty."""
    get = getattr(datamodule, "state_dict", None)
    state = get() if callable(get) else None
    return state or None


def stepping_batches(config: LoopConfig, train_loader: Any) -> int | float:
    """``Trainer.estimated_stepping_batches`` (see there) for ``train_loader``."""
    if config.max_epochs == -1:
        return math.inf if config.max_steps == -1 else config.max_steps
    if train_loader is None:
        raise RuntimeError(
            "trainer.estimated_stepping_batches counts the training batches, which a "
            "Trainer knows once fit() is given its data; read it during or after fit() "
            "(a schedule: total_steps='auto', resolved when the fit starts)"
        )
    batches = limit_batches("train", count_batches(train_loader), config.limit_train_batches)
    if batches == math.inf:
        return config.max_steps
    steps = math.ceil(batches / config.accumulate_grad_batches) * max(config.max_epochs, 1)
    return min(steps, config.max_steps) if config.max_steps != -1 else steps
