"""Data parallel steps (engine.parallel.DDP) on 2 gloo ranks against one process.

The reference is one process on the whole batch: per-rank batch b on 2 ranks must train the
parameters of one process with batch 2b (the gradients of a mean loss over equal shards average
to the whole batch's), to float32 rounding after 20 optimizer steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim, transforms
from engine.parallel import DDP

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks

pytestmark = pytest.mark.slow

B, STEPS = 8, 20


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _tx() -> optim.GradientTransformation:
    return optim.adamw(1e-2, weight_decay=0.01)


def _pipeline(strategy, accumulate: int, precision=None, compile=False):
    return transforms.compose(
        strategy=strategy,
        precision=precision,
        clip=optim.clip_by_global_norm(0.5),
        accumulate=accumulate,
        compile=compile,
    )


def _train(
    rank: int, world: int, accumulate: int, precision: str | None, compile: bool, split=False
):
    """Per-rank batch B over 2 ranks, or batch 2B in one process (world 1); ``split``: one
    process on the ranks' micro-batches of B, accumulating twice as many."""
    strategy = DDP() if world > 1 else None
    if strategy is not None:
        strategy.setup()
    prec = transforms.precision_transform(precision) if precision else None
    if split:
        return _split(accumulate, prec)
    pipeline = _pipeline(strategy, accumulate, prec, compile)
    # rank 1 builds other weights: prepare must give it rank 0's
    state = pipeline.prepare(eg.TrainState.create(_model(0 if rank == 0 else 99), _tx()))
    step = pipeline.train_step(_loss, _tx())
    x, y = _data(STEPS * accumulate * 2 * B)
    per = 2 * B // world
    losses = []
    for i in range(STEPS * accumulate):
        lo = i * 2 * B + rank * per
        state, m = step(state, pipeline.move((x[lo : lo + per], y[lo : lo + per])))
        losses.append(float(m["loss"]))
    return {k: v.detach().clone() for k, v in state.params.items()}, state.step, state.precision


def _split(accumulate: int, prec):
    pipeline = _pipeline(None, 2 * accumulate, prec)
    state = pipeline.prepare(eg.TrainState.create(_model(0), _tx()))
    step = pipeline.train_step(_loss, _tx())
    x, y = _data(STEPS * accumulate * 2 * B)
    for i in range(STEPS * accumulate * 2):
        state, _ = step(state, pipeline.move((x[i * B : (i + 1) * B], y[i * B : (i + 1) * B])))
    return {k: v.detach().clone() for k, v in state.params.items()}, state.step, state.precision


def _one(rank: int, accumulate: int, precision: str | None, compile: bool):
    return _train(rank, 1, accumulate, precision, compile)


def _close(a: dict, b: dict, tol: float) -> float:
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tol, f"largest difference {worst} > {tol}"
    return worst


CONFIGS = [(1, None), (2, None), (2, "bf16-mixed"), (2, "16-mixed")]


def _all_one(rank: int):
    """Every configuration in one process: on the whole batch, and on the ranks' micro-batches."""
    return {
        c: (_train(rank, 1, *c, False), _train(rank, 1, *c, False, split=True)) for c in CONFIGS
    }


def _all_two(rank: int):
    return {c: _train(rank, 2, *c, False) for c in CONFIGS}


@pytest.fixture(scope="module")
def runs():
    """One launch of each (the processes' start dominates the cost)."""
    (one,) = run_ranks(_all_one, 1)
    r0, r1 = run_ranks(_all_two, 2)
    return one, r0, r1


@pytest.mark.parametrize(("accumulate", "precision"), CONFIGS)
def test_two_ranks_train_as_one_process_on_the_whole_batch(runs, accumulate, precision):
    one, two0, two1 = runs
    (ref, ref_steps, _), (split, split_steps, split_prec) = one[accumulate, precision]
    r0, r1 = two0[accumulate, precision], two1[accumulate, precision]
    assert r0[1] == r1[1] == ref_steps == split_steps == STEPS
    # the ranks hold the same bits: the same averaged gradients, the same updates
    for k in r0[0]:
        assert torch.equal(r0[0][k], r1[0][k]), k
    if precision is None:
        _close(r0[0], ref, 1e-6)
    else:
        # in half precision the weight gradient is a sum over the batch rounded to 16 bits
        # inside the matmul: a batch of 2B is rounded once where two ranks' batches of B are
        # rounded apiece, so the whole batch is only the same to half precision's rounding...
        _close(r0[0], ref, 2e-2)
    # ... and the same arithmetic (one process accumulating the ranks' micro-batches, averaged
    # in float32) is the same to float32's, in every precision
    _close(r0[0], split, 1e-6)
    if precision == "16-mixed":  # every rank skipped the same steps: the same loss scale
        assert all(torch.equal(r0[2][k], r1[2][k]) for k in r0[2])
        assert all(torch.equal(r0[2][k], split_prec[k]) for k in r0[2])


