"""Data parallel on this machine: 2 gloo ranks against 1, the all-reduce's cost, and what
overlapping it with the backward pass could hide.

    python -m benchmarks.ddp            # a table
    python -m benchmarks.ddp --json     # one JSON object (what benchmarks.step puts under "ddp")
    python -m benchmarks.ddp --quick    # fewer rounds (under a minute)

Two rank processes (gloo on loopback, one thread each: ``OMP_NUM_THREADS=1``) train the medium
MLP (784-1024-1024-10, AdamW) with a per-rank batch of 256. Every variant is built in the same
two processes, warmed up, then run *interleaved*, round by round (the order rotated each
round), with a barrier before and after each timed block so a block is the slower rank's time:

* ``engine_ddp``: a hand loop over ``transforms.compose(strategy=DDP())``: one bucketed
  all-reduce of the gradients per optimizer step, after the backward pass;
* ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW`` (the raw
  reference; its buckets are all-reduced while the backward pass runs: overlapped);
* ``torch_ddp_no_overlap``: the same model with the backward pass under ``no_sync()`` and one
  flat all-reduce of the gradients after it: torch's step without the overlap;
* ``engine_2x_no_comm``: both ranks running the one-process engine step at once, no collective:
  what two ranks cost each other on shared cores and memory, without communication;
* ``allreduce_grads``: one ``dist.all_reduce`` of a flat float32 tensor of the model's gradient
  size; ``engine_reduce``: ``DDP.reduce`` on the gradients (flatten, all-reduce, average,
  unflatten); ``engine_agree``: ``DDP.agree`` on two flags, the collective the Trainer makes
  twice a batch to agree on stops and signals;
* on rank 0 alone, rank 1 waiting in the closing barrier (which sleeps in a socket read; the
  JSON says how much CPU rank 1 used meanwhile): ``engine_1rank`` (the engine step) and
  ``raw_1rank`` (the raw loop of benchmarks.step) at the same batch of 256, one thread; and,
  for orientation, the engine step and the raw loop on the global batch of 512 with two threads
  (``*_1proc_2threads``): what one process makes of both cores without data parallelism.

A figure is the median over rounds of the per-round ratio (times: the median over rounds).
Then a sweep: ``dist.all_reduce`` of flat float32 tensors from 1 KiB to 64 MiB, each size
timed alone (median of repetitions), as bytes/s: ``algbw`` = bytes / time and ``busbw`` =
``2 (W-1)/W`` bytes / time, what a ring all-reduce moves per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import engine as eg
from benchmarks.checkpoint import _busy_s, flat, show
from benchmarks.step import SHAPES, mlp
from engine import optim, transforms
from engine.parallel import DDP

WORLD = 2
SIZES = (784, 1024, 1024, 10)
BATCH = SHAPES["medium"][1]  # per rank
SWEEP = tuple(2**10 * 4**k for k in range(9))  # 1 KiB ... 64 MiB
COLLECTIVE = (
    "engine_ddp",
    "torch_ddp",
    "torch_ddp_no_overlap",
    "engine_2x_no_comm",
    "allreduce_grads",
    "engine_reduce",
    "engine_agree",
)
SOLO = ("engine_1rank", "raw_1rank", "engine_1proc_2threads", "raw_1proc_2threads")
Run = Callable[[], None]


def _batch(n: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g)


def _loss(model: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


# ------------------------------------------------------------------------------ variants


def _engine(b: Any, strategy: DDP | None) -> Run:
    tx = optim.adamw(1e-3)
    pipeline = transforms.compose(strategy=strategy)
    box = [pipeline.prepare(eg.TrainState.create(mlp(SIZES), tx, seed=0))]
    step = pipeline.train_step(_loss, tx)

    def run() -> None:
        box[0], _ = step(box[0], b)

    return run


def _raw(b: Any) -> Run:
    model = mlp(SIZES)
    opt = torch.optim.AdamW(model.parameters())

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model, b).backward()
        opt.step()

    return run


def _torch_ddp(b: Any, overlap: bool) -> Run:
    model = torch.nn.parallel.DistributedDataParallel(mlp(SIZES))
    opt = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        if overlap:
            _loss(model, b).backward()
        else:
            with model.no_sync():
                _loss(model, b).backward()
            grads = [p.grad for p in params if p.grad is not None]
            flat_grads = _flatten_dense_tensors(grads)
            dist.all_reduce(flat_grads)
            flat_grads.div_(WORLD)
            for g, r in zip(grads, _unflatten_dense_tensors(flat_grads, grads), strict=True):
                g.copy_(r)
        opt.step()

    return run


def _numel() -> int:
    return sum(p.numel() for p in mlp(SIZES).parameters())


def _allreduce(numel: int) -> Run:
    t = torch.ones(numel)
    return lambda: dist.all_reduce(t)


def _reduce(strategy: DDP) -> Run:
    grads = {k: torch.ones_like(p) for k, p in mlp(SIZES).named_parameters()}

    def run() -> None:
        strategy.reduce(grads)

    return run


def _agree(strategy: DDP) -> Run:
    def run() -> None:
        strategy.agree((False, False))

    return run


def _threads(n: int, run: Run) -> Run:
    def threaded() -> None:
        torch.set_num_threads(n)
        try:
            run()
        finally:
            torch.set_num_threads(1)

    return threaded


def build(rank: int) -> dict[str, Run]:
    """Every variant, on this rank (the solo ones are built on rank 0 only)."""
    b, b2 = _batch(BATCH, rank), _batch(WORLD * BATCH, 0)
    strategy = DDP()
    strategy.setup()  # the group is joined already: DDP uses it
    runs = {
        "engine_ddp": _engine(b, strategy),
        "torch_ddp": _torch_ddp(b, overlap=True),
        "torch_ddp_no_overlap": _torch_ddp(b, overlap=False),
        "engine_2x_no_comm": _engine(b, None),
        "allreduce_grads": _allreduce(_numel()),
        "engine_reduce": _reduce(strategy),
        "engine_agree": _agree(strategy),
    }
    if rank == 0:
        runs["engine_1rank"] = _engine(b, None)
        runs["raw_1rank"] = _raw(b)
        runs["engine_1proc_2threads"] = _threads(2, _engine(b2, None))
        runs["raw_1proc_2threads"] = _threads(2, _raw(b2))
    return runs


# ------------------------------------------------------------------------------ one rank


def _timed_block(run: Run | None, steps: int) -> tuple[float, float]:
    """Wall time of ``steps`` calls between two barriers, and this process's CPU time in it."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    if run is not None:
        for _ in range(steps):
            run()
    dist.barrier()
    return (time.perf_counter() - t0) / steps, time.process_time() - c0


