"""Batch norm under data parallel training (engine.parallel.DDP) on 2 gloo ranks.

``sync_batchnorm=True``: per-rank batch b on 2 ranks trains the parameters AND the running
statistics of one process with plain ``nn.BatchNorm*d`` on batch 2b (the synced statistics are
the whole batch's), to float32 rounding after 20 AdamW steps; without it they differ.
``broadcast_buffers=True`` (the default): every rank's buffers are rank 0's after each optimizer
step, bitwise, at one broadcast per step, and none for a model without buffers.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim, transforms
from engine.parallel import DDP, SyncBatchNorm, convert_sync_batchnorm

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[1]
B, STEPS = 8, 20


class Net(nn.Module):
    """BatchNorm2d after a convolution, BatchNorm1d (a cumulative average: momentum=None)
    after a linear layer. Neither has a bias before its batch norm (the usual way: the norm
    takes the mean out, so that bias's gradient is 0 up to rounding, and AdamW, which divides
    by the gradient's size, would follow the rounding)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 8, bias=False)
        self.bn1 = nn.BatchNorm1d(8, momentum=None)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.bn2(self.conv(x)))
        return self.out(torch.tanh(self.bn1(self.fc(h.flatten(1)))))


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net()


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2 * 4 * 4, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    # a channel mean away from 0, as real activations have
    return torch.randn(n, 2, 4, 4, generator=g) + 0.5, torch.randn(n, 3, generator=g)


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _tx() -> optim.GradientTransformation:
    return optim.adamw(1e-2, weight_decay=0.01)


def _snapshot(state) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in state.params.items()},
        "buffers": {k: v.clone() for k, v in state.buffers.items()},
        "step": state.step,
    }


def _train(rank: int, world: int, strategy, accumulate: int = 1, make=_net) -> tuple:
    """``STEPS`` optimizer steps of per-rank batch ``2B / world``: rank r reads its half of
    each batch of 2B. Rank 1 builds other weights (prepare gives it rank 0's)."""
    pipeline = transforms.compose(
        strategy=strategy, clip=optim.clip_by_global_norm(0.5), accumulate=accumulate
    )
    state = pipeline.prepare(eg.TrainState.create(make(0 if rank == 0 else 99), _tx()))
    step = pipeline.train_step(_loss, _tx())
    x, y = _data(STEPS * accumulate * 2 * B)
    per = 2 * B // world
    for i in range(STEPS * accumulate):
        lo = i * 2 * B + rank * per
        state, _ = step(state, pipeline.move((x[lo : lo + per], y[lo : lo + per])))
    return state, pipeline


def _evaluated(state, pipeline) -> torch.Tensor:
    x, _ = _data(2 * B)
    return pipeline.predict_step()(state, x)


def _one(rank: int, accumulate: int) -> dict:
    state, _ = _train(rank, 1, None, accumulate)
    assert not any(isinstance(m, SyncBatchNorm) for m in state.module.modules())
    return _snapshot(state)


def _two(rank: int, accumulate: int) -> dict:
    out = {}
    for name, kwargs in {
        "sync": {"sync_batchnorm": True},
        "local": {},
        "unbroadcast": {"broadcast_buffers": False},
    }.items():
        strategy = DDP(**kwargs)
        strategy.setup()
        state, pipeline = _train(rank, 2, strategy, accumulate)
        synced = [
            type(m).__name__ for m in state.module.modules() if "BatchNorm" in type(m).__name__
        ]
        out[name] = {**_snapshot(state), "eval": _evaluated(state, pipeline), "layers": synced}
    return out


