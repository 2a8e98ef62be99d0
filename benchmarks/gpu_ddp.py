"""The 2-GPU data-parallel check: engine's DDP on 2 ranks (NCCL) against one GPU on the whole
batch, and a time per optimizer step. ``benchmarks/gpu_check.sh`` runs it where
``torch.cuda.device_count() >= 2``:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.gpu_ddp --json gpu_ddp.json
    torchrun --standalone --nproc-per-node 2 -m benchmarks.gpu_ddp --device cpu --quick  # gloo

Three parts, each recorded (under its name in the JSON, with ``error`` if it raised) whatever
the others did; rank 0 rewrites the JSON after each (``"complete": false`` until the end):

* ``equality``: ``transforms.compose(placement=SingleDevice(this rank's GPU), strategy=DDP(),
  clip=clip_by_global_norm(1.0), accumulate=2)``, AdamW, per-rank batch b, 20 optimizer steps
  (rank 1 builds other weights: ``prepare`` must give it rank 0's), against one GPU (rank 0,
  rank 1 waiting) with the same pipeline less the strategy on batch 2b: the largest parameter
  difference (``ok`` when within ``tol``), and whether rank 1's parameters equal rank 0's
  bitwise. TF32 is off, so float32 is float32.
* ``speed``: per model (the medium MLP 784-1024-1024-10 with b = 256; a 54.6M-parameter MLP
  4096-4096-4096-4096-1000 with b = 64, whose 218 MB of gradients make the all-reduce weigh),
  interleaved rounds, the device synchronized and the ranks at a barrier around each timed
  block: engine DDP (2 GPUs, b each), torch ``DistributedDataParallel`` + ``AdamW(fused=True)``
  (2 GPUs), and on rank 0 alone engine on b and on 2b, and the raw loop on b. Figures: ms per
  step and ratios (``engine_2gpu_vs_1gpu``: same per-rank batch, 1.0 is linear scaling;
  ``engine_2gpu_vs_1gpu_global_batch``: the same global batch, below 1.0 two GPUs pay).
* ``trainer``: ``Trainer(strategy="ddp", devices=2)`` under this torchrun (a fit of 2 epochs
  with validation: NCCL's barrier, broadcasts and metric sync on the GPU) against
  ``Trainer(devices=1)`` on rank 0 with batch 2b: parameter and ``val/loss`` differences.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import engine as eg
from benchmarks.step import mlp
from engine import optim, transforms
from engine.parallel import DDP

Run = Callable[[], None]
MODELS = {
    "medium": ((784, 1024, 1024, 10), 256),
    "large": ((4096, 4096, 4096, 4096, 1000), 64),
}
QUICK = {"tiny": ((32, 64, 64, 10), 16)}


def _loss(model: Any, b: Any) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


def _eval(model: Any, b: Any) -> dict[str, torch.Tensor]:
    return {"loss": F.cross_entropy(model(b[0]), b[1])}


def _data(sizes: tuple[int, ...], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, sizes[0], generator=g), torch.randint(0, sizes[-1], (n,), generator=g)


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params.values()])


class Ranks:
    """This process's place in the run: rank, device, and the collectives the check uses."""

    def __init__(self, device_kind: str) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.cuda = device_kind == "cuda"
        if self.cuda:
            self.device = torch.device("cuda", self.local)
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
        dist.init_process_group(
            "nccl" if self.cuda else "gloo", timeout=datetime.timedelta(seconds=90)
        )
        self.devices = [torch.device("cuda", i) for i in range(self.world)] if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        if self.cuda:
            dist.barrier(device_ids=[self.local])
        else:
            dist.barrier()

    def strategy(self) -> DDP:
        s = DDP(devices=self.devices)
        s.setup()  # the group is joined already: DDP uses it
        return s


def _pipeline(ranks: Ranks, strategy: DDP | None, accumulate: int) -> transforms.Pipeline:
    return transforms.compose(
        placement=transforms.SingleDevice(ranks.device),
        strategy=strategy,
        clip=optim.clip_by_global_norm(1.0),
        accumulate=accumulate,
    )


# ------------------------------------------------------------------------------ equality


