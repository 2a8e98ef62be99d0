"""Epoch metrics reduced across ranks (engine/metrics.py: MetricSync, distributed_sync,
MetricReducer.compute(sync, sync_all=) and epoch_logged(sync)).

The process tests run real gloo ranks (spawned, one thread each, a free port per group, a
deadline on every wait) over uneven shards, ``rank::world`` of the data as the evaluation
loaders are sharded (no padding: each sample on exactly one rank), and compare with one process
over the whole set. The reference batches the data differently (3 per batch rather than 2 per
rank): a weighted mean of batch means, a sum, a max and a min do not depend on the batching, so
the values agree up to the order of summation; float32 values summed in another order are
compared with a relative tolerance of 1e-6. One launch of 3 ranks runs every scenario (a
spawned process pays torch's and the engine's import): ranks 0 and 1 first in a group of their
own (``distributed_sync(group)``, 7 samples), then all 3 over 2 samples, so that rank 2 has no
batch at all; the tests read the results.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from engine.metrics import LogOptions, MetricReducer, MetricSync, distributed_sync

N_SAMPLES = 7  # over 2 ranks: 4 and 3 samples, batches of 2 -> [2, 2] and [2, 1]
REDUCE = {"s": "sum", "hi": "max", "lo": "min"}
TOL = 1e-6  # relative: float32 sums in another order
SUM_LIKE = ("loss", "m", "s")
STARTED = "started"  # a rank's first message to the parent


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    x = torch.randn(n, generator=g)
    y = (torch.rand(n, generator=g) < 0.5).long()
    y[0], y[1] = 0, 1  # both classes present (AUROC)
    return x, y


def _batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, ...]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def _metrics(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": (x * x).mean(), "m": x.mean(), "s": x.sum(), "hi": x.max(), "lo": x.min()}


def _epoch(reducer: MetricReducer, batches: list[tuple[torch.Tensor, ...]], extra=None) -> None:
    for x, _ in batches:
        metrics: dict[str, Any] = _metrics(x)
        if extra is not None:
            metrics.update(extra(x))
        reducer.update(metrics, batch_size=len(x))


def _reference(n: int, **kwargs: Any) -> dict[str, float]:
    """One process over the whole set, batches of 3."""
    x, y = _data(n)
    r = MetricReducer(REDUCE, **kwargs)
    _epoch(r, _batches(x, y, 3))
    return r.compute()


class Counting:
    """A MetricSync that counts the collectives it is asked for."""

    def __init__(self, inner: MetricSync) -> None:
        self.inner, self.calls = inner, []
        self.world_size, self.rank = inner.world_size, inner.rank
        self.device = getattr(inner, "device", None)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self.calls.append(op)
        return self.inner.all_reduce(tensor, op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("gather")
        return self.inner.all_gather_object(obj)


# -- the ranks


def _two_ranks(rank: int, world: int, group: Any) -> dict[str, Any]:
    from torchmetrics.classification import BinaryAUROC

    x, y = _data(N_SAMPLES)
    shard = _batches(x[rank::world], y[rank::world], 2)
    out: dict[str, Any] = {"batches": [len(b[0]) for b in shard]}

    # evaluation: every tensor metric, plus one only rank 1's steps return
    sync = Counting(distributed_sync(group))
    r = MetricReducer(REDUCE)
    _epoch(r, shard, extra=(lambda b: {"odd": b.mean()}) if rank == 1 else None)
    out["eval"], out["eval_calls"] = r.compute(sync, sync_all=True), sync.calls

    sync = Counting(distributed_sync(group))  # means and a sum only
    r = MetricReducer({"s": "sum"})
    for xb, _ in shard:
        r.update({k: v for k, v in _metrics(xb).items() if k in SUM_LIKE}, batch_size=len(xb))
    out["eval_sums"], out["eval_sums_calls"] = r.compute(sync, sync_all=True), sync.calls

    # training: only the sync_dist metrics (the loss among them), the others rank-local
    options = {k: LogOptions(sync_dist=True) for k in ("loss", "m", "s")}
    sync = Counting(distributed_sync(group))
    r = MetricReducer(REDUCE, options=options)
    _epoch(r, shard)
    out["train"], out["train_calls"] = r.epoch_logged(sync), sync.calls
    out["train_host_loss"] = r.host_loss
    local = MetricReducer(REDUCE)
    _epoch(local, shard)
    out["local"] = local.compute()

    sync = Counting(distributed_sync(group))
    r = MetricReducer(REDUCE)
    _epoch(r, shard)
    out["train_unsynced"], out["train_unsynced_calls"] = r.epoch_logged(sync), sync.calls

    # a torchmetrics object syncs itself in compute()
    auroc = BinaryAUROC(process_group=group)
    r = MetricReducer()
    for xb, yb in shard:
        auroc.update(torch.sigmoid(xb), yb)
        r.update({"auroc": auroc, "m": xb.mean()}, batch_size=len(xb))
    out["auroc"] = r.compute(distributed_sync(group), sync_all=True)
    return out


def _ranks(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0 and 1 in a group of their own (7 samples), then all 3 (2 samples)."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # every rank takes part in making it
    two = _two_ranks(rank, 2, pair) if rank < 2 else None
    return {"two": two, "three": _three_ranks(rank, world)}


def _three_ranks(rank: int, world: int) -> dict[str, Any]:
    from torchmetrics.classification import BinaryAUROC

    x, y = _data(2)  # rank 2's shard is empty
    shard = _batches(x[rank::world], y[rank::world], 2)
    auroc = BinaryAUROC()
    r = MetricReducer(REDUCE)
    for xb, yb in shard:
        auroc.update(torch.sigmoid(xb), yb)
        r.update({**_metrics(xb), "auroc": auroc}, batch_size=len(xb))
    sync = Counting(distributed_sync())
    return {"batches": len(shard), "eval": r.compute(sync, sync_all=True), "calls": sync.calls}


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results.put((rank, STARTED))  # imports done: the parent's deadline for the work starts
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
        results.put((rank, fn(rank, world)))
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test with it
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    fn: Callable[..., Any], world: int, timeout: float = 50.0, start_timeout: float = 120.0
) -> list[dict[str, Any]]:
    """``fn(rank, world)`` on ``world`` gloo ranks, in rank order. Fails if the ranks have not
    started (imported torch and the engine: slow on a loaded machine) within ``start_timeout``,
    or have not all answered within ``timeout`` after that (a hang; gloo's own timeout is 30 s)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, port, results), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(env)
    started: set[int] = set()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + start_timeout
    try:
        while len(got) < world:
            try:
                rank, value = results.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead:  # killed (e.g. gloo's abort on a mismatched collective), no traceback
                    raise AssertionError(f"ranks {dead} died without an answer") from None
                if time.monotonic() < deadline:
                    continue
                raise
            if value == STARTED:
                started.add(rank)
                if len(started) == world:
                    deadline = time.monotonic() + timeout
            else:
                got[rank] = value
                if isinstance(value, str):  # a rank's traceback: fail now, not at the deadline
                    break
    except queue.Empty:
        waiting = "started" if len(started) < world else "answered"
        missing = sorted(set(range(world)) - (started if waiting == "started" else set(got)))
        raise TimeoutError(f"ranks {missing} have not {waiting} in time (a hang?)") from None
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items()))
    return [got[r] for r in range(world)]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return _run(_ranks, 3)  # one launch: each spawned process pays torch's import