def _skipping(rank: int):
    """16-mixed with a gradient that overflows on rank 1 only: both ranks must skip it."""
    strategy = DDP()
    strategy.setup()
    pipeline = transforms.compose(
        strategy=strategy, precision=transforms.precision_transform("16-mixed")
    )
    state = pipeline.prepare(eg.TrainState.create(_model(0), _tx()))
    step = pipeline.train_step(_loss, _tx())
    x, y = _data(2 * B)
    skipped = []
    for i in range(3):
        xb = x[:B].clone()
        if rank == 1 and i == 1:
            xb[0, 0] = float("inf")
        state, m = step(state, (xb, y[:B]))
        skipped.append(bool(m["skipped"]))
    return skipped, {k: v.clone() for k, v in state.params.items()}


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    (s0, p0), (s1, p1) = run_ranks(_skipping, 2)
    assert s0 == s1 == [False, True, False]
    for k in p0:
        assert torch.equal(p0[k], p1[k])


def _collectives(rank: int):
    strategy = DDP()
    strategy.setup()
    calls = []
    real = torch.distributed.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    torch.distributed.all_reduce = counting
    try:
        pipeline = transforms.compose(strategy=strategy, accumulate=6)
        state = pipeline.prepare(eg.TrainState.create(_model(0), _tx()))
        step = pipeline.train_step(_loss, _tx())
        x, y = _data(B)
        for _ in range(60):
            state, _ = step(state, (x, y))
    finally:
        torch.distributed.all_reduce = real
    return len(calls), state.step


def test_one_all_reduce_per_optimizer_step_not_per_micro_batch():
    (n0, steps), (n1, _) = run_ranks(_collectives, 2)
    assert steps == 10
    assert n0 == n1 == 10  # the model's gradients fit one 25 MiB bucket


def test_buckets_are_cut_by_size_dtype_and_device():
    from engine.parallel.ddp import _buckets

    ts = [torch.zeros(2**18), torch.zeros(2**18), torch.zeros(10, dtype=torch.float64)]
    sizes = [[t.numel() for t in b] for b in _buckets(ts, cap_mb=1.5)]
    assert sizes == [[2**18], [2**18], [10]]  # 1 MiB each: two do not fit 1.5 MiB
    assert [len(b) for b in _buckets(ts, cap_mb=25)] == [2, 1]


def _compiled(rank: int):
    return _train(rank, 2, 1, None, True)


def test_compiled_step_traces_the_all_reduce():
    ((ref, _, _),) = run_ranks(_one, 1, 1, None, True)
    r0, r1 = run_ranks(_compiled, 2, timeout=300)
    for k in r0[0]:
        assert torch.equal(r0[0][k], r1[0][k]), k
    _close(r0[0], ref, 1e-5)


def test_strategy_must_be_a_strategy():
    with pytest.raises(TypeError, match=r"engine\.transforms\.Strategy"):
        transforms.compose(strategy=transforms.Clip(optim.clip_by_global_norm(1.0)))
    with pytest.raises(ValueError, match="backend"):
        DDP(backend="tcp")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(bucket_cap_mb=0)


def _masks(rank: int):
    """The dropout mask each rank's step draws, and its evaluation's."""
    strategy = DDP() if rank >= 0 else None
    if strategy is not None:
        strategy.setup()
    pipeline = transforms.compose(strategy=strategy)
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
    state = pipeline.prepare(eg.TrainState.create(model, _tx()))

    masks = []

    def loss(m, batch):
        out = m(batch[0])
        masks.append((out != 0).detach().clone())
        return out.mean()

    step = pipeline.train_step(loss, _tx())
    x = torch.ones(B, 6)
    step(state, (x, x))
    return masks[0]


def _one_mask(rank: int):
    return _masks(-1)


def test_each_rank_draws_its_own_dropout_masks_rank_zero_the_one_process_ones():
    (one,) = run_ranks(_one_mask, 1)
    r0, r1 = run_ranks(_masks, 2)
    assert torch.equal(r0, one)  # rank 0 draws what one process draws
    assert not torch.equal(r0, r1)  # the other rank's shard gets masks of its own
