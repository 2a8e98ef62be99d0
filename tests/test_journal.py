"""The run journal: lines at the right steps with the step's real loss, fingerprints that match
the states they describe, the task's code pickled for replay, and resume appends."""

from __future__ import annotations

import json
import math
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.checkpoint._pickling import loads_code
from engine.listeners import Journal


def _task() -> eg.Task:
    sched = optim.cosine_decay(0.1, 20)
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(sched), lr=sched)


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]


def _trainer(tmp_path, **kw):
    kw = {"enable_checkpointing": False} | kw
    return eg.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kw,
    )


class _Record(eg.Listener):
    def __init__(self):
        self.losses, self.fingerprints = {}, {}

    def on_train_batch_end(self, rec):
        self.losses[rec.state.step] = float(rec.outputs["loss"])
        self.fingerprints[rec.state.step] = rec.state.fingerprint()


def test_journal_lines_hold_the_steps_loss_lr_and_fingerprint(tmp_path):
    task, seen = _task(), _Record()
    journal = Journal(tmp_path / "run", every_n_steps=2, fingerprint_every_n_steps=4)
    _trainer(tmp_path, max_epochs=2, callbacks=[journal, seen]).fit(
        task, task.init(nn.Linear(3, 1)), _data()
    )
    start, *lines, end = Journal.read(tmp_path / "run")
    assert start["start"] and start["step"] == 0 and "loss" not in start
    assert [x["step"] for x in lines] == [2, 4, 6, 8, 10]
    # the fit's last line: its final step and state (step 10 had its line: no losses left)
    assert end["end"] and end["step"] == 10 and "losses" not in end
    for line in lines:
        assert line["loss"] == seen.losses[line["step"]]
        assert line["lr"] == optim.cosine_decay(0.1, 20)(line["step"])
        assert ("fingerprint" in line) == (line["step"] % 4 == 0)
        if "fingerprint" in line:
            assert line["fingerprint"] == seen.fingerprints[line["step"]]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["max_epochs"] == 2 and config["log_every_n_steps"] == 50


def test_the_task_is_pickled_with_its_code_for_replay(tmp_path):
    task = _task()
    _trainer(tmp_path, max_steps=2, callbacks=[Journal(tmp_path / "run")]).fit(
        task, task.init(nn.Linear(3, 1)), _data()
    )
    again = loads_code((tmp_path / "run" / "task.pkl").read_bytes())
    batch = _data()[0]
    model = nn.Linear(3, 1)
    assert torch.equal(again.loss_fn(model, batch), task.loss_fn(model, batch))


class _SaveAt(eg.Listener):
    def __init__(self, step, path):
        self.step, self.path, self.fingerprint = step, path, None

    def on_train_batch_end(self, rec):
        if rec.state.step == self.step and self.fingerprint is None:
            self.fingerprint = rec.state.fingerprint()
            return eg.Save(self.path)
        return None


def _fit_then_resume_from_step_3(tmp_path) -> _SaveAt:
    """One epoch journaled into tmp_path/run with a checkpoint at step 3, then a second fit
    resumed from it, journaling into the same run directory; returns the saving listener."""
    task, saver = _task(), _SaveAt(3, tmp_path / "ckpt")
    journal = Journal(tmp_path / "run", every_n_steps=5, fingerprint_every_n_steps=0)
    _trainer(tmp_path, max_epochs=1, callbacks=[journal, saver]).fit(
        task, task.init(nn.Linear(3, 1)), _data()
    )
    _trainer(tmp_path, max_epochs=2, callbacks=[Journal(tmp_path / "run", every_n_steps=5)]).fit(
        task, task.init(nn.Linear(3, 1)), _data(), ckpt_path=tmp_path / "ckpt"
    )
    return saver


