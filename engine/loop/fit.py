"""The fit loop: one function, :func:`fit`, a fold over local ``state`` and ``progress`` values.

It reads top to bottom: epochs → position the loader → batches → step → batch events →
validation on the schedule → signal check → stop checks → epoch end. It reads the frozen
:class:`~engine.plan.LoopConfig` and the pure predicates of :mod:`engine.plan.schedule`, and
reaches its driver only through :class:`FitServices`: each service is handed the current
``state`` and :class:`~engine.plan.progress.Progress` and returns the next ones (a listener's
:class:`~engine.events.Stop` changes the progress, a :class:`~engine.events.Transition` the
state). Nothing here reads or writes an attribute of the driver.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from engine.data import (
    batch_size,
    count_batches,
    limit_batches,
    lookahead,
    position_loader,
    restore_loader,
    seed_batches,
    seed_shuffle,
    stateful,
)
from engine.events import Event
from engine.loop import blocks
from engine.loop.services import LoopServices
from engine.plan import schedule
from engine.plan.config import LoopConfig
from engine.plan.progress import Phase, Progress
from engine.state import TrainState
from engine.step import split_metrics

__all__ = ["FitServices", "fit"]


class FitServices(LoopServices, Protocol):
    """What the fit loop asks of its driver. Each call hands over the loop's current values
    (the Trainer's :class:`~engine.driver.run.Run` keeps them as its record of the run, for the
    listeners' view, ``trainer.state`` and checkpoints) and returns the ones the loop
    continues with."""

    #: the blocks of ``steps_per_call`` (:class:`~engine.loop.blocks.BlockPlan`), or ``None``:
    #: a step per call
    blocks: blocks.BlockPlan | None

    def step(
        self, state: TrainState, progress: Progress, batch: Any, *, flush: bool
    ) -> tuple[TrainState, Progress, Mapping[str, torch.Tensor]]:
        """The train step (its own events may ask to stop); returns its metrics too."""
        ...

    def steps(
        self, state: TrainState, progress: Progress, batches: list[Any]
    ) -> tuple[TrainState, Progress, Mapping[str, torch.Tensor]]:
        """A block of whole windows in one call of the train step; its metrics stacked."""
        ...

    def log(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        """Host-side training metrics to the loggers and the progress bar."""
        ...

    def reload_train_loader(self, state: TrainState, progress: Progress) -> Any:
        """The training loader fetched again (``reload_dataloaders_every_n_epochs``), prepared
        as every loader of the run is."""
        ...

    def validate(self, state: TrainState, progress: Progress) -> tuple[TrainState, Progress]:
        """A validation run, in phase ``VALIDATION`` (the loaders reloaded on schedule)."""
        ...

    def epoch_metrics(self, reducer: Any) -> dict[str, float]:
        """The training epoch's reductions, named for the loggers (those logged with
        ``sync_dist`` reduced over every rank)."""
        ...

    def agree(self, state: TrainState, progress: Progress) -> Progress:
        """``progress`` with a stop asked for on any rank, and a signal received by any, on
        every rank (one collective; the identity in one process): every place the loop reads
        ``should_stop`` is preceded by one, so every rank takes the same branch."""
        ...

    def check(self, state: TrainState, progress: Progress, *, batch: bool = False) -> Progress:
        """:meth:`agree`, then, if SIGTERM / SIGINT came (to any rank): save an interrupted
        checkpoint and exit (raises). ``batch``: the check after a training batch, which may
        agree only every few batches where no listener can ask to stop (every rank alike)."""
        ...


def fit(
    config: LoopConfig,
    run: FitServices,
    state: TrainState,
    progress: Progress,
    *,
    train_loader: Any,
    datamodule: Any,
    enable_validation: bool,
) -> tuple[TrainState, Progress]:
    """Train from ``on_train_start`` to ``on_fit_end``; returns the final state and progress.

    ``progress.reducer`` is the epoch's metric reduction (restored by a resume). A state saved
    mid-epoch (``state.batch_idx > 0`` or ``progress.resume_phase``) finishes that epoch even if
    a listener had asked to stop, as the run that never stopped did; under a ``max_epochs`` or
    ``max_steps`` it has already reached, it trains nothing (Lightning's ``FitLoop.done``
    comes first). The training loaders this
    positions are restored as the user made them when it returns or raises.
    """
    reducer, track = progress.reducer, not config.barebones  # barebones: no metrics at all
    positioned: list[Any] = []
    last_reload: int | None = None
    try:
        state, progress = run.emit(Event.ON_TRAIN_START, state, progress)
        while not schedule.fit_done(config, epoch=state.epoch, global_step=state.step) and (
            # mid-epoch, a stop asked for before the save does not end it (the run that never
            # stopped finished the epoch); max_epochs / max_steps reached do, as in Lightning
            progress.resume_phase is not None
            or state.batch_idx > 0
            or not schedule.fit_done(
                config, epoch=state.epoch, global_step=state.step, should_stop=progress.should_stop
            )
        ):
            epoch = state.epoch
            if progress.resume_phase is Phase.EPOCH_END:
                # saved at the end of the epoch: its end (logging, events) has happened
                progress = progress._replace(resume_phase=None)
                reducer.reset()
                state = state.replace(epoch=epoch + 1, batch_idx=0)
                continue
            if last_reload is None:
                last_reload = epoch
            elif _reloads(config, datamodule, epoch - last_reload):
                train_loader = run.reload_train_loader(state, progress)
                last_reload = epoch
            batches = limit_batches(
                "train", count_batches(train_loader), config.limit_train_batches
            )
            if batches == 0:
                break
            progress = progress._replace(
                num_training_batches=batches,
                val_check_batch=schedule.val_check_batch(config, batches, enable_validation),
            )
            validate_this_epoch = schedule.validates_this_epoch(config, epoch, enable_validation)
            state, progress = run.emit(Event.ON_TRAIN_EPOCH_START, state, progress)
            progress = run.agree(state, progress)

            # position the loader at the state's batch of this epoch
            if not any(x is train_loader for x in positioned):
                positioned.append(train_loader)
            skip, offset = position(train_loader, state, epoch, progress.resume_data_state)
            progress = progress._replace(resume_data_state=None)
            if progress.resume_phase is not None:
                state, progress = _finish_resumed_batch(
                    config, run, state, progress, skip, validate_this_epoch
                )
            if _epoch_done(config, state, progress):
                batches = 0
            else:
                batches -= offset

            # the batches, each with its validation check (or a block of them, then its check)
            snapshot = train_loader.state_dict if stateful(train_loader) else None
            loaded = lookahead(train_loader, batches, snapshot=snapshot)
            for item in loaded:
                batch_idx = item[0] + offset
                if batch_idx < skip:
                    continue
                plan = run.blocks
                if plan is None or not blocks.fits(
                    config,
                    plan,
                    state,
                    progress,
                    batch_idx=batch_idx,
                    validates=validate_this_epoch,
                ):
                    runs: Any = ((item,),)
                else:  # a block in one call, or each batch gathered (fewer than a block) alone
                    items = blocks.gather(item, loaded, plan.batches)
                    whole = len(items) == plan.batches and not any(x[2] for x in items[:-1])
                    runs = (items,) if whole else [(x,) for x in items]
                for run_of in runs:
                    state, progress, stop = _train_batches(
                        config, run, state, progress, run_of, offset, validate_this_epoch
                    )
                    if stop:
                        break
                if stop:
                    break

            # the epoch's end
            if track:
                epoch_metrics = run.epoch_metrics(reducer)
                reducer.reset()
                run.log(state, epoch_metrics)
            progress = progress._replace(phase=Phase.EPOCH_END)
            state, progress = run.emit(Event.ON_TRAIN_EPOCH_END, state, progress)
            state = state.replace(epoch=epoch + 1, batch_idx=0)
            progress = progress._replace(phase=Phase.BETWEEN)
            progress = run.check(state, progress)  # one that came during the epoch's end
        state, progress = run.emit(Event.ON_TRAIN_END, state, progress)
        state, progress = run.emit(Event.ON_FIT_END, state, progress)
    finally:
        for loader in positioned:  # as the user made them (reloaded ones too)
            restore_loader(loader)
    return state, progress


def _train_batches(
    config: LoopConfig,
    run: FitServices,
    state: TrainState,
    progress: Progress,
    items: list[Any],
    offset: int,
    validate_this_epoch: bool,
) -> tuple[TrainState, Progress, bool]:
    """Train on one batch, or on a block of them in one call (:mod:`engine.loop.blocks`):
    its events (once for a block), its step, its metrics to the reducer and the loggers; then
    its validation check and the signal check. Returns whether the epoch is done."""
    track = not config.barebones  # barebones: no metrics at all
    reducer = progress.reducer
    last = items[-1]
    batch_idx, is_last, data_position = last[0] + offset, last[2], last[3]
    if data_position is not progress.data_position:  # None unless stateful
        progress = progress._replace(data_position=data_position)
    # the optimizer steps where Lightning's does: after the batch whose index in the epoch
    # completes a window (a resume that changed accumulate_grad_batches at a window boundary
    # steps after a partial one), and after the last batch
    steps = is_last or (batch_idx + 1) % config.accumulate_grad_batches == 0
    block = None
    if len(items) == 1:  # the hot path: one batch, one step call
        batch = run.move(last[1])
        state, progress = run.emit_batch(
            Event.ON_TRAIN_BATCH_START, state, progress, batch=batch, batch_idx=batch_idx
        )
        state, progress, metrics = run.step(state, progress, batch, flush=steps)
        if track:
            reducer.update(metrics, batch_size(batch))
    else:
        moved = [run.move(x[1]) for x in items]
        batch = moved[-1]
        state, progress = run.emit_batch(
            Event.ON_TRAIN_BATCH_START,
            state,
            progress,
            batch=moved[0],
            batch_idx=items[0][0] + offset,
        )
        state, progress, block = run.steps(state, progress, moved)
        each = split_metrics(block, len(moved), config.accumulate_grad_batches)
        metrics = each[-1]
        if track:
            for one, m in zip(moved, each, strict=True):
                reducer.update(m, batch_size(one))
    if track and steps and state.step % config.log_every_n_steps == 0:
        run.log(state, reducer.step_logged(metrics))
    # a checkpoint saved from now on still validates on resume
    progress = progress._replace(phase=Phase.BATCH_END)
    state, progress = run.emit_batch(
        Event.ON_TRAIN_BATCH_END,
        state,
        progress,
        outputs=metrics,
        batch=batch,
        batch_idx=batch_idx,
        block=block,
    )
    if validate_this_epoch and _stop_decides(config, state, progress, batch_idx, is_last):
        progress = run.agree(state, progress)  # a stop asked for now validates
    if validate_this_epoch and _validates_after(config, state, progress, batch_idx, is_last):
        progress = progress._replace(phase=Phase.VALIDATION)
        state, progress = run.validate(state, progress)
    progress = progress._replace(
        total_batch_idx=progress.total_batch_idx + len(items), phase=Phase.BETWEEN
    )
    progress = run.check(state, progress, batch=True)
    return state, progress, _epoch_done(config, state, progress)


def _finish_resumed_batch(
    config: LoopConfig,
    run: FitServices,
    state: TrainState,
    progress: Progress,
    skip: int,
    validate_this_epoch: bool,
) -> tuple[TrainState, Progress]:
    """Complete what the batch a checkpoint was saved in still had to do.

    A listener's save comes after its event has reached every listener, so what is left is
    what the loop does after that event. Saved in ``on_train_batch_end``: the batch's
    validation check runs. Saved during a validation before its results were logged: that
    validation runs again (it is pure: same results). Saved in ``on_validation_epoch_end``:
    ``on_validation_end`` follows; saved in ``on_validation_end``: nothing. In each case the
    batch is then counted.
    """
    phase = progress.resume_phase or Phase.BETWEEN
    progress = progress._replace(resume_phase=None, phase=phase)
    if phase is Phase.BATCH_END:
        last = skip >= progress.num_training_batches
        if (
            skip
            and validate_this_epoch
            and _validates_after(config, state, progress, skip - 1, last)
        ):
            phase = Phase.VALIDATION
    if phase is Phase.VALIDATION and skip:
        state, progress = run.validate(state, progress._replace(phase=Phase.VALIDATION))
    if phase is Phase.VALIDATED:
        progress = progress._replace(phase=Phase.VALIDATION_END)
        state, progress = run.emit(Event.ON_VALIDATION_END, state, progress)
    if phase.mid_batch:
        progress = progress._replace(total_batch_idx=progress.total_batch_idx + 1)
    return state, progress._replace(phase=Phase.BETWEEN)


def position(train_loader: Any, state: TrainState, epoch: int, restored: Any) -> tuple[int, int]:
    """Point the loader at ``epoch``; returns ``(skip, offset)``: the batches the state has
    consumed in it, and how many of those the loader skips without loading them (a state
    saved mid-epoch resumes there; the rest are fetched and dropped). ``restored``: a stateful
    loader's state as a checkpoint recorded it, if any."""
    skip = state.batch_idx
    seed_shuffle(train_loader, state.seed, epoch)  # shuffle=True: order from the state
    seed_batches(train_loader, state.seed, epoch)  # augmentation: from the state too
    offset = skip if position_loader(train_loader, epoch, skip) else 0
    if skip and not offset and restored is not None and stateful(train_loader):
        train_loader.load_state_dict(restored)  # it continues where it was saved
        offset = skip
    if skip and not offset:
        warnings.warn(
            f"resuming mid-epoch by loading and dropping {skip} batches; a DataLoader over "
            "a map-style dataset (with a batch_size) skips them without loading, and so "
            "does a loader with state_dict()/load_state_dict() (torchdata's "
            "StatefulDataLoader)",
            stacklevel=5,
        )
    return skip, offset


