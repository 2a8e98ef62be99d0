"""The 2-GPU FSDP check: engine's FSDP (ZeRO-2 and ZeRO-3 equivalents) on 2 ranks (NCCL)
against DDP and one GPU, its memory per rank and its step time. ``benchmarks/gpu_check.sh``
runs it where ``torch.cuda.device_count() >= 2``:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.gpu_fsdp --json gpu_fsdp.json
    torchrun --standalone --nproc-per-node 2 -m benchmarks.gpu_fsdp --device cpu --quick  # gloo

Three parts, each recorded (under its name in the JSON, with ``error`` if it raised) whatever
the others did; rank 0 rewrites the JSON after each (``"complete": false`` until the end):

* ``equality``: for ``ddp``, ``zero2`` (``FSDP(sharding_strategy="SHARD_GRAD_OP",
  auto_wrap_policy={Block})``) and ``zero3`` (``"FULL_SHARD"``):
  ``transforms.compose(placement=SingleDevice(this rank's GPU), strategy=...,
  clip=clip_by_global_norm(1.0), accumulate=2)``, AdamW, per-rank batch b, 10 optimizer steps
  (rank 1 builds other weights: ``prepare`` must give it rank 0's), against one GPU (rank 0)
  with the same pipeline less the strategy on batch 2b: the largest difference of the gathered
  parameters (``ok`` when every one is within ``tol``; TF32 off).
* ``memory_speed``: :mod:`benchmarks.fsdp`'s variants (``ddp``, ``zero2``, ``zero3``,
  ``torch_ddp``) on the GPUs, on a stack of 8 blocks of ``Linear(4096, 4096)`` (134M parameters,
  537 MB of float32 weights; per-rank batch 64): the bytes each rank holds between steps
  (parameters, optimizer state, the gradient sum of an accumulated step), each step's peak per
  rank (``torch.cuda.max_memory_allocated()`` above what was allocated before it, rank 0's
  figures and ``rank1_step_peak_bytes``), ms per step in interleaved rounds, and each as a ratio
  to ``ddp``'s.
* ``trainer``: ``Trainer(strategy="fsdp", devices=2)`` under this torchrun (2 epochs with
  validation) against ``Trainer(devices=1)`` on rank 0 with batch 2b: the largest parameter
  difference and the ``val/loss`` difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from benchmarks import fsdp as bench
from benchmarks.gpu_ddp import Ranks, training_loader
from engine import optim, transforms

SIZES = {"width": 4096, "blocks": 8, "batch": 64}
EQUALITY = {"width": 256, "blocks": 4, "batch": 32}
KINDS = ("ddp", *bench.SHARDED)


def full_flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every parameter's full value, flattened into one float32 vector (a DTensor gathered:
    a collective, every rank must call it)."""
    from torch.distributed.tensor import DTensor

    parts = []
    for p in params.values():
        if isinstance(p, DTensor):
            p = p.full_tensor()
        parts.append(p.detach().reshape(-1).float())
    return torch.cat(parts)


def _pipeline(ranks: Ranks, kind: str | None, accumulate: int) -> transforms.Pipeline:
    return transforms.compose(
        placement=transforms.SingleDevice(ranks.device),
        strategy=None if kind is None else bench.strategy(kind, ranks.devices),
        clip=optim.clip_by_global_norm(1.0),
        accumulate=accumulate,
    )


# ------------------------------------------------------------------------------ equality


def equality(ranks: Ranks, sizes: dict[str, int], steps: int, tol: float) -> dict[str, Any]:
    accumulate, world, b, width = 2, ranks.world, sizes["batch"], sizes["width"]
    micro = [bench.data(width, world * b, seed=100 + i) for i in range(steps * accumulate)]

    def train(kind: str | None, lo: int, n: int, seed: int) -> torch.Tensor:
        tx = optim.adamw(1e-3, weight_decay=0.01)
        pipeline = _pipeline(ranks, kind, accumulate)
        module = bench.model(width, sizes["blocks"], seed=seed)
        state = pipeline.prepare(eg.TrainState.create(module, tx), tx)
        step = pipeline.train_step(bench.loss_fn, tx)
        for x, y in micro:
            state, _ = step(state, pipeline.move((x[lo : lo + n], y[lo : lo + n])))
        flat = full_flat(state.params)
        ranks.sync()
        return flat

    # rank 1 builds other weights: prepare must give it rank 0's
    mine = {kind: train(kind, ranks.rank * b, b, seed=ranks.rank) for kind in KINDS}
    out: dict[str, Any] = {"per_rank_batch": b, "optimizer_steps": steps, "tol": tol}
    if ranks.rank == 0:
        one = train(None, 0, world * b, seed=0)
        start = full_flat(dict(bench.model(width, sizes["blocks"], seed=0).named_parameters()))
        out["moved"] = float((one.cpu() - start).abs().max())
        for kind, flat in mine.items():
            out[f"{kind}_max_abs_diff"] = float((flat - one).abs().max())
        out["zero2_vs_ddp_max_abs_diff"] = float((mine["zero2"] - mine["ddp"]).abs().max())
        out["zero3_vs_ddp_max_abs_diff"] = float((mine["zero3"] - mine["ddp"]).abs().max())
        out["ok"] = all(out[f"{k}_max_abs_diff"] <= tol for k in KINDS)
    ranks.barrier()
    return out


