import sys, time, os, torch
import engine as eg
from engine import optim, rng
from engine.step._compile import _Compiled
from engine.step._common import _set_mode
from benchmarks.step import mlp, batch, loss_fn, SHAPES
K = int(sys.argv[1])
sizes, n = SHAPES["tiny"]
tx = optim.adamw(1e-3)
step = eg.train_step(loss_fn, tx, compile=True)
def _u(*a): return step._update_core(*a)
inner = torch.compiler.nested_compile_region(_u)
def block_core(module, params, buffers, opt_state, precision, grad_accum, step0, batches, frozen, extra):
    ms = []
    s = step0
    for b in batches:
        opt_state, precision, m = inner(module, params, buffers, opt_state, precision, None, s, b, frozen, extra)
        s = s + 1
        ms.append(m)
    return opt_state, precision, {k: torch.stack([m[k] for m in ms]) for k in ms[0]}
compiled = _Compiled(block_core, {})
state = eg.TrainState.create(mlp(sizes), tx, seed=0)
b = batch(sizes, n)
batches = [b] * K
for i in range(3):
    t = time.perf_counter()
    state._consume("x")
    opt_state, precision, metrics = compiled(state.module, state.params, state.buffers, state.opt_state, state.precision, None, state.step, batches, None, None)
    state = state.replace(opt_state=opt_state, precision=precision, step=state.step + K, _ownership=type(state._ownership)())
    print("call", i, time.perf_counter() - t, flush=True)
