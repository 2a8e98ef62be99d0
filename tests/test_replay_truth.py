"""Replay tells the truth: it starts only from a checkpoint that holds its journaled state, it
compares (and counts) every journaled value of the steps it replays, it refuses a journal line
it cannot vouch for by line number, it never runs past the run's recorded end, it reads pickled
code only from inside the run directory, and its report says what matched.

Each test tampers a real run directory as a hostile user would and replays it through
``engine.replay`` or the ``engine replay`` command in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.listeners import Journal


def _task(lr: bool = True) -> eg.Task:
    sched = optim.cosine_decay(0.05, 40)
    loss = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    return eg.Task(loss, optim.adamw(sched), lr=sched if lr else None)


def _data(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _fit(root: Path, *, seed: int = 7, task: eg.Task | None = None, **kw) -> eg.Trainer:
    task = task or _task()
    flags = dict(
        max_epochs=4,
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=root,
    )
    flags.update(kw)
    trainer = eg.Trainer(**flags)
    torch.manual_seed(0)
    trainer.fit(task, task.init(nn.Linear(3, 1), seed=seed), _data())
    return trainer


def _cli(run: str | Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _procs.run(
        [sys.executable, "-m", "engine", "replay", str(run), "--trust-code", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _rewrite(run: str | Path, lines: list) -> None:
    text = "".join(json.dumps(x) + "\n" for x in lines)
    (Path(run) / "journal.jsonl").write_text(text)


# --------------------------------------------------------------------------- the start checkpoint


def test_an_untouched_run_with_a_last_checkpoint_replays_identically_from_any_step(tmp_path):
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)  # top 1 and "last"
    trainer = _fit(tmp_path, callbacks=[saver])
    assert trainer.global_step == 20
    lines = Journal.read(trainer.run_dir)
    # "last" is journaled at steps 5, 10, 15 and 20; it holds step 20 now
    assert [x["step"] for x in lines if str(x.get("checkpoint", "")).endswith("last")] == [
        5,
        10,
        15,
        20,
    ]
    for from_step in (2, 6, 11, 16, 20):
        with pytest.warns(UserWarning, match="overwritten since") if from_step > 5 else _nothing():
            report = eg.replay(trainer.run_dir, from_step, trust_code=True)
        assert report.identical, str(report)
        assert report.start_step == 0 and report.steps == 20, str(report)
    # and from a fresh process, through the command line
    done = _cli(trainer.run_dir, "--from", "11")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bitwise identical" in done.stdout and "(1..20)" in done.stdout


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_checkpoint_replaced_by_another_state_of_its_step_is_passed_over(tmp_path):
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1)  # one every epoch
    trainer = _fit(tmp_path / "a", callbacks=[saver])
    other = eg.ModelCheckpoint(dirpath=tmp_path / "other", save_top_k=-1)
    _fit(tmp_path / "b", seed=8, callbacks=[other])  # another run: the same steps, other states
    name = "epoch=2-step=15"
    shutil.rmtree(tmp_path / "ckpts" / name)
    shutil.copytree(tmp_path / "other" / name, tmp_path / "ckpts" / name)
    with pytest.warns(UserWarning, match="does not hold the journaled state"):
        report = eg.replay(trainer.run_dir, 16, trust_code=True)
    assert report.identical, str(report)
    assert report.start_step == 10 and Path(report.checkpoint).name == "epoch=1-step=10"


def test_no_checkpoint_holding_its_journaled_state_is_an_error_not_a_divergence(tmp_path):
    trainer = _fit(tmp_path / "a")
    other = _fit(tmp_path / "b", seed=8)
    start = Path(trainer.run_dir) / "start-step=0"
    shutil.rmtree(start)
    shutil.copytree(Path(other.run_dir) / "start-step=0", start)
    with (
        pytest.warns(UserWarning, match="does not hold the journaled state"),
        pytest.raises(eg.ReplayError, match="no journaled checkpoint before step 1 holds"),
    ):
        eg.replay(trainer.run_dir, trust_code=True)


# --------------------------------------------------------------------------- every value compared


def _expected_count(lines: list, start: int, to: int) -> int:
    """The journaled losses and fingerprints of steps start+1..to, counted from the file: each
    line's ``loss`` and ``fingerprint``, each entry of its ``losses``, and the start line's
    fingerprint."""
    n = 0
    for line in lines:
        step = line["step"]
        if line.get("start") and step == start:
            n += "fingerprint" in line
            continue
        if start < step <= to:
            n += ("loss" in line) + ("fingerprint" in line)
        losses = line.get("losses", [])
        first = step - len(losses) + 1
        n += sum(start < s <= to for s in range(first, step + 1))
    return n


def test_identical_counts_every_journaled_value_of_the_replayed_steps(tmp_path):
    journal = Journal(every_n_steps=3, fingerprint_every_n_steps=6)
    trainer = _fit(tmp_path, task=_task(lr=False), callbacks=[journal], max_epochs=3)
    assert trainer.global_step == 15
    lines = Journal.read(trainer.run_dir)
    expected = _expected_count(lines, 0, 15)
    assert expected > 15 + 5  # every step's loss, the lines' losses and fingerprints
    done = _cli(trainer.run_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"bitwise identical ({expected} journaled values compared)" in done.stdout
    # to a step between lines: the line after it holds the losses of steps 7 and 8 too
    report = eg.replay(trainer.run_dir, 1, 8, trust_code=True)
    assert report.identical and report.compared == _expected_count(lines, 0, 8), str(report)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"epoch": 3, "loss": 123.0}, ["epoch: journal 3 != replay 0"]),
        ({"batch_idx": 1, "loss": 123.0}, ["batch_idx: journal 1 != replay 4"]),
    ],
)
def test_a_line_moved_to_another_position_is_a_difference_not_identical(tmp_path, change, words):
    trainer = _fit(tmp_path)
    lines = Journal.read(trainer.run_dir)
    target = next(x for x in lines if x["step"] == 4 and "loss" in x)
    number = lines.index(target) + 1
    target.update(change)
    _rewrite(trainer.run_dir, lines)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert not report.identical, str(report)
    assert report.divergence.step == 4 and report.divergence.line == number
    done = _cli(trainer.run_dir)
    assert done.returncode == 1, done.stdout + done.stderr
    for w in [*words, f"journal line {number}"]:
        assert w in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"step": -4}, ["step=-4"]),
        ({"losses": 123.0}, ["losses=123.0", "not a list"]),
        ({"losses": ["x"]}, ["not a list of numbers"]),
        ({"loss": "123"}, ["loss='123'"]),
        ({"fingerprint": "zz"}, ["fingerprint='zz'"]),
        ({"epoch": True}, ["epoch=True"]),
    ],
)
def test_a_malformed_line_is_refused_naming_its_line_number(tmp_path, change, words):
    trainer = _fit(tmp_path)
    lines = Journal.read(trainer.run_dir)
    target = next(x for x in lines if x["step"] == 8 and "loss" in x)
    number = lines.index(target) + 1
    target.update(change)
    _rewrite(trainer.run_dir, lines)
    with pytest.raises(eg.ReplayError, match=f"line {number} "):
        eg.replay(trainer.run_dir, trust_code=True)
    done = _cli(trainer.run_dir)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for w in [f"line {number} ", *words]:
        assert w in done.stderr, done.stderr


# --------------------------------------------------------------------------- the range


def test_a_line_past_the_runs_end_is_refused_at_once(tmp_path):
    trainer = _fit(tmp_path)
    lines = Journal.read(trainer.run_dir)
    assert lines[-1]["end"] and lines[-1]["step"] == 20
    forged = {"step": 10**12, "epoch": 0, "batch_idx": 0, "loss": 1.0, "losses": [1.0]}
    _rewrite(trainer.run_dir, [*lines, forged])
    began = time.monotonic()
    done = _cli(trainer.run_dir, "--from", "19")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"line {len(lines) + 1} (step {10**12}) is past the end of its fit" in done.stderr
    assert time.monotonic() - began < 60
    # a fit killed before its end line: its lines are no further apart than it wrote them
    _rewrite(trainer.run_dir, [*lines[:-1], forged])
    with pytest.raises(eg.ReplayError, match=f"line {len(lines)} .*a line every 4 steps"):
        eg.replay(trainer.run_dir, 19, trust_code=True)


def test_the_runs_final_step_is_journaled_and_replayed(tmp_path):
    # 5 batches x 3 epochs: a fit that ends at step 15 with lines every 4 steps
    trainer = _fit(tmp_path, max_epochs=3)
    assert trainer.global_step == 15
    end = Journal.read(trainer.run_dir)[-1]
    assert end["end"] and end["step"] == 15 and len(end["losses"]) == 3  # steps 13, 14, 15
    assert end["fingerprint"] == trainer.state.fingerprint()
    done = _cli(trainer.run_dir, "--from", "13", "--to", "15")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bitwise identical" in done.stdout and "(1..15)" in done.stdout
    # the final step's loss is compared: changing it is seen at step 15
    lines = Journal.read(trainer.run_dir)
    lines[-1]["losses"][-1] += 1.0
    _rewrite(trainer.run_dir, lines)
    report = eg.replay(trainer.run_dir, 13, 15, trust_code=True)
    assert report.divergence is not None and report.first_divergent_step == 15, str(report)


# --------------------------------------------------------------------------- pickled code


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _with_transition(tmp_path: Path) -> tuple[eg.Trainer, list, dict]:
    class Halve(eg.Listener):
        def on_train_epoch_end(self, rec):
            return eg.Transition(
                lambda s: s.replace(params={k: v * 0.5 for k, v in s.params.items()}), name="halve"
            )

    trainer = _fit(tmp_path / "run", callbacks=[Halve()], max_epochs=2)
    lines = Journal.read(trainer.run_dir)
    line = next(x for x in lines if "transition" in x)
    return trainer, lines, line


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_a_transitions_pickle_is_read_only_from_inside_the_run_directory(tmp_path, where):
    trainer, lines, line = _with_transition(tmp_path)
    run = Path(trainer.run_dir)
    marker = tmp_path / "pwned"
    import pickle

    outside = tmp_path / "evil.pkl"
    outside.write_bytes(pickle.dumps(_Payload(marker)))
    if where == "parent":
        line["function"] = os.path.relpath(outside, run)
    elif where == "absolute":
        line["function"] = str(outside)
    else:
        (run / line["function"]).unlink()
        (run / line["function"]).symlink_to(outside)
    _rewrite(run, lines)
    with pytest.raises(eg.ReplayError, match="refused"):
        eg.replay(run, trust_code=True)
    done = _cli(run)
    assert done.returncode == 2 and "refused" in done.stderr, done.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------- what the report says


def test_a_fingerprint_alone_differing_says_the_losses_up_to_it_matched(tmp_path):
    journal = Journal(every_n_steps=5, fingerprint_every_n_steps=10)
    trainer = _fit(tmp_path, callbacks=[journal], enable_checkpointing=False)
    lines = Journal.read(trainer.run_dir)
    target = next(x for x in lines if x["step"] == 20 and "fingerprint" in x and "loss" in x)
    target["fingerprint"] = "0" * 32
    _rewrite(trainer.run_dir, lines)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert set(report.divergence.values) == {"fingerprint"} and report.divergence.step == 20
    assert report.diverged_after == 10 and report.losses_matched == 10
    text = str(report)
    assert "first difference seen at step 20" in text
    assert "the journaled losses of all 10 steps 11..20 matched" in text
    assert "no value journaled" not in text and "no fingerprint journaled" not in text


def test_a_run_resumed_past_its_end_mid_epoch_replays_through_both_fits(tmp_path):
    # the first fit ends mid-epoch (max_steps=7); a second resumes from it to step 12
    run = tmp_path / "run"
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, every_n_train_steps=1)
    _fit(tmp_path, callbacks=[Journal(run), saver], max_steps=7, max_epochs=-1)
    again = eg.Trainer(
        max_steps=12,
        max_epochs=-1,
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=tmp_path,
        callbacks=[Journal(run)],
    )
    task = _task()
    again.fit(task, task.init(nn.Linear(3, 1)), _data(), ckpt_path=tmp_path / "ckpts" / "last")
    ends = [x["step"] for x in Journal.read(run) if x.get("end")]
    assert ends == [7, 12]
    report = eg.replay(run, 1, 12, trust_code=True)
    assert report.identical and report.steps == 12, str(report)


def test_a_fingerprint_alone_differing_in_a_journal_without_step_losses(tmp_path):
    # an engine before per-step losses: the lines' own losses are what matched
    journal = Journal(every_n_steps=5, fingerprint_every_n_steps=10)
    trainer = _fit(tmp_path, callbacks=[journal], enable_checkpointing=False)
    lines = Journal.read(trainer.run_dir)
    for line in lines:
        line.pop("losses", None)
    target = next(x for x in lines if x["step"] == 20 and "fingerprint" in x and "loss" in x)
    target["fingerprint"] = "0" * 32
    _rewrite(trainer.run_dir, lines)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.divergence.step == 20 and report.diverged_after == 10
    assert report.losses_matched == 2  # the lines at steps 15 and 20
    assert "the losses journaled for 2 of the 10 steps 11..20 matched" in str(report)