# ------------------------------------------------------------------------------ memory, speed


def memory_speed(ranks: Ranks, sizes: dict[str, int], rounds: int, steps: int) -> dict[str, Any]:
    runs = bench.build(ranks.rank, sizes, ranks.device, ranks.devices)
    for v in runs.values():  # warm-up before the memory is measured (lazy allocations)
        v.run()
    ranks.sync()
    mem = bench.memory(runs, sizes, ranks.rank, ranks.device, ranks.devices, ranks.barrier)
    times = bench.timing(runs, rounds, steps, ranks.barrier)
    gathered: list[Any] = [None] * ranks.world
    dist.all_gather_object(gathered, mem)
    out = bench.figures(mem, times, sizes)
    out["memory_measured_by"] = (
        "torch.cuda.max_memory_allocated" if ranks.cuda else "torch.profiler allocation events"
    )
    out["rank1_held_total_bytes"] = {k: v["total"] for k, v in gathered[1].items()}
    out["rank1_step_peak_bytes"] = {k: v["step_peak"] for k, v in gathered[1].items()}
    return out


# ------------------------------------------------------------------------------ the Trainer


def _eval(m: Any, b: Any) -> dict[str, torch.Tensor]:
    return {"loss": bench.loss_fn(m, b)}


def trainer(ranks: Ranks, sizes: dict[str, int], root: Path) -> dict[str, Any]:
    b, width = sizes["batch"], sizes["width"]
    n = ranks.world * b * 5
    data = TensorDataset(*bench.data(width, n, seed=7))
    quiet: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False}
    accelerator = "gpu" if ranks.cuda else "cpu"

    def fit(devices: int, strategy: str, batch: int, where: Path) -> tuple[Any, Any, float]:
        task = eg.Task(bench.loss_fn, optim.adamw(1e-3), eval_fn=_eval)
        t = eg.Trainer(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            default_root_dir=str(where),
            max_epochs=2,
            enable_journal=strategy != "fsdp",  # not built for sharded runs (it says so)
            **quiet,
        )
        t0 = time.perf_counter()
        state = t.fit(
            task,
            task.init(bench.model(width, sizes["blocks"], seed=0), seed=0),
            training_loader(data, batch, devices),
            DataLoader(data, batch_size=batch),
        )
        ranks.sync()
        return state, t.callback_metrics, time.perf_counter() - t0

    state, metrics, wall = fit(ranks.world, "fsdp", b, root / "fsdp")
    mine = full_flat(state.params).to(ranks.device)
    out: dict[str, Any] = {"per_rank_batch": b, "samples": n, "epochs": 2, "steps": state.step}
    out["fsdp_fit_s"] = wall
    if ranks.rank == 0:
        ref, ref_metrics, ref_wall = fit(1, "auto", ranks.world * b, root / "one")
        out["one_gpu_fit_s"] = ref_wall
        out["one_gpu_steps"] = ref.step
        out["max_abs_diff"] = float((mine - full_flat(ref.params).to(ranks.device)).abs().max())
        out["val_loss"] = float(metrics["val/loss"])
        out["val_loss_diff"] = abs(float(metrics["val/loss"]) - float(ref_metrics["val/loss"]))
    ranks.barrier()
    return out


# ------------------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> dict[str, Any]:
    ranks = Ranks(args.device)
    sizes = dict(bench.QUICK) if args.quick else dict(SIZES)
    small = dict(bench.QUICK) if args.quick else dict(EQUALITY)
    rounds, steps = (3, 3) if args.quick else (7, 10)
    results: dict[str, Any] = {
        "world_size": ranks.world,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(i) for i in range(ranks.world)]
        if ranks.cuda
        else ["cpu"] * ranks.world,
        "complete": False,
    }

    def write() -> None:
        if ranks.rank == 0 and args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")

    def part(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # recorded; the other parts still run
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[rank {ranks.rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        results[name]["wall_s"] = time.perf_counter() - t0
        print(
            f"[rank {ranks.rank}] {name} done in {results[name]['wall_s']:.1f} s", file=sys.stderr
        )
        write()

    tol = 1e-4 if ranks.cuda else 1e-5
    part("equality", lambda: equality(ranks, small, steps=5 if args.quick else 10, tol=tol))
    part("memory_speed", lambda: memory_speed(ranks, sizes, rounds, steps))
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]  # one run directory for every rank (rank 0's), as a real run has
        dist.broadcast_object_list(box, src=0, device=ranks.device if ranks.cuda else None)
        part("trainer", lambda: trainer(ranks, small, Path(box[0])))
        ranks.barrier()  # before rank 0 removes the directory
    ms = results["memory_speed"]
    results["ok"] = bool(
        results["equality"].get("ok")
        and results["trainer"].get("max_abs_diff", 1.0) <= tol
        and ms.get("zero2_vs_ddp_held_total_ratio", 1.0) < 0.6
        and ms.get("zero3_vs_ddp_held_total_ratio", 1.0) < 0.6
    )
    results["complete"] = True
    write()
    if ranks.rank == 0:
        print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--json", help="write the JSON here (rank 0), after each part")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a gloo smoke run")
    p.add_argument("--quick", action="store_true", help="a small model and few steps")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
