import sys, time, torch, gc, torch.nn.functional as F
import engine as eg
from engine import optim
from benchmarks.step import mlp, batch, loss_fn, SHAPES
import os
if os.environ.get("THR1"): import torch._inductor.config as _c; _c.cpp.threads = 1
K = int(sys.argv[1]); size = sys.argv[2] if len(sys.argv) > 2 else "tiny"
sizes, n = SHAPES[size]
tx = optim.adamw(1e-3)
step = eg.train_step(loss_fn, tx, compile=True, steps_per_call=K)
state = eg.TrainState.create(mlp(sizes), tx, seed=0)
b = batch(sizes, n); batches = [b] * K
t0 = time.perf_counter()
for i in range(3):
    t = time.perf_counter(); state, m = step(state, batches); print("call", i, time.perf_counter() - t, flush=True)
model = mlp(sizes); opt = torch.optim.AdamW(model.parameters(), 1e-3)
def raw():
    opt.zero_grad(set_to_none=True); F.cross_entropy(model(b[0]), b[1]).backward(); opt.step()
for _ in range(20): raw()
gc.disable(); rs = []
N = 128 if size == "tiny" else 32
for r in range(7):
    t = time.perf_counter()
    for _ in range(N): raw()
    tr = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(N // K): state, m = step(state, batches)
    te = time.perf_counter() - t
    rs.append(te / tr)
rs.sort(); print("K", K, size, "ratio", rs[3], rs, "raw us", tr / N * 1e6)
