"""Loggers continue on resume (issue 27, item 3): a run killed past its last checkpoint and
resumed from it, into its own logger version, leaves ``metrics.csv`` and the TensorBoard
scalars equal to an uninterrupted run's: the rows before the checkpoint kept, the ones the
killed run wrote after it dropped (the resumed run logs them again), each step once.

A real ``kill -9`` in a fresh process, with the logs flushed at every step (the rows past the
checkpoint are on disk and must go) and with the defaults (killed between flushes: the rows
past the checkpoint never reached the disk).
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
from test_loggers import _scalars

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch, torch.nn.functional as F
    import engine as eg
    from engine import optim
    from engine.listeners import ModelCheckpoint
    from engine.loggers import CSVLogger, TensorBoardLogger

    root, kill_at, flush, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    class Killer(eg.Listener):
        def on_train_batch_end(self, rec):
            if rec.state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def loss(m, b):
        return F.mse_loss(m(b[0]), b[1])

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
    task = eg.Task(loss, optim.adamw(0.05), eval_fn=loss)
    loggers = [
        CSVLogger(root, name="exp", version=0, flush_logs_every_n_steps=flush),
        TensorBoardLogger(root, name="exp", version=0, **({"max_queue": 1} if flush == 1 else {})),
    ]
    trainer = eg.Trainer(
        max_steps=16, log_every_n_steps=1, logger=loggers, default_root_dir=root,
        enable_progress_bar=False, enable_model_summary=False, val_check_interval=4,
        callbacks=[Killer(), ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)],
    )
    state = trainer.fit(
        task, task.init(torch.nn.Linear(4, 1)), data, data[:2],
        ckpt_path=None if resume == "-" else resume,
    )
    print("DONE", state.step, os.path.basename(trainer.ckpt_path or "-"), flush=True)
    """
)