def test_checkpoints_are_journaled_with_a_fingerprint_and_a_resume_appends(tmp_path):
    saver = _fit_then_resume_from_step_3(tmp_path)
    lines = Journal.read(tmp_path / "run")
    ckpt = str(tmp_path / "ckpt")
    assert [(x["step"], x.get("checkpoint", False), x.get("start", False)) for x in lines] == [
        (0, str(tmp_path / "run" / "start-step=0"), True),
        (3, ckpt, False),
        (5, False, False),
        (5, False, False),  # the fit's end
        (3, ckpt, True),  # the resumed fit starts from the checkpoint at step 3
        (5, False, False),  # and re-journals step 5
        (10, False, False),
        (10, False, False),  # its end
    ]
    assert [x.get("end", False) for x in lines] == [False] * 3 + [True] + [False] * 3 + [True]
    assert lines[1]["fingerprint"] == saver.fingerprint == lines[4]["fingerprint"]
    assert "fingerprint" not in lines[2]
    assert lines[2]["loss"] == lines[5]["loss"]  # the resumed step 5 is the same step 5


class _SaveAsyncAt(eg.Listener):
    def __init__(self, steps, root):
        self.steps, self.root, self.fingerprints = steps, root, {}

    def on_train_batch_end(self, rec):
        if rec.state.step in self.steps and rec.state.step not in self.fingerprints:
            self.fingerprints[rec.state.step] = rec.state.fingerprint()
            return eg.Save(self.root / f"s{rec.state.step}", asynchronous=True)
        return None


def test_an_asynchronous_checkpoint_is_journaled_once_on_disk_with_the_writers_fingerprint(
    tmp_path, monkeypatch
):
    from concurrent.futures import Future

    from engine import checkpoint

    real, hashed_on_loop = checkpoint.save_async, []
    monkeypatch.setattr(  # the loop thread hashes no state for these lines
        eg.TrainState, "fingerprint", _counting(eg.TrainState.fingerprint, hashed_on_loop)
    )

    def failing_at_step_4(state, path, **kw):
        if state.step == 4:
            failed: Future = Future()
            failed.set_exception(OSError("disk full"))
            return failed
        return real(state, path, **kw)

    monkeypatch.setattr(checkpoint, "save_async", failing_at_step_4)
    task, saver = _task(), _SaveAsyncAt({2, 4, 5}, tmp_path)
    journal = Journal(tmp_path / "run", every_n_steps=100, fingerprint_every_n_steps=0)
    # step 4's write failed: the fit ends with the error, at the driver's next check
    with pytest.raises(checkpoint.CheckpointError, match="s4"):
        _trainer(tmp_path, max_epochs=1, callbacks=[journal, saver]).fit(
            task, task.init(nn.Linear(3, 1)), _data()
        )
    lines = [x for x in Journal.read(tmp_path / "run") if "checkpoint" in x and not x.get("start")]
    # no line points at a checkpoint that is not there
    landed = [(x["step"], x["checkpoint"]) for x in lines]
    assert landed[0] == (2, str(tmp_path / "s2")) and (4, str(tmp_path / "s4")) not in landed
    assert all(Path(path).is_dir() for _, path in landed)
    for line in lines:
        assert line["fingerprint"] == saver.fingerprints[line["step"]]
    # the saver hashed the state itself; the journal added one (the start line), none for lines
    assert len(hashed_on_loop) == len(saver.fingerprints) + 1


def _counting(fn, calls):
    import threading

    def wrapped(self, *a, **k):
        if threading.current_thread() is threading.main_thread():
            calls.append(self.step)
        return fn(self, *a, **k)

    return wrapped


def test_async_saves_to_one_path_are_journaled_each_with_its_own_fingerprint(tmp_path, monkeypatch):
    # saves to "last" that land back to back (a slow disk, a long validation between batch
    # ends): each line holds the fingerprint of the state that save wrote, not the latest one
    import time

    from engine.checkpoint import _save

    real = _save._write
    monkeypatch.setattr(_save, "_write", lambda *a, **k: time.sleep(0.05) or real(*a, **k))

    class SlowValidation(eg.Listener):
        def on_validation_start(self, rec):
            time.sleep(0.4)

    task, seen = _task(), _Record()
    mc = eg.ModelCheckpoint(
        tmp_path / "ckpt",
        save_top_k=0,
        save_last=True,
        every_n_train_steps=1,
        asynchronous=True,
    )
    journal = Journal(tmp_path / "run", every_n_steps=100, fingerprint_every_n_steps=0)
    _trainer(
        tmp_path,
        max_epochs=2,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[journal, seen, SlowValidation(), mc],
    ).fit(task, task.init(nn.Linear(3, 1)), _data(), _data()[:1])
    lines = [x for x in Journal.read(tmp_path / "run") if "checkpoint" in x and not x.get("start")]
    assert [x["step"] for x in lines] == list(range(1, 11))
    for line in lines:
        assert line["fingerprint"] == seen.fingerprints[line["step"]], line["step"]