@pytest.fixture
def two(ranks) -> list[dict[str, Any]]:
    return [r["two"] for r in ranks[:2]]


@pytest.fixture
def three(ranks) -> list[dict[str, Any]]:
    return [r["three"] for r in ranks]


def _close(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=TOL), (k, a[k], b[k])


# -- the tests


@pytest.mark.slow
def test_evaluation_over_uneven_shards_equals_one_process_over_the_whole_set(two):
    assert [r["batches"] for r in two] == [[2, 2], [2, 1]]
    x, _ = _data(N_SAMPLES)
    want = {**_reference(N_SAMPLES), "odd": float(x[1::2].mean())}  # rank 1 alone
    for rank in two:
        _close(rank["eval"], want)
        assert rank["eval"]["hi"] == float(x.max()) and rank["eval"]["lo"] == float(x.min())
    assert two[0]["eval"] == two[1]["eval"]  # the same bits on every rank


@pytest.mark.slow
def test_evaluation_agrees_the_names_then_reduces_once_per_kind(two):
    for rank in two:
        assert rank["eval_calls"] == ["gather", "sum", "max", "min"]
        assert rank["eval_sums_calls"] == ["gather", "sum"]  # means and sums: one packing
        _close(rank["eval_sums"], {k: _reference(N_SAMPLES)[k] for k in SUM_LIKE})


