"""Train on scikit-learn's digits with differential privacy (DP-SGD) under engine's Trainer.

    python examples/dp_sgd.py [--epochs 15] [--noise 1.0] [--clip 1.0] [--seed 0]

Every optimizer step clips each example's gradient to ``--clip``, adds Gaussian noise of
standard deviation ``--noise * --clip`` to the sum, and divides by the expected batch size
(``engine.privacy.DPSGD``, plugged into the Trainer). At the end it prints the test accuracy and
the privacy spent, epsilon for ``--delta``, from Opacus's RDP accountant (``pip install opacus``;
without it the epsilon is not printed). The digits data (1,797 8x8 images) ships inside
scikit-learn: nothing is downloaded.

The accountant assumes Poisson sampling (each example joins a batch with probability
``batch_size / len(train)``); this script shuffles into fixed-size batches, the usual
approximation.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim, privacy
from engine.loggers import CSVLogger


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


def make_model() -> nn.Module:
    # no batch norm: it mixes the examples of a batch, which per-example gradients cannot have
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--noise", type=float, default=1.0, help="noise multiplier")
    p.add_argument("--clip", type=float, default=1.0, help="per-example clipping norm")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs/dp_sgd", help="where logs go")
    args = p.parse_args(argv)

    train, test = load(args.seed)
    # the order of epoch e is a function of (seed, e): a resume or a replay sees the same batches
    shuffle = eg.data.ShuffleSampler(train, seed=args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=shuffle)
    test_loader = DataLoader(test, batch_size=360)
    dp = privacy.DPSGD(
        max_grad_norm=args.clip,
        noise_multiplier=args.noise,
        sample_rate=args.batch_size / len(train),
        expected_batch_size=args.batch_size,
    )
    task = eg.Task(loss_fn, optim.adam(args.lr), prog_bar=["acc"])

    torch.manual_seed(args.seed)  # the script owns its process: seed the initial weights
    state = task.init(make_model(), seed=args.seed)
    trainer = eg.Trainer(
        max_epochs=args.epochs,
        plugins=[dp],
        default_root_dir=args.root,
        logger=CSVLogger(args.root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    start = time.perf_counter()
    state = trainer.fit(task, state, train_dataloaders=train_loader)
    elapsed = time.perf_counter() - start
    (result,) = trainer.test(task, state, dataloaders=test_loader, verbose=False)
    try:
        epsilon = privacy.epsilon(state, args.delta)
        spent = f"epsilon {epsilon:.2f} at delta {args.delta:g}"
    except ImportError:
        epsilon, spent = math.nan, "epsilon needs Opacus's accountant: pip install opacus"
    print(
        f"DP-SGD on digits: {len(train)} train / {len(test)} test images, noise multiplier "
        f"{args.noise}, clipping norm {args.clip}, {state.step} steps in {elapsed:.1f}s"
    )
    print(f"test accuracy {result['test/acc']:.2%}; {spent}")
    return {"acc": result["test/acc"], "epsilon": epsilon, "steps": state.step}


if __name__ == "__main__":
    main()
