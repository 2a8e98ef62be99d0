"""Lightning's ``examples/pytorch/basics/autoencoder.py``, ported to engine, on digits.

    python examples/autoencoder.py --config examples/autoencoder.yaml [--trainer.max_epochs=3]
    cd examples && engine fit --config autoencoder.yaml     # the same pieces, the command

Lightning's program: a ``LightningCLI(run=False)`` building an autoencoder (``LitAutoEncoder``),
a ``LightningDataModule`` with four loaders and an ``ImageSampler`` callback from the command
line, then ``fit``, ``test(ckpt_path="best")`` and ``predict(ckpt_path="best")``. Here: the
model is a plain ``nn.Module``, its ``training_step`` / ``validation_step`` / ``test_step`` /
``predict_step`` a :class:`engine.Task` (``self.log(..., on_step=True)`` becomes
``LogOptions(on_step=True)``), the datamodule stays a datamodule, the callback is a listener,
and :func:`engine.cli.build` is ``run=False``. scikit-learn's digits (8x8 images, shipped with
it) stand in for MNIST: nothing is downloaded.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim
from engine.metrics import LogOptions


class AutoEncoder(nn.Module):
    """``LitAutoEncoder``'s network: 64 pixels -> ``hidden_dim`` -> 3 -> ``hidden_dim`` -> 64."""

    def __init__(self, hidden_dim: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x.flatten(1)))


def _reconstruction(model: nn.Module, batch: Any) -> torch.Tensor:
    x, _ = batch
    return F.mse_loss(model(x), x.flatten(1))


def make_task(learning_rate: float = 1e-3) -> eg.Task:
    """``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` and
    ``configure_optimizers`` (``torch.optim.Adam(self.parameters(), lr)``)."""
    on_step = LogOptions(on_step=True)
    return eg.Task(
        lambda m, b: (loss := _reconstruction(m, b), {"train_loss": loss}),
        optim.adam(learning_rate),
        eval_fn=lambda m, b: {"val_loss": _reconstruction(m, b)},
        test_fn=lambda m, b: {"test_loss": _reconstruction(m, b)},
        predict_fn=lambda m, b: m(b[0]),
        log_options={"train_loss": on_step, "val_loss": on_step, "test_loss": on_step},
        hparams={"learning_rate": learning_rate},
    )


class DigitsDataModule:
    """``MyDataModule``: train / val / test / predict loaders (digits: 1,437 train, 180 val,
    180 test; predict on the test split)."""

    def __init__(self, batch_size: int = 32) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        test, val, train = order[:180], order[180:360], order[360:]
        make = lambda idx: TensorDataset(x[idx], torch.tensor(y)[idx])  # noqa: E731
        self.train, self.val, self.test = make(train), make(val), make(test)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)


class ImageSampler(eg.Listener):
    """``ImageSampler``: at each training epoch's end, on rank 0, reconstruct a few validation
    images and save them with the originals (``samples-epoch=N.pt`` in the run directory,
    where Lightning's saves a torchvision grid to its logger)."""

    rank_zero_only = True  # one process writes them, as Lightning's @rank_zero_only

    def __init__(self, num_samples: int = 8) -> None:
        self.num_samples = num_samples
        self.saved: list[str] = []

    def on_train_epoch_end(self, rec: eg.EventRecord) -> None:
        dm = rec.run.datamodule
        if dm is None or rec.state is None:
            return
        x = dm.val.tensors[0][: self.num_samples]
        # pl_module(x) in eval mode: the state's weights, read (not consumed), no gradients
        out = eg.predict_step(lambda model, batch: model(batch))(rec.state, x)
        path = os.path.join(rec.run.log_dir or ".", f"samples-epoch={rec.run.current_epoch}.pt")
        # clones: a slice saved as it is would carry the whole split's storage with it
        pair = {"images": x.reshape(-1, 8, 8).clone(), "reconstructions": out.reshape(-1, 8, 8)}
        torch.save(pair, path)
        self.saved.append(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from engine.cli import build

    cli = build(argv)  # LightningCLI(..., run=False): the config and overrides, nothing run
    state = cli.trainer.fit(cli.task, cli.state, datamodule=cli.datamodule)
    (tested,) = cli.trainer.test(datamodule=cli.datamodule, ckpt_path="best", verbose=False)
    predictions = cli.trainer.predict(datamodule=cli.datamodule, ckpt_path="best")
    first = predictions[0]
    best = cli.trainer.checkpoint_callback.best_model_path
    print(f"trained {state.step} steps; best checkpoint {best}")
    print(f"test_loss (best) = {tested['test_loss_epoch']:.5f}; predictions[0]: {first.shape}")
    return {"state": state, "test": tested, "predictions": predictions, "trainer": cli.trainer}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # class_path: autoencoder.*
    main()
