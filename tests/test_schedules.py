"""Schedules equal torch.optim.lr_scheduler's learning-rate sequences."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler as tls

from engine import optim
from engine.optim import schedules


def _torch_lrs(make_scheduler, steps: int, base_lr: float) -> list[float]:
    """The lr each of ``steps`` optimizer steps uses when the scheduler is stepped after each."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _assert_same(ours, theirs, rtol=1e-12):
    assert len(ours) == len(theirs)
    for n, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-300), (n, a, b)


CASES = {
    "step_lr": (
        lambda o: tls.StepLR(o, step_size=30, gamma=0.1),
        schedules.step_lr(0.1, step_size=30, gamma=0.1),
    ),
    "multistep_lr": (
        lambda o: tls.MultiStepLR(o, milestones=[30, 80, 80, 200], gamma=0.5),
        schedules.multistep_lr(0.1, [200, 30, 80, 80], gamma=0.5),
    ),
    "exponential": (
        lambda o: tls.ExponentialLR(o, gamma=0.97),
        schedules.exponential(0.1, 0.97),
    ),
    "cosine_decay": (
        lambda o: tls.CosineAnnealingLR(o, T_max=299, eta_min=1e-4),
        schedules.cosine_decay(0.1, 299, eta_min=1e-4),
    ),
    "cosine_decay_to_zero": (
        lambda o: tls.CosineAnnealingLR(o, T_max=299),
        schedules.cosine_decay(0.1, 299),
    ),
    "linear_up": (
        lambda o: tls.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=100),
        schedules.linear(0.025, 0.1, 100),
    ),
    "linear_down": (
        lambda o: tls.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=250),
        schedules.linear(0.1, 0.1 * 0.1, 250),
    ),
    "warmup_cosine": (
        lambda o: tls.SequentialLR(
            o,
            [
                tls.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=30),
                tls.CosineAnnealingLR(o, T_max=270, eta_min=1e-3),
            ],
            milestones=[30],
        ),
        schedules.warmup_cosine(0.1, warmup_steps=30, total_steps=300, init=0.01, end=1e-3),
    ),
    "constant": (lambda o: tls.LambdaLR(o, lambda n: 1.0), schedules.constant(0.1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_equals_torch_lr_scheduler(name):
    make, ours = CASES[name]
    theirs = _torch_lrs(make, 300, base_lr=0.1)
    _assert_same([ours(n) for n in range(300)], theirs)


def test_warmup_cosine_from_zero_equals_lambda_lr():
    peak, warm, total = 3e-3, 25, 300

    def factor(n):  # the textbook formula, written independently of the schedule
        if n < warm:
            return n / warm
        return 0.5 * (1 + math.cos(math.pi * (n - warm) / (total - warm)))

    theirs = _torch_lrs(lambda o: tls.LambdaLR(o, factor), 300, base_lr=peak)
    ours = schedules.warmup_cosine(peak, warm, total)
    _assert_same([ours(n) for n in range(300)], theirs)
    assert ours(total) == 0.0 and ours(10 * total) == 0.0


@pytest.mark.parametrize(
    ("total", "pct", "anneal", "three_phase", "div", "final_div"),
    [
        (300, 0.3, "cos", False, 25.0, 1e4),
        (300, 0.25, "linear", False, 10.0, 100.0),
        (300, 0.3, "cos", True, 25.0, 1e4),
        (301, 0.2, "linear", True, 25.0, 1e4),
        (7, 0.3, "cos", False, 25.0, 1e4),
        (2, 0.3, "cos", False, 25.0, 1e4),
    ],
)
def test_one_cycle_equals_torch(total, pct, anneal, three_phase, div, final_div):
    def make(o):
        return tls.OneCycleLR(
            o,
            max_lr=0.5,
            total_steps=total,
            pct_start=pct,
            anneal_strategy=anneal,
            three_phase=three_phase,
            div_factor=div,
            final_div_factor=final_div,
            cycle_momentum=False,
        )

    theirs = _torch_lrs(make, total, base_lr=0.5)
    ours = schedules.one_cycle(0.5, total, pct, div, final_div, anneal, three_phase)
    _assert_same([ours(n) for n in range(total)], theirs)
    assert ours(total + 5) == ours(total - 1)  # constant after the end


def test_cosine_decay_stays_at_eta_min_after_decay_steps():
    s = schedules.cosine_decay(1.0, 10, eta_min=0.1)
    assert [s(n) for n in (10, 11, 1000)] == [0.1, 0.1, 0.1]


def test_schedules_are_reexported_at_top_level():
    assert optim.warmup_cosine is schedules.warmup_cosine
    assert optim.one_cycle is schedules.one_cycle


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: schedules.one_cycle(1.0, total_steps=0), "'total_steps' must be a positive int"),
        (lambda: schedules.one_cycle(1.0, 10, pct_start=1.5), r"'pct_start'.*\(got 1.5\)"),
        (lambda: schedules.one_cycle(1.0, 10, anneal="exp"), r"'anneal'.*\(got 'exp'\)"),
        (lambda: schedules.one_cycle(-1.0, 10), r"'max_lr'.*\(got -1.0\)"),
        (lambda: schedules.cosine_decay(1.0, 0), r"'decay_steps'.*\(got 0\)"),
        (lambda: schedules.linear(0.0, 1.0, -3), r"'steps'.*\(got -3\)"),
        (lambda: schedules.step_lr(1.0, 0), r"'step_size'.*\(got 0\)"),
        (lambda: schedules.multistep_lr(1.0, [3, -1]), r"'milestones\[i\]'.*\(got -1\)"),
        (lambda: schedules.exponential(1.0, -0.5), r"'gamma'.*\(got -0.5\)"),
        (lambda: schedules.warmup_cosine(1.0, 10, 10), r"'total_steps' \(10\).*'warmup_steps'"),
        (lambda: schedules.warmup_cosine(1.0, -1, 10), r"'warmup_steps'.*\(got -1\)"),
        (lambda: schedules.constant(float("nan")), r"'value'.*\(got nan\)"),
    ],
)
def test_bad_schedule_arguments_name_the_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@settings(max_examples=40, deadline=None)
@given(
    peak=st.floats(1e-6, 10.0),
    warm=st.integers(0, 50),
    decay=st.integers(1, 200),
    init_frac=st.floats(0.0, 1.0),
    end_frac=st.floats(0.0, 1.0),
)
def test_warmup_cosine_rises_then_falls_within_bounds(peak, warm, decay, init_frac, end_frac):
    init, end = peak * init_frac, peak * end_frac
    s = schedules.warmup_cosine(peak, warm, warm + decay, init=init, end=end)
    lrs = [s(n) for n in range(warm + decay + 3)]
    tol = 1e-12 * peak
    assert all(min(init, end) - tol <= x <= peak + tol for x in lrs)
    rising, falling = lrs[: warm + 1], lrs[warm:]
    assert all(a <= b + tol for a, b in itertools.pairwise(rising))
    assert all(a + tol >= b for a, b in itertools.pairwise(falling))


