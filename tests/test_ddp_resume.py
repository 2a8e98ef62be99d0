"""Checkpoints of data-parallel runs: exact resume in fresh processes (mid-epoch, and inside an
accumulation window, where each rank's partial gradient sum is its own), resume on another
world size with the epoch's sample position carried over, and the refusals that keep both
truthful.

Each run is a script in a fresh process tree (torchrun's, or one plain process) with a
timeout, so a hang fails the test. The dataset carries each sample's index, and every rank
records the indices of each batch it trains on, so coverage is checked sample by sample.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_ddp_trainer import _final, _ok, _python, _torchrun

import engine as eg
from engine import checkpoint, optim
from engine.parallel import positions

N = 160  # samples; with batch 8: 10 batches per rank on 2 ranks, 20 on one

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
    n = args["n"]
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g),
                       torch.arange(n))
    loader = DataLoader(ds, batch_size=args["batch"], shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    class Seen(eg.Listener):  # the sample indices of every batch this rank trains on
        handles_blocks = args.get("steps_per_call", 1) > 1  # then: each block's last batch
        def __init__(self):
            self.rows = []
        def on_train_batch_end(self, rec):
            self.rows.append([rec.state.epoch, rec.batch_idx, rec.batch[2].tolist()])

    seen = Seen()
    callbacks = [seen]
    if args.get("signal_rank") is not None:
        import signal as _s
        class SignalOnRank(eg.Listener):
            def on_train_batch_end(self, rec):
                if (rec.run.global_rank, rec.batch_idx) == (args["signal_rank"],
                                                            args["signal_at"]):
                    os.kill(os.getpid(), _s.SIGTERM)
        callbacks.append(SignalOnRank())
    if args.get("every"):
        callbacks.append(eg.listeners.ModelCheckpoint(
            dirpath=os.path.join(args["root"], "ckpts"), filename="{step}",
            save_top_k=-1, every_n_train_steps=args["every"]))

    task = eg.Task(loss_fn, optim.adamw(1e-2, weight_decay=0.01))
    trainer = eg.Trainer(
        accelerator="cpu", strategy=args.get("strategy", "ddp"), devices=args["devices"],
        max_epochs=args.get("epochs", 1), accumulate_grad_batches=args.get("accumulate", 1),
        gradient_clip_val=0.5, default_root_dir=args["root"], enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
        log_every_n_steps=args.get("log_every", 1), compile=args.get("compile", False),
        steps_per_call=args.get("steps_per_call", 1),
    )
    try:
        out = trainer.fit(task, task.init(model, seed=0), loader, ckpt_path=args.get("ckpt"))
    finally:
        tag = args.get("tag", "run")
        with open(os.path.join(args["root"], f"seen-{tag}-{trainer.global_rank}.json"), "w") as f:
            json.dump(seen.rows, f)
    if trainer.is_global_zero:
        torch.save({"params": {k: v.clone() for k, v in out.params.items()}, "step": out.step,
                    "world_size": trainer.world_size}, os.path.join(args["root"], "final.pt"))
    """
)


def _script(root: Path) -> Path:
    path = root / "resume_script.py"
    path.write_text(SCRIPT)
    return path


def _two(root: Path, **args):
    root.mkdir(parents=True, exist_ok=True)
    return _torchrun(_script(root), {"n": N, "batch": 8, "devices": 2, "root": str(root), **args})


def _one(root: Path, **args):
    root.mkdir(parents=True, exist_ok=True)
    common = {"n": N, "batch": 8, "devices": 1, "strategy": "auto", "root": str(root)}
    return _python(_script(root), {**common, **args})


def _seen(root: Path, tag: str, ranks: int) -> list[list]:
    rows = []
    for r in range(ranks):
        rows += json.loads((root / f"seen-{tag}-{r}.json").read_text())
    return rows


def _bitwise(a: dict, b: dict) -> None:
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"parameters that differ bitwise: {differ}"


