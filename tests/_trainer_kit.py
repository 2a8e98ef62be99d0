"""What the Trainer's test files share (tests' helper): quiet flags, a model, batches, a
loss and task, a fake logger, an event recorder and the same run in Lightning."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}


def _trainer(**kwargs) -> eg.Trainer:
    return eg.Trainer(**{**QUIET, **kwargs})


def _linear() -> nn.Linear:
    # initialised from its own generator: the tests leave the global RNG alone too
    model = nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 3, generator=g))
        model.bias.copy_(torch.randn(1, generator=g))
    return model


def _batches(n: int = 10, size: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)
    ]


def _uneven_loader(n: int = 10, batch_size: int = 4, seed: int = 2) -> DataLoader:
    """Batches of 4, 4 and 2 samples: a plain mean of batch means would be wrong."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _task(**kwargs) -> eg.Task:
    return eg.Task(_mse, optim.sgd(0.1, momentum=0.9), **kwargs)


class FakeLogger:
    """Any object with log_metrics(metrics, step) and finalize(status) is a logger."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.statuses: list[str] = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def finalize(self, status):
        self.statuses.append(status)


class Recorder(eg.Listener):
    """Records (event, stage, batch_idx, dataloader_idx) for every event."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, int | None, int]] = []

    def __getattr__(self, name):
        if not name.startswith(("on_", "setup", "teardown")):
            raise AttributeError(name)

        def handle(rec):
            self.rows.append((name, rec.stage, rec.batch_idx, rec.dataloader_idx))

        return handle

    def of(self, event: str) -> list[tuple[str, str, int | None, int]]:
        return [r for r in self.rows if r[0] == event]


def _quiet_lightning():
    pl = pytest.importorskip("pytorch_lightning")
    warnings.filterwarnings("ignore")
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return pl


def _as_loader(batches) -> DataLoader:
    """The same batches as a DataLoader (what Lightning takes)."""
    xs, ys = zip(*batches, strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=len(xs[0]))


def _lightning(**kwargs):
    """A Lightning Trainer and a LightningModule that train like ``_task()`` on ``_linear()``."""
    pl = _quiet_lightning()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = _linear()

        def training_step(self, batch, batch_idx):
            loss = _mse(self.layer, batch)
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    off = {"enable_checkpointing": False, "enable_progress_bar": False}
    kwargs = {"logger": False, "enable_model_summary": False, **off, **kwargs}
    return pl.Trainer(**kwargs), Module()


def _hand_fit(task, state, batches, epochs, *, accumulate=1, clip=None):
    """The loop fit runs, written out over task.train_step(): Lightning steps the optimizer on
    the epoch's last batch even if the accumulation window is partial (flush=True)."""
    step = task.train_step(accumulate=accumulate, clip=clip)
    for epoch in range(epochs):
        for i, batch in enumerate(batches):
            state, _ = step(state, batch, flush=i == len(batches) - 1)
        state = state.replace(epoch=epoch + 1, batch_idx=0)
    return state


def _eval_fn(model, batch):
    x, y = batch
    mse = F.mse_loss(model(x), y)
    return {"mse": mse, "n": torch.tensor(float(len(x))), "hi": mse, "lo": mse}


def _expected_eval(model, loader):
    """The same metrics computed without the engine: sample-weighted MSE over the whole set."""
    with torch.no_grad():
        per_batch = [F.mse_loss(model(x), y) for x, y in loader]
        xs, ys = zip(*loader, strict=True)
        whole = F.mse_loss(model(torch.cat(xs)), torch.cat(ys))
    return {
        "mse": float(whole),
        "n": float(sum(len(x) for x in xs)),
        "hi": float(max(per_batch)),
        "lo": float(min(per_batch)),
    }
