"""The Trainer's own launches of a data-parallel fit: ``"ddp_spawn"`` / ``"ddp_fork"`` return
rank 0's final state to the caller, two "nodes" on loopback join one group, a rank that raises
ends the run with its error, ``sync_dist`` reduces an epoch value over the ranks, and what one
process prints is printed once. Each run is a fresh process tree with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim
    from engine.metrics import LogOptions

    def loss_fn(m, b):
        x, y = b
        loss = F.mse_loss(m(x), y)
        return loss, {"first": x[:, 0].mean()}

    class Raise(eg.Listener):
        def __init__(self, rank, at):
            self.rank, self.at = rank, at

        def on_train_batch_end(self, rec):
            if rec.run.global_rank == self.rank and rec.batch_idx == self.at:
                raise ValueError("rank %d gave up on purpose" % self.rank)

    def main():
        args = json.loads(sys.argv[1])
        torch.set_num_threads(1)
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
        loader = DataLoader(ds, batch_size=args["batch"], shuffle=True)
        if args.get("distributed_order"):  # one process reading the order DDP deals out
            from torch.utils.data import DistributedSampler
            order = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
            loader = DataLoader(ds, batch_size=args["batch"], sampler=order)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 3))
        options = {"first": LogOptions(on_step=True, on_epoch=True, sync_dist=args["sync"])}
        task = eg.Task(loss_fn, optim.adamw(1e-2), log_options=options,
                       eval_fn=lambda m, b: {"loss": F.mse_loss(m(b[0]), b[1])})
        callbacks = [Raise(*args["raise"])] if args.get("raise") else []
        if args.get("best"):  # ranked by a rank-local value: each rank would pick its own
            callbacks.append(eg.listeners.ModelCheckpoint(
                monitor="train/first_step", mode="min", save_top_k=1, every_n_train_steps=1))
        trainer = eg.Trainer(
            accelerator="cpu", strategy=args["strategy"], devices=args["devices"],
            num_nodes=args.get("num_nodes", 1), max_epochs=1, default_root_dir=args["root"],
            enable_progress_bar=False, logger=False, enable_checkpointing=bool(args.get("best")),
            callbacks=callbacks or None, log_every_n_steps=1,
        )
        out = trainer.fit(task, task.init(model, seed=0), loader)
        if args.get("best"):
            trainer.validate(task, out, loader, ckpt_path="best", verbose=False)
            print("rank", trainer.global_rank, "validated", trainer.ckpt_path, flush=True)
        rank = trainer.global_rank
        torch.save(
            {"params": {k: v.detach().clone() for k, v in out.params.items()},
             "step": out.step, "metrics": dict(trainer.callback_metrics),
             "pid": os.getpid()},
            os.path.join(args["root"], f"final-{rank}-{os.getpid()}.pt"),
        )
        print("returned to pid", os.getpid(), "as rank", rank, "of", trainer.world_size)

    if __name__ == "__main__":
        main()
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "ENGINE_LAUNCHED_BY",
    ):
        env.pop(k, None)
    # the ranks share one stdout pipe: unbuffered (as CI's environment may be), print's pieces
    # from two ranks interleave mid-line; buffered, each flushed line is one write
    env.pop("PYTHONUNBUFFERED", None)
    env.update(extra)
    return env


def _run(tmp_path: Path, args: dict, *, timeout: float = 150, **env: str):
    script = tmp_path / "launch_fit.py"
    script.write_text(SCRIPT)
    args = {"sync": False, **args}
    return _procs.run(
        [sys.executable, str(script), json.dumps(args)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _finals(root: Path) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted(root.glob("final-*.pt"))]


def _ok(proc) -> None:
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: one process on the whole batch, reading the order DDP deals over its
    ranks (Lightning's DistributedSampler(shuffle=True, seed=0)), run once for the module."""
    tmp_path = tmp_path_factory.mktemp("one")
    root = tmp_path / "one"
    args = {"strategy": "auto", "devices": 1, "batch": 16, "root": str(root)}
    _ok(_run(tmp_path, {**args, "distributed_order": True}))
    (final,) = _finals(root)
    return final


def _close(a: dict, b: dict) -> None:
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_spawned_ranks_return_rank_zeros_final_state_to_the_caller(tmp_path, strategy, one):
    root = tmp_path / strategy
    proc = _run(tmp_path, {"strategy": strategy, "devices": 2, "batch": 8, "root": str(root)})
    _ok(proc)
    (final,) = _finals(root)  # saved by the caller alone, from the state the fit returned
    assert proc.stdout.count("returned to pid") == 1
    assert final["step"] == one["step"] == 4
    _close(final["params"], one["params"])
    assert proc.stdout.count("Trainable params") == 1  # the summary, printed by rank 0


def test_two_nodes_on_loopback_join_one_group(tmp_path, one):
    root = tmp_path / "nodes"
    port = str(free_port())
    args = {"strategy": "ddp", "devices": 1, "num_nodes": 2, "batch": 8, "root": str(root)}
    script = tmp_path / "launch_fit.py"
    script.write_text(SCRIPT)
    procs = [
        _procs.Popen(
            [sys.executable, str(script), json.dumps({"sync": False, **args})],
            env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    assert "as rank 0 of 2" in outs[0][0] and "as rank 1 of 2" in outs[1][0]
    for final in _finals(root):
        _close(final["params"], one["params"])


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_rank_that_raises_ends_the_run_with_its_error(tmp_path, strategy):
    proc = _run(
        tmp_path,
        {
            "strategy": strategy,
            "devices": 2,
            "batch": 8,
            "root": str(tmp_path / "r"),
            "raise": [1, 1],
        },
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rank 1 gave up on purpose" in proc.stderr, proc.stderr[-4000:]


def test_sync_dist_reduces_an_epoch_value_over_the_ranks(tmp_path, one):
    root = tmp_path / "sync"
    _ok(
        _run(
            tmp_path, {"strategy": "ddp", "devices": 2, "batch": 8, "root": str(root), "sync": True}
        )
    )
    synced = [f["metrics"]["train/first_epoch"] for f in _finals(root)]
    assert synced[0] == synced[1]  # every rank holds the reduced value
    assert abs(synced[0] - one["metrics"]["train/first_epoch"]) < 1e-6
    root = tmp_path / "local"
    _ok(_run(tmp_path, {"strategy": "ddp", "devices": 2, "batch": 8, "root": str(root)}))
    local = [f["metrics"]["train/first_epoch"] for f in _finals(root)]
    assert local[0] != local[1]  # each rank's own shard, as Lightning without sync_dist


def test_ckpt_path_best_is_rank_zeros_checkpoint_on_every_rank(tmp_path):
    root = tmp_path / "best"
    proc = _run(
        tmp_path, {"strategy": "ddp", "devices": 2, "batch": 8, "root": str(root), "best": True}
    )
    _ok(proc)
    loaded = sorted(
        line.split(" validated ")[1] for line in proc.stdout.splitlines() if " validated " in line
    )
    assert len(loaded) == 2 and loaded[0] == loaded[1], loaded
    assert [p.name for p in (root / "checkpoints").iterdir()] == [Path(loaded[0]).name]
