"""K optimizer steps per call (``steps_per_call``): the same numbers as K single steps (bitwise
eager, within compile's tolerance compiled), metrics for every micro-batch, bad input refused
before the state is consumed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim


def _mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 5))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 10, generator=g), torch.randint(0, 5, (16,), generator=g))
        for _ in range(n)
    ]


def _ce(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def _singles(batches, *, accumulate=1, dropout=0.0, compile=False, flush_last=False, **kw):
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=accumulate, compile=compile, **kw)
    state = eg.TrainState.create(_mlp(dropout), tx, seed=3)
    out = []
    for i, b in enumerate(batches):
        state, m = step(state, b, flush=flush_last and i == len(batches) - 1)
        out.append(m)
    return state, out


def _assert_states_equal(a, b, exact=True):
    for k in a.params:
        if exact:
            assert torch.equal(a.params[k], b.params[k]), k
        else:
            torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-5, atol=1e-6)
    assert (a.step, a.micro_step, a.batch_idx) == (b.step, b.micro_step, b.batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_eager_block_is_bitwise_single_steps_with_dropout(accumulate):
    K = 3
    batches = _batches(K * accumulate * 2)
    ref, ref_metrics = _singles(batches, accumulate=accumulate, dropout=0.3, grad_norm=True)
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=accumulate, steps_per_call=K, grad_norm=True)
    state = eg.TrainState.create(_mlp(0.3), tx, seed=3)
    n = K * accumulate
    state, first = step(state, batches[:n])
    state, second = step(state, batches[n:])
    _assert_states_equal(state, ref)
    assert state.step == 2 * K
    for got, part in ((first, ref_metrics[:n]), (second, ref_metrics[n:])):
        assert got["loss"].shape == (n,)
        assert torch.equal(got["loss"], torch.stack([m["loss"] for m in part]))
        assert torch.equal(got["acc"], torch.stack([m["acc"] for m in part]))
        # grad_norm is reported by the calls that step the optimizer: one per window
        assert torch.equal(
            got["grad_norm"], torch.stack([m["grad_norm"] for m in part if "grad_norm" in m])
        )
        assert got["grad_norm"].shape == (K,)


def test_stacked_batch_equals_the_list():
    batches = _batches(4)
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, steps_per_call=4)
    a, ma = step(eg.TrainState.create(_mlp(), tx, seed=0), batches)
    stacked = (torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
    b, mb = step(eg.TrainState.create(_mlp(), tx, seed=0), stacked, stacked=True)
    _assert_states_equal(a, b)
    assert torch.equal(ma["loss"], mb["loss"])


def test_a_shorter_call_runs_single_steps_and_flushes_the_partial_window():
    batches = _batches(3)
    ref, _ = _singles(batches, accumulate=2, flush_last=True)
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=2, steps_per_call=4)
    state = eg.TrainState.create(_mlp(), tx, seed=3)
    state, metrics = step(state, batches, flush=True)
    _assert_states_equal(state, ref)
    assert state.step == 2 and state.micro_step == 0 and metrics["loss"].shape == (3,)


def test_donate_false_leaves_the_input_state_unchanged():
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, steps_per_call=2, donate=False)
    state = eg.TrainState.create(_mlp(), tx, seed=0)
    before = {k: v.clone() for k, v in state.params.items()}
    new, _ = step(state, _batches(2))
    assert all(torch.equal(before[k], state.params[k]) for k in before)
    assert new.step == 2 and state.step == 0


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_steps_per_call_must_be_a_positive_int(bad):
    with pytest.raises(
        ValueError, match=r"steps_per_call must be a positive int.*" + repr(bad).replace(".", r"\.")
    ):
        eg.train_step(_ce, optim.sgd(0.1), steps_per_call=bad)


def test_bad_batches_are_refused_before_the_state_is_consumed():
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, steps_per_call=2)
    state = eg.TrainState.create(_mlp(), tx, seed=0)
    x, y = _batches(1)[0]
    with pytest.raises(TypeError, match="list or tuple of batches"):
        step(state, iter([(x, y), (x, y)]))
    with pytest.raises(ValueError, match="empty"):
        step(state, [])
    with pytest.raises(TypeError, match="stacked=True takes a batch of tensors"):
        step(state, (x, "labels"), stacked=True)
    with pytest.raises(ValueError, match=r"first dimensions differ \(\[3, 4\]\)"):
        step(state, (torch.zeros(3, 16, 10), torch.zeros(4, 16)), stacked=True)
    state, _ = step(state, [(x, y), (x, y)])  # still the caller's: nothing was consumed
    assert state.step == 2


def test_compiled_block_is_one_graph_and_equals_single_compiled_steps():
    K = 2
    batches = _batches(2 * K)
    ref, ref_metrics = _singles(batches, compile=True)
    eager, _ = _singles(batches)
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, compile=True, steps_per_call=K)
    state = eg.TrainState.create(_mlp(), tx, seed=3)
    losses = []
    for i in range(0, len(batches), K):
        state, m = step(state, batches[i : i + K])
        losses.append(m["loss"])
    assert step._block is not None  # the calls ran as blocks, not as single steps
    _assert_states_equal(state, ref, exact=False)
    _assert_states_equal(state, eager, exact=False)
    torch.testing.assert_close(
        torch.cat(losses), torch.stack([m["loss"] for m in ref_metrics]), rtol=1e-5, atol=1e-6
    )
