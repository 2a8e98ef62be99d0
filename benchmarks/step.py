"""Per-step time and peak memory of engine's steps as ratios to a raw PyTorch loop.

    python -m benchmarks.step            # a table
    python -m benchmarks.step --json     # one JSON object of ratios (and the raw timings)
    python -m benchmarks.step --quick    # fewer rounds; finishes in under two minutes

Speed: every variant runs on the same model shape and the same batch, *interleaved* round by
round in one process, so drift in machine load hits all of them alike; a variant's figure is the
median over rounds of (its time / the raw loop's time in that round). The raw loop is
``zero_grad(set_to_none=True)``, forward, ``backward()``, ``torch.optim.AdamW()`` step (the
default foreach implementation).

Memory: each variant trains a ~50M-parameter MLP with AdamW for a few steps in a fresh process;
the figure is its peak RSS above the RSS it had before building the model (so the shared cost of
importing torch does not dilute the ratio).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from benchmarks import checkpoint as checkpoint_bench
from engine import optim

SHAPES = {
    "tiny": ((32, 64, 64, 10), 64),
    "medium": ((784, 1024, 1024, 10), 256),
}
MEMORY_SHAPE = ((4096, 4096, 4096, 4096, 1000), 64)  # 54.6M parameters


def mlp(sizes: tuple[int, ...], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch(sizes: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, sizes[0], generator=g), torch.randint(0, sizes[-1], (n,), generator=g)


def loss_fn(model, b):
    x, y = b
    return F.cross_entropy(model(x), y)


# ------------------------------------------------------------------------------ variants


def raw_loop(sizes, b, fused: bool = False) -> Callable[[], None]:
    model = mlp(sizes)
    opt = torch.optim.AdamW(model.parameters(), fused=fused or None)
    x, y = b

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return run


def engine_loop(sizes, b, compile: bool = False, fused: bool | None = None) -> Callable[[], None]:
    tx = optim.adamw(1e-3, fused=fused)  # default: torch.optim.AdamW's default path, bitwise
    box = [eg.TrainState.create(mlp(sizes), tx, seed=0)]
    step = eg.train_step(loss_fn, tx, compile=compile)

    def run() -> None:
        box[0], _ = step(box[0], b)

    return run


def multistep_loop(sizes, b, k: int) -> Callable[[], None]:
    """``steps_per_call=k`` compiled: one call runs k optimizer steps (``run.per_call``)."""
    tx = optim.adamw(1e-3)
    box = [eg.TrainState.create(mlp(sizes), tx, seed=0)]
    step = eg.train_step(loss_fn, tx, compile=True, steps_per_call=k)
    batches = [b] * k

    def run() -> None:
        box[0], _ = step(box[0], batches)

    run.per_call = k  # type: ignore[attr-defined]
    return run


MULTISTEP_K = (4, 8, 16)

VARIANTS: dict[str, Callable[..., Callable[[], None]]] = {
    "raw": raw_loop,
    "raw_fused": lambda s, b: raw_loop(s, b, fused=True),
    "engine_eager": engine_loop,
    "engine_fused": lambda s, b: engine_loop(s, b, fused=True),
    "engine_compiled": lambda s, b: engine_loop(s, b, compile=True),
    **{f"engine_multistep{k}": (lambda s, b, k=k: multistep_loop(s, b, k)) for k in MULTISTEP_K},
}


def time_variants(name: str, rounds: int, steps: int, warmup: int) -> dict[str, float]:
    sizes, n = SHAPES[name]
    b = batch(sizes, n)
    runs = {k: make(sizes, b) for k, make in VARIANTS.items()}
    compile_s = {}
    for k, run in runs.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            run()
        compile_s[k] = time.perf_counter() - t0
    # a variant that runs several optimizer steps per call is timed per optimizer step
    calls = {k: max(steps // getattr(run, "per_call", 1), 1) for k, run in runs.items()}
    per_step = {k: calls[k] * getattr(run, "per_call", 1) for k, run in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    gc.collect()
    gc.disable()  # as timeit does: a collection landing in one variant's window is noise
    names = list(runs)
    try:
        for r in range(rounds):
            # each round starts one variant later: what runs before a variant (the caches and
            # the allocator it leaves) is every variant's in turn, not always the same one's
            for k in names[r % len(names) :] + names[: r % len(names)]:
                run = runs[k]
                t0 = time.perf_counter()
                for _ in range(calls[k]):
                    run()
                times[k].append((time.perf_counter() - t0) / per_step[k])
    finally:
        gc.enable()
    out = {f"{name}_raw_step_us": statistics.median(times["raw"]) * 1e6}
    for k in runs:
        if k != "raw":
            ratios = [t / r for t, r in zip(times[k], times["raw"], strict=True)]
            out[f"{name}_{k}_ratio"] = statistics.median(ratios)
    out[f"{name}_compile_warmup_s"] = compile_s["engine_compiled"]
    # the headline: K=8 (the others are reported beside it)
    out[f"{name}_engine_multistep_ratio"] = out[f"{name}_engine_multistep8_ratio"]
    # K=8 against K=1 directly, round by round (the target: K=8 no slower than compiled K=1)
    pairs = zip(times["engine_multistep8"], times["engine_compiled"], strict=True)
    out[f"{name}_multistep8_vs_compiled"] = statistics.median(a / b for a, b in pairs)
    return out


def compile_child(k: int) -> None:
    """Time the first two calls of a ``steps_per_call=k`` compiled step in this fresh process
    (the compile; the second call, with the next step number, runs the same graph: the step
    counter is symbolic from the first call)."""
    sizes, n = SHAPES["tiny"]
    run = multistep_loop(sizes, batch(sizes, n), k)
    t0 = time.perf_counter()
    run()
    run()
    print(json.dumps({"compile_s": time.perf_counter() - t0}))


def probe_child() -> None:
    """Time Inductor's first compile in this fresh process over an empty cache: a trivial graph,
    so the time is Inductor's once-per-cache probes (test programs for this CPU's vector
    instruction sets, the C++ wrapper's precompiled header) and its first-use setup."""
    t0 = time.perf_counter()
    torch.compile(lambda x: x + 1, options={"cpp_wrapper": True})(torch.ones(4))
    print(json.dumps({"compile_s": time.perf_counter() - t0}))