def _epoch_samples(rows: list[list], epoch: int, below: int | None = None) -> list[int]:
    return [i for e, b, idx in rows if e == epoch and (below is None or b < below) for i in idx]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """An uninterrupted 2-rank run, 2 epochs, accumulation 2, a checkpoint every step."""
    root = tmp_path_factory.mktemp("two")
    _ok(_two(root, accumulate=2, epochs=2, every=1, tag="full"))
    return root


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """An uninterrupted 1-process run of the same data, batch 8, a checkpoint every step."""
    root = tmp_path_factory.mktemp("one")
    _ok(_one(root, every=1, tag="full"))
    return root


@pytest.mark.slow
def test_ddp_resume_inside_an_accumulation_window_is_bitwise_identical(two_rank_run, tmp_path):
    full = _final(two_rank_run)
    assert full["step"] == 10 and full["world_size"] == 2
    # SIGTERM on rank 1 after batch 2: step 1 done, batch 2 summed into the next window
    stopped = _two(tmp_path, accumulate=2, epochs=2, signal_rank=1, signal_at=2, tag="cut")
    assert "SIGTERM received" in stopped.stderr, stopped.stderr[-3000:]
    (cut,) = (tmp_path / "checkpoints").glob("interrupted-step=*")
    meta = checkpoint.read_meta(cut)
    assert (meta["step"], meta["micro_step"], meta["batch_idx"]) == (1, 1, 3)
    assert meta["grad_accum_ranks"] == 2 and meta["extra"]["trainer"]["world_size"] == 2
    # the two ranks' partial sums differ (their shards differ): each must get its own back
    tensors = torch.load(cut / checkpoint.TENSORS, weights_only=True)
    mine = {k[len("grad_accum/") :]: v for k, v in tensors.items() if k.startswith("grad_accum/")}
    other = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("grad_accum@1/")}
    assert mine.keys() == other.keys() and any(not torch.equal(mine[k], other[k]) for k in mine)

    resumed = tmp_path / "resumed"
    _ok(_two(resumed, accumulate=2, epochs=2, ckpt=str(cut), tag="resumed"))
    assert _final(resumed)["step"] == 10
    _bitwise(_final(resumed)["params"], full["params"])
    # the resumed ranks trained on exactly the batches the uninterrupted ranks did after it
    assert sorted(map(str, _seen(resumed, "resumed", 2))) == sorted(
        str(r) for r in _seen(two_rank_run, "full", 2) if (r[0], r[1]) >= (0, 3)
    )


@pytest.mark.slow
def test_ddp_resume_mid_epoch_at_a_step_is_bitwise_identical(two_rank_run, tmp_path):
    ckpt = two_rank_run / "ckpts" / "step=2"  # batch 4 of epoch 0 on each rank
    assert checkpoint.read_meta(ckpt)["batch_idx"] == 4
    _ok(_two(tmp_path, accumulate=2, epochs=2, ckpt=str(ckpt), tag="resumed"))
    _bitwise(_final(tmp_path)["params"], _final(two_rank_run)["params"])


@pytest.mark.slow
def test_a_resume_inside_a_window_on_another_world_size_is_refused(tmp_path):
    _two(tmp_path, accumulate=2, signal_rank=0, signal_at=0, tag="cut")
    (cut,) = (tmp_path / "checkpoints").glob("interrupted-step=*")
    assert checkpoint.read_meta(cut)["micro_step"] == 1
    proc = _one(tmp_path / "one", accumulate=2, ckpt=str(cut))
    assert proc.returncode != 0
    err = proc.stderr
    assert "world size 2" in err and "world size 1" in err and "optimizer step" in err, err[-2000:]


@pytest.mark.slow
def test_two_ranks_stopped_mid_epoch_resume_on_one_process_seeing_each_sample_once(
    two_rank_run, one_process_run, tmp_path
):
    ckpt = two_rank_run / "ckpts" / "step=2"  # 4 batches of 8 on each of 2 ranks: 64 samples
    _ok(_one(tmp_path, accumulate=2, ckpt=str(ckpt), tag="resumed"))
    before = _epoch_samples(_seen(two_rank_run, "full", 2), 0, below=4)
    after_rows = _seen(tmp_path, "resumed", 1)
    assert [b for _, b, _ in after_rows] == list(range(8, 20))  # 64 / 8: batch 8 on
    counts = Counter(before + _epoch_samples(after_rows, 0))
    assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}
    # the one process continues the interrupted fit's order (DistributedSampler's, as
    # Lightning deals it over ranks: randperm with seed 0 + epoch 0) from global sample 64
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
    assert [i for _, _, idx in after_rows for i in idx] == order[64:]
    assert _final(tmp_path)["step"] == 2 + 12 // 2  # training went on: 6 more steps


