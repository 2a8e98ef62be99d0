"""DDP data as Lightning 2.6, with Lightning itself as the oracle: the same program on 2 gloo
ranks under ``strategy="ddp"`` in Lightning and in engine takes the same batches on every rank
(Lightning's ``use_distributed_sampler`` replaces a training loader's sampler, shuffled or not,
with ``DistributedSampler(shuffle=True, seed)`` and calls ``set_epoch`` each epoch; evaluation
loaders get ``DistributedSampler(shuffle=False)``, padded), so every rank's per-step training
losses are bitwise Lightning's for 50 steps over 2 epochs and the validation loss (Lightning's
``sync_dist=True``, engine's mean over ranks) is the same number."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    args = json.loads(sys.argv[1])
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    train = TensorDataset(torch.randn(203, 6, generator=g), torch.randn(203, 3, generator=g))
    val = TensorDataset(torch.randn(101, 6, generator=g), torch.randn(101, 3, generator=g))
    train_loader = DataLoader(train, batch_size=4, shuffle=args["shuffle"])
    val_loader = DataLoader(val, batch_size=5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    rank = int(os.environ["RANK"])
    losses = []

    if args["framework"] == "lightning":
        import pytorch_lightning as pl

        pl.seed_everything(args["seed"], verbose=False)

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = model

            def training_step(self, batch, i):
                loss = F.mse_loss(self.net(batch[0]), batch[1])
                losses.append(loss.item())
                return loss

            def validation_step(self, batch, i):
                self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-2)

        trainer = pl.Trainer(
            accelerator="cpu", strategy="ddp", devices=2, max_epochs=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(Module(), train_loader, val_loader)
        val_loss = float(trainer.callback_metrics["val_loss"])
    else:
        import engine as eg
        from engine import optim

        class Record(eg.Listener):
            def on_train_batch_end(self, rec):
                losses.append(float(rec.outputs["loss"]))

        task = eg.Task(
            lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adam(1e-2),
            eval_fn=lambda m, b: {"val_loss": F.mse_loss(m(b[0]), b[1])},
        )
        trainer = eg.Trainer(
            accelerator="cpu", strategy="ddp", devices=2, max_epochs=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[Record()], default_root_dir=args["root"],
        )
        trainer.fit(task, task.init(model, seed=args["seed"]), train_loader, val_loader)
        val_loss = float(trainer.callback_metrics["val_loss"])
    with open(os.path.join(args["root"], f"{args['framework']}-{rank}.json"), "w") as f:
        json.dump({"losses": losses, "val_loss": val_loss}, f)
    """
)


def _run(tmp_path: Path, framework: str, shuffle: bool, seed: int) -> None:
    script = tmp_path / "parity.py"
    script.write_text(SCRIPT)
    args = {"framework": framework, "shuffle": shuffle, "seed": seed, "root": str(tmp_path)}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("PL_GLOBAL_SEED", None)
    proc = torchrun([str(script), json.dumps(args)], 2, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize(("shuffle", "seed"), [(False, 0), (True, 7)])
def test_ddp_takes_lightnings_batches_on_every_rank_bitwise(tmp_path, shuffle, seed):
    for framework in ("lightning", "engine"):
        _run(tmp_path, framework, shuffle, seed)
    for rank in (0, 1):
        ours = json.loads((tmp_path / f"engine-{rank}.json").read_text())
        theirs = json.loads((tmp_path / f"lightning-{rank}.json").read_text())
        # 203 samples padded to 204, 102 a rank in batches of 4: 26 steps an epoch, 2 epochs
        assert len(theirs["losses"]) == 52
        assert ours["losses"] == theirs["losses"], rank  # bitwise, every step, every rank
        # 101 validation samples padded to 102 (one counted twice, as Lightning counts it)
        assert abs(ours["val_loss"] - theirs["val_loss"]) <= 1e-7 * abs(theirs["val_loss"])