_HANGS = """
import sys, time, tempfile
from pathlib import Path
import torch, torch.nn.functional as F
import engine as eg
from engine import checkpoint, optim
from engine.listeners import Journal

from engine.checkpoint import _save
real = _save._write
_save._write = lambda *a, **k: time.sleep(0.2) or real(*a, **k)
real_async = checkpoint.save_async
root = Path(tempfile.mkdtemp())

def cancelling(state, path, **kw):  # "b" is queued behind "a": its write is cancelled
    queued = real_async(state, path, **kw)
    if Path(path).name == "b":
        assert queued.cancel()
    return queued

checkpoint.save_async = cancelling

class Refuses(eg.Listener):
    def on_save_checkpoint(self, rec):
        if Path(rec.checkpoint_path).parent == root:
            raise RuntimeError("a listener refuses this save")

class Saver(eg.Listener):
    def on_train_batch_end(self, rec):
        if rec.state.step == 2:
            return [eg.Save(root / "a", asynchronous=True), eg.Save(root / "b", asynchronous=True)]

task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
data = [(torch.randn(4, 3), torch.randn(4, 1))] * 4
listeners = [Journal(root / "run"), Refuses(), Saver()] if sys.argv[1] == "raise" else [
    Journal(root / "run"), Saver()]
trainer = eg.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=root, callbacks=listeners)
try:
    trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
except RuntimeError as e:
    print("raised:", e)
print("lines:", [x["step"] for x in Journal.read(root / "run") if "checkpoint" in x])
"""


def test_a_refused_or_cancelled_asynchronous_save_ends_the_fit_rather_than_hanging(tmp_path):
    import sys

    for case, expected in (
        ("raise", "raised: a listener refuses this save"),
        ("cancel", "lines: [0, 2]"),  # the start, and "a"; the cancelled "b" has no line
    ):
        done = _procs.run(
            [sys.executable, "-c", _HANGS, case], capture_output=True, text=True, timeout=60
        )
        assert expected in done.stdout, (case, done.stdout, done.stderr[-2000:])


def test_a_checkpoint_saved_at_train_end_after_the_journal_is_journaled(tmp_path):
    class SaveAtEnd(eg.Listener):
        def on_train_end(self, rec):
            return eg.Save(tmp_path / "end")

    task = _task()
    _trainer(tmp_path, max_epochs=1, callbacks=[Journal(tmp_path / "run"), SaveAtEnd()]).fit(
        task, task.init(nn.Linear(3, 1)), _data()
    )
    last = Journal.read(tmp_path / "run")[-1]
    assert last["checkpoint"] == str(tmp_path / "end") and last["step"] == 5


