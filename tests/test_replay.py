"""Replay: a journaled run re-executes bitwise, a tampered journal or different data is caught at
the first differing step with both values, a NaN is traced to its step and its backward function,
and pickled code loads only when trusted."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.listeners import Journal


def _task() -> eg.Task:
    sched = optim.cosine_decay(0.05, 40)
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(sched), lr=sched)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.3), nn.Linear(16, 1))


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _fit(tmp_path: Path, task: eg.Task | None = None, data=None, state=None, **kw) -> eg.Trainer:
    task = task or _task()
    flags = dict(
        max_epochs=4,
        log_every_n_steps=2,
        accumulate_grad_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    flags.update(kw)
    trainer = eg.Trainer(**flags)
    state = state if state is not None else task.init(_model(), seed=7)
    trainer.fit(task, state, data if data is not None else _data())
    return trainer


def test_each_fit_writes_a_replayable_run_directory(tmp_path):
    trainer = _fit(tmp_path)
    run = Path(trainer.run_dir)
    assert run == tmp_path / "lightning_logs" / "version_0"
    assert {"journal.jsonl", "config.json", "task.pkl", "model.pkl", "data.pkl"} <= {
        p.name for p in run.iterdir()
    }
    lines = Journal.read(run)
    start = lines[0]
    assert start["start"] and start["step"] == 0 and Path(start["checkpoint"]).is_dir()
    # the model's structure is saved without its weights
    assert (run / "model.pkl").stat().st_size < 8000
    # the start checkpoint is the state the fit began with
    template = _task().init(_model(), seed=7)
    assert eg.checkpoint.load(start["checkpoint"], template).fingerprint() == start["fingerprint"]


def test_a_replay_of_the_whole_run_is_bitwise_identical(tmp_path):
    trainer = _fit(tmp_path)
    report = eg.replay(trainer.run_dir, trust_code=True)
    last = max(x["step"] for x in Journal.read(trainer.run_dir))
    assert report.identical, str(report)
    assert report.steps == last == trainer.global_step == 12
    assert report.compared >= 12  # losses, learning rates and fingerprints along the way
    assert "bitwise identical" in str(report)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_replay_starts_from_the_newest_checkpoint_before_from_step(tmp_path, asynchronous):
    saver = eg.ModelCheckpoint(
        dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1, asynchronous=asynchronous
    )
    trainer = _fit(tmp_path, callbacks=[saver])
    report = eg.replay(trainer.run_dir, 7, 9, trust_code=True)
    assert report.identical, str(report)
    assert report.start_step == 6 and Path(report.checkpoint).name.endswith("step=6")
    assert report.steps == 3  # steps 7, 8 and 9
    assert sorted(report.losses) == [7, 8, 9]


def test_replay_passes_over_weights_only_checkpoints(tmp_path):
    light = eg.ModelCheckpoint(
        dirpath=tmp_path / "light", every_n_train_steps=2, save_top_k=-1, save_weights_only=True
    )
    trainer = _fit(tmp_path, callbacks=[light])
    assert any(
        x.get("checkpoint", "").startswith(str(tmp_path / "light"))
        for x in Journal.read(trainer.run_dir)
        if isinstance(x.get("checkpoint"), str)
    )
    report = eg.replay(trainer.run_dir, 7, 9, trust_code=True)
    assert report.identical, str(report)
    assert report.start_step == 0  # the start checkpoint: the others hold no optimizer state


def test_a_journal_with_sha256_fingerprints_still_replays_and_is_checked(tmp_path):
    # engine before checkpoint format 3 journaled SHA-256 fingerprints (64 hex digits)
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=4, save_top_k=-1)
    trainer = _fit(tmp_path, callbacks=[saver])
    path = Path(trainer.run_dir) / "journal.jsonl"
    lines = Journal.read(trainer.run_dir)
    template = _task().init(_model(), seed=7)
    rewritten = 0
    for line in lines:
        if "fingerprint" in line and "checkpoint" in line:  # (the end line's stays xxh3)
            state = eg.checkpoint.load(line["checkpoint"], template)
            assert line["fingerprint"] == state.fingerprint()
            line["fingerprint"] = state.fingerprint("sha256")
            rewritten += 1
    assert rewritten >= 3  # the start and the checkpoints at steps 4, 8 and 12
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = eg.replay(trainer.run_dir, 5, 12, trust_code=True)
    assert report.identical, str(report)
    last = next(x for x in reversed(lines) if "fingerprint" in x and x["step"] == 12)
    last["fingerprint"] = "0" * 64
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = eg.replay(trainer.run_dir, 5, 12, trust_code=True)
    assert report.divergence is not None and report.divergence.step == 12
    assert report.divergence.values["fingerprint"][0] == "0" * 64


def test_a_tampered_journal_is_reported_at_its_step_with_both_values(tmp_path):
    trainer = _fit(tmp_path)
    path = Path(trainer.run_dir) / "journal.jsonl"
    lines = Journal.read(trainer.run_dir)
    target = next(x for x in lines if x["step"] == 6 and "loss" in x)
    original = target["loss"]
    target["loss"] = original * (1 + 2**-20)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert not report.identical
    assert report.divergence is not None and report.divergence.step == 6
    assert report.divergence.values["loss"] == (target["loss"], original)
    assert "step 6" in str(report) and "loss" in str(report)


def test_different_data_is_caught_at_the_first_journaled_value(tmp_path):
    trainer = _fit(tmp_path)
    other = _data()
    other[3] = (other[3][0] + 1e-3, other[3][1])  # one input, a tiny bit off
    report = eg.replay(trainer.run_dir, trust_code=True, data=other)
    assert report.divergence is not None
    # batch 3 feeds step 2 (accumulation of 2): the first journaled value after it differs
    assert report.divergence.step == 2


def test_replay_refuses_pickled_code_unless_trusted_and_runs_nothing(tmp_path):
    trainer = _fit(tmp_path)
    run = Path(trainer.run_dir)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    (run / "task.pkl").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(eg.UntrustedCodeError, match="trust_code=True"):
        eg.replay(run)
    assert not marker.exists()


def test_steps_out_of_range_and_missing_runs_are_clear_errors(tmp_path):
    trainer = _fit(tmp_path)
    with pytest.raises(eg.ReplayError, match="past the journal's last step"):
        eg.replay(trainer.run_dir, 1, 999, trust_code=True)
    with pytest.raises(eg.ReplayError, match="before from_step"):
        eg.replay(trainer.run_dir, 5, 4, trust_code=True)
    with pytest.raises(eg.ReplayError, match="not a run directory"):
        eg.replay(tmp_path / "nowhere", trust_code=True)
    shutil.rmtree(Path(trainer.run_dir) / "start-step=0")
    with pytest.raises(eg.ReplayError, match="no loadable checkpoint taken before step 3"):
        eg.replay(trainer.run_dir, 3, 4, trust_code=True)


def test_a_moved_run_directory_still_replays(tmp_path):
    trainer = _fit(tmp_path)
    moved = tmp_path / "elsewhere"
    shutil.move(trainer.run_dir, moved)
    assert eg.replay(moved, trust_code=True).identical


def _nan_task() -> eg.Task:
    def loss_fn(model, batch):
        x, y = batch
        out = model(x)
        # a square root of a quantity training drives below zero: NaN after some steps
        return F.mse_loss(out, y) + torch.sqrt(out.mean() + 3.0)

    return eg.Task(loss_fn, optim.sgd(0.05), lr=0.05)


def test_nan_hunting_finds_the_step_and_the_backward_function(tmp_path):
    data = [(x, torch.full((4, 1), -5.0)) for x, _ in _data(5)]
    trainer = _fit(
        tmp_path, task=_nan_task(), data=data, accumulate_grad_batches=1, log_every_n_steps=5
    )
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical  # NaN losses replay bitwise too
    bad = report.first_nonfinite_step
    assert bad is not None and all(v == v for s, v in report.losses.items() if s < bad)
    again = eg.replay(trainer.run_dir, bad, bad, trust_code=True, detect_anomaly=True)
    assert again.anomaly_step == bad and again.steps == bad - 1
    assert "SqrtBackward0" in again.anomaly and "loss_fn" in again.anomaly
    assert "torch.sqrt(out.mean() + 3.0)" in again.anomaly  # the forward line that did it
    assert not torch.is_anomaly_enabled()


_SCRIPT = """
import sys
import torch, torch.nn.functional as F
import engine as eg
from engine import optim

