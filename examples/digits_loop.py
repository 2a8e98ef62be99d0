"""Train on scikit-learn's digits with engine's pure steps in a hand-written loop (no Trainer).

    python examples/digits_loop.py [--epochs 30] [--seed 0]

The digits data (1,797 8x8 images) ships inside scikit-learn: nothing is downloaded. The loop
below is all there is: a frozen TrainState goes in, a new one comes out. Batches are shuffled by a
generator seeded from (seed, epoch), so the run is a pure function of its seed.
"""

from __future__ import annotations

import argparse
import time

import torch
from digits import loss_fn, make_model  # the same model and loss as the Trainer demo
from sklearn.datasets import load_digits

import engine as eg
from engine import optim


def load(seed: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def batches(x, y, batch_size: int, seed: int, epoch: int):
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 10_007 + epoch))
    for i in range(0, len(x), batch_size):
        idx = order[i : i + batch_size]
        yield x[idx], y[idx]


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    x_train, y_train, x_test, y_test = load(args.seed)
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    total = args.epochs * steps_per_epoch

    torch.manual_seed(args.seed)  # the script owns its process: seed the initial weights
    model = make_model()
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(
            optim.warmup_cosine(3e-3, warmup_steps=total // 20, total_steps=total),
            weight_decay=1e-2,
        ),
    )
    state = eg.TrainState.create(model, tx, seed=args.seed)
    train_step = eg.train_step(loss_fn, tx)
    eval_step = eg.eval_step(loss_fn)

    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images, "
        f"{state.num_params():,} parameters, {args.epochs} epochs"
    )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        state = state.replace(epoch=epoch, batch_idx=0)
        losses = []
        for batch in batches(x_train, y_train, args.batch_size, args.seed, epoch):
            state, metrics = train_step(state, batch)
            losses.append(metrics["loss"])  # tensors: no host sync inside the loop
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            test = eval_step(state, (x_test, y_test))
            print(
                f"epoch {epoch + 1:3d}  train loss {torch.stack(losses).mean():.4f}  "
                f"test loss {test['loss']:.4f}  test acc {test['acc']:.2%}"
            )
    elapsed = time.perf_counter() - start
    acc = float(eval_step(state, (x_test, y_test))["acc"])
    print(
        f"done: {state.step} steps in {elapsed:.1f}s, test accuracy {acc:.2%}, "
        f"state fingerprint {state.fingerprint()[:16]}"
    )
    return acc


if __name__ == "__main__":
    main()
