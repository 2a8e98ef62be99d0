import sys, time, torch, torch.nn.functional as F
import engine as eg
from engine import optim, rng
from engine.step._train import TrainStep
from engine.step._compile import _Compiled
from engine.step._common import _set_mode
from benchmarks.step import mlp, batch, loss_fn, SHAPES

K = int(sys.argv[1]); mode = sys.argv[2] if len(sys.argv) > 2 else "unroll"
sizes, n = SHAPES["tiny"]
tx = optim.adamw(1e-3)
step = eg.train_step(loss_fn, tx, compile=True)
def block_core(module, params, buffers, opt_state, precision, grad_accum, step0, batches, frozen, extra):
    ms = []
    s = step0
    for b in batches:
        opt_state, precision, m = step._update_core(module, params, buffers, opt_state, precision, None, s, b, frozen, extra)
        s = s + 1
        ms.append(m)
    return opt_state, precision, {k: torch.stack([m[k] for m in ms]) for k in ms[0]}
import os
compiled = _Compiled(block_core, {"options": {"size_asserts": False, "cpp_wrapper": False}} if os.environ.get("PYW") else {})
state = eg.TrainState.create(mlp(sizes), tx, seed=0)
b = batch(sizes, n)
batches = [b] * K
def run(state):
    state._consume("x")
    _set_mode(state.module, True)
    with rng.seeded(rng.derive_seed(state.seed, state.step, 0), ()):
        opt_state, precision, metrics = compiled(state.module, state.params, state.buffers, state.opt_state, state.precision, None, state.step, batches, None, None)
    return state.replace(opt_state=opt_state, precision=precision, step=state.step + K, batch_idx=state.batch_idx + K, _ownership=type(state._ownership)()), metrics
for i in range(3):
    t = time.perf_counter()
    state, m = run(state)
    print("call", i, time.perf_counter() - t, flush=True)
# time vs raw
model = mlp(sizes); opt = torch.optim.AdamW(model.parameters(), 1e-3)
def raw():
    opt.zero_grad(set_to_none=True); F.cross_entropy(model(b[0]), b[1]).backward(); opt.step()
for _ in range(20): raw()
import gc; gc.disable()
rs = []
for r in range(7):
    t = time.perf_counter()
    for _ in range(8 * 16): raw()
    tr = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(8 * 16 // K): state, m = run(state)
    te = time.perf_counter() - t
    rs.append(te / tr)
rs.sort(); print("K", K, "ratio", rs[3], "raw us", tr / 128 * 1e6)