def _close(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _float(d: dict) -> dict:
    return {k: v for k, v in d.items() if v.is_floating_point()}


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_synced_batchnorm_on_two_ranks_trains_as_one_process_on_the_whole_batch(accumulate):
    (ref,) = run_ranks(_one, 1, accumulate)
    r0, r1 = run_ranks(_two, 2, accumulate, timeout=240)
    assert ref["step"] == r0["sync"]["step"] == r1["sync"]["step"] == STEPS
    assert r0["sync"]["layers"] == ["SyncBatchNorm", "SyncBatchNorm"]  # ours, on the CPU
    # synced: the parameters and the running statistics of one process on batch 2B
    worst_p = _close(r0["sync"]["params"], ref["params"])
    worst_b = _close(_float(r0["sync"]["buffers"]), _float(ref["buffers"]))
    assert worst_p <= 1e-6, f"parameters differ by {worst_p}"
    assert worst_b <= 1e-6, f"running statistics differ by {worst_b}"
    for k, v in ref["buffers"].items():
        if not v.is_floating_point():  # num_batches_tracked: one per micro-batch
            assert torch.equal(r0["sync"]["buffers"][k], v), k
    assert int(ref["buffers"]["bn1.num_batches_tracked"]) == STEPS * accumulate
    # not synced: each rank normalises by its own half of the batch; it trains otherwise
    assert _close(r0["local"]["params"], ref["params"]) > 1e-3
    assert _close(_float(r0["local"]["buffers"]), _float(ref["buffers"])) > 1e-3
    assert r0["local"]["layers"] == ["BatchNorm2d", "BatchNorm1d"]
    # every rank's buffers are rank 0's (broadcast_buffers), bitwise, synced or not, so the
    # ranks evaluate alike; the parameters are the same bits already (averaged gradients)
    for run in ("sync", "local"):
        for part in ("params", "buffers"):
            for k, v in r0[run][part].items():
                assert torch.equal(v, r1[run][part][k]), (run, part, k)
        assert torch.equal(r0[run]["eval"], r1[run]["eval"]), run
    # without the broadcast the ranks' running statistics are their own batches'
    assert _close(_float(r0["unbroadcast"]["buffers"]), _float(r1["unbroadcast"]["buffers"])) > 0
    assert not torch.equal(r0["unbroadcast"]["eval"], r1["unbroadcast"]["eval"])


class _Counting:
    """Counts the calls of ``torch.distributed``'s ``all_reduce`` and ``broadcast`` while
    active (the strategy calls them through the module)."""

    def __init__(self) -> None:
        self.calls = {"all_reduce": 0, "broadcast": 0}
        self.real = {k: getattr(dist, k) for k in self.calls}

    def _counting(self, kind: str):
        def call(*a, **kw):
            self.calls[kind] += 1
            return self.real[kind](*a, **kw)

        return call

    def __enter__(self) -> dict[str, int]:
        for kind in self.calls:
            setattr(dist, kind, self._counting(kind))
        return self.calls

    def __exit__(self, *exc) -> None:
        for kind, fn in self.real.items():
            setattr(dist, kind, fn)


def _collectives(rank: int) -> dict:
    """The collectives of 10 optimizer steps (after prepare) for an MLP and for a batch norm
    net: one gradient all-reduce per step each, one buffer broadcast per step for the net."""
    counts = {}
    for name, model in (("mlp", nn.Sequential(nn.Flatten(), _mlp(0))), ("bn", _net(0))):
        strategy = DDP()
        strategy.setup()
        pipeline = transforms.compose(strategy=strategy, accumulate=2)
        state = pipeline.prepare(eg.TrainState.create(model, _tx()))
        step = pipeline.train_step(_loss, _tx())
        x, y = _data(B)
        with _Counting() as calls:
            for _ in range(20):
                state, _ = step(state, (x, y))
            pipeline.eval_step(_loss)(state, (x, y))  # evaluation broadcasts nothing
        counts[name] = {**calls, "steps": state.step}
    return counts


@pytest.mark.slow
def test_buffers_are_broadcast_once_per_optimizer_step_and_never_without_buffers():
    c0, c1 = run_ranks(_collectives, 2)
    assert c0 == c1
    assert c0["mlp"] == {"all_reduce": 10, "broadcast": 0, "steps": 10}
    # the net's running statistics (float32) in one flattened broadcast per optimizer step
    assert c0["bn"] == {"all_reduce": 10, "broadcast": 10, "steps": 10}


def _compiled(rank: int, compile: bool) -> dict:
    """5 steps on 2 ranks (or 1 process on the whole batch), compiled or not, synced and not;
    momentum 0.1 (torch's own BatchNorm1d with momentum=None reads a tensor as a float, which
    torch.compile refuses)."""
    world = 2 if rank >= 0 else 1
    out = {}
    for name in ("sync", "local") if world == 2 else ("one",):
        strategy = DDP(sync_batchnorm=name == "sync") if world == 2 else None
        if strategy is not None:
            strategy.setup()
        pipeline = transforms.compose(strategy=strategy, compile=compile)
        net = _net(0)
        net.bn1.momentum = 0.1
        state = pipeline.prepare(eg.TrainState.create(net, _tx()))
        step = pipeline.train_step(_loss, _tx())
        x, y = _data(2 * B * 5)
        per = 2 * B // world
        for i in range(5):
            lo = i * 2 * B + max(rank, 0) * per
            state, _ = step(state, (x[lo : lo + per], y[lo : lo + per]))
        out[name] = _snapshot(state)
    return out


def _compiled_one(rank: int) -> dict:
    return _compiled(-1, False)


@pytest.mark.slow
def test_compiled_steps_sync_batchnorm_and_broadcast_the_buffers():
    """Compiled: the synced statistics' all-reduce (torch's functional collective) is traced
    into the graph, and the buffers' broadcast still follows every optimizer step (the mark
    that reduce leaves inside the compiled core reaches the eager wrapper around it)."""
    (ref,) = run_ranks(_compiled_one, 1)
    c0, c1 = run_ranks(_compiled, 2, True, timeout=400)
    assert _close(c0["sync"]["params"], ref["one"]["params"]) <= 1e-6
    assert _close(_float(c0["sync"]["buffers"]), _float(ref["one"]["buffers"])) <= 1e-6
    for k, v in c0["local"]["buffers"].items():  # rank 0's, though each rank normalised its own
        assert torch.equal(v, c1["local"]["buffers"][k]), k
    assert _close(_float(c0["local"]["buffers"]), _float(ref["one"]["buffers"])) > 1e-3


def test_sync_batchnorm_in_one_process_is_torch_batchnorm():
    torch.manual_seed(0)
    for plain, x in (
        (nn.BatchNorm1d(5), torch.randn(6, 5)),
        (nn.BatchNorm1d(5, momentum=None), torch.randn(6, 5, 3)),
        (nn.BatchNorm2d(3, affine=False), torch.randn(4, 3, 2, 2) * 3 + 1),
        (nn.BatchNorm3d(2, track_running_stats=False), torch.randn(2, 2, 2, 2, 3)),
    ):
        sync = SyncBatchNorm.from_batchnorm(_copy(plain))
        assert sorted(sync.state_dict()) == sorted(plain.state_dict())
        for _ in range(3):
            assert torch.equal(sync(x), plain(x))
        sync.eval(), plain.eval()
        assert torch.equal(sync(x), plain(x))
        for k, v in plain.state_dict().items():
            assert torch.equal(sync.state_dict()[k], v), k


def _copy(m: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(m)


def test_convert_keeps_the_tensors_names_and_modes():
    net = _net(0)
    net.bn1.eval()
    before = {k: v for k, v in (*net.named_parameters(), *net.named_buffers())}
    keys = sorted(net.state_dict())
    out = convert_sync_batchnorm(net)
    assert out is net and isinstance(net.bn2, SyncBatchNorm) and isinstance(net.bn1, SyncBatchNorm)
    assert sorted(net.state_dict()) == keys
    after = dict((*net.named_parameters(), *net.named_buffers()))
    assert all(after[k] is v for k, v in before.items())
    assert net.bn2.training and not net.bn1.training and net.bn1.momentum is None
    assert convert_sync_batchnorm(net) is net  # converting twice changes nothing
    bn = nn.BatchNorm1d(3)
    assert isinstance(convert_sync_batchnorm(bn), SyncBatchNorm)  # a batch norm itself: new
    with pytest.raises(ValueError, match="num_features=4"):
        SyncBatchNorm(3)(torch.randn(2, 4))
    with pytest.raises(ValueError, match="2 or more"):
        SyncBatchNorm(3)(torch.randn(3))


def test_prepare_converts_the_module_after_a_step_bound_its_old_layers():
    """A step already ran (the module's slots were found and cached): after prepare the steps
    bind the new layers' slots, so the batch norm weights still train."""
    tx = optim.sgd(0.1)
    state = eg.TrainState.create(_net(0), tx)
    step = eg.train_step(_loss, tx)
    x, y = _data(B)
    state, _ = step(state, (x, y))
    state = DDP(sync_batchnorm=True).prepare(state)  # one process: no collective
    assert isinstance(state.module.bn1, SyncBatchNorm)
    w = state.params["bn1.weight"].detach().clone()
    mean = state.buffers["bn2.running_mean"].clone()
    state, _ = step(state, (x, y))
    assert not torch.equal(state.params["bn1.weight"], w)
    assert not torch.equal(state.buffers["bn2.running_mean"], mean)
    assert int(state.buffers["bn1.num_batches_tracked"]) == 2
    assert DDP().prepare(state).module.bn1 is state.module.bn1  # no flag: nothing converted


# ---------------------------------------------------------------------- under the Trainer

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(96, 6, generator=g) + 0.5, torch.randn(96, 3, generator=g))
    loader = DataLoader(ds, batch_size=args["batch"], shuffle=True)
    if args.get("distributed_order"):  # one process reading the order DDP deals out
        from torch.utils.data import DistributedSampler
        order = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=args["batch"], sampler=order)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2, weight_decay=0.01))
    trainer = eg.Trainer(
        accelerator="cpu", strategy=args["strategy"], devices=args["devices"], max_epochs=2,
        sync_batchnorm=args["sync"], default_root_dir=args["root"], enable_progress_bar=False,
        enable_checkpointing=False, logger=False, enable_model_summary=False,
    )
    out = trainer.fit(task, task.init(model, seed=0), loader)
    torch.save({"params": {k: v.detach().clone() for k, v in out.params.items()},
                "buffers": {k: v.clone() for k, v in out.buffers.items()}, "step": out.step,
                "layer": type(out.module[1]).__name__},
               os.path.join(args["root"], "final-%d.pt" % trainer.global_rank))
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # the ranks share one stdout pipe: unbuffered (as CI's environment may be), print's pieces
    # from two ranks interleave mid-line; buffered, each flushed line is one write
    env.pop("PYTHONUNBUFFERED", None)
    return env


