"""The journal and replay of a fully sharded run (``strategy="fsdp"``).

A sharded state's fingerprint gathers every shard: a collective. So on every rank the journal
runs (rank 0 writes, the others follow: the same fingerprints, the same start checkpoint, saved
by every rank), and a replay re-executes the run on as many ranks with the same kind of
strategy, every rank computing the fingerprints its checker compares. Each run here is a fresh
process tree (torchrun, or the replay's own spawned ranks) with a timeout, so a hang (a
fingerprint one rank computes and another does not) fails the test instead of the suite.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import _procs
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_ddp_trainer import _env, _ok, _torchrun

from engine import checkpoint
from engine.listeners import Journal

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim
    from engine.parallel import FSDP, full_state

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(96, 6, generator=g), torch.randn(96, 3, generator=g))
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    task = eg.Task(loss_fn, optim.adamw(1e-2, weight_decay=0.01))
    callbacks = [
        eg.listeners.ModelCheckpoint(dirpath=os.path.join(args["root"], "ckpts"),
                                     filename="{step}", save_top_k=-1, every_n_train_steps=1),
        eg.listeners.Journal(fingerprint_every_n_steps=2),
    ]
    trainer = eg.Trainer(
        accelerator="cpu", strategy=FSDP(sharding_strategy=args["sharding"]), devices=2,
        max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5,
        default_root_dir=args["root"], logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, log_every_n_steps=1,
    )
    out = trainer.fit(task, task.init(model, seed=0), loader)
    whole = full_state(out)  # a collective: every rank
    if trainer.is_global_zero:
        with open(os.path.join(args["root"], "final.json"), "w") as f:
            json.dump({"fingerprint": whole.fingerprint(), "step": out.step,
                       "run_dir": trainer.run_dir}, f)
    """
)

# replay in a process of its own (its ranks are spawned from there), with a timeout
REPLAY = textwrap.dedent(
    """
    import json, sys
    import engine as eg

    if __name__ == "__main__":  # the replay's ranks are spawned: they import this again
        args = json.loads(sys.argv[1])
        r = eg.replay(args["run_dir"], args.get("from_step"), args.get("to_step"),
                      trust_code=True)
        d = r.divergence
        print("REPORT " + json.dumps({
            "identical": r.identical, "steps": r.steps, "compared": r.compared,
            "start_step": r.start_step, "first_divergent_step": r.first_divergent_step,
            "diverged": None if d is None else sorted(d.values), "text": str(r),
        }))
    """
)


def _replay(tmp_path: Path, run_dir: Path, **args) -> dict:
    script = tmp_path / "replay_script.py"
    script.write_text(REPLAY)
    proc = _procs.run(
        [sys.executable, str(script), json.dumps({"run_dir": str(run_dir), **args})],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    _ok(proc)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A 2-rank FULL_SHARD run: 2 epochs of 3 optimizer steps, accumulation 2, a checkpoint
    every step, no logger (the journal's directory is claimed by rank 0 for every rank)."""
    root = tmp_path_factory.mktemp("fsdp-journal")
    script = root / "fsdp_script.py"
    script.write_text(SCRIPT)
    _ok(_torchrun(script, {"root": str(root), "sharding": "FULL_SHARD"}, timeout=240))
    return root


@pytest.mark.slow
def test_a_sharded_run_is_journaled_by_rank_zero_with_every_rank_joining(sharded_run):
    final = json.loads((sharded_run / "final.json").read_text())
    run_dir = Path(final["run_dir"])
    # one run directory, claimed by rank 0 and named on every rank
    assert [p.name for p in (sharded_run / "lightning_logs").iterdir()] == [run_dir.name]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["world_size"] == 2 and config["sharded"] is True
    lines = Journal.read(run_dir)
    start = lines[0]
    assert start["start"] and start["step"] == 0 and "fingerprint" in start
    # the start checkpoint was saved by both ranks, as shards
    meta = checkpoint.read_meta(Path(start["checkpoint"]))
    assert meta.get("layout") == "sharded" and meta.get("world_size") == 2
    checkpoint.verify(Path(start["checkpoint"]))
    # the fingerprint of every checkpoint (and every 2 steps), gathered on every rank: the
    # last is the final state's, equal to its gathered whole's hashed on one process
    fingerprinted = [x["step"] for x in lines if "fingerprint" in x]
    assert {1, 2, 3, 4, 5, 6} <= set(fingerprinted)
    end = lines[-1]
    assert end["end"] and end["step"] == final["step"] == 6
    assert end["fingerprint"] == final["fingerprint"]
    assert len([x for x in lines if "losses" in x]) >= 6


@pytest.mark.slow
def test_a_sharded_run_replays_bitwise_on_its_ranks(sharded_run, tmp_path):
    run_dir = Path(json.loads((sharded_run / "final.json").read_text())["run_dir"])
    whole = _replay(tmp_path, run_dir)
    assert whole["identical"], whole["text"]
    assert whole["steps"] == 6 and whole["compared"] >= 12, whole["text"]
    later = _replay(tmp_path, run_dir, from_step=4, to_step=6)
    assert later["identical"] and later["start_step"] == 3 and later["steps"] == 3, later["text"]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["loss", "fingerprint"])
def test_a_difference_in_a_sharded_replay_is_named_and_every_rank_stops(
    sharded_run, tmp_path, what
):
    """Rank 0 finds the difference; the ranks keep computing the fingerprints together up to
    the agreed stop (a rank that stopped joining would hang the other in the gather)."""
    run_dir = Path(json.loads((sharded_run / "final.json").read_text())["run_dir"])
    edited = tmp_path / "edited"
    shutil.copytree(run_dir, edited)
    out = []
    for text in (edited / "journal.jsonl").read_text().splitlines():
        line = json.loads(text)
        losses = line.get("losses", ())
        if what == "loss" and line["step"] - len(losses) < 4 <= line["step"]:  # step 4's
            losses[4 - line["step"] - 1] += 1e-3
            if line["step"] == 4:
                line["loss"] = losses[-1]
        if what == "fingerprint" and line["step"] == 4 and "fingerprint" in line:
            line["fingerprint"] = "0" * len(line["fingerprint"])
        out.append(json.dumps(line))
    (edited / "journal.jsonl").write_text("\n".join(out) + "\n")
    report = _replay(tmp_path, edited, from_step=1, to_step=6)
    assert not report["identical"], report["text"]
    assert report["diverged"] == [what], report["text"]
    if what == "loss":
        assert report["first_divergent_step"] == 4, report["text"]
