"""A data-parallel run that loses a rank once, restarts under torchrun and ends bitwise.

    python examples/preemption.py [--root runs/preemption] [--kill-signal SIGKILL] [--kill-at 27]

Trains an MLP with dropout on scikit-learn's digits on 2 gloo CPU ranks, twice, with
``torchrun --standalone --nproc-per-node=2 --max-restarts=1``:

1. **uninterrupted**, for reference;
2. **preempted**: rank 1 of the first attempt kills itself at step ``--kill-at`` with
   ``--kill-signal`` (``SIGKILL``: a lost machine, nothing saved; ``SIGTERM``: a preemption
   notice, the ranks save ``interrupted-step=N`` and exit). torchrun starts the group
   again; the same script calls ``fit(..., ckpt_path="last")``, which in the restarted attempt
   finds the first attempt's run directory and its newest checkpoint and continues from it.

Then it compares the two: the final state's fingerprint (every parameter and optimizer value,
bitwise), the steps each attempt started from (the journal's ``start`` lines), and
``metrics.csv`` (each step once, the same values). Nothing about the restart is in the
training code: the same ``fit`` call runs in every attempt. ``--strategy fsdp`` shards the
state instead. ``docs/distributed.md`` ("Preemption and restarts") explains what is resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from digits import load  # noqa: E402  (the examples' directory, as above)

import engine as eg  # noqa: E402
from engine import optim  # noqa: E402
from engine.listeners import ModelCheckpoint  # noqa: E402
from engine.loggers import CSVLogger  # noqa: E402


def loss_fn(model: nn.Module, batch: Any) -> Any:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def worker(args: argparse.Namespace) -> None:
    """One rank of one attempt (torchrun sets RANK and TORCHELASTIC_RESTART_COUNT)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))

    class Preemption(eg.Listener):
        """Rank 1 of the first attempt dies at step ``kill_at``: the fault, not the recovery."""

        def on_train_batch_end(self, rec: eg.EventRecord) -> None:
            sig = args.kill_signal
            if sig != "none" and attempt == 0 and rank == 1 and rec.state.step == args.kill_at:
                os.kill(os.getpid(), getattr(signal, sig))

    train, val, _ = load(0)
    steps = args.epochs * -(-len(train) // (2 * args.batch_size))  # 2 ranks
    schedule = optim.warmup_cosine(3e-3, warmup_steps=steps // 10, total_steps=steps)
    task = eg.Task(loss_fn, optim.adamw(schedule, weight_decay=1e-2), lr=schedule)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    trainer = eg.Trainer(
        strategy=args.strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=CSVLogger(args.root),  # version=None: a restart continues in the same version
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Preemption(), ModelCheckpoint(every_n_train_steps=10, save_last=True)],
    )
    state = trainer.fit(
        task,
        task.init(model, seed=0),
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=256),
        ckpt_path="last",  # the newest checkpoint of this run, if there is one
    )
    fingerprint = state.fingerprint()  # a collective under FSDP: every rank computes it
    if trainer.is_global_zero:
        result = {
            "attempt": attempt,
            "step": state.step,
            "fingerprint": fingerprint,
            "resumed_from": trainer.ckpt_path,
            "run_dir": str(trainer.run_dir),
        }
        Path(args.root, "result.json").write_text(json.dumps(result))


def launch(root: Path, args: argparse.Namespace, *, preempt: bool) -> dict[str, Any]:
    """One torchrun job of 2 ranks, at most one restart; its rank 0's result and journal."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        str(Path(__file__).resolve()),
        "--worker",
        "--root",
        str(root),
        "--strategy",
        args.strategy,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--kill-at",
        str(args.kill_at),
        "--kill-signal",
        args.kill_signal if preempt else "none",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # 2 ranks on a small machine
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads((root / "result.json").read_text())
    run_dir = Path(result["run_dir"])
    journal = [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines()]
    result["starts"] = [line["step"] for line in journal if line.get("start")]
    result["csv"] = (run_dir / "metrics.csv").read_text()
    result["seconds"] = elapsed
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/preemption")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--kill-signal", default="SIGKILL", choices=["SIGKILL", "SIGTERM", "none"])
    p.add_argument("--kill-at", type=int, default=27, help="the step rank 1 dies at")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return {}

    root = Path(args.root)
    whole = launch(root / "uninterrupted", args, preempt=False)
    cut = launch(root / "preempted", args, preempt=True)
    same = whole["fingerprint"] == cut["fingerprint"]
    print(f"uninterrupted: 1 attempt, steps 0-{whole['step']}")
    print(
        f"preempted:     rank 1 {args.kill_signal} at step {args.kill_at}; "
        f"attempt {cut['attempt']} started from step {cut['starts'][-1]} "
        f"({Path(cut['resumed_from']).name}) and ended at step {cut['step']}"
    )
    print(f"final state:   {'bitwise equal' if same else 'DIFFERENT'} ({cut['fingerprint']})")
    print(f"metrics.csv:   {'identical' if whole['csv'] == cut['csv'] else 'DIFFERENT'}")
    print(
        f"wall time:     {whole['seconds']:.1f} s uninterrupted, {cut['seconds']:.1f} s "
        f"preempted (the restart and the steps redone: {cut['seconds'] - whole['seconds']:+.1f} s)"
    )
    return {"uninterrupted": whole, "preempted": cut, "bitwise": same}


if __name__ == "__main__":
    sys.exit(0 if main().get("bitwise", True) else 1)
