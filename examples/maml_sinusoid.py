"""MAML on sinusoid regression (Finn et al., 2017, section 5.1), under the Trainer.

    python examples/maml_sinusoid.py [--steps 300] [--meta-batch 10] [--seed 0] [--root runs/maml]

Each task is a sine wave ``y = A sin(x - phase)`` (A in [0.1, 5], phase in [0, pi]); a model
sees K = 10 points of a new task (the support set), takes one SGD step on them, and is scored
on 10 other points (the query set). MAML trains the initial weights so that this one step
works: the loss of a batch of tasks is the query loss *after* adaptation, and its gradient
goes through the inner SGD step, second derivatives included.

In engine the inner step is ``optim.sgd(0.01)`` run by ``optim.differentiable_step``, and the
whole of MAML is the Task's loss function, ``meta.maml_loss``: the outer step is an ordinary
train step with Adam, so the Trainer checkpoints it, resumes it bitwise and replays it like any
other fit. Validation reports the post-adaptation query loss on held-out tasks (the inner step
runs inside the evaluation step, with gradients of its own). The tasks are generated from a
seed: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import engine as eg
from engine import meta, optim

SHOTS = 10  # K: support (and query) points per task
INNER_LR = 0.01  # the paper's
# The paper's outer Adam runs at 1e-3 for 70,000 steps; 1e-2 gets most of the way in 300.
OUTER_LR = 1e-2


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def make_task(inner_steps: int = 1, first_order: bool = False) -> eg.Task:
    loss = meta.maml_loss(mse, optim.sgd(INNER_LR), inner_steps, first_order=first_order)
    return eg.Task(loss, optim.adam(OUTER_LR))


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )  # fmt: skip


def loaders(steps: int, meta_batch: int, seed: int) -> tuple[DataLoader, DataLoader]:
    """One epoch of ``steps`` batches of ``meta_batch`` tasks, and 200 held-out tasks."""
    train = meta.Sinusoid(steps * meta_batch, shots=SHOTS, seed=seed)
    held_out = meta.Sinusoid(200, shots=SHOTS, seed=seed + 1_000_003)  # tasks never trained on
    return (
        DataLoader(train, batch_size=meta_batch, shuffle=True),
        DataLoader(held_out, batch_size=50),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="outer (meta) steps")
    parser.add_argument("--meta-batch", type=int, default=10, help="tasks per outer step")
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--first-order", action="store_true", help="first-order MAML")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="runs/maml")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)  # the initial weights (the script's choice, not the engine's)
    task = make_task(args.inner_steps, args.first_order)
    state = task.init(make_model(), seed=args.seed)
    train, held_out = loaders(args.steps, args.meta_batch, args.seed)
    trainer = eg.Trainer(
        max_epochs=1,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        check_val_every_n_epoch=1,
    )

    def post_adaptation_loss(state: eg.TrainState) -> float:
        return trainer.validate(task, state, held_out)[0]["val/loss"]

    before = post_adaptation_loss(state)
    print(f"held-out query loss after {args.inner_steps} inner step(s), before meta-training: "
          f"{before:.3f}")  # fmt: skip
    start = time.perf_counter()
    state = trainer.fit(task, state, train)
    seconds = time.perf_counter() - start
    after = post_adaptation_loss(state)
    print(f"held-out query loss after {args.inner_steps} inner step(s), after {state.step} "
          f"meta-steps ({seconds:.1f} s): {after:.3f}")  # fmt: skip
    return {"before": before, "after": after, "step": state.step, "seconds": seconds}


if __name__ == "__main__":
    main()
