"""A GAN on scikit-learn's two moons: two optimizers updated in one pure step, under the Trainer.

    python examples/gan.py [--epochs 100] [--seed 0] [--root runs/gan]

Lightning writes this with manual optimization (``self.automatic_optimization = False`` and two
optimizers from ``configure_optimizers``). Here the generator and the discriminator live in one
``TrainState`` (one module, two parameter groups with an Adam each through
``optim.multi_transform``), and one pure step ``gan_step(state, batch) -> (state, metrics)``
updates the discriminator, then the generator. The Trainer drives it like any step: epochs,
validation, checkpoints, exact resume and replay. The data (2-D points) is made by scikit-learn:
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import make_moons
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim

NOISE = 8  # the generator's input size
# the two optimizers, by parameter group (a parameter's group is its name's first part)
OPTIMIZERS = {
    "gen": optim.adam(1e-3, betas=(0.5, 0.999)),
    "disc": optim.adam(1e-3, betas=(0.5, 0.999)),
}


def _group(params: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: k.split(".")[0] for k in params}


class GAN(nn.Module):
    """A generator (noise -> point) and a discriminator (point -> logit) in one module;
    ``model("gen", z)`` and ``model("disc", x)`` call them (also through a state's view)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.gen = nn.Sequential(
            nn.Linear(NOISE, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 2),
        )  # fmt: skip
        self.disc = nn.Sequential(
            nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, net: str, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, net)(x)


def _grads(loss: torch.Tensor, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def gan_step(state: eg.TrainState, batch: tuple[torch.Tensor]) -> tuple[eg.TrainState, dict]:
    """One batch: a discriminator step, then a generator step. Pure: the noise comes from the
    generator the Trainer seeds from ``(seed, step)``, every tensor from ``state``."""
    (real,) = batch
    model = eg.ModelView(state.module, state.params, state.buffers)
    groups = _group(state.params)
    mine = {g: {k: p for k, p in state.params.items() if groups[k] == g} for g in OPTIMIZERS}
    inner = dict(state.opt_state.inner)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    z = torch.randn(len(real), NOISE)

    # the discriminator learns to tell real points (1) from generated ones (0) ...
    fake = model("gen", z).detach()
    d_loss = F.binary_cross_entropy_with_logits(
        model("disc", real), ones
    ) + F.binary_cross_entropy_with_logits(model("disc", fake), zeros)
    _, inner["disc"] = optim.apply_gradients(
        OPTIMIZERS["disc"], _grads(d_loss, mine["disc"]), inner["disc"], mine["disc"], state.step
    )
    # ... then the generator learns to make it say "real"
    g_loss = F.binary_cross_entropy_with_logits(model("disc", model("gen", z)), ones)
    _, inner["gen"] = optim.apply_gradients(
        OPTIMIZERS["gen"], _grads(g_loss, mine["gen"]), inner["gen"], mine["gen"], state.step
    )
    new = state.replace(opt_state=type(state.opt_state)(inner), step=state.step + 1)
    return new, {"loss": d_loss.detach() + g_loss.detach(), "d_loss": d_loss, "g_loss": g_loss}


def sample_distance(model, batch: tuple[torch.Tensor]) -> dict[str, torch.Tensor]:
    """How far generated points lie from the real ones, and the real ones from them (the mean
    nearest-neighbour distances; 0 for a perfect generator)."""
    (real,) = batch
    fake = model("gen", torch.randn(len(real), NOISE))
    d = torch.cdist(fake, real)
    return {"dist": 0.5 * (d.min(dim=1).values.mean() + d.min(dim=0).values.mean())}


def make_task() -> eg.Task:
    return eg.Task(
        step_fn=gan_step,
        tx=optim.multi_transform(OPTIMIZERS, _group),
        eval_fn=sample_distance,
        prog_bar=("d_loss", "g_loss"),
    )


def moons(seed: int, n: int = 2000) -> TensorDataset:
    x, _ = make_moons(n_samples=n, noise=0.05, random_state=seed)
    x = torch.tensor(x, dtype=torch.float32)
    return TensorDataset((x - x.mean(0)) / x.std(0))


def loaders(seed: int) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(moons(seed), batch_size=128, shuffle=True)
    val = DataLoader(moons(seed + 1, n=1000), batch_size=1000)
    return train, val


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="runs/gan")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    task = make_task()
    state = task.init(GAN(), seed=args.seed)
    train, val = loaders(args.seed)
    trainer = eg.Trainer(
        max_epochs=args.epochs, default_root_dir=args.root, logger=False, check_val_every_n_epoch=10
    )
    before = trainer.validate(task, state, val, verbose=False)[0]["val/dist"]
    start = time.perf_counter()
    state = trainer.fit(task, state, train, val)
    after = trainer.validate(task, state, val, verbose=False)[0]["val/dist"]
    print(
        f"{state.step} steps in {time.perf_counter() - start:.1f} s; mean distance between "
        f"generated and real points: {before:.3f} before training, {after:.3f} after"
    )
    return {"before": before, "after": after, "step": state.step}


if __name__ == "__main__":
    main()