@pytest.mark.slow
def test_one_process_resumes_on_two_ranks_at_an_even_batch(one_process_run, tmp_path):
    ckpt = one_process_run / "ckpts" / "step=6"  # 6 batches of 8: 48 samples, 3 per rank
    _ok(_two(tmp_path, ckpt=str(ckpt), tag="resumed"))
    before = _epoch_samples(_seen(one_process_run, "full", 1), 0, below=6)
    after_rows = _seen(tmp_path, "resumed", 2)
    assert sorted({b for _, b, _ in after_rows}) == list(range(3, 10))
    counts = Counter(before + _epoch_samples(after_rows, 0))
    assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}
    # each rank's shard is DistributedSampler's dealing of the epoch's order from there
    order = [i for _, _, idx in _seen(one_process_run, "full", 1) for i in idx]
    for r in range(2):
        rows = json.loads((tmp_path / f"seen-resumed-{r}.json").read_text())
        assert [i for _, _, idx in rows for i in idx] == order[48 + r :: 2]
    assert _final(tmp_path)["step"] == 6 + 7


@pytest.mark.slow
def test_a_position_that_is_no_whole_global_batch_is_refused(one_process_run, tmp_path):
    ckpt = one_process_run / "ckpts" / "step=5"  # 5 batches of 8: 40 samples, not 16k
    proc = _two(tmp_path, ckpt=str(ckpt))
    assert proc.returncode != 0
    assert "N=40" in proc.stderr and "world size 2" in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------- in one process


def test_checkpoint_keeps_each_ranks_partial_gradient_sum(tmp_path):
    state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
    sums = [{k: torch.randn_like(v) for k, v in state.params.items()} for _ in range(3)]
    state = state.replace(grad_accum=sums[0], micro_step=1)
    path = checkpoint.save(state, tmp_path / "c", rank_grad_accum=sums[1:])
    assert checkpoint.read_meta(path)["grad_accum_ranks"] == 3
    for rank in range(3):
        back = checkpoint.load(path, state, rank=rank)
        assert all(torch.equal(back.grad_accum[k], sums[rank][k]) for k in state.params)
        assert all(torch.equal(back.params[k], state.params[k]) for k in state.params)
    with pytest.raises(checkpoint.CheckpointError, match="none of them rank 3's"):
        checkpoint.load(path, state, rank=3)
    # one process's checkpoint inside a window holds rank 0's only
    single = checkpoint.save(state, tmp_path / "one")
    assert checkpoint.read_meta(single)["grad_accum_ranks"] == 1
    with pytest.raises(checkpoint.CheckpointError, match="rank 1's"):
        checkpoint.load(single, state, rank=1)
    # at a step: nothing per rank, every rank loads the same
    at_step = checkpoint.save(state.replace(grad_accum=None, micro_step=0), tmp_path / "s")
    assert checkpoint.load(at_step, state, rank=1).grad_accum is None


def test_check_world_refuses_a_window_without_every_ranks_sum(tmp_path):
    meta = {
        "micro_step": 1,
        "has_grad_accum": True,
        "step": 3,
        "batch_idx": 7,
        "epoch": 0,
        "grad_accum_ranks": 1,
        "extra": {"trainer": {"world_size": 2}},
    }
    with pytest.raises(checkpoint.CheckpointError, match=r"world size 2.*world size 4"):
        positions.check_world(tmp_path, meta, world_size=4, accumulate=2)
    with pytest.raises(checkpoint.CheckpointError, match="of 1 rank"):
        positions.check_world(tmp_path, meta, world_size=2, accumulate=2)
    positions.check_world(tmp_path, {**meta, "grad_accum_ranks": 2}, world_size=2, accumulate=2)
    positions.check_world(tmp_path, {**meta, "micro_step": 0}, world_size=4, accumulate=2)


