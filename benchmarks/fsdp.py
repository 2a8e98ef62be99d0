"""Fully sharded training on this machine: what FSDP's ZeRO-2 and ZeRO-3 equivalents hold per
rank, their peak memory in a step and their step time, against engine's DDP, on 2 gloo ranks.

    python -m benchmarks.fsdp            # a table
    python -m benchmarks.fsdp --json     # one JSON object (what benchmarks.step puts under "fsdp")
    python -m benchmarks.fsdp --quick    # fewer rounds (about a minute)

Two rank processes (gloo on loopback, one thread each: ``OMP_NUM_THREADS=1``) train a stack of
``BLOCKS`` blocks (``Block``: ``Linear(1024, 1024)`` and a ReLU) under a ``Linear(1024, 10)``
head, 6.3M parameters, with AdamW and a per-rank batch of 64. The variants, built in the same
two processes:

* ``ddp``: ``transforms.compose(strategy=DDP())``: every rank holds every parameter and both
  AdamW moments; one bucketed all-reduce of the gradients per step;
* ``zero2``: ``FSDP(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={Block})``: parameters,
  gradients and optimizer state sharded (``Shard(0)``), each block's parameters gathered at its
  forward and kept to its backward; what ``deepspeed_stage_1`` / ``_2`` run as;
* ``zero3``: ``FSDP(sharding_strategy="FULL_SHARD", ...)``: the same, a block's gathered
  parameters freed after its forward and gathered again in backward (``deepspeed_stage_3``);
* ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``, the raw
  reference for ``ddp``;
* ``torch_fsdp2``: torch's own ``fully_shard`` on each ``Block`` and on the model (FULL_SHARD,
  ``reshard_after_forward=True``) + ``torch.optim.AdamW``: the raw reference for ``zero3``
  (``fsdp_engine_vs_torch``: ``zero3``'s step time over its).

What is measured, per rank (rank 0's figures; rank 1's are the same up to an uneven shard):

* **held**: the bytes of the tensors the state keeps between steps, counted tensor by tensor
  (a DTensor by its local shard, ``to_local().nbytes``): parameters, optimizer state and the
  gradient sum kept between the micro-batches of an accumulated step (``grad_accum``, measured
  after one micro-batch of a separate ``accumulate=2`` pipeline: a step with ``accumulate=1``
  keeps no gradients between steps). For ``torch_ddp``: parameters, ``.grad`` (kept from one
  step to the next's ``zero_grad``) and the optimizer's state;
* **step peak**: the most bytes allocated at once during one optimizer step above what was
  allocated when it began (on the CPU: the allocation and free events of ``torch.profiler``
  with ``profile_memory=True``, summed in time order over the last of three profiled steps, so
  that the blocks it frees were allocated in the profiler's view; on CUDA
  ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, less
  ``memory_allocated()`` before); the median of three such measurements, the garbage collector
  off in each (their range is in the JSON). It counts what torch's allocator hands out
  (activations, gradients, gathered parameters, the optimizer's temporaries, the collectives'
  output buffers), not gloo's own buffers nor Python objects. ``*_step_peak_bytes`` is that
  plus ``*_step_start_bytes``, what the variant holds as its step begins (parameters,
  optimizer state, and for ``torch_ddp`` last step's ``.grad``, which its ``zero_grad`` frees
  first: its figure above the start is small, 0 up to the forward's end).
  ``*_forward_peak_bytes``: the same up to the end of the forward pass (the model's forward
  hook marks it), where ZeRO-3 has freed each block's gathered weights and ZeRO-2 not;
* **time**: ms per optimizer step, the variants run interleaved, round by round (the order
  rotated), a barrier before and after each timed block (a block is the slower rank's time); a
  ratio is the median over rounds of the per-round ratio.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import engine as eg
from benchmarks.checkpoint import _busy_s, flat, show
from benchmarks.ddp import _children_cpu, _cpu_name, _free_port, exit_rank
from engine import optim, transforms
from engine.parallel import DDP
from engine.parallel.fsdp import FSDP

WORLD = 2
WIDTH, BLOCKS, CLASSES, BATCH = 1024, 6, 10, 64
QUICK = {"width": 128, "blocks": 4, "batch": 16}
SHARDED = ("zero2", "zero3")
VARIANTS = ("ddp", *SHARDED, "torch_ddp", "torch_fsdp2")
Run = Callable[[], None]


class Block(nn.Module):
    """One unit of the benchmark's model: ``relu(Linear(width, width)(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def model(width: int = WIDTH, blocks: int = BLOCKS, seed: int = 0) -> nn.Module:
    """``blocks`` :class:`Block` s and a ``Linear(width, CLASSES)`` head.

    Example:
        >>> sum(p.numel() for p in model(1024, 6).parameters())
        6307850
    """
    torch.manual_seed(seed)
    m = nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, CLASSES))
    m.register_forward_hook(_forward_end)  # where a memory measurement marks the forward's end
    return m