class _StepLosses(eg.Listener):
    """Each optimizer step's loss, as the step reports it (the last micro-batch's)."""

    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, rec):
        if rec.state.micro_step == 0:
            self.losses[rec.state.step] = float(rec.outputs["loss"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_journal_lines_hold_every_steps_loss_as_a_raw_rerun_computes_it(tmp_path, accumulate):
    task, seen = _task(), _StepLosses()
    journal = Journal(tmp_path / "run", every_n_steps=4)
    trainer = _trainer(
        tmp_path, max_epochs=4, accumulate_grad_batches=accumulate, callbacks=[journal, seen]
    )
    torch.manual_seed(0)
    trainer.fit(task, task.init(nn.Linear(3, 1)), _data())
    # the same steps again without a Trainer: the optimizer steps when the accumulation window
    # is full and at each epoch's last batch
    torch.manual_seed(0)
    step, state, raw = task.train_step(accumulate=accumulate), task.init(nn.Linear(3, 1)), {}
    for _ in range(4):
        for i, batch in enumerate(_data()):
            state, metrics = step(state, batch, flush=i == len(_data()) - 1)
            if state.micro_step == 0:
                raw[state.step] = float(metrics["loss"])
    lines = [x for x in Journal.read(tmp_path / "run") if "loss" in x]
    assert [x["step"] for x in lines] == list(range(4, len(raw) + 1, 4))
    for line in lines:
        first = line["step"] - 3
        assert len(line["losses"]) == 4 and line["losses"][-1] == line["loss"]
        expected = [raw[s] for s in range(first, line["step"] + 1)]
        assert [x.hex() for x in line["losses"]] == [x.hex() for x in expected]  # bitwise
        assert line["losses"] == [seen.losses[s] for s in range(first, line["step"] + 1)]


def test_a_resumed_fit_journals_the_losses_of_its_own_steps(tmp_path):
    _fit_then_resume_from_step_3(tmp_path)
    first, again, last = [x for x in Journal.read(tmp_path / "run") if "loss" in x]
    assert (first["step"], again["step"], last["step"]) == (5, 5, 10)
    assert len(first["losses"]) == 5 and len(last["losses"]) == 5
    assert again["losses"] == first["losses"][-2:]  # steps 4 and 5, re-executed after step 3


def test_non_finite_step_losses_round_trip_through_the_journal(tmp_path):
    def loss_fn(model, batch):  # a weight per batch: the loss of step 2 is infinite
        x, y, w = batch
        return F.mse_loss(model(x), y) * w

    task = eg.Task(loss_fn, optim.sgd(0.1))
    weights = [torch.tensor(1.0), torch.tensor(float("inf")), torch.tensor(1.0)]
    data = [(x, y, w) for (x, y), w in zip(_data()[:3], weights, strict=True)]
    _trainer(tmp_path, max_epochs=1, callbacks=[Journal(tmp_path / "run", every_n_steps=3)]).fit(
        task, task.init(nn.Linear(3, 1)), data
    )
    (line,) = [x for x in Journal.read(tmp_path / "run") if "loss" in x]
    finite, inf, nan = line["losses"]  # step 2's infinite gradient turns the weights NaN
    assert math.isfinite(finite) and inf == float("inf") and math.isnan(nan)
    assert math.isnan(line["loss"])


def test_the_journal_reads_losses_to_the_host_once_a_line_not_once_a_step(tmp_path, monkeypatch):
    import threading

    calls = []

    def counting(name):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, **k):
            if threading.current_thread() is threading.main_thread():
                calls.append(name)
            return real(self, *a, **k)

        return wrapped

    # the ways a value comes to Python (the start line's fingerprint hashes the state's bytes)
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))

    def syncs(journal):
        task = _task()
        calls.clear()
        _trainer(  # the Trainer logs no step: log_every_n_steps beyond the run
            tmp_path,
            max_epochs=4,
            log_every_n_steps=1000,
            enable_journal=journal is not None,
            callbacks=[journal] if journal is not None else [],
        ).fit(task, task.init(nn.Linear(3, 1)), _data())
        return len(calls)

    without = syncs(None)
    journal = Journal(tmp_path / "run", every_n_steps=5, fingerprint_every_n_steps=0)
    with_journal = syncs(journal)
    lines = [x for x in Journal.read(tmp_path / "run") if "loss" in x]
    assert len(lines) == 4 and all(len(x["losses"]) == 5 for x in lines)  # 20 steps
    assert with_journal - without <= len(lines), (with_journal, without)


def test_a_run_without_a_logger_claims_its_version_so_a_concurrent_one_takes_the_next(
    tmp_path, monkeypatch
):
    # two logger-less fits starting at once into one root both read version 0 as free; the
    # first to create it owns it, the other's journal goes to version_1 instead of sharing it
    import engine.loggers.base as base

    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)  # the other run's, just made
    monkeypatch.setattr(base, "next_version", lambda root: 0)  # read before it was made
    task = _task()
    _trainer(tmp_path, max_epochs=1).fit(task, task.init(nn.Linear(3, 1)), _data())
    assert not list((tmp_path / "lightning_logs" / "version_0").iterdir())
    assert Journal.read(tmp_path / "lightning_logs" / "version_1")[0]["start"]
