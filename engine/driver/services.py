"""The loops' services over a :class:`~engine.driver.run.Run`: what
:func:`engine.loop.fit.fit` (:class:`FitServices`) and :mod:`engine.loop.evaluate`
(:class:`EvalServices`) ask of their driver, around the stage's steps. Events go through the
Run (:meth:`~engine.driver.run.Run.emit`, which records what the loop hands over); nothing here
keeps a copy of the state or the progress.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from engine import transforms
from engine.data import resolve_loaders
from engine.driver.run import STEP_EVENTS, Run
from engine.events import Event
from engine.loop import evaluate as eval_loops
from engine.plan.progress import Progress
from engine.state import TrainState

__all__ = ["EvalServices", "FitServices", "observer"]

#: Where no listener can ask to stop, the ranks agree on a signal about this often (seconds)
#: rather than after every batch: a SIGTERM is acted on within this, plus a batch.
AGREE_EVERY_S = 0.25
MAX_AGREE_EVERY = 1000  # batches


class _Services:
    """What every loop asks: the events (through the Run) and the batches' placement."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.move = run.pipeline.move
        self.emit = run.emit
        self.emit_batch = run.emit_batch


class EvalServices(_Services):
    """The services to one evaluation loop (:class:`engine.loop.evaluate.EvalServices`),
    around its evaluation or prediction ``step``."""

    def __init__(self, run: Run, step: Any, indices: Sequence[Any] = ()) -> None:
        super().__init__(run)
        self._step = step
        self._indices = indices  # per prediction loader: its next batch's dataset indices

    def batch_indices(self, dataloader_idx: int) -> Any:
        return self._indices[dataloader_idx]() if self._indices else None

    def step(self, state: TrainState, batch: Any) -> Any:
        return self._step(state, batch)

    def reducer(self) -> Any:
        return self.run.task.reducer()

    def compute(self, reducer: Any) -> dict[str, float]:
        # every evaluation epoch's metrics, computed here: over every rank's shard (one
        # process's are the run's)
        return reducer.compute(self.run.strategy.sync, sync_all=True)

    def log(self, state: TrainState, progress: Progress, metrics: dict[str, float]) -> None:
        self.run.hand_over(state, progress)  # the row's step is the state's
        self.run.log_metrics(metrics)
        self.run.show(metrics)

    def log_step(self, kind: str, dataloader_idx: int, metrics: dict[str, float]) -> None:
        # Lightning logs an evaluation batch's step values at the count of that loader's
        # batches its loop has evaluated so far (a fit's validations count on across epochs),
        # and with no epoch (Lightning adds it only to rows logged at its own step)
        self.run.log_row(metrics, self.run.eval_batches_seen(kind, dataloader_idx), run_row=False)
        self.run.show(metrics)


