"""``BasePredictionWriter`` (issue 28, item 7): predictions written per batch and per epoch with
their batches' dataset indices; under DDP each rank writes its own shard's, and the files put
back in dataset order are the one-process predictions, every sample once."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from _ranks import torchrun
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim
from engine.listeners import BasePredictionWriter

ROOT = Path(__file__).resolve().parents[1]


def _dataset(n: int = 11) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.arange(n))


def _task() -> eg.Task:
    return eg.Task(
        lambda m, b: m(b[0]).sum(), optim.sgd(0.1), predict_fn=lambda m, b: (m(b[0]), b[1])
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


class _Both(BasePredictionWriter):
    def __init__(self, interval: str = "batch_and_epoch") -> None:
        super().__init__(interval)
        self.batches: list[tuple] = []
        self.epochs: list[tuple] = []

    def write_on_batch_end(self, rec, prediction, batch_indices, batch, batch_idx, dl_idx):
        self.batches.append((prediction, batch_indices, batch_idx, dl_idx))

    def write_on_epoch_end(self, rec, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def test_batch_and_epoch_writes_carry_each_batchs_dataset_indices():
    writer = _Both()
    trainer = eg.Trainer(callbacks=[writer], **QUIET)
    task = _task()
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True, generator=None)
    out = trainer.predict(task, task.init(_model()), loader, return_predictions=False)
    assert out is None  # not returned; the writer kept its own for the epoch's end
    assert [b[2] for b in writer.batches] == [0, 1, 2] and {b[3] for b in writer.batches} == {0}
    for prediction, indices, _, _ in writer.batches:
        _, labels = prediction  # the batch's own labels are its dataset indices here
        assert labels.tolist() == indices
    (epoch,) = writer.epochs
    predictions, indices = epoch
    assert [p[1].tolist() for p in predictions] == indices[0]  # one loader: [[...], ...]
    assert sorted(i for batch in indices[0] for i in batch) == list(range(11))


def test_several_loaders_and_a_loader_without_indices():
    writer = _Both("epoch")
    trainer = eg.Trainer(callbacks=[writer], **QUIET)
    task = _task()
    data = _dataset(3)
    unbatched = DataLoader(data, batch_size=None)  # no batch sampler: no indices to give
    trainer.predict(task, task.init(_model()), [DataLoader(data, batch_size=2), unbatched])
    ((predictions, indices),) = writer.epochs
    assert len(predictions) == 2  # one list per loader, as Lightning's
    assert indices == [[[0, 1], [2]], [None, None, None]]


def test_a_bad_interval_and_a_missing_method_are_named():
    with pytest.raises(ValueError, match=r"write_interval='step'\): pass one of 'batch'"):
        BasePredictionWriter("step")
    trainer = eg.Trainer(callbacks=[BasePredictionWriter()], **QUIET)
    task = _task()
    with pytest.raises(NotImplementedError, match="implement it"):
        trainer.predict(task, task.init(_model()), DataLoader(_dataset(), batch_size=4))


SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    import engine as eg
    from torch.utils.data import DataLoader
    from engine.listeners import BasePredictionWriter
    from test_prediction_writer import _dataset, _model, _task

    out = sys.argv[1]

    class PerRank(BasePredictionWriter):
        def __init__(self):
            super().__init__("batch_and_epoch")
            self.rows = []

        def write_on_batch_end(self, rec, prediction, batch_indices, batch, batch_idx, dl):
            self.rows.append((prediction[0], batch_indices))

        def write_on_epoch_end(self, rec, predictions, batch_indices):
            rank = rec.run.global_rank
            torch.save({{"batches": self.rows, "epoch": (predictions, batch_indices)}},
                       os.path.join(out, f"predictions-{{rank}}.pt"))

    trainer = eg.Trainer(strategy="ddp", devices=2, accelerator="cpu", callbacks=[PerRank()],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    task = _task()
    trainer.predict(task, task.init(_model()), DataLoader(_dataset(), batch_size=2),
                    return_predictions=False)
    """
)


@pytest.mark.slow
def test_under_ddp_each_rank_writes_its_shard_and_they_reassemble_in_dataset_order(tmp_path):
    script = tmp_path / "predict.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = torchrun([str(script), str(tmp_path)], 2, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the reference: one process, the same model
    task = _task()
    expected = torch.cat(
        [
            p[0]
            for p in eg.Trainer(**QUIET).predict(
                task, task.init(_model()), DataLoader(_dataset(), batch_size=2)
            )
        ]
    )
    rows: dict[int, torch.Tensor] = {}
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"predictions-{rank}.pt", weights_only=False)
        preds, indices = saved["epoch"]
        assert [[int(i) for i in b] for b in indices[0]] == [b for _, b in saved["batches"]]
        for (out, _), batch in zip(preds, indices[0], strict=True):
            for row, i in zip(out, batch, strict=True):
                assert i not in rows, f"sample {i} predicted twice"
                rows[i] = row
    assert sorted(rows) == list(range(11))  # every sample once: no padding in prediction
    assert torch.equal(torch.stack([rows[i] for i in range(11)]), expected)
    json.dumps(sorted(rows))  # indices are plain ints
