"""The fit stage, top to bottom: the directories checked, the datamodule set up and asked for
its loaders (in Lightning's order), the data's determinism warned about, the schedule checked,
the directories claimed; then, in the run's context, the steps built, the sanity check and the
fit loop (:func:`engine.loop.fit.fit`) over the :class:`~engine.driver.run.Run`."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import attrs

from engine import checkpoint, optim
from engine.data import (
    count_batches,
    is_datamodule,
    limit_batches,
    order_outside_the_state,
    randomness_outside_the_state,
    resolve_loaders,
    setup_datamodule,
)
from engine.driver import directories
from engine.driver._checks import warn_hyperparams_in_dtype
from engine.driver._profiling import Profiler
from engine.driver.assembly import Assembly
from engine.driver.context import running
from engine.driver.restore import datamodule_first
from engine.driver.run import STEP_EVENTS, Run, stepping_batches
from engine.driver.services import EvalServices, FitServices
from engine.events import Event
from engine.loop import evaluate as eval_loops
from engine.loop.blocks import BlockPlan
from engine.loop.fit import fit as fit_loop
from engine.plan import schedule
from engine.plan.config import LoopConfig
from engine.state import TrainState
from engine.step import TrainStep
from engine.task import Task

__all__ = ["Trials", "fit"]


def fit(
    run: Run,
    profiler: Any,
    task: Task,
    state: TrainState,
    train_dataloaders: Any,
    val_dataloaders: Any,
    datamodule: Any,
    ckpt_path: str | None,
) -> TrainState:
    """``Trainer.fit`` in this process (see there)."""
    config = run.config
    directories.check(run)  # before any work: a directory that cannot be written says so
    if datamodule is None and is_datamodule(train_dataloaders):
        datamodule, train_dataloaders = train_dataloaders, None
    if datamodule is not None:  # Lightning's protocol: before its loaders are asked for
        setup_datamodule(datamodule, "fit", run.facade)
    datamodule_first(run, ckpt_path, datamodule)
    # the order Lightning asks a datamodule for them: the validation loaders first when a
    # sanity check will run on them (before training starts), else the training loader
    val_first = config.num_sanity_val_steps > 0 and config.limit_val_batches and ckpt_path is None
    if val_first:
        val_loaders = run.prepare_loaders(
            "val", resolve_loaders("fit", val_dataloaders, datamodule, "val_dataloader")
        )
    train_loaders = run.prepare_loaders(
        "train", resolve_loaders("fit", train_dataloaders, datamodule, "train_dataloader")
    )
    if len(train_loaders) != 1:
        raise ValueError(
            f"Trainer.fit() takes exactly one training dataloader (got {len(train_loaders)})"
        )
    if not val_first:
        val_loaders = run.prepare_loaders(
            "val", resolve_loaders("fit", val_dataloaders, datamodule, "val_dataloader")
        )
    run.strategy.agree_loaders()  # every rank built them alike (one collective)
    _warn_about_the_data(train_loaders[0])
    # what the first epoch's loop would refuse (val_check_interval longer than the epoch)
    # is refused before the loggers make their run directories
    _check_schedule(run, train_loaders[0], val_loaders)
    run.fitting(train_loaders[0], datamodule)
    directories.claim(run)
    with running(run, profiler, task, state, ckpt_path, datamodule):
        _fit(run, profiler, task, train_loaders[0], val_loaders, datamodule)
    if state._ownership.consumed_by == "train_step":
        state._ownership.consumed_by = "Trainer.fit"  # its error says what to use instead
    assert run.state is not None
    run.fit_ended()
    if run.signals.came:  # after the last epoch's end: nothing to stop
        run.signals.report_late(run.global_step, run.current_epoch)
    return run.state


def _warn_about_the_data(train_loader: Any) -> None:
    if order_outside_the_state(train_loader):
        warnings.warn(
            "the training DataLoader shuffles with a RandomSampler that draws from the "
            "generator you gave it, which is outside the run's state: a run resumed from a "
            "checkpoint or replayed will see other batches than this one. Leave out "
            "generator= (the Trainer then seeds the order from the state's seed and the "
            "epoch), or pass sampler=engine.data.ShuffleSampler(dataset, seed=...)",
            stacklevel=3,
        )
    if randomness_outside_the_state(train_loader):
        warnings.warn(
            "the training DataLoader loads in worker processes that the Trainer cannot "
            "seed (a custom batch sampler, batch_size=None, an iterable dataset, a loader "
            "with state_dict() or a dataset without an instance dict): random numbers its "
            "dataset draws there (random augmentation) are outside the run's state, so a run "
            "resumed from a checkpoint or replayed may see other batches. Wrap the dataset "
            "in engine.data.SeededDataset(dataset, seed=...) to seed each sample",
            stacklevel=3,
        )


def _check_schedule(run: Run, train_loader: Any, val_loaders: list[Any]) -> None:
    """Raise what :func:`engine.plan.schedule.val_check_batch` raises for the fit's first
    epoch (the loop asks again each epoch: a reloaded loader may change its length)."""
    config = run.config
    batches = limit_batches("train", count_batches(train_loader), config.limit_train_batches)
    if batches == 0:  # the loop trains nothing and asks nothing
        return
    validates = any(
        limit_batches("val", count_batches(dl), config.limit_val_batches) for dl in val_loaders
    )
    schedule.val_check_batch(config, batches, validates)


def _fit(
    run: Run, profiler: Any, task: Task, train_loader: Any, val_loaders: list[Any], dm: Any
) -> None:
    config = run.config
    if task.step_fn is not None:
        _check_custom_step(run)
    pipeline = run.pipeline
    assert run.state is not None
    # the run's length, where a schedule asked for it (total_steps="auto"): the task the
    # fit runs (and the journal records, for replay) has it resolved
    task = _resolve_total_steps(task, run)
    run.begin_fit(task, Trials(config, run.assembly, run.facade))
    if task.tx is not None:
        warn_hyperparams_in_dtype(
            task.tx,
            run.state.opt_state,
            run.state.params,
            f"the parameters' dtype under precision={config.precision!r}",
        )
    plan = _block_plan(run, task)
    built = task.train_step(
        transforms=pipeline, **({"steps_per_call": plan.windows} if plan else {})
    )
    steps = None
    if isinstance(built, TrainStep) and plan is not None:  # a plan: not a custom step_fn
        step = profiler.timed("train_step", built.one)
        steps = profiler.timed("train_step", built.steps)
    else:
        step = profiler.timed("train_step", built)
    evaluate = (  # built only when there is something to validate (fit has no loaders
        # to add later), so a task without an evaluation function fits without one
        profiler.timed(
            "validation_step",
            task.eval_step(transforms=pipeline, inference_mode=config.inference_mode),
        )
        if val_loaders
        else None
    )
    num_val_batches = run.count_batches("val", val_loaders)
    enable_validation = sum(num_val_batches) > 0
    if task.hparams:
        checkpoint._hparams_doc(task.hparams)  # a value checkpoints cannot hold: named now
        for lg in run.loggers if run.is_global_zero and config.enable_autolog_hparams else ():
            lg.log_hyperparams(dict(task.hparams))
    run.announce(Event.ON_FIT_START)
    if run.searched and dm is not None:
        # a tuner's listener searched (and may have set the datamodule's batch_size): the
        # loaders fetched again, as Lightning's tuners reset them after their search
        train_loader, val_loaders = _fetch_again(run, dm, val_loaders)
        num_val_batches = run.count_batches("val", val_loaders)
        enable_validation = sum(num_val_batches) > 0

    eval_services = None if evaluate is None else EvalServices(run, evaluate)
    run.val_loaders_fetched(None)
    sanity = [min(config.num_sanity_val_steps, n) for n in num_val_batches]
    if eval_services is not None and enable_validation and sum(sanity) > 0:
        run.sanity_check_starts()  # the listeners' view says so, around the events too
        state, progress = eval_loops.sanity_check(
            eval_services, run.state, run.progress, val_loaders, sanity
        )
        run.sanity_check_ended(state, progress)

    progress = run.progress
    if progress.reducer is None:  # else restored by a resume
        progress = progress._replace(reducer=task.reducer())
    services = FitServices(run, step, eval_services, val_loaders, dm, steps=steps, blocks=plan)
    state, progress = fit_loop(
        config,
        services,
        run.state,
        progress,
        train_loader=train_loader,
        datamodule=dm,
        enable_validation=enable_validation,
    )
    run.hand_over(state, progress)


def _block_plan(run: Run, task: Task) -> BlockPlan | None:
    """Where ``steps_per_call`` blocks may run (:mod:`engine.loop.blocks`), or ``None`` (a step
    per call): also ``None``, with a warning that says why, where something must see every
    step (a custom ``step_fn``, a listener of the step's own events, or of the training batch
    events without :attr:`~engine.events.Listener.handles_blocks`)."""
    config = run.config
    if config.steps_per_call == 1:
        return None
    why = None
    batch_events = (Event.ON_TRAIN_BATCH_START, Event.ON_TRAIN_BATCH_END)
    # every listener, rank-zero ones included (the journal, the bar): the plan must be the same
    # on every rank, or the ranks' checks (and their collectives) would not line up
    listeners = run.callbacks
    if task.step_fn is not None:
        why = "the task's step_fn is the user's own single step"
    else:
        inside = [x for x in listeners if _handles(x, STEP_EVENTS)]
        per_batch = [
            x
            for x in listeners
            if _handles(x, batch_events) and not getattr(x, "handles_blocks", False)
        ]
        if inside:
            names = ", ".join(e.value for e in STEP_EVENTS)
            why = f"{_names(inside)} listen to events inside the step ({names})"
        elif per_batch:
            why = (
                f"{_names(per_batch)} must see every training batch (a listener that can take "
                "one on_train_batch_end per block sets handles_blocks = True)"
            )
    if why is not None:
        warnings.warn(
            f"Trainer(steps_per_call={config.steps_per_call}) runs one optimizer step per call: "
            f"{why}",
            UserWarning,
            stacklevel=4,
        )
        return None
    ends = [config.log_every_n_steps] if not config.barebones else []
    recorded: dict[str, frozenset[int]] = {}
    for listener in listeners:
        if _handles(listener, batch_events):
            ends.extend(n for n in getattr(listener, "block_ends", tuple)() if n)
        starts = getattr(listener, "block_starts", lambda: None)()
        if starts is not None:
            recorded[type(listener).__name__] = frozenset(starts)
    if len(set(recorded.values())) > 1:
        raise ValueError(
            f"listeners {', '.join(sorted(recorded))} each give the steps where blocks start "
            "(block_starts), and they differ: a fit runs one plan; keep one of them"
        )
    return BlockPlan(
        config.steps_per_call,
        config.accumulate_grad_batches,
        tuple(sorted(set(ends))),
        next(iter(recorded.values()), None),
    )


def _handles(listener: Any, events: tuple[Event, ...]) -> bool:
    return any(callable(getattr(listener, e.value, None)) for e in events)


def _names(listeners: list[Any]) -> str:
    return ", ".join(sorted({type(x).__name__ for x in listeners}))


def _fetch_again(run: Run, dm: Any, val_loaders: list[Any]) -> tuple[Any, list[Any]]:
    """The datamodule's training loader (and validation loaders, if the fit has any) again."""
    train = run.prepare_loaders("train", resolve_loaders("fit", None, dm, "train_dataloader"))
    if val_loaders:
        val_loaders = run.prepare_loaders("val", resolve_loaders("fit", None, dm, "val_dataloader"))
    run.strategy.agree_loaders()
    run.refetched(train[0])
    return train[0], val_loaders