def _run(cmd: list[str]) -> None:
    proc = _procs.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


@pytest.mark.slow
def test_trainer_sync_batchnorm_under_torchrun_trains_as_one_process(tmp_path):
    script = tmp_path / "bn_script.py"
    script.write_text(SCRIPT)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    single = {
        "strategy": "auto",
        "devices": 1,
        "batch": 16,
        "sync": False,
        "root": str(one),
        "distributed_order": True,
    }  # the order DDP deals over its ranks, as Lightning's
    _run([sys.executable, str(script), json.dumps(single)])
    ddp = {"strategy": "ddp", "devices": 2, "batch": 8, "sync": True, "root": str(two)}
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            str(script),
            json.dumps(ddp),
        ]
    )
    ref = torch.load(one / "final-0.pt", weights_only=False)
    r0, r1 = (torch.load(two / f"final-{r}.pt", weights_only=False) for r in (0, 1))
    assert ref["step"] == r0["step"] == 12 and ref["layer"] == "BatchNorm1d"
    assert r0["layer"] == "SyncBatchNorm"
    assert _close(r0["params"], ref["params"]) <= 1e-6
    assert _close(_float(r0["buffers"]), _float(ref["buffers"])) <= 1e-6
    for part in ("params", "buffers"):
        for k, v in r0[part].items():
            assert torch.equal(v, r1[part][k]), (part, k)