def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(6)]
task = eg.Task(loss_fn, optim.adam(0.01), lr=0.01)
trainer = eg.Trainer(max_epochs=3, log_every_n_steps=1, enable_progress_bar=False,
                     enable_model_summary=False, logger=False, default_root_dir=sys.argv[1],
                     compile=sys.argv[2:] == ["compile"])
trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
print(trainer.run_dir)
"""


def test_the_command_line_replays_a_run_without_its_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    done = _procs.run(
        [sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    run = done.stdout.strip().splitlines()[-1]
    script.unlink()  # the replay must not need it
    cli = [sys.executable, "-m", "engine", "replay", run]
    refused = _procs.run(cli, capture_output=True, text=True)
    assert refused.returncode == 2 and "--trust-code" in refused.stderr
    ok = _procs.run([*cli, "--trust-code", "--from", "4"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "bitwise identical" in ok.stdout
    Journal_path = Path(run) / "journal.jsonl"
    lines = [json.loads(x) for x in Journal_path.read_text().splitlines()]
    lines[-1]["loss"] = 123.0
    Journal_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    diverged = _procs.run([*cli, "--trust-code"], capture_output=True, text=True)
    assert diverged.returncode == 1 and "123.0" in diverged.stdout


def test_a_compiled_run_of_a_script_replays_in_a_process_without_its_globals(tmp_path):
    # The script's loss reads the global F. Its function is pickled by value and its namespace
    # named __main__; torch.compile reads an inlined function's globals from the module its
    # namespace names, which in the replaying process is another __main__ (without F).
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    done = _procs.run(
        [sys.executable, str(script), str(tmp_path / "out"), "compile"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    run = done.stdout.strip().splitlines()[-1]
    ok = _procs.run(
        [sys.executable, "-m", "engine", "replay", run, "--trust-code", "--from", "10"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "bitwise identical" in ok.stdout


def test_enable_journal_false_and_barebones_write_no_run_directory(tmp_path):
    trainer = _fit(tmp_path, enable_journal=False, enable_checkpointing=False)
    assert trainer.run_dir is None and not (tmp_path / "lightning_logs").exists()
    task = _task()
    bare = eg.Trainer(max_epochs=1, barebones=True, default_root_dir=tmp_path)
    bare.fit(task, task.init(_model()), _data())
    assert bare.run_dir is None and not (tmp_path / "lightning_logs").exists()
    with pytest.raises(ValueError, match="enable_journal"):
        eg.Trainer(barebones=True, enable_journal=True)


def test_pickled_code_keeps_its_file_and_source_lines_after_the_file_is_gone(tmp_path):
    import importlib
    import linecache
    import traceback

    from engine.checkpoint._pickling import dumps_code, loads_code

    source = tmp_path / "gone_module.py"
    source.write_text("def fail(x):\n    raise ValueError(f'bad {x}')  # the line to see\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("gone_module")
        import cloudpickle

        cloudpickle.register_pickle_by_value(module)  # as a script's own code travels
        payload = dumps_code(module.fail)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gone_module", None)
    source.unlink()
    linecache.clearcache()
    fail = loads_code(payload)
    with pytest.raises(ValueError) as info:
        fail(1)
    text = "".join(traceback.format_exception(info.value))
    assert str(source) in text and "# the line to see" in text


def test_a_pure_function_model_replays(tmp_path):
    def loss_fn(p, batch):
        x, y = batch
        return F.mse_loss(x @ p["w"] + p["b"], y[:, 0])

    task = eg.Task(loss_fn, optim.adam(0.05), lr=0.05)
    state = eg.TrainState.create({"w": torch.zeros(3), "b": torch.zeros(())}, task.tx, seed=1)
    trainer = _fit(tmp_path, task, state=state, max_epochs=3, accumulate_grad_batches=1)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical and report.steps == 18, str(report)


def test_data_too_large_to_pickle_is_left_out_and_replay_takes_it_as_an_argument(tmp_path):
    with pytest.warns(UserWarning, match="max_data_bytes"):
        trainer = _fit(  # the data pickles to ~1.5 kB
            tmp_path, max_epochs=2, callbacks=[Journal(max_data_bytes=1000)]
        )
    run = Path(trainer.run_dir)
    assert not (run / "data.pkl").exists() and (run / "task.pkl").exists()
    with pytest.raises(eg.ReplayError, match=r"replay\(\.\.\., data=\.\.\.\)"):
        eg.replay(run, trust_code=True)
    assert eg.replay(run, trust_code=True, data=_data()).identical


def _changed_at(data: list, index: int) -> list:
    other = list(data)
    x, y = other[index]
    other[index] = (x + 1e-3, y)  # one input, a tiny bit off
    return other


def _strip_step_losses(run: str | Path) -> None:
    """Rewrite the journal as an engine before per-step losses wrote it."""
    path = Path(run) / "journal.jsonl"
    lines = Journal.read(run)
    assert any("losses" in x for x in lines)
    for line in lines:
        line.pop("losses", None)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_change_between_journal_lines_is_reported_at_its_exact_step(tmp_path, accumulate):
    # lines at steps 10, 20, 30, 40; the data of step 22 alone differs at replay
    data = _data(40 * accumulate)
    trainer = _fit(
        tmp_path, data=data, max_epochs=1, log_every_n_steps=10, accumulate_grad_batches=accumulate
    )
    # the last micro-batch of step 22: the one whose loss the step reports
    other = _changed_at(data, 22 * accumulate - 1)
    report = eg.replay(trainer.run_dir, trust_code=True, data=other)
    assert report.divergence is not None, str(report)
    assert report.divergence.step == report.first_divergent_step == 22
    assert report.diverged_after == 21
    journaled, replayed = report.divergence.values["loss"]
    assert journaled != replayed and replayed == report.losses[22]
    assert report.steps == 22  # the replay stops at the divergence
    assert "first divergence at step 22" in str(report)


def test_a_changed_task_is_reported_at_the_first_step_whose_loss_differs(tmp_path):
    # a learning rate off at step 22 alone changes the update of step 22: step 23's loss
    trainer = _fit(
        tmp_path, data=_data(40), max_epochs=1, log_every_n_steps=10, accumulate_grad_batches=1
    )
    run = Path(trainer.run_dir)
    sched = optim.cosine_decay(0.05, 40)

    def off_at_22(step):
        return sched(step) * (1.5 if step == 21 else 1.0)  # the lr of the 22nd update

    from engine.checkpoint._pickling import dumps_code

    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(off_at_22), lr=sched)
    (run / "task.pkl").write_bytes(dumps_code(task))
    report = eg.replay(run, trust_code=True)
    assert report.divergence is not None and report.first_divergent_step == 23, str(report)
    assert set(report.divergence.values) == {"loss"}


def test_a_journal_without_per_step_losses_replays_and_reports_the_interval(tmp_path, capsys):
    data = _data(40)
    trainer = _fit(
        tmp_path, data=data, max_epochs=1, log_every_n_steps=10, accumulate_grad_batches=1
    )
    run = Path(trainer.run_dir)
    _strip_step_losses(run)
    same = eg.replay(run, trust_code=True)
    assert same.identical and same.steps == 40, str(same)
    assert same.diverged_after is None and same.first_divergent_step is None
    report = eg.replay(run, trust_code=True, data=_changed_at(data, 21))  # step 22's batch
    assert report.divergence is not None, str(report)
    # the first differing value is journaled at step 30; steps 21..29 hold none
    assert report.divergence.step == 30 and report.diverged_after == 20
    assert report.first_divergent_step is None
    assert "divergence lies in steps (20, 30]" in str(report)
    # the command line prints the same
    from engine.checkpoint._pickling import dumps_code
    from engine.cli import main

    (run / "data.pkl").write_bytes(dumps_code(_changed_at(data, 21)))
    assert main(["replay", str(run), "--trust-code"]) == 1
    out = capsys.readouterr().out
    assert "first difference seen at step 30" in out and "(20, 30]" in out


def test_the_interval_starts_at_the_checkpoint_the_replay_starts_from(tmp_path):
    # a checkpoint at step 25, between the lines at 20 and 30 of a journal without losses
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=25, save_top_k=-1)
    data = _data(40)
    trainer = _fit(
        tmp_path,
        data=data,
        max_epochs=1,
        log_every_n_steps=10,
        callbacks=[saver],
        accumulate_grad_batches=1,
    )
    _strip_step_losses(trainer.run_dir)
    report = eg.replay(trainer.run_dir, 26, 40, trust_code=True, data=_changed_at(data, 26))
    assert report.start_step == 25
    assert report.divergence is not None and report.divergence.step == 30
    assert report.diverged_after == 25 and "(25, 30]" in str(report)


def test_a_differing_fingerprint_alone_is_placed_after_the_last_matching_one(tmp_path):
    # every loss matches, so the state's difference lies after its last matching fingerprint
    journal = Journal(every_n_steps=10, fingerprint_every_n_steps=20)
    trainer = _fit(
        tmp_path, data=_data(40), max_epochs=1, accumulate_grad_batches=1, callbacks=[journal]
    )
    path = Path(trainer.run_dir) / "journal.jsonl"
    lines = Journal.read(trainer.run_dir)
    last = next(x for x in lines if x["step"] == 40 and "fingerprint" in x)
    last["fingerprint"] = "0" * 32
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.divergence is not None and set(report.divergence.values) == {"fingerprint"}
    assert report.divergence.step == 40 and report.diverged_after == 20
    assert report.first_divergent_step is None and "(20, 40]" in str(report)


def test_replay_names_the_step_of_a_non_finite_micro_batch_inside_a_window(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(6)]
    data[4] = (torch.full((4, 3), float("inf")), data[4][1])  # micro-batch 1 of step 3's window
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    trainer = eg.Trainer(
        max_epochs=1,
        precision="16-mixed",
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical and report.first_nonfinite_step == 3, str(report)
    assert not math.isfinite(report.first_nonfinite_loss)


def test_an_edited_loss_at_a_step_whose_loss_matched_is_named_once(tmp_path, capsys):
    """Every step's loss journaled: the line of step 30 edited in its ``loss`` alone (its
    ``losses`` still hold the true one, which the replay matches). The journal pins the
    difference to step 30 itself: said once, not as the empty interval (30, 30]."""
    trainer = _fit(
        tmp_path, data=_data(40), max_epochs=1, log_every_n_steps=10, accumulate_grad_batches=1
    )
    run = Path(trainer.run_dir)
    path = run / "journal.jsonl"
    lines = Journal.read(run)
    line = next(x for x in lines if x.get("step") == 30 and "loss" in x)
    assert line["losses"][-1] == line["loss"]
    line["loss"] += 1.0
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = eg.replay(run, trust_code=True)
    assert report.divergence is not None and report.divergence.step == 30, str(report)
    assert report.first_divergent_step == 30
    text = str(report)
    assert "first divergence at step 30" in text
    assert "divergence lies in steps" not in text and "(30, 30]" not in text
    from engine.cli import main

    assert main(["replay", str(run), "--trust-code"]) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 30" in out and "(30, 30]" not in out


def test_a_replay_computes_with_the_runs_thread_count(tmp_path):
    """A loss reduced over 2**18 elements is summed in per-thread parts: the run on one thread,
    its replay in a process now on two still computes its bits (config.json's ``threads``);
    without the recorded count (a run journaled before it) the replay differs at step 1, so
    the check can fail."""
    wide = 1 << 16

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(3, wide)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, wide, generator=g)) for _ in range(3)]
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    torch.set_num_threads(1)  # the autouse fixture gives the process's count back after
    trainer = _fit(
        tmp_path,
        task=task,
        data=data,
        state=task.init(model(), seed=7),
        max_epochs=2,
        accumulate_grad_batches=1,
        log_every_n_steps=1,
    )
    config = Path(trainer.run_dir) / "config.json"
    assert json.loads(config.read_text())["threads"] == 1
    torch.set_num_threads(2)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical, str(report)
    assert torch.get_num_threads() == 2  # the caller's count back
    recorded = json.loads(config.read_text())
    del recorded["threads"]
    config.write_text(json.dumps(recorded))
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert not report.identical and report.first_divergent_step == 1, str(report)


def test_a_recorded_thread_count_that_is_not_a_count_is_refused_naming_it(tmp_path):
    trainer = _fit(tmp_path, max_epochs=1)
    config = Path(trainer.run_dir) / "config.json"
    for bad in (0, -2, "4", 2.0, True):
        config.write_text(json.dumps({**json.loads(config.read_text()), "threads": bad}))
        with pytest.raises(eg.ReplayError, match=r"threads=.* is not a thread count"):
            eg.replay(trainer.run_dir, trust_code=True)