def test_carry_position_converts_the_rank_local_batch_index():
    state = eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1)).replace(batch_idx=6)
    total = 26  # 20 batches of an earlier epoch, then 6
    s, p = positions.carry_position(
        Path("c"), state, total, {"world_size": 1, "position_unit": 8}, world_size=2, unit=8
    )
    assert (s.batch_idx, p) == (3, 23)
    s, p = positions.carry_position(
        Path("c"), state, total, {"world_size": 2, "position_unit": 8}, world_size=2, unit=8
    )
    assert s is state and p == total
    with pytest.raises(checkpoint.CheckpointError, match=r"N=48 .*world size 4"):
        positions.carry_position(
            Path("c"),
            state,
            total,
            {"world_size": 1, "position_unit": 8},
            world_size=4,
            unit=8,
        )
    with pytest.raises(checkpoint.CheckpointError, match="stateful loader"):
        positions.carry_position(
            Path("c"),
            state,
            total,
            {"world_size": 2, "position_unit": 8, "data_state": {"batches": 6}},
            world_size=1,
            unit=8,
        )
    with pytest.raises(checkpoint.CheckpointError, match="cannot be carried over"):
        positions.carry_position(
            Path("c"),
            state,
            total,
            {"world_size": 1, "position_unit": None},
            world_size=2,
            unit=None,
        )


def test_position_unit_is_what_a_rank_batch_advances_the_global_position_by():
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    assert positions.position_unit(DataLoader(range(10), batch_size=4)) == 4
    custom = type("Custom", (BatchSampler,), {})(SequentialSampler(range(10)), 3, False)
    assert positions.position_unit(DataLoader(range(10), batch_sampler=custom)) == 1
    assert positions.position_unit([1, 2, 3]) is None
    assert positions.position_unit(DataLoader(range(10), batch_size=None)) is None


# ---------------------------------------------------------------- replay of a DDP run


@pytest.mark.slow
def test_replay_reexecutes_a_ddp_run_on_its_world_size(two_rank_run, tmp_path):
    run_dir = two_rank_run / "lightning_logs" / "version_0"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["world_size"] == 2 and config["strategy"] == "ddp" and config["devices"] == 2
    from engine.replaying import ReplayError

    with pytest.raises(ReplayError, match="detect_anomaly=True is not available"):
        eg.replay(run_dir, trust_code=True, detect_anomaly=True)
    report = eg.replay(run_dir, trust_code=True)
    assert report.identical, str(report)
    assert report.steps == 10 and report.compared >= 10  # every step's loss, fingerprints
    # from a checkpoint mid-run: the newest before step 7 (every step was saved)
    later = eg.replay(run_dir, from_step=7, to_step=9, trust_code=True)
    assert later.identical and later.start_step == 6 and later.steps == 3, str(later)

    # a journal whose loss of step 4 is not what the ranks compute: named, step 4 exactly
    edited = tmp_path / "edited"
    import shutil

    shutil.copytree(run_dir, edited)
    lines = (edited / "journal.jsonl").read_text().splitlines()
    out = []
    for text in lines:
        line = json.loads(text)
        if "losses" in line and line["step"] - len(line["losses"]) < 4 <= line["step"]:
            line["losses"][4 - line["step"] - 1] += 1e-3
            if line["step"] == 4:
                line["loss"] = line["losses"][-1]
        out.append(json.dumps(line))
    (edited / "journal.jsonl").write_text("\n".join(out) + "\n")
    diverged = eg.replay(edited, from_step=1, to_step=6, trust_code=True)
    assert not diverged.identical
    assert diverged.first_divergent_step == 4, str(diverged)
    assert set(diverged.divergence.values) == {"loss"}


def test_replay_runs_a_ddp_journal_on_cpu_ranks_only():
    from engine.replaying import ReplayError
    from engine.replaying._loading import _flags

    with pytest.raises(ReplayError, match="CPU processes only"):
        _flags({"device": "cuda:0", "world_size": 2})
    assert _flags({"device": "cpu", "world_size": 2})["devices"] == 2
    assert "strategy" not in _flags({"device": "cpu", "world_size": 1})