def rank_main(rank: int, port: int, rounds: int, steps: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    runs = build(rank)
    names = [*COLLECTIVE, *SOLO]
    for name in names:  # warm-up (torch DDP rebuilds its buckets after the first step)
        _timed_block(runs.get(name) if name in COLLECTIVE or rank == 0 else None, 3)
    times: dict[str, list[float]] = {n: [] for n in names}
    idle_cpu: list[float] = []  # rank 1's CPU seconds per second while rank 0 runs alone
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            solo = name in SOLO
            wall, cpu = _timed_block(runs.get(name) if not solo or rank == 0 else None, steps)
            times[name].append(wall)
            if solo and rank == 1:
                idle_cpu.append(cpu / (wall * steps))
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, {"times": times, "idle_cpu": idle_cpu})
    sweep = _sweep(reps)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"times": times, "idle_cpu": gathered[1]["idle_cpu"], "sweep": sweep})
        )
    dist.barrier()
    dist.destroy_process_group()


def _sweep(reps: int) -> dict[str, dict[str, float]]:
    """Each size of ``SWEEP`` all-reduced alone, keyed by its size ("1KiB" ... "64MiB")."""
    rows = {}
    for nbytes in SWEEP:
        t = torch.ones(nbytes // 4)
        n = max(3, min(reps * 20, int(reps * 2**22 / nbytes)))  # more repetitions when small
        for _ in range(2):
            dist.all_reduce(t)
        each = []
        dist.barrier()
        for _ in range(n):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            each.append(time.perf_counter() - t0)
        s = statistics.median(each)
        rows[_size(nbytes)] = {
            "bytes": nbytes,
            "ms": s * 1e3,
            "algbw_gb_s": nbytes / s / 1e9,
            "busbw_gb_s": 2 * (WORLD - 1) / WORLD * nbytes / s / 1e9,
        }
    return rows


def _size(n: int) -> str:
    return f"{n // 2**20}MiB" if n >= 2**20 else f"{n // 2**10}KiB"


# ------------------------------------------------------------------------------ the parent


def exit_rank() -> NoReturn:
    """End a rank process whose work is done (its figures written): run the exit functions,
    destroy the process group, flush, and leave with status 0 without the interpreter's
    finalization.

    A gloo worker thread can still hold the last reference to a tensor of the final collective
    after the main thread has returned from it. Dropped during finalization, that tensor's
    Python object takes the GIL after Python has torn it down, and the process aborts
    ("terminate called without an active exception", status -6; pytorch/pytorch#179291). It is
    rare (one CI run in a few dozen), and it fails a run whose figures are complete.
    """
    import atexit

    atexit._run_exitfuncs()  # what a normal exit runs first (engine's DDP destroys its group)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(rounds: int, steps: int, reps: int, timeout: float) -> dict[str, Any]:
    """Start the two rank processes, wait for both (a bounded time), read rank 0's raw
    measurements."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        cmd = [sys.executable, "-m", "benchmarks.ddp", "--port", str(port)]
        cmd += ["--rounds", str(rounds), "--steps", str(steps), "--reps", str(reps), "--out", out]
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + timeout
        errors = []
        try:
            for r, p in enumerate(procs):
                try:
                    _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    errors.append(f"rank {r} did not finish in {timeout:.0f} s")
                    break
                if p.returncode != 0:
                    errors.append(f"rank {r} exited with {p.returncode}:\n{err.decode()[-3000:]}")
                    break
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        if errors:
            raise RuntimeError("benchmarks.ddp: " + "\n".join(errors))
        return json.loads(Path(out).read_text())


def _median_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON's figures from the ranks' raw times."""
    t = raw["times"]
    ms = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    numel = _numel()
    out: dict[str, Any] = {
        "world_size": WORLD,
        "backend": "gloo",
        "threads_per_rank": 1,
        "per_rank_batch": BATCH,
        "params": numel,
        "grad_bytes": numel * 4,
        # one optimizer step, ms (median over rounds)
        "engine_1rank_step_ms": ms["engine_1rank"],
        "engine_2rank_step_ms": ms["engine_ddp"],
        "raw_1rank_step_ms": ms["raw_1rank"],
        "torch_ddp_2rank_step_ms": ms["torch_ddp"],
        "torch_ddp_no_overlap_2rank_step_ms": ms["torch_ddp_no_overlap"],
        "engine_2x_no_comm_step_ms": ms["engine_2x_no_comm"],
        "engine_1proc_2threads_global_batch_step_ms": ms["engine_1proc_2threads"],
        "raw_1proc_2threads_global_batch_step_ms": ms["raw_1proc_2threads"],
        "allreduce_grads_ms": ms["allreduce_grads"],
        "engine_reduce_ms": ms["engine_reduce"],
        # the Trainer's stop / signal agreement: 2 int32 flags, twice a batch
        "engine_agree_ms": ms["engine_agree"],
    }
    ratios = {
        # time per optimizer step, 2 ranks over 1 rank at the same per-rank batch (1.0: two
        # ranks do twice the work in the same time)
        "engine_2rank_vs_1rank": ("engine_ddp", "engine_1rank"),
        "torch_2rank_vs_1rank": ("torch_ddp", "raw_1rank"),
        # engine's data parallel step against torch's DDP + AdamW in the same processes
        "engine_ddp_vs_torch_ddp": ("engine_ddp", "torch_ddp"),
        "engine_1rank_vs_raw_1rank": ("engine_1rank", "raw_1rank"),
        # what two ranks cost each other without any communication
        "no_comm_2rank_vs_1rank": ("engine_2x_no_comm", "engine_1rank"),
        # torch's overlapped step over its step without overlap (< 1: overlap paid)
        "torch_overlap_vs_no_overlap": ("torch_ddp", "torch_ddp_no_overlap"),
        # the same global batch: 2 ranks of 1 thread against 1 process of 2 threads
        "engine_2rank_vs_1proc_2threads": ("engine_ddp", "engine_1proc_2threads"),
        "torch_2rank_vs_1proc_2threads": ("torch_ddp", "raw_1proc_2threads"),
    }
    for name, (num, den) in ratios.items():
        out[f"{name}_ratio"] = _median_ratio(t, num, den)
    shares = {
        # the all-reduce's share of the 2-rank step: what overlap could hide at most
        "allreduce_share_of_engine_step": ("allreduce_grads", "engine_ddp"),
        "engine_reduce_share_of_engine_step": ("engine_reduce", "engine_ddp"),
        "allreduce_share_of_torch_step": ("allreduce_grads", "torch_ddp_no_overlap"),
        "agree_share_of_engine_step": ("engine_agree", "engine_ddp"),
    }
    for name, (num, den) in shares.items():
        out[name] = _median_ratio(t, num, den)
    # samples per second of 2 ranks over 1 rank's (2.0 would be linear scaling)
    out["engine_2rank_speedup"] = WORLD / out["engine_2rank_vs_1rank_ratio"]
    out["torch_2rank_speedup"] = WORLD / out["torch_2rank_vs_1rank_ratio"]
    out["overlap_hides_at_most"] = out["allreduce_share_of_engine_step"]
    out["rank1_cpu_while_waiting"] = statistics.median(raw["idle_cpu"]) if raw["idle_cpu"] else None
    out["allreduce_sweep"] = raw["sweep"]
    return out


def run(rounds: int = 15, steps: int = 5, reps: int = 10, timeout: float = 900) -> dict[str, Any]:
    """Measure (2 rank processes) and return the figures, with the machine they ran on."""
    busy0, wall0, own0 = _busy_s(), time.monotonic(), _children_cpu()
    out = figures(_launch(rounds, steps, reps, timeout))
    busy1, wall1, own1 = _busy_s(), time.monotonic(), _children_cpu()
    out["rounds"], out["steps_per_round"] = rounds, steps
    if busy0 is not None and busy1 is not None:
        # cores other processes kept busy meanwhile (0 on an idle machine): noise to expect
        other = (busy1 - busy0 - (own1 - own0)) / (wall1 - wall0)
        out["other_processes_cores"] = max(0.0, other)
    return out


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.port, args.rounds, args.steps, args.reps, args.out)
        exit_rank()
    rounds = args.rounds or (5 if args.quick else 15)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }
    steps, reps = (3, 3) if args.quick else (args.steps, args.reps)
    results.update(run(rounds, steps=steps, reps=reps))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in flat(results).items():
            print(show(k, v))


if __name__ == "__main__":
    main()
