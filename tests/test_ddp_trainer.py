"""Trainer(strategy="ddp") on 2 gloo ranks, under torchrun and launched by the Trainer itself,
against one process: the same parameters, side effects on rank 0 only, stops agreed, a rank
that raises or is signalled ends every rank, resume in fresh processes and on another world
size.

Each run is a script in a fresh process tree (torchrun's, or the Trainer's own launch) with a
timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import _procs
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import free_port, torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = args.get("n", 160)
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))
    loader = DataLoader(ds, batch_size=args["batch"], shuffle=args.get("shuffle", True))
    if args.get("distributed_order"):  # one process reading the order DDP deals out (Lightning's)
        from torch.utils.data import DistributedSampler
        order = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=args["batch"], sampler=order)
    val = DataLoader(ds, batch_size=7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    def eval_fn(m, b):
        return {"loss": F.mse_loss(m(b[0]), b[1])}

    callbacks = []
    if args.get("stop_rank") is not None:
        class StopOnRank(eg.Listener):
            def on_train_batch_end(self, rec):
                if rec.run.global_rank == args["stop_rank"] and rec.batch_idx == args["stop_at"]:
                    return eg.Stop("rank-local stop")
        callbacks.append(StopOnRank())
    if args.get("raise_rank") is not None:
        class RaiseOnRank(eg.Listener):
            def on_train_batch_end(self, rec):
                if rec.run.global_rank == args["raise_rank"] and rec.batch_idx == args["raise_at"]:
                    raise RuntimeError("rank %d raised on purpose" % rec.run.global_rank)
        callbacks.append(RaiseOnRank())
    if args.get("signal_rank") is not None:
        import signal as _s
        class SignalOnRank(eg.Listener):
            def on_train_batch_end(self, rec):
                at = (args["signal_rank"], args["signal_at"])
                if (rec.run.global_rank, rec.batch_idx) == at:
                    os.kill(os.getpid(), _s.SIGTERM)
        callbacks.append(SignalOnRank())
    if args.get("checkpoint"):
        callbacks.append(eg.listeners.ModelCheckpoint(save_last=True, save_top_k=-1,
                                                      every_n_train_steps=args["checkpoint"]))

    task = eg.Task(loss_fn, optim.adamw(1e-2, weight_decay=0.01), eval_fn=eval_fn)
    trainer = eg.Trainer(
        accelerator="cpu",
        strategy=args.get("strategy", "ddp"),
        devices=args["devices"],
        num_nodes=args.get("num_nodes", 1),
        max_epochs=args.get("epochs", 1),
        max_steps=args.get("max_steps", -1),
        accumulate_grad_batches=args.get("accumulate", 1),
        gradient_clip_val=0.5,
        precision=args.get("precision"),
        default_root_dir=args["root"],
        enable_progress_bar=args.get("bar", False),
        callbacks=callbacks or None,
        log_every_n_steps=1,
        enable_checkpointing=args.get("checkpointing", True),
    )
    state = task.init(model, seed=0)
    out = trainer.fit(task, state, loader, val if args.get("validate") else None,
                      ckpt_path=args.get("ckpt_path"))
    if args.get("test"):  # its results table: printed once, by rank 0
        trainer.test(task, out.copy(), val)
    if trainer.is_global_zero:
        torch.save({"params": {k: v.clone() for k, v in out.params.items()}, "step": out.step,
                    "epoch": out.epoch, "world_size": trainer.world_size,
                    "metrics": dict(trainer.callback_metrics)},
                   os.path.join(args["root"], "final.pt"))
    print("rank", trainer.global_rank, "of", trainer.world_size, "done at step", out.step)
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "fit_script.py"
    path.write_text(SCRIPT)
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ):
        env.pop(k, None)
    # the ranks share one stdout pipe: unbuffered, print's pieces from two ranks interleave
    # mid-line; buffered, each flushed line is one write. (torchrun starts its workers with
    # python -u whatever this says: parse their output by whole strings, not by lines)
    env.pop("PYTHONUNBUFFERED", None)
    return env


def _torchrun(
    script: Path, args: dict, *, nproc: int = 2, timeout: float = 180, real: bool = False
):
    """The script on ``nproc`` ranks: under torchrun itself (``real``: the tests about running
    under torchrun), or on ranks forked as torchrun's workers (``_ranks.torchrun``)."""
    if not real:
        return torchrun([script, json.dumps(args)], nproc, env=_env(), timeout=timeout)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(script),
        json.dumps(args),
    ]
    return _procs.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _python(script: Path, args: dict, *, timeout: float = 180):
    cmd = [sys.executable, str(script), json.dumps(args)]
    return _procs.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _final(root: Path) -> dict:
    return torch.load(root / "final.pt", weights_only=False)