class FitServices(_Services):
    """The services to one fit loop (:class:`engine.loop.fit.FitServices`); its validations
    run :func:`engine.loop.evaluate.evaluate` through ``eval_services``."""

    def __init__(
        self,
        run: Run,
        step: Any,
        eval_services: EvalServices | None,
        val_loaders: list[Any],
        dm: Any,
        *,
        steps: Any = None,
        blocks: Any = None,
    ) -> None:
        super().__init__(run)
        self.train_step, self.eval_services = step, eval_services
        # steps_per_call: the block's call of the train step, and where blocks run
        self.train_steps, self.blocks = steps, blocks
        self.val_loaders, self.dm = val_loaders, dm
        self.reported_nonfinite = False  # a non-finite training loss is reported once a fit
        # one process has nothing to agree with: its own stop and signal are the run's
        self.several = run.world_size > 1
        # No listener can ask to stop (each says `may_stop = False`: the Trainer's defaults):
        # after a batch only a signal needs agreeing, and that every few batches (about every
        # AGREE_EVERY_S seconds, an interval the ranks agree on), not a collective a batch.
        # The same on every rank: it reads the full listener list, rank-zero ones included.
        self.lazy = self.several and not any(getattr(x, "may_stop", True) for x in run.callbacks)
        self._since, self._every, self._mark = 0, 1, time.monotonic()

    def reload_train_loader(self, state: TrainState, progress: Progress) -> Any:
        # the datamodule's train_dataloader() again (reload_dataloaders_every_n_epochs)
        loaders = self.run.prepare_loaders(
            "train", resolve_loaders("fit", None, self.dm, "train_dataloader")
        )
        self.run.strategy.agree_loaders()
        return loaders[0]

    def step(
        self, state: TrainState, progress: Progress, batch: Any, *, flush: bool
    ) -> tuple[TrainState, Progress, Mapping[str, torch.Tensor]]:
        run = self.run
        run.hand_over(state, progress)  # the step's own events see the state it takes
        try:
            new, metrics = self.train_step(state, batch, flush=flush)
        except RuntimeError as e:
            if "Inference tensors" not in str(e):
                raise
            raise RuntimeError(
                f"{e}\nThe batch holds inference tensors: tensors made under "
                "torch.inference_mode(), such as the outputs of Trainer.predict (which predicts "
                "under it by default). Train on `t.clone()` of them, or predict with "
                "Trainer(inference_mode=False), whose outputs are ordinary tensors"
            ) from e
        run.hand_over(new)
        return new, run.progress, metrics

    def steps(
        self, state: TrainState, progress: Progress, batches: list[Any]
    ) -> tuple[TrainState, Progress, Mapping[str, torch.Tensor]]:
        run = self.run
        run.hand_over(state, progress)
        new, metrics = self.train_steps(state, batches)
        run.hand_over(new)
        return new, run.progress, metrics

    def log(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        run = self.run
        run.hand_over(state)
        # a training step's row, or the epoch's: Lightning logs both at the step before the
        # (last) batch's optimizer step, as the batch's validation rows
        run.log_row(metrics, max(state.step - 1, 0), run_row=True)
        run.show(metrics)
        reducer = run.progress.reducer
        loss = getattr(reducer, "host_loss", None)  # read with the logged values: no extra sync
        if loss is not None and not math.isfinite(loss) and not self.reported_nonfinite:
            self.reported_nonfinite = True  # once a fit: every later step is likely as bad
            what = "epoch's mean loss" if reducer.host_loss_of_epoch else "loss"
            import warnings

            warnings.warn(
                f"the training {what} is {loss} at global_step {state.step} (epoch "
                f"{state.epoch}). The loss is read on the host only to log it (every "
                f"log_every_n_steps={run.config.log_every_n_steps} steps), so the first "
                "non-finite step may be earlier: find it with Trainer(detect_anomaly=True) or "
                "`engine replay`; a lower learning rate, gradient_clip_val or a look at the "
                "data may help",
                RuntimeWarning,
                stacklevel=2,
            )

    def validate(self, state: TrainState, progress: Progress) -> tuple[TrainState, Progress]:
        run = self.run
        run.hand_over(state, progress)
        self.val_loaders = run.reload_val_loaders(self.val_loaders, self.dm)
        assert self.eval_services is not None  # fit validates only with validation loaders
        state, progress, _ = eval_loops.evaluate(
            "validation",
            self.eval_services,
            state,
            progress,
            self.val_loaders,
            run.num_val_batches,
            log=True,
        )
        return state, progress

    def epoch_metrics(self, reducer: Any) -> dict[str, float]:
        # the training epoch's reductions; those logged with sync_dist over every rank's
        return reducer.epoch_logged(self.run.strategy.sync)

    def agree(self, state: TrainState, progress: Progress) -> Progress:
        run = self.run
        signals = run.signals
        flags = (progress.should_stop, signals.offer())  # read once, before the collective
        agreed: tuple[bool | int, ...]
        if not self.several:
            agreed = flags
        elif self.lazy:
            # the batches until the next agreement: each rank proposes its own from its pace
            # since the last one, and the ranks take the fewest (the maximum of the negatives)
            now = time.monotonic()
            pace = (now - self._mark) / max(self._since, 1)
            proposed = max(1, min(MAX_AGREE_EVERY, int(AGREE_EVERY_S / max(pace, 1e-6))))
            agreed = run.strategy.agree((*flags, -proposed))
            self._since, self._every, self._mark = 0, -int(agreed[2]), now
        else:
            agreed = run.strategy.agree(flags)
        stop, signalled = bool(agreed[0]), bool(agreed[1])
        signals.settle(signalled)  # every rank acts on what the ranks agreed, nothing later
        if stop != progress.should_stop:
            run.hand_over(state, progress)
            progress = run.agreed_stop(stop)
        return progress

    def check(self, state: TrainState, progress: Progress, *, batch: bool = False) -> Progress:
        if batch and self.lazy:
            self._since += 1
            if self._since < self._every:  # no stop can have been asked for: nothing to agree
                return progress
        progress = self.agree(state, progress)
        run = self.run
        if run.signals.agreed is not None:
            run.hand_over(state, progress)
            run.signals.stop(
                state, run.config.default_root_dir, run.save_checkpoint, run.strategy.barrier
            )
        return progress


def observer(run: Run) -> transforms.Observe | None:
    """Lightning's hooks inside the step, where it calls them (after the forward pass, after
    backward, before the optimizer step), when a listener has them; else none, and the step
    stays one call (one graph under ``compile``)."""
    wanted = [e for e in STEP_EVENTS if run.emitter.wants(e)]
    if not wanted:
        return None
    if run.task is not None and run.task.step_fn is not None:
        names = ", ".join(e.value for e in wanted)
        raise ValueError(
            f"listeners of {names} run inside a step the Trainer builds from loss_fn; a "
            "custom step_fn is the user's own, so call such code from inside it"
        )
    if run.config.compile:
        names = ", ".join(e.value for e in wanted)
        raise ValueError(
            f"Trainer(compile=...): listeners of {names} run inside the step, which "
            "compile=True makes one graph; drop compile or those listeners"
        )

    def at(event: Event, **fields: Any) -> None:
        assert run.state is not None
        run.announce_batch(event, batch_idx=run.state.batch_idx, **fields)

    def named(grads: Any) -> Mapping[str, Any]:
        assert run.state is not None
        return MappingProxyType(dict(zip(run.state.params, grads, strict=True)))

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
