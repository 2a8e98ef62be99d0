"""``Trainer(strategy=FSDP(...))`` under torchrun, 2 gloo ranks, against DDP and one process.

The step-level equality is tests/test_fsdp.py's; here the driver around it: the loaders'
sharding, the epoch's metrics over every rank, validation, test and predict through the bind
hook, the journal, and a state that comes back sharded.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import _procs
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_ddp_trainer import _close, _final, _ok, _python, _torchrun

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim
    from engine.parallel.fsdp import FSDP

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(160, 6, generator=g), torch.randn(160, 3, generator=g))
    loader = DataLoader(ds, batch_size=args["batch"], shuffle=True)
    if args.get("distributed_order"):  # one process reading the order DDP deals out
        from torch.utils.data import DistributedSampler
        order = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=args["batch"], sampler=order)
    val = DataLoader(ds, batch_size=args["batch"])
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2, weight_decay=0.01),
                   eval_fn=lambda m, b: {"loss": F.mse_loss(m(b[0]), b[1])},
                   predict_fn=lambda m, b: m(b[0]))
    strategy = {"fsdp": lambda: FSDP(**args.get("options", {}))}.get(
        args["strategy"], lambda: args["strategy"])()
    trainer = eg.Trainer(
        accelerator="cpu", strategy=strategy, devices=args["devices"], max_epochs=2,
        accumulate_grad_batches=2, gradient_clip_val=0.5, default_root_dir=args["root"],
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        enable_checkpointing=False,
    )
    out = trainer.fit(task, task.init(model, seed=0), loader, val)
    sharded = out.sharded
    if args.get("save"):  # every rank, as Lightning's save_checkpoint
        trainer.save_checkpoint(os.path.join(args["root"], "saved"))
    tested = trainer.test(task, out, val, verbose=False)[0]
    predicted = trainer.predict(task, out, DataLoader(ds, batch_size=40))
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    params = {k: full(v).detach().clone() for k, v in out.params.items()}
    if trainer.is_global_zero:
        torch.save({"params": params, "step": out.step, "sharded": sharded,
                    "world_size": trainer.world_size, "test": tested,
                    "predicted": torch.cat(predicted).shape[0],
                    "metrics": dict(trainer.callback_metrics)},
                   os.path.join(args["root"], "final.pt"))
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "fsdp_script.py"
    path.write_text(SCRIPT)
    return path


def test_fsdp_fit_validate_test_predict_equal_one_process_and_ddp(tmp_path):
    script = _script(tmp_path)
    one, ddp, fsdp = tmp_path / "one", tmp_path / "ddp", tmp_path / "fsdp"
    # one process reading the order DDP and FSDP deal over ranks (Lightning's
    # DistributedSampler(shuffle=True, seed=0)) on the whole batch
    single = {"devices": 1, "batch": 16, "root": str(one), "strategy": "auto"}
    _ok(_python(script, {**single, "distributed_order": True}))
    _ok(_torchrun(script, {"devices": 2, "batch": 8, "root": str(ddp), "strategy": "ddp"}))
    _ok(_torchrun(script, {"devices": 2, "batch": 8, "root": str(fsdp), "strategy": "fsdp"}))
    a, d, f = _final(one), _final(ddp), _final(fsdp)
    assert f["sharded"] and not d["sharded"] and f["world_size"] == 2
    assert a["step"] == d["step"] == f["step"] == 10
    _close(f["params"], a["params"])
    _close(f["params"], d["params"])
    # validation over every rank's shard is the whole set's; the training loss (not synced,
    # as Lightning's sync_dist=False) is rank 0's own, as under DDP
    assert abs(f["metrics"]["val/loss"] - a["metrics"]["val/loss"]) < 1e-6
    assert abs(f["metrics"]["train/loss_epoch"] - d["metrics"]["train/loss_epoch"]) < 1e-6
    assert abs(f["test"]["test/loss"] - a["test"]["test/loss"]) < 1e-6
    # each rank predicts its shard of the 160 samples
    assert f["predicted"] == 80 and a["predicted"] == 160


@pytest.mark.parametrize("name", ["fsdp", "deepspeed_stage_2"])
def test_strategy_names_run_fsdp_and_train_as_ddp(tmp_path, name):
    script = _script(tmp_path)
    ddp, named = tmp_path / "ddp", tmp_path / "named"
    _ok(_torchrun(script, {"devices": 2, "batch": 8, "root": str(ddp), "strategy": "ddp"}))
    proc = _torchrun(script, {"devices": 2, "batch": 8, "root": str(named), "strategy": name})
    _ok(proc)
    d, f = _final(ddp), _final(named)
    assert f["sharded"] and f["step"] == d["step"] == 10
    _close(f["params"], d["params"])


SPAWN = textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim
    from engine.parallel.fsdp import FSDP

    def main():
        torch.set_num_threads(1)
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(),
                                    torch.nn.Linear(7, 3))
        task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2))
        trainer = eg.Trainer(
            accelerator="cpu", strategy=FSDP(start_method="spawn"), devices=2, max_epochs=1,
            default_root_dir=sys.argv[1], enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, logger=False, enable_journal=False,
        )
        out = trainer.fit(task, task.init(model, seed=0), DataLoader(ds, batch_size=8))
        assert not out.sharded, "a spawned run returns the whole state"
        x = torch.randn(4, 6)
        y = eg.ModelView(out.module, out.params, out.buffers)(x)  # usable in the caller
        print("returned", out.step, tuple(out.params["0.weight"].shape), tuple(y.shape))

    if __name__ == "__main__":
        main()
    """
)


def test_a_spawned_fsdp_run_returns_the_whole_state(tmp_path):

    from test_ddp_trainer import _env

    script = tmp_path / "spawn_fsdp.py"
    script.write_text(SPAWN)
    proc = _procs.run(
        [sys.executable, str(script), str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    _ok(proc)
    assert "returned 4 (7, 6) (4, 3)" in proc.stdout


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_state_dict_type_decides_the_checkpoints_layout(tmp_path, kind):
    import torch

    import engine as eg
    from engine import checkpoint, optim

    script = _script(tmp_path)
    root = tmp_path / kind
    args = {"devices": 2, "batch": 8, "root": str(root), "strategy": "fsdp", "save": True,
            "options": {"state_dict_type": kind}}  # fmt: skip
    _ok(_torchrun(script, args))
    saved = root / "saved"
    meta = checkpoint.inspect(saved)
    assert (meta.get("layout") == "sharded") == (kind == "sharded"), meta.get("layout")
    assert (saved / "tensors.pt").exists() == (kind == "full")
    # either loads on one process as the run's gathered state
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    template = eg.TrainState.create(model, optim.adamw(1e-2, weight_decay=0.01))
    back = checkpoint.load(saved, template)
    final = _final(root)
    assert back.step == final["step"] == 10
    _close(back.params, final["params"], tol=0.0)