def _fit(tmp: Path, root: Path, *, kill_at: int, flush: int, resume: str = "-"):
    script = tmp / "fit.py"
    script.write_text(SCRIPT)
    return _procs.run(
        [sys.executable, str(script), str(root), str(kill_at), str(flush), resume],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    done = _fit(tmp, tmp / "runs", kill_at=-1, flush=100)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "runs" / "exp" / "version_0"


@pytest.mark.parametrize("flush", [1, 100], ids=["flushed-every-step", "killed-between-flushes"])
def test_a_killed_run_resumed_into_its_own_version_logs_each_step_once(tmp_path, reference, flush):
    root = tmp_path / "runs"
    killed = _fit(tmp_path, root, kill_at=13, flush=flush)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    log_dir = root / "exp" / "version_0"
    rows = (log_dir / "metrics.csv").read_text().splitlines()
    if flush == 1:  # the killed run's rows past its last checkpoint (step 10) are on disk
        assert any(r.startswith("12,") for r in rows), rows
    before = sorted(p.name for p in log_dir.glob("events.out.tfevents.*"))

    resumed = _fit(tmp_path, root, kill_at=-1, flush=flush, resume="last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split()[-2:] == ["16", "epoch=1-step=10"], resumed.stdout
    assert "is being replaced" not in resumed.stderr
    assert "exists and is not empty" not in resumed.stderr

    # the CSV, byte for byte: the same rows, values, columns and header
    assert (log_dir / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()
    # the TensorBoard scalars: every (step, value) of every tag once, as uninterrupted
    assert _scalars(str(log_dir)) == _scalars(str(reference))
    after = sorted(p.name for p in log_dir.glob("events.out.tfevents.*"))
    assert after[: len(before)] == before or len(after) == len(before) + 1


def test_a_resume_into_another_version_leaves_the_first_ones_log_alone(tmp_path):
    """``ckpt_path=`` from another logger version: that version's log is not touched, the new
    one starts empty at the resume point (today's behaviour, Lightning's too)."""
    from engine.loggers import CSVLogger

    first = CSVLogger(tmp_path, name="exp", version=0)
    for step in range(4):
        first.log_metrics({"loss": float(step)}, step)
    state = first.state_dict()
    text = Path(first.metrics_file).read_text()
    other = CSVLogger(tmp_path, name="exp", version=1)
    other.load_state_dict(state)
    other.log_metrics({"loss": 9.0}, 4)
    other.finalize("success")
    assert Path(first.metrics_file).read_text() == text
    assert Path(other.metrics_file).read_text() == "step,loss\n4,9.0\n"


def test_csv_resume_keeps_the_rows_before_the_checkpoint_and_their_columns(tmp_path):
    from engine.loggers import CSVLogger

    lg = CSVLogger(tmp_path, name="exp", version=0)
    lg.log_metrics({"loss": 1.0}, 0)
    lg.log_metrics({"loss": 0.5, "val": 2.0}, 1)
    state = lg.state_dict()  # written, and counted: 2 rows
    assert state == {"log_dir": os.path.realpath(lg.log_dir), "rows": 2}
    lg.log_metrics({"loss": 0.25, "extra": 3.0}, 2)  # past the checkpoint: a new column
    lg.finalize("success")

    again = CSVLogger(tmp_path, name="exp", version=0)
    again.load_state_dict(state)
    assert Path(again.metrics_file).read_text() == "step,loss,val\n0,1.0,\n1,0.5,2.0\n"
    again.log_metrics({"loss": 0.125}, 2)
    again.log_metrics({"loss": 0.0625}, None)  # numbered after the kept rows
    again.finalize("success")
    assert Path(again.metrics_file).read_text() == (
        "step,loss,val\n0,1.0,\n1,0.5,2.0\n2,0.125,\n3,0.0625,\n"
    )


def test_csv_resume_onto_a_shorter_file_keeps_it_and_says_so(tmp_path):
    from engine.loggers import CSVLogger

    lg = CSVLogger(tmp_path, name="exp", version=0)
    for step in range(3):
        lg.log_metrics({"loss": float(step)}, step)
    state = lg.state_dict()
    Path(lg.metrics_file).write_text("step,loss\n0,0.0\n")  # cut by hand
    again = CSVLogger(tmp_path, name="exp", version=0)
    with pytest.warns(UserWarning, match="holds 1 rows, fewer than the 3"):
        again.load_state_dict(state)
    again.log_metrics({"loss": 3.0}, 3)
    again.finalize("success")
    assert Path(again.metrics_file).read_text() == "step,loss\n0,0.0\n3,3.0\n"


def test_tensorboard_resume_cuts_back_and_removes_what_came_after(tmp_path):
    from engine.loggers import TensorBoardLogger

    lg = TensorBoardLogger(tmp_path, name="exp", version=0)
    for step in range(3):
        lg.log_metrics({"loss": float(step)}, step)
    state = lg.state_dict()
    lg.log_metrics({"loss": 99.0}, 3)  # after the checkpoint, in the same file
    lg.finalize("success")
    lg.log_metrics({"loss": 98.0}, 4)  # and in a file opened after it
    lg.finalize("success")
    assert len(list(Path(lg.log_dir).glob("events.out.tfevents.*"))) == 2

    again = TensorBoardLogger(tmp_path, name="exp", version=0)
    again.load_state_dict(state)
    assert _scalars(again.log_dir) == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0)]}
    again.log_metrics({"loss": 3.0}, 3)
    again.finalize("success")
    assert _scalars(again.log_dir) == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]}


def test_a_logger_without_state_is_left_as_before(tmp_path):
    """A logger of the user's own (only ``log_metrics``) is not asked for a state; one built
    on :class:`engine.loggers.Logger` records nothing by default."""
    from engine.loggers import Logger

    class Printer(Logger):
        def log_metrics(self, metrics, step):
            pass

    lg = Printer(tmp_path)
    assert lg.state_dict() == {}
    lg.load_state_dict({"log_dir": lg.log_dir})  # nothing to do


def test_test_after_fit_does_not_cut_the_fits_log(tmp_path):
    """Only a fit continues a log: ``test(ckpt_path=...)`` from an early checkpoint appends
    its row after the whole fit's rows."""
    import torch
    import torch.nn.functional as F

    import engine as eg
    from engine import optim
    from engine.listeners import ModelCheckpoint
    from engine.loggers import CSVLogger

    def loss(m, b):
        return F.mse_loss(m(b[0]), b[1])

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    task = eg.Task(loss, optim.sgd(0.1), eval_fn=loss)
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    trainer = eg.Trainer(
        max_steps=8,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, version=0),
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver],
    )
    state = trainer.fit(task, task.init(torch.nn.Linear(4, 1)), data)
    fitted = _rows(trainer.logger.metrics_file)
    first = sorted(Path(saver.dirpath).glob("*step=2*"))[0]
    trainer.test(task, state, data, ckpt_path=first)
    rows = _rows(trainer.logger.metrics_file)
    assert len(rows) == len(fitted) + 1 and "test/loss" in rows[-1]
    assert [{k: v for k, v in r.items() if k != "test/loss"} for r in rows[:-1]] == fitted


def _rows(path: str) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))