class Trials:
    """Trial fits on a Trainer's flags (:class:`engine.events.Trials`): what a listener's
    :class:`~engine.events.Search` and :class:`engine.Tuner` run. Each trial is a fit in a
    :class:`Run` of its own, on the flags as resolved (precision, devices, accumulation,
    clipping, ``max_epochs``, ``limit_train_batches``) with ``max_steps`` the trial's and no
    validation, loggers, checkpoints, profiler or listeners but those given; bare
    (``barebones``: no metrics reduced or logged, so a loss that diverges, as a learning-rate
    search makes it, is no warning), the listeners reading each step's ``outputs``."""

    def __init__(self, config: LoopConfig, assembly: Assembly, facade: Any = None) -> None:
        self.config, self.assembly = config, assembly
        # weakly, as Run holds it: the Trainer's Run holds these Trials, and a cycle back to the
        # Trainer would leave its dataloaders to the garbage collector, under which torch takes
        # 5 s a persistent worker to shut down (its queues are finalized before the iterator)
        self._facade = None if facade is None else weakref.ref(facade)

    @property
    def facade(self) -> Any:
        """The Trainer these trials run for, while it lives."""
        return None if self._facade is None else self._facade()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_facade": None}  # a weak reference does not pickle

    def fit(
        self,
        task: Task,
        state: TrainState,
        train_dataloader: Any,
        *,
        steps: int,
        listeners: Any = (),
    ) -> TrainState:
        """Train ``state`` (consumed) for at most ``steps`` optimizer steps; see
        :class:`engine.events.Trials`."""
        config = attrs.evolve(
            self.config,
            max_steps=state.step + steps,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            barebones=True,  # no epoch metrics, logging or warnings: a trial reads its outputs
            profiler=None,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_journal=False,
        )
        run = Run(config, self.assembly, (), list(listeners), stage="fit", facade=self.facade)
        return fit(run, Profiler(None), task, state, train_dataloader, None, None, None)