@pytest.mark.slow
def test_training_reduces_only_sync_dist_metrics_in_one_collective(two):
    want = _reference(N_SAMPLES)
    for rank in two:
        assert rank["train_calls"] == ["sum"]  # loss, m and s (means and a sum): one packing
        logged = rank["train"]
        assert math.isclose(logged["train/m_epoch"], want["m"], rel_tol=TOL)
        assert math.isclose(logged["train/s_epoch"], want["s"], rel_tol=TOL)
        assert math.isclose(rank["train_host_loss"], want["loss"], rel_tol=TOL)
        # sync_dist=False: this rank's own values, as Lightning logs them
        assert logged["train/hi_epoch"] == rank["local"]["hi"]
        assert logged["train/lo_epoch"] == rank["local"]["lo"]
    assert two[0]["local"]["hi"] != two[1]["local"]["hi"]  # the shards do differ


@pytest.mark.slow
def test_training_without_sync_dist_stays_rank_local_and_communicates_nothing(two):
    for rank in two:
        assert rank["train_unsynced_calls"] == []
        local = {f"train/{k}_epoch": v for k, v in rank["local"].items()}
        assert rank["train_unsynced"] == local
    assert two[0]["train_unsynced"] != two[1]["train_unsynced"]


@pytest.mark.slow
def test_a_torchmetrics_metric_syncs_itself_to_the_whole_set(two):
    from torchmetrics.classification import BinaryAUROC

    x, y = _data(N_SAMPLES)
    whole = float(BinaryAUROC()(torch.sigmoid(x), y))
    local = float(BinaryAUROC()(torch.sigmoid(x[::2]), y[::2]))
    assert whole != local  # a rank's own AUROC would not pass
    for rank in two:
        assert math.isclose(rank["auroc"]["auroc"], whole, rel_tol=TOL)
        assert math.isclose(rank["auroc"]["m"], float(x.mean()), rel_tol=TOL)


@pytest.mark.slow
def test_a_rank_without_batches_takes_part_and_gets_the_global_values(three):
    from torchmetrics.classification import BinaryAUROC

    assert [r["batches"] for r in three] == [1, 1, 0]
    x, y = _data(2)
    want = {**_reference(2), "auroc": float(BinaryAUROC()(torch.sigmoid(x), y))}
    for rank in three:
        _close(rank["eval"], want)
        # the names, the zero-batch rank's copy of the metric object, then one per kind
        assert rank["calls"] == ["gather", "gather", "sum", "max", "min"]


# -- one process: no collective, today's bits


class _Refuse:
    world_size, rank = 1, 0

    def all_reduce(self, tensor, op):
        raise AssertionError("a world of one needs no collective")

    def all_gather_object(self, obj):
        raise AssertionError("a world of one needs no collective")


def test_one_rank_is_bitwise_the_unsynced_reduction():
    x, y = _data(N_SAMPLES)
    options = {k: LogOptions(sync_dist=True) for k in ("loss", "m", "hi")}
    plain, one, logged = (MetricReducer(REDUCE, fold_every=2, options=options) for _ in range(3))
    for r in (plain, one, logged):
        _epoch(r, _batches(x, y, 3))
    want = plain.compute()
    assert one.compute(_Refuse(), sync_all=True) == want
    assert logged.epoch_logged(_Refuse()) == {f"train/{k}_epoch": v for k, v in want.items()}
    assert isinstance(_Refuse(), MetricSync)


def test_sync_dist_must_be_a_bool():
    with pytest.raises(ValueError, match=r"LogOptions\(sync_dist='yes'\): pass True or False"):
        LogOptions(sync_dist="yes")  # type: ignore[arg-type]


def test_distributed_sync_without_a_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed_sync()
