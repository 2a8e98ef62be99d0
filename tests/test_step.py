"""Steps against a raw PyTorch loop: same numbers, same randomness rules, donation enforced."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import engine as eg
from engine import optim


def _mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(10, 32),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 5),
    )


def _batches(n: int, size: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 10, generator=g), torch.randint(0, 5, (size,), generator=g))
        for _ in range(n)
    ]


def _ce(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def _raw_loop(model, opt, batches):
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize(
    ("ours", "theirs", "exact"),
    [
        (
            lambda: optim.sgd(0.05, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            True,
        ),
        (lambda: optim.adamw(1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3), True),
        (
            lambda: optim.adamw(1e-3, fused=True),
            lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
            True,
        ),
        (lambda: optim.adamw(1e-3, fused=True), lambda p: torch.optim.AdamW(p, lr=1e-3), False),
    ],
    ids=["sgd-momentum", "adamw-default", "adamw-fused", "adamw-fused-vs-default"],
)
def test_train_step_matches_a_raw_pytorch_loop(ours, theirs, exact):
    batches = _batches(60)
    reference = _mlp()
    expected = _raw_loop(reference, theirs(reference.parameters()), batches)
    tx = ours()
    state = eg.TrainState.create(_mlp(), tx, seed=0)
    step = eg.train_step(_ce, tx)
    for b in batches:
        state, _ = step(state, b)
    assert state.step == 60 and state.batch_idx == 60
    for name, p in expected.items():
        if exact:
            assert torch.equal(state.params[name], p), name
        else:
            torch.testing.assert_close(state.params[name], p, rtol=1e-6, atol=1e-7)


def test_metrics_are_detached_tensors_of_the_micro_batch():
    tx = optim.sgd(0.1)
    state = eg.TrainState.create(_mlp(), tx)
    state, metrics = eg.train_step(_ce, tx)(state, _batches(1)[0])
    assert set(metrics) == {"loss", "acc"}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())


def test_dropout_is_a_function_of_seed_and_step_and_leaves_global_rng_alone():
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx)
    batch = _batches(1)[0]
    start = eg.TrainState.create(_mlp(dropout=0.5), tx, seed=7)
    a0, b0 = start.copy(), start.copy()

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a1, ma = step(a0, batch)
    assert torch.equal(torch.rand(3), expected_next), "the step consumed the caller's RNG"
    b1, mb = step(b0, batch)
    assert a1.fingerprint() == b1.fingerprint() and torch.equal(ma["loss"], mb["loss"])

    # another step index or another seed draws another mask
    _, mc = step(start.copy().replace(step=5), batch)
    _, md = step(eg.TrainState.create(_mlp(dropout=0.5), tx, seed=8), batch)
    assert not torch.equal(mc["loss"], ma["loss"]) and not torch.equal(md["loss"], ma["loss"])


def test_batchnorm_running_statistics_come_back_in_the_new_state():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = _batches(5)
    _raw_loop(ref, opt, batches)
    tx = optim.sgd(0.1)
    state = eg.TrainState.create(ours, tx)
    step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
    for b in batches:
        state, _ = step(state, b)
    for name, buf in ref.named_buffers():
        assert torch.equal(state.buffers[name], buf), name
    assert int(state.buffers["1.num_batches_tracked"]) == 5


def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch():
    big = _batches(6, size=64)
    tx = optim.adam(1e-2)
    whole = eg.TrainState.create(_mlp(), tx)
    step = eg.train_step(_ce, tx)
    for b in big:
        whole, _ = step(whole, b)

    acc = eg.TrainState.create(_mlp(), tx)
    step4 = eg.train_step(_ce, tx, accumulate=4)
    for x, y in big:
        for i in range(4):
            acc, _ = step4(acc, (x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)]))
            if i < 3:
                assert acc.grad_accum is not None and acc.micro_step == i + 1
    assert acc.step == whole.step == 6 and acc.batch_idx == 24 and acc.grad_accum is None
    for name, p in whole.params.items():
        torch.testing.assert_close(acc.params[name], p, rtol=1e-5, atol=1e-6)


def test_flush_steps_the_optimizer_on_a_partial_window():
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, accumulate=4)
    state = eg.TrainState.create(_mlp(), tx)
    b = _batches(2)
    state, _ = step(state, b[0])
    state, _ = step(state, b[1], flush=True)
    assert (state.step, state.micro_step, state.grad_accum) == (1, 0, None)


def test_a_consumed_state_cannot_be_used_again():
    tx = optim.adamw(1e-3)
    step = eg.train_step(_ce, tx)
    state = eg.TrainState.create(_mlp(), tx)
    alias = state.replace(epoch=1)  # shares the tensors, so it shares their fate
    new, _ = step(state, _batches(1)[0])
    assert state.consumed and not new.consumed
    for stale in (state, alias):
        with pytest.raises(eg.ConsumedStateError, match=r"consumed by train_step \(at step 0\)"):
            step(stale, _batches(1)[0])
    with pytest.raises(eg.ConsumedStateError, match="donate=False"):
        eg.eval_step(_ce)(state, _batches(1)[0])


def test_donate_false_leaves_the_input_bitwise_unchanged_and_computes_the_same():
    tx = optim.adamw(1e-3)
    state = eg.TrainState.create(_mlp(dropout=0.2), tx, seed=4)
    before = state.fingerprint()
    keep = eg.train_step(_ce, tx, donate=False)
    out, m1 = keep(state, _batches(1)[0])
    assert state.fingerprint() == before and not state.consumed
    out2, m2 = eg.train_step(_ce, tx)(state, _batches(1)[0])
    assert out.fingerprint() == out2.fingerprint() and torch.equal(m1["loss"], m2["loss"])


def test_pure_function_model_trains_without_a_module():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, generator=g)
    y = x @ torch.tensor([2.0, -1.0, 0.5]) + 0.3
    tx = optim.sgd(0.1)
    state = eg.TrainState.create({"w": torch.zeros(3), "b": torch.zeros(())}, tx)

    def loss_fn(p, batch):
        xb, yb = batch
        return F.mse_loss(xb @ p["w"] + p["b"], yb)

    step = eg.train_step(loss_fn, tx)
    for _ in range(300):
        state, metrics = step(state, (x, y))
    torch.testing.assert_close(state.params["w"], torch.tensor([2.0, -1.0, 0.5]), atol=1e-4, rtol=0)
    assert float(metrics["loss"]) < 1e-8


def test_tied_weights_receive_both_gradients_like_the_raw_module():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, t):
            return self.out(self.emb(t))

    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ref = Tied()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(ref(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
    tx = optim.sgd(0.5)
    state = eg.TrainState.create(Tied(), tx)
    assert list(state.params) == ["emb.weight"]
    step = eg.train_step(lambda m, t: F.cross_entropy(m(t).flatten(0, 1), t.flatten()), tx)
    for _ in range(3):
        state, _ = step(state, tokens)
    assert torch.equal(state.params["emb.weight"], ref.emb.weight)


def test_eval_and_predict_run_in_eval_mode_without_consuming_the_state():
    model = _mlp(dropout=0.5)
    tx = optim.sgd(0.1)
    state = eg.TrainState.create(model, tx)
    x, y = _batches(1)[0]
    metrics = eg.eval_step(_ce)(state, (x, y))
    preds = eg.predict_step()(state, x)
    assert not state.consumed
    reference = _mlp(dropout=0.5).eval()
    with torch.no_grad():
        expected = reference(x)
    assert torch.equal(preds, expected)
    assert torch.equal(metrics["loss"], F.cross_entropy(expected, y))
    assert set(metrics) == {"loss", "acc"}


@pytest.mark.parametrize(
    ("loss_fn", "error", "match"),
    [
        (lambda m, b: m(b[0]), ValueError, r"scalar loss \(got shape \(16, 5\)\)"),
        (lambda m, b: [F.cross_entropy(m(b[0]), b[1])], TypeError, "got list"),
    ],
)
def test_bad_loss_functions_get_a_clear_error(loss_fn, error, match):
    tx = optim.sgd(0.1)
    with pytest.raises(error, match=match):
        eg.train_step(loss_fn, tx)(eg.TrainState.create(_mlp(), tx), _batches(1)[0])


def test_bad_builder_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"accumulate must be a positive int \(got 0\)"):
        eg.train_step(_ce, optim.sgd(0.1), accumulate=0)
    with pytest.raises(TypeError, match="got str"):
        eg.train_step(_ce, "sgd")


@pytest.mark.slow
def test_compiled_step_is_one_graph_and_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    batches = _batches(12)
    tx = optim.adamw(1e-2)
    eager = eg.TrainState.create(_mlp(), tx)
    compiled = eg.TrainState.create(_mlp(), tx)
    e_step = eg.train_step(_ce, tx)
    c_step = eg.train_step(_ce, tx, compile=True)  # fullgraph=True: a graph break raises
    for b in batches:
        eager, me = e_step(eager, b)
        compiled, mc = c_step(compiled, b)
        torch.testing.assert_close(mc["loss"], me["loss"], rtol=1e-5, atol=1e-6)
    for name, p in eager.params.items():
        torch.testing.assert_close(compiled.params[name], p, rtol=1e-5, atol=1e-6)
    assert not counters["graph_break"]
    # a static first graph, then one with a symbolic step: no recompilation per step
    assert counters["stats"]["unique_graphs"] <= 2


def test_a_step_never_reads_tensor_values_on_the_host(monkeypatch):
    """Metrics stay tensors and the fused optimizers never call .item(): no device sync. (The
    default path reads its step counters on the host where they are CPU tensors, as torch.optim's
    does; on an accelerator its bias corrections stay tensors.)"""
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine(1e-3, warmup_steps=2, total_steps=10), fused=True),
    )
    step = eg.train_step(_ce, tx, accumulate=2)
    state = eg.TrainState.create(_mlp(dropout=0.1), tx)

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync inside a step")

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for b in _batches(4):
        state, metrics = step(state, b)
    monkeypatch.undo()
    assert state.step == 2 and isinstance(metrics["loss"], torch.Tensor)


@settings(max_examples=12, deadline=None)
@given(k=st.integers(0, 9), accumulate=st.sampled_from([1, 3]))
def test_rerunning_from_any_saved_state_is_bitwise_identical(k, accumulate):
    """A state determines the rest of the run: continue from a snapshot taken at call k."""
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=accumulate)
    batches = _batches(10, size=8)
    state = eg.TrainState.create(_mlp(dropout=0.3), tx, seed=11)
    snapshot = None
    for i, b in enumerate(batches):
        if i == k:
            snapshot = state.copy()
        state, _ = step(state, b)
    resumed = snapshot
    for b in batches[k:]:
        resumed, _ = step(resumed, b)
    assert resumed.fingerprint() == state.fingerprint()


@pytest.mark.slow
def test_compiled_eval_predict_and_pure_function_steps_match_eager():
    x, y = _batches(1)[0]
    tx = optim.sgd(0.1)
    state = eg.TrainState.create(_mlp(dropout=0.5), tx)
    for compile in (False, True):
        metrics = eg.eval_step(_ce, compile=compile)(state, (x, y))
        preds = eg.predict_step(compile=compile)(state, x)
        if not compile:
            expected_metrics, expected_preds = metrics, preds
    torch.testing.assert_close(metrics, expected_metrics)
    torch.testing.assert_close(preds, expected_preds)

    def linear(p, batch):
        xb, yb = batch
        return F.mse_loss(xb @ p["w"], yb)

    target = torch.randn(10)
    runs = []
    for compile in (False, True):
        s = eg.TrainState.create({"w": torch.zeros(10)}, tx)
        step = eg.train_step(linear, tx, compile=compile)
        for _ in range(5):
            s, _ = step(s, (x, x @ target))
        runs.append(s.params["w"])
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)


def test_grad_norm_metric_is_the_total_norm_before_clipping():
    model = _mlp()
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, grad_norm=True, clip=optim.clip_by_global_norm(1e-3))
    _, metrics = step(eg.TrainState.create(_mlp(), tx), (x, y))
    torch.testing.assert_close(metrics["grad_norm"], expected)


@pytest.mark.slow
def test_a_process_compiles_many_steps_without_hitting_dynamos_recompile_limit():
    tx = optim.sgd(0.1)
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    for i in range(12):  # Dynamo allows 8 recompilations per code object
        state = eg.TrainState.create(torch.nn.Linear(3, 1), tx, seed=i)
        step = eg.train_step(lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), tx, compile=True)
        state, metrics = step(state, batch)
        assert state.step == 1 and torch.isfinite(metrics["loss"])