def _close(a: dict, b: dict, tol: float = 1e-6) -> None:
    worst = max(float((a[k] - b[k]).detach().abs().max()) for k in a)
    assert worst <= tol, f"largest parameter difference {worst} > {tol}"


def _ok(proc) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def test_ddp_under_torchrun_trains_as_one_process_on_the_whole_batch(tmp_path):
    script = _script(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    common = {"accumulate": 2, "epochs": 2, "validate": True}
    # DDP's training order is DistributedSampler(shuffle=True, seed=0)'s, as Lightning's: one
    # process reading that order on the whole batch takes the same steps
    one_rank = {**common, "devices": 1, "batch": 16, "root": str(one), "strategy": "auto"}
    _ok(_python(script, {**one_rank, "distributed_order": True}))
    two_ranks = {**common, "devices": 2, "batch": 8, "root": str(two), "test": True}
    proc = _torchrun(script, two_ranks, real=True)
    _ok(proc)
    assert proc.stdout.count("test results") == 1, proc.stdout  # one table, not one a rank
    a, b = _final(one), _final(two)
    assert a["step"] == b["step"] == 10 and b["world_size"] == 2
    _close(b["params"], a["params"])
    # validation metrics over every rank's shard: the whole set's, as one process
    assert abs(b["metrics"]["val/loss"] - a["metrics"]["val/loss"]) < 1e-6 * max(
        1.0, abs(a["metrics"]["val/loss"])
    )
    # one rank writes: one version directory, one journal, each line once, one set of
    # checkpoints
    versions = sorted(p.name for p in (two / "lightning_logs").iterdir())
    assert versions == ["version_0"], versions
    lines = (two / "lightning_logs" / "version_0" / "journal.jsonl").read_text().splitlines()
    steps = [json.loads(x).get("step") for x in lines if '"kind": "step"' in x or '"step"' in x]
    assert len(lines) == len(
        (one / "lightning_logs" / "version_0" / "journal.jsonl").read_text().splitlines()
    ), "the journal of 2 ranks has the lines of one process"
    ckpts = sorted(p.name for p in (two / "lightning_logs" / "version_0" / "checkpoints").iterdir())
    assert ckpts == sorted(
        p.name for p in (one / "lightning_logs" / "version_0" / "checkpoints").iterdir()
    )
    assert steps  # the journal has step lines
    assert proc.stdout.count("done at step 10") == 2


def test_ddp_launched_by_the_trainer_runs_the_script_on_each_rank(tmp_path):
    script = _script(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    single = {"devices": 1, "batch": 16, "root": str(one), "strategy": "auto"}
    _ok(_python(script, {**single, "distributed_order": True}))  # the order DDP deals
    proc = _python(script, {"devices": 2, "batch": 8, "root": str(two), "strategy": "ddp"})
    _ok(proc)
    assert "rank 0 of 2 done" in proc.stdout and "rank 1 of 2 done" in proc.stdout
    _close(_final(two)["params"], _final(one)["params"])


def test_a_stop_on_one_rank_stops_every_rank_after_the_same_batch(tmp_path):
    script = _script(tmp_path)
    root = tmp_path / "run"
    proc = _torchrun(
        script,
        {"devices": 2, "batch": 8, "root": str(root), "stop_rank": 1, "stop_at": 3, "epochs": 3},
        timeout=120,
    )
    _ok(proc)
    assert _final(root)["step"] == 4  # the batch of index 3 was the last, on both ranks
    assert proc.stdout.count("done at step 4") == 2


def test_a_rank_that_raises_ends_every_rank_with_its_error(tmp_path):
    script = _script(tmp_path)
    start = time.monotonic()
    proc = _torchrun(
        script,
        {"devices": 2, "batch": 8, "root": str(tmp_path / "r"), "raise_rank": 1, "raise_at": 2},
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rank 1 raised on purpose" in proc.stderr
    assert time.monotonic() - start < 100


def test_sigterm_on_one_rank_saves_once_and_every_rank_exits(tmp_path):
    script = _script(tmp_path)
    root = tmp_path / "r"
    proc = _torchrun(
        script,
        {
            "devices": 2,
            "batch": 8,
            "root": str(root),
            "signal_rank": 1,
            "signal_at": 2,
            "epochs": 3,
        },
        timeout=120,
    )
    assert "SIGTERM received" in proc.stderr, proc.stderr[-3000:]
    saved = list((root / "checkpoints").glob("interrupted-step=*"))
    assert [p.name for p in saved] == ["interrupted-step=3"], saved
