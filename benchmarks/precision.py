"""bf16-mixed against float32 through the Trainer on the CPU, eager and compiled.

    python -m benchmarks.precision            # a table
    python -m benchmarks.precision --json     # what benchmarks.step puts under "precision"

Each variant fits one epoch of ``BATCHES`` batches of the medium MLP of ``benchmarks.step``
(784-1024-1024-10, batch 256, AdamW) with ``Trainer(accelerator="cpu", barebones=True,
precision=...)``, ``"32-true"`` or ``"bf16-mixed"``, eager or ``compile=True``. One unrecorded
fit per variant warms up (and compiles); then the variants fit interleaved, round by round. A
figure is the median over rounds of the per-round ratio:

* ``bf16_vs_f32_eager`` / ``bf16_vs_f32_compiled``: the bf16-mixed fit's time over the float32
  fit's (below 1: bf16-mixed is faster);
* ``compiled_vs_eager_f32`` / ``compiled_vs_eager_bf16``: compiled over eager, per precision;
* ``bf16_vs_f32_raw``: the same ratio for the raw PyTorch loop of ``benchmarks.step`` over the
  same batches (``torch.autocast("cpu", torch.bfloat16)`` around forward and loss), for
  orientation: what autocast itself gains on this processor;
* ``trainer_vs_raw_f32`` / ``trainer_vs_raw_bf16``: the eager Trainer's fit over the raw loop.

``ms_per_batch`` gives each variant's median fit time per batch, ``iqr`` the interquartile
range of the per-round ratios, ``other_processes_cores`` how many cores other processes kept busy
while the rounds ran, ``cpu_bf16`` whether the processor has AVX512-BF16 or AMX
instructions (without them, bf16 matrix products are emulated and slower than float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import engine as eg
from benchmarks.checkpoint import _busy_s
from benchmarks.step import SHAPES, batch, loss_fn, mlp, raw_loop
from engine import optim

BATCHES = 20  # per fit: ~0.5-1 s of float32 steps on 2 cores
VARIANTS = {  # name: (precision flag, compile)
    "f32_eager": ("32-true", False),
    "bf16_eager": ("bf16-mixed", False),
    "f32_compiled": ("32-true", True),
    "bf16_compiled": ("bf16-mixed", True),
}
RAW = {"f32_raw": False, "bf16_raw": True}  # name: autocast


def _fit(precision: str, compile: bool, data: list[Any]) -> Callable[[], None]:
    sizes, _ = SHAPES["medium"]
    task = eg.Task(loss_fn, optim.adamw(1e-3))
    box = [task.init(mlp(sizes), seed=0)]

    def run() -> None:
        trainer = eg.Trainer(
            accelerator="cpu", max_epochs=1, barebones=True, precision=precision, compile=compile
        )
        box[0] = trainer.fit(task, box[0].replace(epoch=0, batch_idx=0), data)

    return run


def _raw(autocast: bool, data: list[Any]) -> Callable[[], None]:
    sizes, _ = SHAPES["medium"]
    step = raw_loop(sizes, data[0])  # the batches are one batch repeated

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for _ in data:
                step()

    return run


def _cpu_bf16() -> bool | None:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def run(rounds: int, batches: int = BATCHES, compile: bool = True) -> dict[str, Any]:
    """The figures of the module's docstring, over ``rounds`` interleaved rounds."""
    sizes, n = SHAPES["medium"]
    data = [batch(sizes, n)] * batches
    names = [k for k, (_, c) in VARIANTS.items() if compile or not c]
    runs = {k: _fit(*VARIANTS[k], data) for k in names}
    runs.update({k: _raw(autocast, data) for k, autocast in RAW.items()})
    names = list(runs)
    warmup_s = {}
    for k, fit in runs.items():
        t0 = time.perf_counter()
        fit()
        warmup_s[k] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in runs}
    gc.collect()
    busy, cpu, wall = _busy_s(), time.process_time(), time.perf_counter()
    gc.disable()  # as timeit does
    try:
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for k in order:
                t0 = time.perf_counter()
                runs[k]()
                times[k].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    busy_after, cpu, wall = _busy_s(), time.process_time() - cpu, time.perf_counter() - wall
    others = None if busy is None or busy_after is None else (busy_after - busy - cpu) / wall

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(times[a], times[b], strict=True)]

    pairs = {
        "bf16_vs_f32_eager": ("bf16_eager", "f32_eager"),
        "bf16_vs_f32_compiled": ("bf16_compiled", "f32_compiled"),
        "compiled_vs_eager_f32": ("f32_compiled", "f32_eager"),
        "compiled_vs_eager_bf16": ("bf16_compiled", "bf16_eager"),
        "bf16_vs_f32_raw": ("bf16_raw", "f32_raw"),
        "trainer_vs_raw_f32": ("f32_eager", "f32_raw"),
        "trainer_vs_raw_bf16": ("bf16_eager", "bf16_raw"),
    }
    out: dict[str, Any] = {
        "model": "MLP 784-1024-1024-10, batch 256",
        "batches_per_fit": batches,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "cpu_bf16": _cpu_bf16(),
        "other_processes_cores": others,
    }
    for key, (a, b) in pairs.items():
        if a in times and b in times:
            out[key] = statistics.median(ratios(a, b))
            out[f"{key}_iqr"] = _quartiles(ratios(a, b))
    out["ms_per_batch"] = {k: statistics.median(v) / batches * 1e3 for k, v in times.items()}
    out["warmup_s"] = warmup_s
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--batches", type=int, default=BATCHES, help="batches per fit")
    p.add_argument("--skip-compile", action="store_true", help="eager variants only")
    args = p.parse_args(argv)
    out = run(args.rounds, args.batches, compile=not args.skip_compile)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    from benchmarks.checkpoint import flat, show

    for k, v in flat(out).items():
        print(show(k, v))


if __name__ == "__main__":
    main()