def equality(ranks: Ranks, shape: Any, steps: int, tol: float) -> dict[str, Any]:
    (sizes, b), accumulate, world = shape, 2, ranks.world
    micro = [_data(sizes, world * b, seed=100 + i) for i in range(steps * accumulate)]

    def train(strategy: DDP | None, lo: int, n: int, seed: int) -> torch.Tensor:
        tx = optim.adamw(1e-3, weight_decay=0.01)
        pipeline = _pipeline(ranks, strategy, accumulate)
        state = pipeline.prepare(eg.TrainState.create(mlp(sizes, seed=seed), tx))
        step = pipeline.train_step(_loss, tx)
        for x, y in micro:
            state, _ = step(state, pipeline.move((x[lo : lo + n], y[lo : lo + n])))
        ranks.sync()
        return _flat(state.params)

    # rank 1 builds other weights: prepare must broadcast rank 0's
    mine = train(ranks.strategy(), ranks.rank * b, b, seed=ranks.rank)
    zero = mine.clone()
    dist.broadcast(zero, src=0)
    equal = torch.tensor([int(torch.equal(mine, zero))], device=ranks.device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    out: dict[str, Any] = {"per_rank_batch": b, "optimizer_steps": steps, "tol": tol}
    out["ranks_bitwise_equal"] = bool(equal.item())
    if ranks.rank == 0:
        one = train(None, 0, world * b, seed=0)
        diff = (mine - one).abs()
        out["max_abs_diff"] = float(diff.max())
        out["max_rel_diff"] = float((diff / one.abs().clamp_min(1e-3)).max())
        out["moved"] = float((one - _flat(mlp(sizes, seed=0).state_dict())).abs().max())
        out["ok"] = out["max_abs_diff"] <= tol and out["ranks_bitwise_equal"]
    ranks.barrier()
    return out


# ------------------------------------------------------------------------------ speed


def _engine(ranks: Ranks, sizes: Any, batch: Any, strategy: DDP | None) -> Run:
    tx = optim.adamw(1e-3)
    pipeline = _pipeline(ranks, strategy, 1)
    box = [pipeline.prepare(eg.TrainState.create(mlp(sizes), tx))]
    step = pipeline.train_step(_loss, tx)
    moved = pipeline.move(batch)

    def run() -> None:
        box[0], _ = step(box[0], moved)

    return run


def _raw(ranks: Ranks, sizes: Any, batch: Any, ddp: bool) -> Run:
    model: torch.nn.Module = mlp(sizes).to(ranks.device)
    if ddp:
        ids = [ranks.local] if ranks.cuda else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), fused=ranks.cuda or None)
    x, y = (t.to(ranks.device) for t in batch)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model, (x, y)).backward()
        opt.step()

    return run


def speed(ranks: Ranks, shape: Any, rounds: int, steps: int) -> dict[str, Any]:
    sizes, b = shape
    mine = _data(sizes, b, seed=ranks.rank)
    runs: dict[str, Run | None] = {
        "engine_ddp": _engine(ranks, sizes, mine, ranks.strategy()),
        "torch_ddp": _raw(ranks, sizes, mine, ddp=True),
    }
    solo = ("engine_1gpu", "engine_1gpu_global_batch", "raw_1gpu")
    if ranks.rank == 0:
        runs["engine_1gpu"] = _engine(ranks, sizes, mine, None)
        runs["engine_1gpu_global_batch"] = _engine(
            ranks, sizes, _data(sizes, ranks.world * b, seed=0), None
        )
        runs["raw_1gpu"] = _raw(ranks, sizes, mine, ddp=False)
    else:
        runs.update(dict.fromkeys(solo))
    names = list(runs)

    def block(name: str, n: int) -> float:
        run = runs[name]
        ranks.barrier()
        t0 = time.perf_counter()
        if run is not None:
            for _ in range(n):
                run()
        ranks.barrier()
        return (time.perf_counter() - t0) / n

    for name in names:  # warm-up (torch DDP rebuilds its buckets after the first step)
        block(name, 3)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(block(name, steps))

    def ratio(a: str, c: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[c], strict=True))

    params = sum(p.numel() for p in mlp(sizes).parameters())
    out: dict[str, Any] = {"params": params, "grad_bytes": params * 4, "per_rank_batch": b}
    out.update({f"{n}_step_ms": statistics.median(t) * 1e3 for n, t in times.items()})
    out["engine_2gpu_vs_1gpu_ratio"] = ratio("engine_ddp", "engine_1gpu")
    out["torch_2gpu_vs_1gpu_ratio"] = ratio("torch_ddp", "raw_1gpu")
    out["engine_ddp_vs_torch_ddp_ratio"] = ratio("engine_ddp", "torch_ddp")
    out["engine_2gpu_vs_1gpu_global_batch_ratio"] = ratio("engine_ddp", "engine_1gpu_global_batch")
    out["engine_2gpu_speedup"] = ranks.world / out["engine_2gpu_vs_1gpu_ratio"]
    return out