@settings(max_examples=40, deadline=None)
@given(
    total=st.integers(2, 400),
    pct=st.floats(0.05, 0.95),
    three_phase=st.booleans(),
    anneal=st.sampled_from(["cos", "linear"]),
)
def test_one_cycle_stays_between_its_min_and_max(total, pct, three_phase, anneal):
    if three_phase:
        pct /= 2  # the two rising/falling phases must fit in the cycle
    s = schedules.one_cycle(1.0, total, pct, anneal=anneal, three_phase=three_phase)
    lrs = [s(n) for n in range(total)]
    assert all(1.0 / 25 / 1e4 * (1 - 1e-9) <= x <= 1.0 + 1e-12 for x in lrs)
    assert math.isclose(lrs[-1], 1.0 / 25 / 1e4, rel_tol=1e-9)


def test_a_schedule_traces_with_a_symbolic_step_without_recompiling():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sched = schedules.warmup_cosine(1.0, 5, 50, init=0.1, end=0.01)
    f = torch.compile(lambda x, step: x * sched(step), fullgraph=True, dynamic=True)
    for n in (0, 3, 5, 6, 20, 49, 70):
        torch.testing.assert_close(f(torch.ones(()), n), torch.tensor(sched(n)))
    assert counters["stats"]["unique_graphs"] == 1
