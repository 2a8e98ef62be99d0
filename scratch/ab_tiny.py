"""A/B: medium MLP, compiled K=1 vs K=8 blocks, interleaved rounds, ratio to the raw loop."""
import os, statistics, sys, time, resource
import torch
sys.path.insert(0, os.getcwd())
from benchmarks.step import SHAPES, batch, raw_loop, engine_loop, multistep_loop

sizes, n = SHAPES["tiny"]
b = batch(sizes, n)
ks = [int(k) for k in (sys.argv[1:] or ["8"])]
fns = {"raw": raw_loop(sizes, b), "k1": engine_loop(sizes, b, compile=True)}
for k in ks:
    fns[f"k{k}"] = multistep_loop(sizes, b, k)
for f in fns.values():
    for _ in range(3):
        f()
steps = 96
ratios = {k: [] for k in fns}
faults = {k: 0 for k in fns}
for r in range(int(os.environ.get("ROUNDS", 9))):
    t = {}
    for name, f in fns.items():
        per = getattr(f, "per_call", 1)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        s = time.perf_counter()
        for _ in range(steps // per):
            f()
        t[name] = (time.perf_counter() - s) / steps
        faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    for name in fns:
        ratios[name].append(t[name] / t["raw"])
    print(r, {k: round(v[-1], 3) for k, v in ratios.items()}, flush=True)
print("median", {k: round(statistics.median(v), 3) for k, v in ratios.items()})
print("faults/step", {k: v // (steps * int(os.environ.get("ROUNDS", 9))) for k, v in faults.items()})