# ------------------------------------------------------------------------------ the Trainer


def trainer(ranks: Ranks, shape: Any, root: Path) -> dict[str, Any]:
    sizes, b = shape
    n = ranks.world * b * 10
    data = TensorDataset(*_data(sizes, n, seed=7))
    quiet: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False}
    accelerator = "gpu" if ranks.cuda else "cpu"

    def fit(devices: int, strategy: str, batch: int, where: Path) -> tuple[Any, Any, float]:
        task = eg.Task(_loss, optim.adamw(1e-3), eval_fn=_eval)
        t = eg.Trainer(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            default_root_dir=str(where),
            max_epochs=2,
            **quiet,
        )
        t0 = time.perf_counter()
        state = t.fit(
            task,
            task.init(mlp(sizes, seed=0), seed=0),
            training_loader(data, batch, devices),
            DataLoader(data, batch_size=batch),
        )
        ranks.sync()
        return state, t.callback_metrics, time.perf_counter() - t0

    state, metrics, wall = fit(ranks.world, "ddp", b, root / "ddp")
    mine = _flat(state.params).to(ranks.device)
    zero = mine.clone()
    dist.broadcast(zero, src=0)
    equal = torch.tensor([int(torch.equal(mine, zero))], device=ranks.device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    out: dict[str, Any] = {"per_rank_batch": b, "samples": n, "epochs": 2, "steps": state.step}
    out["ddp_fit_s"] = wall
    out["ranks_bitwise_equal"] = bool(equal.item())
    if ranks.rank == 0:
        ref, ref_metrics, ref_wall = fit(1, "auto", ranks.world * b, root / "one")
        out["one_gpu_fit_s"] = ref_wall
        out["one_gpu_steps"] = ref.step
        out["max_abs_diff"] = float((mine - _flat(ref.params).to(ranks.device)).abs().max())
        out["val_loss"] = float(metrics["val/loss"])
        out["val_loss_diff"] = abs(float(metrics["val/loss"]) - float(ref_metrics["val/loss"]))
    ranks.barrier()
    return out


def training_loader(data: Any, batch: int, devices: int) -> DataLoader:
    """The training loader of a fit on ``devices``: data parallel reads
    ``DistributedSampler(shuffle=True, seed=0)``'s order (as Lightning does), so the one-device
    reference reads that same order on the whole batch."""
    if devices > 1:
        return DataLoader(data, batch_size=batch)
    order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=batch, sampler=order)


# ------------------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> dict[str, Any]:
    ranks = Ranks(args.device)
    models = QUICK if args.quick else MODELS
    first = next(iter(models.values()))
    rounds, steps = (3, 5) if args.quick else (7, 20)
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
    part("equality", lambda: equality(ranks, first, steps=10 if args.quick else 20, tol=tol))
    results["speed"] = {}
    for name, shape in models.items():
        t0 = time.perf_counter()
        try:
            results["speed"][name] = speed(ranks, shape, rounds, steps)
        except Exception as e:
            results["speed"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(traceback.format_exc(), file=sys.stderr)
        results["speed"][name]["wall_s"] = time.perf_counter() - t0
        write()
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]  # one run directory for every rank (rank 0's), as a real run has
        dist.broadcast_object_list(box, src=0, device=ranks.device if ranks.cuda else None)
        part("trainer", lambda: trainer(ranks, first, Path(box[0])))
        ranks.barrier()  # before rank 0 removes the directory
    results["ok"] = bool(
        results["equality"].get("ok")
        and results["trainer"].get("ranks_bitwise_equal")
        and results["trainer"].get("max_abs_diff", 1.0) <= tol
    )
    results["complete"] = True
    write()
    if ranks.rank == 0:
        print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the JSON here (rank 0), after each part")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a gloo smoke run")
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