def _resolve_total_steps(task: Task, run: Run) -> Task:
    """``task`` with its ``total_steps="auto"`` schedules (:class:`engine.optim.AutoLength`)
    resolved to ``trainer.estimated_stepping_batches``; ``task`` itself without any."""
    tx = task.tx
    if (tx is None or not optim.has_deferred(tx)) and not isinstance(task.lr, optim.AutoLength):
        return task
    config = run.config
    total = stepping_batches(config, run.train_dataloader)
    if isinstance(total, float) or total < 1:
        raise ValueError(
            f"total_steps='auto': the run's length is unknown "
            f"(trainer.estimated_stepping_batches = {total}, with max_epochs="
            f"{config.max_epochs}, max_steps={config.max_steps} and "
            f"{run.progress.num_training_batches or 'unsized'} training batches); set "
            "max_steps, or max_epochs with a training loader that has a length, or pass "
            "total_steps=N"
        )
    lr = task.lr.resolve_total_steps(total) if isinstance(task.lr, optim.AutoLength) else task.lr
    return attrs.evolve(
        task, tx=None if tx is None else optim.resolve_total_steps(tx, total), lr=lr
    )


def _check_custom_step(run: Run) -> None:
    """The flags that act inside a step built from ``loss_fn`` cannot reach into a custom one."""
    config = run.config
    for flag, value, on in (
        (
            "accumulate_grad_batches",
            config.accumulate_grad_batches,
            config.accumulate_grad_batches > 1,
        ),
        ("gradient_clip_val", config.gradient_clip_val, bool(config.gradient_clip_val)),
        ("compile", config.compile, bool(config.compile)),
    ):
        if on:
            raise ValueError(
                f"Trainer({flag}={value!r}) acts inside a train step built from loss_fn; the "
                "task's step_fn is its own step: accumulate, clip (optim.clip_by_global_norm in "
                "its optimizers) or compile inside it, and leave the flag at its default"
            )
    privacy = run.assembly.privacy
    if privacy is not None:
        raise ValueError(
            f"Trainer(plugins=[{privacy!r}]) computes the gradients of a train step "
            "built from loss_fn; the task's step_fn is its own step: take per-example "
            "gradients inside it (engine.per_example_grads, engine.privacy.clip_and_sum and "
            "gaussian_noise), or give the task a loss_fn"
        )
    if run.assembly.precision.overrides("wrap_grad"):
        raise ValueError(
            f"Trainer(precision={config.precision!r}) autocasts the forward pass of a train "
            "step built from loss_fn; the task's step_fn is its own step: enter torch.autocast "
            "inside it (and scale its float16 loss), or use a true precision such as "
            "'bf16-true', which casts the state and the batches the step_fn receives"
        )
