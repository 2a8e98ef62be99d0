"""A Lightning program ported to engine, piece by piece (docs/lightning.md walks through it).

    python examples/lightning_port.py [--epochs 15] [--root runs/port]

The Lightning original: a small CNN on scikit-learn's digits with a ``LightningDataModule``,
``ModelCheckpoint`` and ``EarlyStopping`` on ``val_loss``, a ``LearningRateMonitor``,
``ReduceLROnPlateau`` from ``configure_optimizers``, TensorBoard and CSV loggers, a
dataset-level F1 from torchmetrics, then ``test`` on the best checkpoint and ``predict``.
Each piece below says what it was in Lightning. Needs scikit-learn and torchmetrics.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import torchmetrics
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import checkpoint, optim
from engine.listeners import EarlyStopping, LearningRateMonitor, ModelCheckpoint, ReduceLROnPlateau
from engine.loggers import CSVLogger, TensorBoardLogger
from engine.metrics import LogOptions


class DigitsDataModule:
    """Lightning's DataModule protocol, unchanged: engine calls ``prepare_data``,
    ``setup(stage)``, the ``*_dataloader`` methods and ``teardown(stage)`` where Lightning does
    (a ``pytorch_lightning.LightningDataModule`` subclass works as it is)."""

    def __init__(self, batch_size: int = 64, seed: int = 0) -> None:
        self.batch_size, self.seed = batch_size, seed

    def prepare_data(self) -> None:
        load_digits()  # ships with scikit-learn: nothing to download

    def setup(self, stage: str) -> None:
        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        y = torch.tensor(y)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        test, val, train = order[:360], order[360:540], order[540:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])
        self.test_set = TensorDataset(x[test], y[test])

    def train_dataloader(self) -> DataLoader:
        # shuffle=True is fine: the Trainer seeds the order from the state's seed and the epoch
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)


def make_model() -> nn.Module:
    """The LightningModule's network (its ``__init__`` / ``forward``)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def make_task(lr: float = 3e-3) -> eg.Task:
    """``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` and
    ``configure_optimizers``, as pure functions."""
    # self.val_f1 = torchmetrics.F1Score(...) in the LightningModule: dataset-level, updated per
    # batch, computed and reset at each epoch's end
    f1 = torchmetrics.F1Score(task="multiclass", num_classes=10, average="macro")

    def training_step(model, batch):
        x, y = batch
        logits = model(x)
        # self.log("train_acc", acc, prog_bar=True)
        return F.cross_entropy(logits, y), {"train_acc": (logits.argmax(-1) == y).float().mean()}

    def evaluate(prefix: str):
        def step(model, batch):
            x, y = batch
            logits = model(x)
            f1.update(logits.argmax(-1), y)
            return {
                f"{prefix}_loss": F.cross_entropy(logits, y),  # self.log("val_loss", loss)
                f"{prefix}_acc": (logits.argmax(-1) == y).float().mean(),
                f"{prefix}_f1": f1,  # self.log("val_f1", self.val_f1)
            }

        return step

    # configure_optimizers: AdamW and {"scheduler": ReduceLROnPlateau, "monitor": "val_loss"};
    # the learning rate the plateau changes lives in the optimizer state
    tx = optim.inject_hyperparams(optim.adamw)(lr=lr, weight_decay=1e-4)
    return eg.Task(
        training_step,
        tx,
        eval_fn=evaluate("val"),
        test_fn=evaluate("test"),
        predict_fn=lambda model, batch: model(batch[0]).argmax(-1),
        log_options={
            "train_acc": LogOptions(prog_bar=True),
            "val_acc": LogOptions(prog_bar=True),
        },
        hparams={"lr": lr, "weight_decay": 1e-4, "model": "cnn-16-32"},  # save_hyperparameters
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs/port", help="where logs and checkpoints go")
    args = p.parse_args(argv)

    dm = DigitsDataModule(seed=args.seed)
    task = make_task()
    torch.manual_seed(args.seed)  # seed_everything: the initial weights
    state = task.init(make_model(), seed=args.seed)
    best = ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.3f}")
    trainer = eg.Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=[TensorBoardLogger(args.root), CSVLogger(args.root)],
        callbacks=[
            best,
            EarlyStopping(monitor="val_loss", patience=5),
            LearningRateMonitor(logging_interval="epoch"),
            ReduceLROnPlateau(monitor="val_loss", patience=2, factor=0.5),
        ],
        log_every_n_steps=10,
    )
    state = trainer.fit(task, state, datamodule=dm)
    (results,) = trainer.test(task, state, datamodule=dm, ckpt_path="best", verbose=False)
    predictions = trainer.predict(task, state, datamodule=dm)
    assert predictions is not None

    # load_from_checkpoint for inference: the weights alone, into a fresh module
    model = make_model()
    checkpoint.load_weights(best.best_model_path, model)
    print(
        f"best checkpoint {best.best_model_path} (val_loss {float(best.best_model_score):.4f}); "
        f"test accuracy {results['test_acc']:.2%}, test F1 {results['test_f1']:.3f}; "
        f"{sum(len(p) for p in predictions)} predictions; hyperparameters "
        f"{checkpoint.read_hparams(best.best_model_path)}"
    )
    return results


if __name__ == "__main__":
    main()
