"""A fake fit loop (tests' helper): emits Lightning 2.x's fit events through the Emitter, in
the order of Lightning's fit loop, for listeners tested without a Trainer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
from torch import nn

import engine as eg
from engine import optim
from engine.driver.resolve import resolve
from engine.events import Emitter, Event, EventRecord, Log, RunView, Stop

# ---------------------------------------------------------------------- a fake fit loop


class FakeFit:
    """A fit loop emitting events in Lightning's order, with the view of the run a listener
    gets (``rec.run``) built from its attributes, and the Stop and Log requests carried out
    after each event.

    ``val_metrics(epoch)`` is merged into the callback metrics at the end of each validation
    (Lightning's ``on_validation_epoch_end`` logging), ``train_epoch_metrics(epoch)`` before
    ``on_train_epoch_end``. Stop requests are honoured after ``min_epochs``, mid-epoch too.
    """

    def __init__(
        self,
        listeners: Sequence[Any],
        *,
        max_epochs: int = 10,
        min_epochs: int = 0,
        num_training_batches: float = 2,
        num_val_batches: Sequence[float] = (1,),
        num_sanity_val_steps: int = 0,
        val_check_interval: float | int = 1.0,
        check_val_every_n_epoch: int = 1,
        expose_schedule: bool = True,
        val_metrics: Callable[[int], dict[str, float]] | None = None,
        train_epoch_metrics: Callable[[int], dict[str, float]] | None = None,
        loggers: Sequence[Any] = (),
        task: Any = None,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        self.emitter = Emitter(listeners)
        self.state = eg.TrainState.create(nn.Linear(3, 2), optim.sgd(0.1))
        self.max_epochs, self.min_epochs, self.max_steps = max_epochs, min_epochs, -1
        self.num_training_batches = num_training_batches
        self.num_val_batches = list(num_val_batches)
        self.num_sanity_val_steps = num_sanity_val_steps
        if expose_schedule:  # the Trainer's resolved flags, which listeners ask the schedule
            self.config = resolve(
                val_check_interval=val_check_interval,
                check_val_every_n_epoch=check_val_every_n_epoch,
            )
        self._val_check_interval = val_check_interval
        self._every = check_val_every_n_epoch
        self.val_metrics, self.train_epoch_metrics = val_metrics, train_epoch_metrics
        self.loggers, self.task, self.on_batch = list(loggers), task, on_batch
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self._pbm: dict[str, float] = {}
        self.num_test_batches: list[float] = []
        self.num_predict_batches: list[float] = []
        self.log_every_n_steps = 1
        self.sanity_checking = False
        self.should_stop = False
        self.stops: list[Stop] = []
        self.events: list[str] = []
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def _shown(self) -> Mapping[str, float]:
        """What the view holds as ``progress_bar_metrics``."""
        return MappingProxyType(dict(self._pbm))

    def view(self, stage: str = "fit") -> RunView:
        config = getattr(self, "config", None)
        if config is not None:
            config = attrs.evolve(
                config,
                log_every_n_steps=self.log_every_n_steps,
                num_sanity_val_steps=self.num_sanity_val_steps,
            )
        return RunView(
            stage=stage,
            sanity_checking=self.sanity_checking,
            global_step=self.global_step,
            current_epoch=self.current_epoch,
            num_training_batches=self.num_training_batches,
            num_val_batches=tuple(self.num_val_batches),
            num_test_batches=tuple(self.num_test_batches),
            num_predict_batches=tuple(self.num_predict_batches),
            should_stop=self.should_stop,
            config=config,
            callback_metrics=MappingProxyType(dict(self.callback_metrics)),
            logged_metrics=MappingProxyType(dict(self.logged_metrics)),
            progress_bar_metrics=self._shown(),
            default_root_dir=".",
            task=self.task,
            loggers=tuple(self.loggers),
        )

    @property
    def global_step(self) -> int:
        return self.state.step

    @property
    def current_epoch(self) -> int:
        return self.state.epoch

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        step = self.global_step if step is None else step
        self.logged.append((step, dict(metrics)))
        for lg in self.loggers:
            lg.log_metrics(metrics, step)
        self.logged_metrics.update(metrics)
        self.callback_metrics.update(metrics)

    def emit(self, event: Event, stage: str = "fit", **fields: Any) -> None:
        self.events.append(event.value)
        stage = "sanity_check" if self.sanity_checking else stage

        if not self.emitter.wants(event):
            return
        run = self.view("fit" if stage == "sanity_check" else stage)
        record = EventRecord(event, stage, self.state, run.callback_metrics, run, **fields)
        for _, request in self.emitter.emit(event, record):  # after every listener had it
            if isinstance(request, Stop):
                self.should_stop = True
                self.stops.append(request)
            elif isinstance(request, Log):
                self.log_metrics(dict(request.metrics), request.step)

    def _can_stop(self) -> bool:
        return self.should_stop and self.current_epoch >= self.min_epochs

    def validate(self, limits: Sequence[float], stage: str = "fit") -> None:
        self.emit(Event.ON_VALIDATION_START, stage)
        self.emit(Event.ON_VALIDATION_EPOCH_START, stage)
        for dl, n in enumerate(limits):
            for b in range(int(n)):
                self.emit(Event.ON_VALIDATION_BATCH_START, stage, batch_idx=b, dataloader_idx=dl)
                self.emit(Event.ON_VALIDATION_BATCH_END, stage, batch_idx=b, dataloader_idx=dl)
        if not self.sanity_checking and self.val_metrics is not None:
            metrics = self.val_metrics(self.current_epoch)
            self.callback_metrics.update(metrics)
            self._pbm.update(metrics)
        self.emit(Event.ON_VALIDATION_EPOCH_END, stage)
        self.emit(Event.ON_VALIDATION_END, stage)

    def fit(self) -> FakeFit:
        self.emit(Event.SETUP)
        self.emit(Event.ON_FIT_START)
        has_val = sum(self.num_val_batches) > 0
        if has_val and self.num_sanity_val_steps:
            self.sanity_checking = True
            self.emit(Event.ON_SANITY_CHECK_START)
            self.validate([min(self.num_sanity_val_steps, n) for n in self.num_val_batches])
            self.emit(Event.ON_SANITY_CHECK_END)
            self.sanity_checking = False
        self.emit(Event.ON_TRAIN_START)
        if isinstance(self._val_check_interval, float):
            val_every = max(1, int(self.num_training_batches * self._val_check_interval))
        else:
            val_every = self._val_check_interval
        while not self._can_stop() and self.current_epoch < self.max_epochs:
            epoch = self.current_epoch
            validates = has_val and (epoch + 1) % self._every == 0
            self.emit(Event.ON_TRAIN_EPOCH_START)
            for b in range(int(self.num_training_batches)):
                self.state = self.state.replace(batch_idx=b)
                self.emit(Event.ON_TRAIN_BATCH_START, batch_idx=b)
                self.emit(Event.ON_BEFORE_OPTIMIZER_STEP, batch_idx=b)
                self.state = self.state.replace(step=self.state.step + 1, batch_idx=b + 1)
                if self.on_batch is not None:
                    self.on_batch()
                self._pbm["train/loss"] = 1.0 / self.state.step
                self.emit(Event.ON_TRAIN_BATCH_END, batch_idx=b)
                if validates and (b + 1) % val_every == 0:
                    self.validate(self.num_val_batches)
                if self._can_stop():
                    break
            if self.train_epoch_metrics is not None:
                self.callback_metrics.update(self.train_epoch_metrics(epoch))
            self.emit(Event.ON_TRAIN_EPOCH_END)
            self.state = self.state.replace(epoch=epoch + 1, batch_idx=0)
        self.emit(Event.ON_TRAIN_END)
        self.emit(Event.ON_FIT_END)
        self.emit(Event.TEARDOWN)
        return self
