"""Train a small MLP on scikit-learn's digits with engine's Trainer.

    python examples/digits.py [--epochs 30] [--seed 0] [--root runs/digits]

The digits data (1,797 8x8 images) ships inside scikit-learn: nothing is downloaded. The same
``Task`` drives a hand-written loop in ``examples/digits_loop.py``. Logs go to TensorBoard and
CSV under ``--root`` (``tensorboard --logdir runs/digits``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim
from engine.listeners import EarlyStopping
from engine.loggers import CSVLogger, TensorBoardLogger


def load(seed: int) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Train / validation / test splits (1,257 / 180 / 360 images), fixed by ``seed``."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, val, train = order[:360], order[360:540], order[540:]
    return (
        TensorDataset(x[train], y[train]),
        TensorDataset(x[val], y[val]),
        TensorDataset(x[test], y[test]),
    )


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def make_task(total_steps: int) -> eg.Task:
    schedule = optim.warmup_cosine(3e-3, warmup_steps=total_steps // 20, total_steps=total_steps)
    tx = optim.adamw(schedule, weight_decay=1e-2, mask=optim.decay_mask)
    hparams = {"lr": 3e-3, "weight_decay": 1e-2, "total_steps": total_steps}
    return eg.Task(loss_fn, tx, lr=schedule, prog_bar=["acc"], hparams=hparams)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(256, 10),
    )


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs/digits", help="where logs go")
    args = p.parse_args(argv)

    train, val, test = load(args.seed)
    # the order of epoch e is a function of (seed, e): a resume or a replay sees the same batches
    shuffle = eg.data.ShuffleSampler(train, seed=args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=shuffle)
    val_loader = DataLoader(val, batch_size=256)
    test_loader = DataLoader(test, batch_size=256)
    task = make_task(args.epochs * len(train_loader))

    torch.manual_seed(args.seed)  # the script owns its process: seed the initial weights
    state = task.init(make_model(), seed=args.seed)
    trainer = eg.Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=[TensorBoardLogger(args.root), CSVLogger(args.root)],
        callbacks=[EarlyStopping("val/loss", patience=8)],
        log_every_n_steps=10,
    )
    start = time.perf_counter()
    state = trainer.fit(task, state, train_dataloaders=train_loader, val_dataloaders=val_loader)
    elapsed = time.perf_counter() - start
    (result,) = trainer.test(task, state, dataloaders=test_loader, verbose=False)
    acc = result["test/acc"]
    print(
        f"digits: {len(train)} train / {len(val)} val / {len(test)} test images, "
        f"{state.num_params():,} parameters"
    )
    print(
        f"trained {trainer.current_epoch} epochs ({state.step} steps) in {elapsed:.1f}s; "
        f"val loss {trainer.callback_metrics['val/loss']:.4f}; "
        f"test accuracy {acc:.2%}; logs in {trainer.log_dir}"
    )
    # the `engine` command beside this interpreter (.venv/bin/engine after `make demo`)
    command = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "engine"))
    print(f"re-run and verify steps: {command} replay {trainer.run_dir} --trust-code --from N")
    return acc


if __name__ == "__main__":
    main()
