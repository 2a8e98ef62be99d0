"""The fit loop as a fold over locals (engine/loop/fit.py) and the Progress record it threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine as eg
from engine import optim, transforms
from engine.driver.resolve import resolve
from engine.events import Event
from engine.loop import Phase, Progress
from engine.loop.fit import fit
from engine.metrics import MetricReducer


def test_progress_round_trips_through_a_checkpoints_json():
    progress = Progress(
        total_batch_idx=7, phase=Phase.VALIDATED, should_stop=True, num_training_batches=4
    )
    saved = progress.to_json()
    assert saved == {
        "total_batch_idx": 7,
        "phase": "validated",
        "should_stop": True,
        "data_state": None,
    }
    restored = Progress.from_checkpoint(saved)
    assert restored.resume_phase is Phase.VALIDATED and restored.phase is Phase.BETWEEN
    # a listener's stop is recorded but not carried over (Lightning's is not either)
    assert restored.total_batch_idx == 7 and not restored.should_stop
    assert Progress.from_checkpoint({}) == Progress()  # an engine that recorded nothing


def test_progress_from_an_older_checkpoint_and_a_bad_one():
    # before requests, a checkpoint recorded the event it was saved in beside the phase
    older = {"phase": "validated", "event": ["on_validation_end", []]}
    assert Progress.from_checkpoint(older).resume_phase is Phase.VALIDATION_END
    older["event"] = ["on_validation_epoch_end", ["Journal"]]
    assert Progress.from_checkpoint(older).resume_phase is Phase.VALIDATED
    with pytest.raises(TypeError, match="total_batch_idx"):
        Progress.from_checkpoint({"total_batch_idx": -1})
    with pytest.raises(ValueError, match="phases"):
        Progress.from_checkpoint({"phase": "elsewhere"})


class _Services:
    """FitServices without a Trainer: records the events; stops when asked to."""

    def __init__(self, step, stop_at_step=None):
        self.train_step, self.stop_at_step = step, stop_at_step
        self.blocks = None  # a step per call
        self.events: list[tuple[str, int, Phase]] = []
        self.validations = 0

    def emit(self, event, state, progress, **fields):
        self.events.append((event.value, state.step, progress.phase))
        if self.stop_at_step is not None and state.step >= self.stop_at_step:
            progress = progress._replace(should_stop=True)
        return state, progress

    emit_batch = emit

    def move(self, batch):
        return batch

    def step(self, state, progress, batch, *, flush):
        state, metrics = self.train_step(state, batch, flush=flush)
        return state, progress, metrics

    def log(self, state, metrics):
        pass

    def validate(self, state, progress):
        assert progress.phase is Phase.VALIDATION
        self.validations += 1
        return state, progress

    def epoch_metrics(self, reducer):
        return reducer.epoch_logged()

    def agree(self, state, progress):
        self.agreements = getattr(self, "agreements", 0) + 1
        return progress

    def check(self, state, progress, *, batch=False):
        assert progress.phase is Phase.BETWEEN
        return self.agree(state, progress)


def _setup():
    torch.manual_seed(0)
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    state = task.init(torch.nn.Linear(3, 1), seed=0)
    step = task.train_step(transforms=transforms.compose())
    return task, data, state, step


def test_the_loop_runs_on_its_services_alone():
    task, data, state, step = _setup()
    config = resolve(max_epochs=2, barebones=True, val_check_interval=2)
    run = _Services(step)
    progress = Progress(reducer=MetricReducer(task.reduce))
    state, progress = fit(
        config, run, state, progress, train_loader=data, datamodule=None, enable_validation=True
    )
    assert (state.step, state.epoch, state.batch_idx) == (6, 2, 0)
    assert progress.total_batch_idx == 6 and progress.num_training_batches == 3
    assert progress.phase is Phase.BETWEEN and not progress.should_stop
    assert run.validations == 2  # every 2 batches, counted across epochs: after batches 2, 4
    names = [e for e, _, _ in run.events]
    assert names[0] == Event.ON_TRAIN_START.value and names[-1] == Event.ON_FIT_END.value
    assert names.count(Event.ON_TRAIN_BATCH_END.value) == 6
    assert all(p is Phase.BATCH_END for e, _, p in run.events if e == "on_train_batch_end")
    assert all(p is Phase.EPOCH_END for e, _, p in run.events if e == "on_train_epoch_end")


def test_a_stop_the_services_return_ends_the_loop():
    task, data, state, step = _setup()
    config = resolve(max_epochs=5, barebones=True)
    run = _Services(step, stop_at_step=2)
    progress = Progress(reducer=MetricReducer(task.reduce))
    state, progress = fit(
        config, run, state, progress, train_loader=data, datamodule=None, enable_validation=False
    )
    # the stop asked for in on_train_batch_end after step 2 ends the epoch and the fit
    assert progress.should_stop and (state.step, state.epoch) == (2, 1)
