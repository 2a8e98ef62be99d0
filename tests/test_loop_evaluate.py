"""The evaluation loops (``engine/loop/evaluate.py``) on their services alone, and the two seams
a strategy fills: every loader list through ``Run.prepare_loaders`` before it is counted,
every evaluation epoch's metrics through ``EvalServices.compute``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
import engine.driver.services
from engine import optim
from engine.driver.run import Run
from engine.events import Event
from engine.loop import Phase, Progress
from engine.loop.evaluate import evaluate, predict, sanity_check
from engine.metrics import MetricReducer

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "enable_journal": False,
}


class _Services:
    """Services that record what the loop asks; a batch event at ``stop_at`` asks to stop (as a
    listener's Stop would: the progress comes back changed)."""

    def __init__(self, stop_at: tuple[int, int] | None = None, scale: float = 1.0) -> None:
        self.events: list[tuple[Event, Phase]] = []
        self.computed = 0
        self.logged: list[dict[str, float]] = []
        self.stop_at, self.scale = stop_at, scale

    def emit(self, event, state, progress, **fields):
        self.events.append((event, progress.phase))
        return state, progress

    def emit_batch(self, event, state, progress, **fields):
        self.events.append((event, progress.phase))
        if (fields["dataloader_idx"], fields["batch_idx"]) == self.stop_at:
            progress = progress._replace(should_stop=True)
        return state, progress

    def move(self, batch):
        return batch

    def step(self, state, batch):
        return {"loss": batch.mean()}

    def reducer(self):
        return MetricReducer()

    def compute(self, reducer):
        self.computed += 1
        return {k: v * self.scale for k, v in reducer.compute().items()}

    def log(self, state, progress, metrics):
        self.logged.append(metrics)

    def log_step(self, kind, dataloader_idx, metrics):
        self.logged.append(metrics)

    def batch_indices(self, dataloader_idx):
        return None


def test_evaluate_names_reduces_and_logs_per_loader_through_its_services():
    run = _Services(stop_at=(1, 0), scale=10.0)
    loaders = [[torch.ones(2), torch.zeros(2)], [torch.full((2,), 3.0)] * 3]
    progress = Progress()._replace(phase=Phase.VALIDATION)
    _, progress, results = evaluate("validation", run, None, progress, loaders, [2, 2], log=True)
    # each loader's mean over the batches the limit lets through, as compute() returned it
    assert results == [{"val/loss/dataloader_idx_0": 5.0}, {"val/loss/dataloader_idx_1": 30.0}]
    assert run.computed == 2
    assert run.logged == [{**results[0], **results[1]}]  # one row, every loader's
    assert progress.should_stop  # the batch event's request is carried on
    assert progress.phase is Phase.VALIDATION_END
    ends = [(e, p) for e, p in run.events if e.value.endswith("_end")]
    assert ends[-2:] == [
        (Event.ON_VALIDATION_EPOCH_END, Phase.VALIDATED),  # its results exist: a resume keeps them
        (Event.ON_VALIDATION_END, Phase.VALIDATION_END),
    ]
    assert sum(e is Event.ON_VALIDATION_BATCH_START for e, _ in run.events) == 4


def test_test_epochs_and_the_sanity_check_leave_the_phase_and_log_nothing_unasked():
    run = _Services()
    loaders = [[torch.ones(1)]]
    _, progress, results = evaluate("test", run, None, Progress(), loaders, [1], log=False)
    assert results == [{"test/loss": 1.0}] and run.logged == []
    assert progress.phase is Phase.BETWEEN
    run = _Services()
    _, progress = sanity_check(run, None, Progress(), [[torch.ones(1)] * 3], [2])
    names = [e for e, _ in run.events]
    assert names[0] is Event.ON_SANITY_CHECK_START and names[-1] is Event.ON_SANITY_CHECK_END
    assert names.count(Event.ON_VALIDATION_BATCH_END) == 2 and run.logged == []


def test_predict_keeps_outputs_per_loader_only_when_asked():
    run = _Services()
    loaders = [[torch.ones(1)], [torch.zeros(1), torch.ones(1)]]
    _, _, outputs = predict(run, None, Progress(), loaders, [1, 2], keep=True)
    assert [[o["loss"].item() for o in outs] for outs in outputs] == [[1.0], [0.0, 1.0]]
    _, _, outputs = predict(run, None, Progress(), loaders, [1, 2], keep=False)
    assert outputs == [[], []]


def _task():
    return eg.Task(
        lambda m, b: F.mse_loss(m(b[0]), b[1]),
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"loss": F.mse_loss(m(b[0]), b[1])},
        predict_fn=lambda m, b: m(b[0]),
    )


class _Data:
    """A datamodule: 4 batches per loader."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


def _halving(monkeypatch) -> list[str]:
    """A strategy-like seam: each loader keeps its first half of batches; the stages whose
    loaders passed it, in order."""
    prepared: list[str] = []

    def prepare_loaders(self, stage, loaders):
        prepared.append(stage)
        return [list(loader)[: len(loader) // 2] for loader in loaders]

    monkeypatch.setattr(Run, "prepare_loaders", prepare_loaders)
    return prepared


def test_every_loader_list_passes_the_loader_seam_before_it_is_counted(monkeypatch):
    prepared = _halving(monkeypatch)
    trainer = eg.Trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1, **QUIET)
    task, dm = _task(), _Data()
    state = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), datamodule=dm)
    # the sanity check's loaders first, the training loader, then each epoch's reloads
    assert prepared == ["val", "train", "train", "val", "train", "val"]
    assert trainer.num_training_batches == 2 and trainer.num_val_batches == [2]
    assert state.step == 6  # 3 epochs of the 2 batches left
    trainer.validate(task, state, datamodule=dm, verbose=False)
    trainer.test(task, state, datamodule=dm, verbose=False)
    outputs = trainer.predict(task, state, datamodule=dm)
    assert prepared[6:] == ["val", "test", "predict"]
    assert (trainer.num_val_batches, trainer.num_test_batches) == ([2], [2])
    assert trainer.num_predict_batches == [2] and len(outputs) == 2


def test_every_evaluation_epochs_metrics_pass_the_compute_seam(monkeypatch):
    calls: list[dict[str, float]] = []
    compute = engine.driver.services.EvalServices.compute

    def offset(self, reducer):
        out = {k: v + 100.0 for k, v in compute(self, reducer).items()}
        calls.append(out)
        return out

    monkeypatch.setattr(engine.driver.services.EvalServices, "compute", offset)
    trainer = eg.Trainer(max_epochs=2, num_sanity_val_steps=1, **QUIET)
    task, dm = _task(), _Data()
    state = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), datamodule=dm)
    assert len(calls) == 3  # the sanity check and two validations
    assert trainer.callback_metrics["val/loss"] == calls[-1]["loss"] > 100.0
    (result,) = trainer.test(task, state, datamodule=dm, verbose=False)
    assert result == {"test/loss": calls[-1]["loss"]} and len(calls) == 4
