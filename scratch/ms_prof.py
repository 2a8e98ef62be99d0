import sys, time, torch, gc, cProfile, pstats
import engine as eg
from engine import optim
from benchmarks.step import mlp, batch, loss_fn, SHAPES
import os
if os.environ.get("THR1"): import torch._inductor.config as _c; _c.cpp.threads = 1
K = int(os.environ.get("K", 8))
sizes, n = SHAPES["tiny"]
tx = optim.adamw(1e-3)
opts = {"options": {"max_autotune": True, "size_asserts": False, "cpp_wrapper": True, "max_autotune_gemm_backends": "CPP,ATEN"}} if os.environ.get("MAT") else True
step = eg.train_step(loss_fn, tx, compile=opts, steps_per_call=K)
t0=time.perf_counter()
state = eg.TrainState.create(mlp(sizes), tx, seed=0)
b = batch(sizes, n); batches = [b] * K
for i in range(5): state, m = step(state, batches)
print("warm", time.perf_counter()-t0)
gc.disable()
t = time.perf_counter()
for i in range(200): state, m = step(state, batches)
full = (time.perf_counter() - t) / 200
blk = step._block
args = lambda s: (s.module, s.params, s.buffers, s.opt_state, s.precision, s.step, batches, K, False, None, None)
t = time.perf_counter()
for i in range(200): blk(*args(state))
print("full call us", full * 1e6, "block core us", (time.perf_counter() - t) / 200 * 1e6)
pr = cProfile.Profile(); pr.enable()
for i in range(200): state, m = step(state, batches)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
from torch.profiler import profile
with profile() as p:
    for i in range(20): state, m = step(state, batches)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
