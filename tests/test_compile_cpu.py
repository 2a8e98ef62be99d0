"""What a compiled step does on the CPU beyond torch.compile's defaults: a small graph runs on one
thread (engine/step/_threads.py), and a linear layer's bias is added by Inductor's kernels, not by
ATen's addmm (engine/step/_unfuse_bias.py). Both must keep the step's numbers: checked against
the eager step."""

from __future__ import annotations

import json
import sys
import threading

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import engine as eg
from engine import optim
from engine.step._isa_probe import wants_probe
from engine.step._threads import SMALL, _on_one_thread, is_small_cpu_graph
from engine.step._unfuse_bias import unfuse_bias_pass


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _batch(n: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _counting_set_num_threads(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch.set_num_threads

    def record(n: int) -> None:
        calls.append(n)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", record)
    return calls


@pytest.mark.parametrize(("width", "batch", "one_thread"), [(16, 32, True), (256, 64, False)])
def test_a_small_cpu_graph_runs_on_one_thread_a_larger_one_on_the_process_threads(
    monkeypatch, width, batch, one_thread
):
    torch.set_num_threads(2)
    tx = optim.adamw(1e-2)
    eager = eg.train_step(_loss, tx)
    compiled = eg.train_step(_loss, tx, compile=True)
    s_eager = eg.TrainState.create(_mlp(width), tx, seed=0)
    s_comp = eg.TrainState.create(_mlp(width), tx, seed=0)
    b = _batch(batch)
    s_comp, _ = compiled(s_comp, b)  # compiles
    calls = _counting_set_num_threads(monkeypatch)
    for _ in range(3):
        s_eager, m_eager = eager(s_eager, b)
        s_comp, m_comp = compiled(s_comp, b)
    s_eager, m_eager = eager(s_eager, b)
    assert calls == ([1, 2] * 3 if one_thread else [])
    assert torch.get_num_threads() == 2
    torch.testing.assert_close(m_comp["loss"], m_eager["loss"], rtol=1e-5, atol=1e-6)
    for name, p in s_eager.params.items():
        torch.testing.assert_close(s_comp.params[name], p, rtol=1e-5, atol=1e-6)


def test_the_smallness_test_reads_every_computed_tensor_and_what_operations_read():
    seen: dict[str, bool] = {}

    def backend(name):
        def compile_(gm, example_inputs):
            seen[name] = is_small_cpu_graph(gm)
            return gm.forward

        return compile_

    def f(x, w):
        return torch.relu(x @ w).sum()

    side = int(SMALL**0.5)
    small = torch.randn(side, side)
    torch.compile(f, backend=backend("small"), dynamic=False)(small, small)
    big = torch.randn(2 * side, side)  # twice the rows: more than SMALL elements
    torch.compile(f, backend=backend("input"), dynamic=False)(big, small)
    # a stacked input read only by indexing does not count: its micro-batches do
    stacked = torch.randn(4, side, side)
    torch.compile(lambda s, w: f(s[1], w), backend=backend("picked"), dynamic=False)(stacked, small)
    # symbolic sizes count as large
    torch.compile(f, backend=backend("dynamic"), dynamic=True)(small, small)
    assert seen == {"small": True, "input": False, "picked": True, "dynamic": False}


def test_one_thread_is_the_calling_threads_and_comes_back_after_a_raise():
    torch.set_num_threads(2)
    torch.randn(1 << 20).exp().sum()  # this thread has run a parallel region: counts its own
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def graph() -> None:
        seen["inside"] = torch.get_num_threads()
        inside.set()
        release.wait(30)
        raise ValueError("the graph failed")

    def caller() -> None:
        torch.randn(1 << 20).exp().sum()
        with pytest.raises(ValueError, match="the graph failed"):
            _on_one_thread(graph)()
        seen["caller_after"] = torch.get_num_threads()

    t = threading.Thread(target=caller)
    t.start()
    assert inside.wait(30)
    seen["other_thread"] = torch.get_num_threads()
    release.set()
    t.join(timeout=30)
    assert seen == {"inside": 1, "other_thread": 2, "caller_after": 2}
    assert torch.get_num_threads() == 2


def _post_grad_graph(*args):
    return make_fx(torch.addmm, tracing_mode="fake")(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_bias_pass_turns_addmm_into_a_product_and_an_add_with_the_same_numbers(dtype):
    g = torch.Generator().manual_seed(0)
    bias, x, w = (torch.randn(*s, generator=g, dtype=dtype) for s in ((5,), (3, 4), (4, 5)))
    gm = _post_grad_graph(bias, x, w)
    unfuse_bias_pass()(gm.graph)
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default not in targets
    assert torch.ops.aten.mm.default in targets
    torch.testing.assert_close(gm(bias, x, w), torch.addmm(bias, x, w), rtol=0, atol=1e-6)


def test_the_bias_pass_keeps_addmm_in_half_precision():
    bias, x, w = torch.zeros(5, dtype=torch.bfloat16), torch.ones(3, 4), torch.ones(4, 5)
    gm = _post_grad_graph(bias, x.bfloat16(), w.bfloat16())
    unfuse_bias_pass()(gm.graph)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default in targets


def test_a_post_grad_pass_of_the_users_own_is_kept():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    ran: list[bool] = []

    class Theirs(CustomGraphPass):
        def __call__(self, graph):
            ran.append(any(n.target == torch.ops.aten.addmm.default for n in graph.nodes))

        def uuid(self):
            return "test_compile_cpu.theirs"

    tx = optim.sgd(0.1)
    step = eg.train_step(_loss, tx, compile=True)
    # torch's own config patches: pytest's monkeypatch undoes a config it did not find in the
    # module's __dict__ by deleting it, which hides the option from every later test.
    # Compiled for real: a cached graph would not run the pass.
    with (
        torch._inductor.config.patch(post_grad_custom_post_pass=Theirs(), fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        step(eg.TrainState.create(_mlp(16), tx, seed=0), _batch(32))
    assert ran and all(ran)  # theirs ran, and saw the addmm ours would have rewritten


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_another_backend_gets_none_of_inductors_options(backend, caplog):
    # engine's Inductor options (the C++ wrapper, the bias pass, STORE_EACH_STEP) go to Inductor
    # alone: aot_eager warned that it ignored them, another backend could refuse them
    tx = optim.sgd(0.1)
    step = eg.train_step(_loss, tx, compile={"backend": backend}, steps_per_call=2)
    with caplog.at_level("WARNING"):
        _, metrics = step(eg.TrainState.create(_mlp(16), tx, seed=0), [_batch(32)] * 2)
    assert metrics["loss"].shape == (2,)
    assert not [r for r in caplog.records if "ignoring extra kwargs" in r.getMessage()]


def _in_loops(cpp: str, token: str) -> list[str]:
    """The lines of Inductor's C++ source holding ``token`` inside a ``for`` loop's body."""
    found, depth, loops = [], 0, []
    for line in cpp.splitlines():
        if line.lstrip().startswith("for("):
            loops.append(depth)  # the body is the next brace opened at this depth
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1] and "}" in line:
            loops.pop()
        if token in line and any(depth > d for d in loops):
            found.append(line.strip())
    return found


def test_compiled_adams_bias_corrections_run_once_a_step_not_in_every_elements_loop():
    # Inductor inlines a 0-d tensor's math into each kernel that reads it; C's errno keeps the
    # compiler from hoisting libm's pow out of the loop, which then ran once per vector of every
    # parameter (~10% of a compiled medium-MLP step). adaptive.py stacks the corrections.
    from torch._inductor.utils import run_and_get_code

    tx = optim.adamw(1e-2)
    step = eg.train_step(_loss, tx, compile=True)
    eager = eg.train_step(_loss, tx)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        (state, _), codes = run_and_get_code(
            step, eg.TrainState.create(_mlp(64), tx, seed=0), _batch(32)
        )
    (cpp,) = codes
    assert "std::pow" in cpp and "for(" in cpp  # the C++ source, with the corrections in it
    assert _in_loops(cpp, "std::pow") == []
    assert _in_loops("for(int x=0; x<4; x++)\n{\n  y = std::pow(a, b);\n}\n", "std::pow")
    expected, _ = eager(eg.TrainState.create(_mlp(64), tx, seed=0), _batch(32))
    for name, p in expected.params.items():
        torch.testing.assert_close(state.params[name], p, rtol=1e-5, atol=1e-6)


_PROBE_ORDER = """
import json, sys, threading, time
import torch
from torch import nn
from torch._inductor import cpu_vec_isa
import engine as eg
from engine import optim

asked = []  # (thread, start, end, answer) of each call of Inductor's cached CPU probe
cached = cpu_vec_isa.valid_vec_isa_list

def recording():
    start = time.perf_counter()
    answer = cached()
    asked.append((threading.current_thread().name, start, time.perf_counter(), answer))
    return answer

cpu_vec_isa.valid_vec_isa_list = recording
compile = json.loads(sys.argv[1])

def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)

tx = optim.adamw(1e-3)
state = eg.TrainState.create(nn.Linear(4, 2), tx, seed=0)
step = eg.train_step(loss, tx, compile=compile)
state, _ = step(state, (torch.ones(8, 4), torch.zeros(8, 2)))
for t in threading.enumerate():
    if t.name == "engine-inductor-cpu-probe":
        t.join()
print(json.dumps({
    "threads": [a[0] for a in asked],
    "answers": [[str(isa) for isa in a[3]] for a in asked],
    "misses": cached.cache_info().misses,
}))
"""


def _probe_calls(compile) -> dict:
    done = _procs.run(
        [sys.executable, "-c", _PROBE_ORDER, json.dumps(compile)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_inductors_cpu_probe_runs_in_a_thread_of_its_own_before_inductor_asks():
    # Inductor asks which vector instruction sets the CPU runs only after the trace; engine
    # starts the answer (~1.3 s of child processes) in a thread before it: the first call of
    # Inductor's probe is that thread's. Where the trace is short, Inductor asks while the
    # thread still probes and finds the sets probed so far cached (each set's answer is): the
    # same answer either way.
    calls = _probe_calls(True)
    assert calls["threads"][0] == "engine-inductor-cpu-probe", calls
    assert "MainThread" in calls["threads"], calls  # Inductor did ask
    first, *others = calls["answers"]
    assert all(answer == first for answer in others), calls


def test_a_users_own_vec_isa_ok_leaves_inductors_probe_to_inductor():
    # the option holds only while Inductor compiles: a probe run before it would cache the
    # global setting's answer for the process, and the user's option would go unread
    calls = _probe_calls({"options": {"cpp.vec_isa_ok": False}})
    assert set(calls["threads"]) == {"MainThread"}, calls
    assert calls["misses"] == 1, calls


@pytest.mark.parametrize(
    ("options", "wanted"),
    [
        ({}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, True),
        ({"options": {"cpp.simdlen": 256}}, True),
        ({"options": {"cpp.vec_isa_ok": True}}, False),
        ({"options": {"cpp": {"vec_isa_ok": False}}}, False),
        ({"backend": "eager"}, False),
        ({"backend": "aot_eager"}, False),
    ],
)
def test_which_compiles_run_inductors_cpu_probe_ahead(options, wanted):
    assert wants_probe(options) is wanted