def _validates_after(
    config: LoopConfig, state: TrainState, progress: Progress, batch_idx: int, is_last: bool
) -> bool:
    """Whether validation runs after this training batch, in an epoch that validates."""
    return schedule.should_validate(
        config,
        val_check_batch=progress.val_check_batch,
        batch_idx=batch_idx,
        total_batch_idx=progress.total_batch_idx,
        is_last=is_last,
        should_stop=progress.should_stop,
        epoch=state.epoch,
        global_step=state.step,
    )


def _stop_decides(
    config: LoopConfig, state: TrainState, progress: Progress, batch_idx: int, is_last: bool
) -> bool:
    """Whether a stop asked for in this batch changes whether it validates (so the ranks agree
    on the stop first): a question of the schedule alone, the same on every rank."""
    stop = progress._replace(should_stop=True)
    go = progress._replace(should_stop=False)
    return _validates_after(config, state, stop, batch_idx, is_last) != _validates_after(
        config, state, go, batch_idx, is_last
    )


def _reloads(config: LoopConfig, datamodule: Any, epochs_since: int) -> bool:
    """Lightning's ``reload_dataloaders_every_n_epochs`` for the training loader."""
    every = config.reload_dataloaders_every_n_epochs
    return bool(every) and datamodule is not None and epochs_since >= every


def _epoch_done(config: LoopConfig, state: TrainState, progress: Progress) -> bool:
    return schedule.epoch_done(
        config, global_step=state.step, should_stop=progress.should_stop, epoch=state.epoch
    )