def measure_compile(k: int = 8) -> dict[str, float]:
    """Cold (a cache holding no graph of the step) and warm (the cache the cold run filled)
    compile times of the tiny MLP's ``steps_per_call=k`` step, each in a fresh process.

    Before the cold run, a process of its own fills the empty cache with Inductor's
    once-per-cache probes of the machine (:func:`probe_child`; reported as
    ``inductor_probes_s``): the same for any graph, and paid once by a user whose cache
    persists, they are not the step's compile."""
    import os
    import tempfile

    def child(*flags: str) -> float:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.step", *flags],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])["compile_s"]

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out["inductor_probes_s"] = child("--probe-child")
        for kind in ("cold", "warm"):
            out[f"multistep_compile_{kind}_s"] = child("--compile-child", str(k))
    return out


# ------------------------------------------------------------------------------ memory


def _rss_mb() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def memory_child(variant: str, steps: int) -> None:
    sizes, n = MEMORY_SHAPE
    b = batch(sizes, n)
    base = _current_rss_mb()
    run = VARIANTS[variant](sizes, b)
    for _ in range(steps):
        run()
    print(json.dumps({"peak_mb": _rss_mb() - base}))


def measure_memory(variants: list[str], steps: int) -> dict[str, float]:
    peaks = {}
    for v in variants:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.step", "--memory-child", v, "--steps", str(steps)],
            check=True,
            capture_output=True,
            text=True,
        )
        peaks[v] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
    result = {"memory_raw_peak_mb": peaks["raw"]}
    for v in variants:
        if v != "raw":
            result[f"memory_{v}_ratio"] = peaks[v] / peaks["raw"]
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="fewer rounds (under two minutes)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--compile-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--only-steps", action="store_true", help="the step timings and compile times alone"
    )
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.steps)
        return
    if args.compile_child:
        compile_child(args.compile_child)
        return
    if args.probe_child:
        probe_child()
        return
    rounds = 7 if args.quick else 21
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    results.update(time_variants("tiny", rounds, steps=100, warmup=30))
    results.update(time_variants("medium", rounds if not args.quick else 5, steps=16, warmup=4))
    results.update(measure_compile(8))
    if args.only_steps:
        print(json.dumps(results, indent=2))
        return
    results.update(measure_memory(["raw", "raw_fused", "engine_eager", "engine_fused"], steps=3))
    from benchmarks.trainer import time_trainer  # imports this module: import late

    results.update(time_trainer(rounds=5 if args.quick else 11))
    # save/load/async figures, on disk and on tmpfs (see benchmarks/checkpoint.py)
    results["checkpoint"] = checkpoint_bench.run(rounds=5 if args.quick else 15)
    # bf16-mixed vs float32 through the Trainer (see benchmarks/precision.py)
    from benchmarks import precision as precision_bench  # imports this module: import late

    results["precision"] = precision_bench.run(
        rounds=3 if args.quick else 9, batches=10 if args.quick else precision_bench.BATCHES
    )
    # 2 gloo ranks against 1, the all-reduce's cost, overlap (see benchmarks/ddp.py)
    from benchmarks import ddp as ddp_bench  # imports this module: import late

    quick = dict(steps=3, reps=3) if args.quick else {}
    results["ddp"] = ddp_bench.run(rounds=5 if args.quick else 15, **quick)
    # FSDP's ZeRO-2 / ZeRO-3 equivalents against DDP on 2 gloo ranks: bytes held per rank,
    # a step's peak, step time (see benchmarks/fsdp.py)
    from benchmarks import fsdp as fsdp_bench  # imports this module: import late

    results["fsdp"] = fsdp_bench.run(rounds=5 if args.quick else 11)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in checkpoint_bench.flat(results).items():
            print(checkpoint_bench.show(k, v))


if __name__ == "__main__":
    main()
