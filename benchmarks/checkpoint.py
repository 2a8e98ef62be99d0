"""Checkpoint save/load time against plain ``torch.save`` + fsync / ``torch.load``.

    python -m benchmarks.checkpoint [--json]

A ~200 MB state (an MLP with AdamW: parameters and two moments) is saved and loaded, rounds
interleaved, each variant into a fresh directory on the same disk:

* ``save_vs_torch``: ``engine.checkpoint.save`` (hash, fsync, rename) over ``torch.save`` of the
  same tensors + fsync (target <= 1.10);
* ``load_vs_torch``: ``engine.checkpoint.load`` (checksum verification included) over
  ``torch.load(weights_only=True)`` of that file (target <= 1.10);
* ``async_blocked_vs_sync``: the time ``save_async`` blocks the caller (the snapshot) over a
  synchronous save (target <= 0.10).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import engine as eg
from engine import checkpoint, optim


def _state() -> eg.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 2048), nn.ReLU(), nn.Linear(2048, 2048))  # 12.6M
    state = eg.TrainState.create(model, optim.adamw(1e-3))
    return state  # moments are zeros until a step; their bytes are written all the same


def _torch_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def run(rounds: int) -> dict[str, float]:
    state = _state()
    tensors, _ = checkpoint._flatten(state)
    size_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    times: dict[str, list[float]] = {
        k: [] for k in ("save", "torch_save", "load", "torch_load", "async_blocked")
    }
    root = Path(tempfile.mkdtemp(prefix="engine-bench-", dir=os.getcwd()))
    try:
        for r in range(rounds):
            ours, theirs = root / f"ours-{r}", root / f"theirs-{r}.pt"
            t0 = time.perf_counter()
            checkpoint.save(state, ours)
            times["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _torch_save(tensors, theirs)
            times["torch_save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            checkpoint.load(ours, state)
            times["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(theirs, map_location="cpu", weights_only=True)
            times["torch_load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            future = checkpoint.save_async(state, root / f"async-{r}")
            times["async_blocked"].append(time.perf_counter() - t0)
            future.result()
            for p in (ours, theirs, root / f"async-{r}"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "checkpoint_state_mb": size_mb,
        "checkpoint_save_s": med["save"],
        "checkpoint_save_vs_torch": med["save"] / med["torch_save"],
        "checkpoint_load_vs_torch": med["load"] / med["torch_load"],
        "checkpoint_async_blocked_vs_sync": med["async_blocked"] / med["save"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    out = run(args.rounds)
    print(
        json.dumps(out, indent=2)
        if args.json
        else "\n".join(f"{k:36s} {v:.3f}" for k, v in out.items())
    )


if __name__ == "__main__":
    main()