def data(width: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def loss_fn(m: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def strategy(kind: str, devices: list[torch.device] | None = None) -> DDP | None:
    """The strategy of a variant: ``"ddp"``, ``"zero2"``, ``"zero3"`` (``None`` otherwise),
    set up on the process group already joined."""
    s: DDP
    if kind == "ddp":
        s = DDP(devices=devices)
    elif kind in SHARDED:
        sharding = "SHARD_GRAD_OP" if kind == "zero2" else "FULL_SHARD"
        s = FSDP(sharding_strategy=sharding, auto_wrap_policy={Block}, devices=devices)
    else:
        return None
    s.setup()
    return s


def local_bytes(tree: Any) -> int:
    """The bytes of the tensors in ``tree`` this process holds (a DTensor: its local shard).

    Example:
        >>> local_bytes({"w": torch.zeros(4, 2), "step": torch.tensor(0)})
        40
    """
    from torch.distributed.tensor import DTensor

    total = 0
    for t in pytree.tree_leaves(tree):
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            total += t.nbytes
    return total


class Variant:
    """One variant in this rank: its step (``run``), what it holds between steps (``held``)."""

    def __init__(self, run: Run, held: Callable[[], dict[str, int]]) -> None:
        self.run, self.held = run, held


def engine_variant(
    kind: str,
    sizes: dict[str, int],
    batch: Any,
    device: torch.device,
    devices: list[torch.device] | None = None,
    accumulate: int = 1,
) -> Variant:
    tx = optim.adamw(1e-3)
    pipeline = transforms.compose(
        placement=transforms.SingleDevice(device),
        strategy=strategy(kind, devices),
        accumulate=accumulate,
    )
    module = model(sizes["width"], sizes["blocks"])
    box = [pipeline.prepare(eg.TrainState.create(module, tx, seed=0), tx)]
    step = pipeline.train_step(loss_fn, tx)
    moved = pipeline.move(batch)

    def run() -> None:
        box[0], _ = step(box[0], moved)

    def held() -> dict[str, int]:
        s = box[0]
        return {
            "params": local_bytes(s.params),
            "opt_state": local_bytes(s.opt_state),
            "grads": local_bytes(s.grad_accum),
        }

    return Variant(run, held)


def _torch_loop(wrapped: nn.Module, batch: Any, device: torch.device, cuda: bool) -> Variant:
    """torch's own loop over ``wrapped`` (a DDP module, or a model ``fully_shard`` sharded):
    ``zero_grad``, backward, ``torch.optim.AdamW``."""
    opt = torch.optim.AdamW(wrapped.parameters(), fused=True if cuda else None)
    params = list(wrapped.parameters())
    b = tuple(t.to(device) for t in batch)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(wrapped, b).backward()
        opt.step()

    def held() -> dict[str, int]:
        return {
            "params": local_bytes(params),
            "opt_state": local_bytes(list(opt.state.values())),
            "grads": local_bytes([p.grad for p in params if p.grad is not None]),
        }

    return Variant(run, held)


def torch_ddp_variant(
    sizes: dict[str, int], batch: Any, device: torch.device, cuda: bool = False
) -> Variant:
    m: nn.Module = model(sizes["width"], sizes["blocks"]).to(device)
    ddp = nn.parallel.DistributedDataParallel(m, device_ids=[device] if cuda else None)
    return _torch_loop(ddp, batch, device, cuda)


def torch_fsdp2_variant(
    sizes: dict[str, int], batch: Any, device: torch.device, cuda: bool = False
) -> Variant:
    from torch.distributed.fsdp import fully_shard

    m: nn.Module = model(sizes["width"], sizes["blocks"]).to(device)
    for block in m:
        if isinstance(block, Block):
            fully_shard(block)
    fully_shard(m)
    return _torch_loop(m, batch, device, cuda)


def build(
    rank: int,
    sizes: dict[str, int],
    device: torch.device,
    devices: list[torch.device] | None = None,
) -> dict[str, Variant]:
    """Every variant on this rank (its own batch: seed ``1000 + rank``)."""
    b = data(sizes["width"], sizes["batch"], seed=1000 + rank)
    runs = {k: engine_variant(k, sizes, b, device, devices) for k in ("ddp", *SHARDED)}
    runs["torch_ddp"] = torch_ddp_variant(sizes, b, device, cuda=device.type == "cuda")
    runs["torch_fsdp2"] = torch_fsdp2_variant(sizes, b, device, cuda=device.type == "cuda")
    return runs


# ------------------------------------------------------------------------------ memory


MARK = 999_983  # bytes: the allocation that marks where the measured step begins
FORWARD_MARK = 999_979  # bytes: the one a model's forward hook makes at the forward's end
_at_forward_end: list[Callable[[], None]] = []  # what a measurement does there (nothing else)


def _forward_end(module: nn.Module, args: Any, out: Any) -> None:
    for f in _at_forward_end:
        f()


def step_peak_bytes(run: Run, device: torch.device, lead: int = 2) -> int:
    """The most bytes allocated at once during ``run()`` above what was allocated before it
    (the first of :func:`step_peaks`).

    Example:
        >>> def two():
        ...     a = torch.empty(1024)
        ...     b = torch.empty(1024)
        >>> step_peak_bytes(two, torch.device("cpu"))
        8192
    """
    return step_peaks(run, device, lead)[0]


def step_peaks(run: Run, device: torch.device, lead: int = 2) -> tuple[int, int | None]:
    """The most bytes allocated at once during ``run()`` above what was allocated before it,
    and the same up to the end of its first forward pass (``None`` if no model built here ran
    one: :func:`model`'s modules mark it, in a forward hook).

    On CUDA, ``torch.cuda.max_memory_allocated``. On the CPU, from ``torch.profiler``'s
    allocation and free events (``profile_memory=True``) summed in time order: the profiler
    knows a block's size only when it saw it allocated, so ``lead`` calls of ``run`` are
    profiled first (the blocks a step frees were then allocated in view), a marker allocation
    follows, and the peak is taken over the last call, from the marker on.
    """
    for _ in range(lead if device.type == "cuda" else 0):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward: list[int] = []
        _at_forward_end.append(lambda: forward.append(torch.cuda.max_memory_allocated(device)))
        try:
            run()
        finally:
            _at_forward_end.clear()
        torch.cuda.synchronize(device)
        at_forward = int(forward[0] - before) if forward else None
        return int(torch.cuda.max_memory_allocated(device) - before), at_forward
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(lead):
            run()
        marker = torch.empty(MARK, dtype=torch.uint8)
        del marker

        def mark() -> None:
            torch.empty(FORWARD_MARK, dtype=torch.uint8)

        _at_forward_end.append(mark)
        try:
            run()
        finally:
            _at_forward_end.clear()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if node.tag == _EventType.Allocation and fields.device.type == "cpu":
            events.append((node.start_time_ns, int(fields.alloc_size)))
        stack.extend(node.children)
    events.sort()
    freed = [i for i, (_, size) in enumerate(events) if size == -MARK]
    if not freed:
        raise RuntimeError("benchmarks.fsdp: the profiler did not record the marker allocation")
    live = peak = 0  # the level the step starts from counts: a step that frees first peaks at 0
    fwd: int | None = None
    for _, size in events[freed[-1] + 1 :]:
        if size == FORWARD_MARK and fwd is None:
            fwd = peak
        live += size
        peak = max(peak, live)
    return peak, fwd


def memory(
    runs: dict[str, Variant],
    sizes: dict[str, int],
    rank: int,
    device: torch.device,
    devices: list[torch.device] | None,
    barrier: Callable[[], None],
    repeat: int = 3,
) -> dict[str, dict[str, int]]:
    """Per variant: its held bytes (the gradients: the sum an ``accumulate=2`` pipeline keeps
    between its micro-batches), what is allocated as its step begins, and its step's peak
    above that (the median of ``repeat`` measurements, the garbage collector off in each, and
    their least and greatest), whole and up to the forward's end."""
    out: dict[str, dict[str, int]] = {}
    b = data(sizes["width"], sizes["batch"], seed=1000 + rank)
    for name, v in runs.items():
        barrier()
        held = v.held()
        # what is allocated as the step begins: the state, and the gradients this variant keeps
        # from the last step (torch's .grad; engine's step keeps none with accumulate=1)
        start = held["params"] + held["opt_state"] + held["grads"]
        peaks, forwards = [], []
        for _ in range(repeat):
            barrier()
            gc.collect()
            gc.disable()  # as while timing: a collection mid-step would move the peak
            try:
                peak, fwd = step_peaks(v.run, device)
            finally:
                gc.enable()
            peaks.append(peak)
            forwards.append(-1 if fwd is None else fwd)
        barrier()
        peak = int(statistics.median(peaks))
        if not name.startswith("torch_"):  # the gradient sum an accumulated step keeps
            acc = engine_variant(name, sizes, b, device, devices, accumulate=2)
            acc.run()
            held["grads"] = acc.held()["grads"]
            del acc
        barrier()
        held["total"] = held["params"] + held["opt_state"] + held["grads"]
        fwd = int(statistics.median(forwards))
        out[name] = {**held, "start": start, "step_peak_above_start": peak}
        out[name]["step_peak"] = start + peak
        out[name]["forward_peak_above_start"] = fwd
        out[name]["forward_peak"] = start + fwd
        out[name]["step_peak_above_start_min"] = min(peaks)
        out[name]["step_peak_above_start_max"] = max(peaks)
    return out


# ------------------------------------------------------------------------------ time


def timing(
    runs: dict[str, Variant], rounds: int, steps: int, barrier: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per step of each variant per round, interleaved (the order rotated)."""
    names = list(runs)

    def block(name: str, n: int) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            runs[name].run()
        barrier()
        return (time.perf_counter() - t0) / n

    for name in names:  # warm-up (torch DDP rebuilds its buckets after the first step)
        block(name, 2)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(block(name, steps))
    return times


def figures(
    mem: dict[str, dict[str, int]], times: dict[str, list[float]], sizes: dict[str, int]
) -> dict[str, Any]:
    """The JSON's figures: bytes and ms per variant, and each as a ratio to ``ddp``'s."""

    def ratio(a: str, c: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[c], strict=True))

    params = sum(p.numel() for p in model(sizes["width"], sizes["blocks"]).parameters())
    out: dict[str, Any] = {
        "world_size": WORLD,
        "threads_per_rank": 1,
        "per_rank_batch": sizes["batch"],
        "width": sizes["width"],
        "blocks": sizes["blocks"],
        "params": params,
        "param_bytes": params * 4,
    }
    ddp = mem["ddp"]
    for name, m in mem.items():
        for part in ("params", "opt_state", "grads", "total"):
            out[f"{name}_held_{part}_bytes"] = m[part]
        out[f"{name}_step_start_bytes"] = m["start"]
        out[f"{name}_step_peak_above_start_bytes"] = m["step_peak_above_start"]
        out[f"{name}_step_peak_above_start_range_bytes"] = [
            m["step_peak_above_start_min"],
            m["step_peak_above_start_max"],
        ]
        out[f"{name}_step_peak_bytes"] = m["step_peak"]
        out[f"{name}_forward_peak_above_start_bytes"] = m["forward_peak_above_start"]
        out[f"{name}_forward_peak_bytes"] = m["forward_peak"]
    for name in (*SHARDED, "torch_ddp", "torch_fsdp2"):
        m = mem[name]
        for part in ("params", "opt_state", "grads", "total"):
            out[f"{name}_vs_ddp_held_{part}_ratio"] = m[part] / ddp[part] if ddp[part] else None
        out[f"{name}_vs_ddp_step_peak_ratio"] = m["step_peak"] / ddp["step_peak"]
        out[f"{name}_vs_ddp_forward_peak_ratio"] = m["forward_peak"] / ddp["forward_peak"]
    for name, t in times.items():
        out[f"{name}_step_ms"] = statistics.median(t) * 1e3
    for name in SHARDED:
        out[f"{name}_vs_ddp_step_ratio"] = ratio(name, "ddp")
    out["zero3_vs_zero2_step_ratio"] = ratio("zero3", "zero2")
    out["ddp_vs_torch_ddp_step_ratio"] = ratio("ddp", "torch_ddp")
    out["fsdp_engine_vs_torch"] = ratio("zero3", "torch_fsdp2")
    return out


# ------------------------------------------------------------------------------ one rank


def rank_main(rank: int, port: int, rounds: int, steps: int, quick: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    sizes = dict(QUICK) if quick else {"width": WIDTH, "blocks": BLOCKS, "batch": BATCH}
    cpu = torch.device("cpu")
    runs = build(rank, sizes, cpu)
    for v in runs.values():  # warm-up before the memory is measured (lazy allocations)
        v.run()
    mem = memory(runs, sizes, rank, cpu, None, dist.barrier)
    times = timing(runs, rounds, steps, dist.barrier)
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, mem)
    if rank == 0:
        result = figures(mem, times, sizes)
        result["backend"] = "gloo"
        result["memory_measured_by"] = "torch.profiler allocation events (CPU)"
        result["rank1_held_total_bytes"] = {k: v["total"] for k, v in gathered[1].items()}
        result["rank1_step_peak_bytes"] = {k: v["step_peak"] for k, v in gathered[1].items()}
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the parent


def _launch(rounds: int, steps: int, quick: bool, timeout: float) -> dict[str, Any]:
    """Start the two rank processes, wait for both (a bounded time), read rank 0's figures."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        cmd = [sys.executable, "-m", "benchmarks.fsdp", "--port", str(port), "--out", out]
        cmd += ["--rounds", str(rounds), "--steps", str(steps)] + (["--quick"] if quick else [])
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
            raise RuntimeError("benchmarks.fsdp: " + "\n".join(errors))
        return dict(json.loads(Path(out).read_text()))


def run(
    rounds: int = 11, steps: int = 3, quick: bool = False, timeout: float = 900
) -> dict[str, Any]:
    """Measure (2 rank processes) and return the figures, with the load other processes put
    on the machine meanwhile.

    ``quick`` is a small model (width 128, 4 blocks, batch 16) for a smoke run: its memory
    figures are exact, its times say little.
    """
    busy0, wall0, own0 = _busy_s(), time.monotonic(), _children_cpu()
    out = _launch(rounds, steps, quick, timeout)
    busy1, wall1, own1 = _busy_s(), time.monotonic(), _children_cpu()
    out["rounds"], out["steps_per_round"] = rounds, steps
    if busy0 is not None and busy1 is not None:
        other = (busy1 - busy0 - (own1 - own0)) / (wall1 - wall0)
        out["other_processes_cores"] = max(0.0, other)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="a small model, few rounds")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.port, args.rounds, args.steps, args.quick, args.out)
        exit_rank()
    rounds = args.rounds or (3 if args.quick else 11)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }
    results.update(run(rounds, steps=args.steps, quick=args.quick))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in flat(results).items():
            print(show(k, v))


if __name__ == "__main__":
    main()
