"""A learning-rate sweep on scikit-learn's digits: 8 rates in ONE vmapped run.

    python examples/ensemble_sweep.py [--epochs 10] [--seed 0] [--root runs/ensemble_sweep]

``ensemble.sweep`` makes 8 copies of one MLP, each with its own AdamW learning rate (held in the
optimizer state by ``optim.inject_hyperparams``, stacked on a member axis), and
``ensemble.ensemble_step`` trains all 8 in one ``torch.func.vmap``-ed step under the Trainer:
each member's loss and accuracy are logged under its own name (``train/loss/lr=0.001``, ...,
in ``metrics.csv`` under ``--root``). Member ``i`` ends where a separate run with rate ``i``
would (to 1e-6; bitwise where the kernels allow, ``tests/test_ensemble.py``). The digits ship
with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import ensemble, optim

RATES = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def load(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train / test splits (1,437 / 360 images), fixed by ``seed``."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs/ensemble_sweep", help="where logs go")
    args = p.parse_args(argv)

    train, test = load(args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3, weight_decay=1e-2)
    state = ensemble.sweep(eg.TrainState.create(model, tx, seed=args.seed), lr=RATES)
    names = ensemble.member_names(state, "lr")  # lr=0.0001, lr=0.0003, ...
    task = eg.Task(
        step_fn=ensemble.ensemble_step(loss_fn, tx, names=names),
        eval_fn=ensemble.ensemble_eval(loss_fn, names=names),
    )
    loader = DataLoader(train, batch_size=64, sampler=eg.data.ShuffleSampler(train, seed=args.seed))
    trainer = eg.Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=eg.CSVLogger(args.root),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    state = trainer.fit(task, state, loader)
    seconds = time.perf_counter() - start

    x, y = test.tensors
    metrics = eg.eval_step(task.eval_fn)(state, (x, y))  # every member on the test set
    results = {n: float(metrics[f"acc/{n}"]) for n in names}
    print(f"{len(names)} learning rates, {state.step} steps each, in one run of {seconds:.1f} s")
    for name, acc in results.items():
        print(f"  {name:<10} test accuracy {acc:.3f}")
    best = max(results, key=results.__getitem__)
    print(f"best: {best} ({results[best]:.3f}); take it out with ensemble.member(state, i)")
    return results


if __name__ == "__main__":
    main()
