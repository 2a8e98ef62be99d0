"""A fit given a real ``pytorch_lightning.LightningDataModule`` replays in a fresh process
without its script: the datamodule is pickled without the Trainer it was attached to, or, when
it holds something that does not pickle (an open file), as its class and the hyperparameters
its ``save_hyperparameters()`` recorded."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import _procs
import pytest

pytest.importorskip("pytorch_lightning")

_SCRIPT = """
import os, sys
import torch, torch.nn.functional as F
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
import engine as eg
from engine import optim

class Sums(pl.LightningDataModule):
    def __init__(self, n=40, batch_size=8):
        super().__init__()
        self.save_hyperparameters()
        if {open_file}:
            self.notes = open(os.devnull, "w")  # a file it writes: this one does not pickle

    def setup(self, stage):
        assert self.trainer is not None and self.trainer.max_epochs != 0
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.hparams.n, 3, generator=g)
        self.train = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

def loss_fn(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])

task = eg.Task(loss_fn, optim.adam(0.01), lr=0.01)
trainer = eg.Trainer(max_epochs=3, log_every_n_steps=2, enable_progress_bar=False,
                     enable_model_summary=False, logger=False, default_root_dir=sys.argv[1])
torch.manual_seed(0)
trainer.fit(task, task.init(torch.nn.Linear(3, 1)), datamodule=Sums())
print(trainer.run_dir)
"""


@pytest.mark.slow
@pytest.mark.parametrize("open_file", [False, True])
def test_a_lightning_datamodule_run_replays_in_a_fresh_process(tmp_path, open_file):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(open_file=open_file)))
    done = _procs.run(
        [
            sys.executable,
            "-W",
            "error::UserWarning:engine.listeners.journal",
            str(script),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "could not be pickled" not in done.stderr
    run = Path(done.stdout.strip().splitlines()[-1])
    assert (run / "data.pkl").is_file()
    script.unlink()  # the replay must not need it
    replayed = _procs.run(
        [sys.executable, "-m", "engine", "replay", str(run), "--trust-code"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "replayed 15 steps (1..15)" in replayed.stdout
    assert "bitwise identical" in replayed.stdout
    # what was pickled: the datamodule without its trainer, or how to make it again
    from engine.checkpoint._data import references

    made_again = references((run / "data.pkl").read_bytes())
    assert made_again == ([("the data source", "__main__.Sums(n=40, batch_size=8)")] * open_file)


def test_a_run_on_a_loader_with_persistent_workers_replays(tmp_path):
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import engine as eg
    from engine import optim

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, generator=g)
    loader = DataLoader(
        TensorDataset(x, x.sum(1, keepdim=True)),
        batch_size=6,
        num_workers=1,
        persistent_workers=True,
    )
    next(iter(loader))  # a look at a batch first: the loader keeps its workers' iterator
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.05), lr=0.05)
    trainer = eg.Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Journal")
        trainer.fit(task, task.init(torch.nn.Linear(3, 1)), loader)
    assert (Path(trainer.run_dir) / "data.pkl").is_file()
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical and report.steps == 8, str(report)
