"""The journal on a failing disk: whole lines or a clear error, never a torn line; a reader takes
a torn last line for the interrupted write it is, and replay still works."""

from __future__ import annotations

import errno
import json
import os
import sys
import uuid
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.errors import CheckpointError
from engine.listeners import Journal
from engine.listeners.journal import JournalError, JournalWriteError


def _task() -> eg.Task:
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.05), lr=0.05)


def _data(n: int = 5):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _fit(run: Path, **kw) -> eg.Trainer:
    flags = dict(
        max_epochs=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=run.parent,
        callbacks=[Journal(run, every_n_steps=1)],
    )
    flags.update(kw)
    trainer = eg.Trainer(**flags)
    task = _task()
    torch.manual_seed(0)
    trainer.fit(task, task.init(nn.Linear(3, 1), seed=3), _data())
    return trainer


def _full_after(monkeypatch, lines: int, *, partial: bool = True) -> None:
    """``os.write`` to a journal.jsonl fails with ENOSPC after ``lines`` writes, having written
    half of the bytes it was given first (a disk that fills in the middle of a line)."""
    real, calls = os.write, []

    def write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name.endswith("journal.jsonl"):
            calls.append(len(data))
            if len(calls) > lines:
                if partial and len(calls) == lines + 1:
                    return real(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_mid_line_raises_a_clear_error_and_leaves_whole_lines(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _full_after(monkeypatch, 6)
    with pytest.raises(JournalWriteError, match="the disk is full") as info:
        _fit(run)
    assert str(run / "journal.jsonl") in str(info.value)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    raw = (run / "journal.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    rows = raw.splitlines()
    assert len(rows) == 6 and all(isinstance(json.loads(r), dict) for r in rows)


def test_a_write_refused_for_permissions_names_the_cause(tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("journal.jsonl"):
            raise OSError(errno.EACCES, "Permission denied")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(JournalWriteError, match="Permission denied"):
        _fit(run)


def test_a_torn_last_line_is_an_interrupted_write_and_replay_still_runs(tmp_path):
    trainer = _fit(tmp_path / "run", enable_checkpointing=False)
    journal = Path(trainer.run_dir) / "journal.jsonl"
    rows = journal.read_bytes().splitlines(keepends=True)
    torn = b"".join(rows[:12]) + rows[12][: len(rows[12]) // 2]  # a killed fit's last write
    journal.write_bytes(torn)
    with pytest.warns(UserWarning, match=rf"{journal}: line 13, the last, is incomplete"):
        lines = Journal.read(trainer.run_dir)
    assert [x["step"] for x in lines] == list(range(12))
    with pytest.warns(UserWarning, match="line 13, the last, is incomplete"):
        report = eg.replay(trainer.run_dir, 1, 11, trust_code=True)
    assert report.identical, str(report)
    done = _procs.run(
        [sys.executable, "-m", "engine", "replay", trainer.run_dir, "--trust-code", "--to", "11"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "bitwise identical" in done.stdout and "line 13, the last, is incomplete" in done.stderr


def test_a_torn_line_before_the_last_is_an_error_naming_it(tmp_path):
    trainer = _fit(tmp_path / "run")
    journal = Path(trainer.run_dir) / "journal.jsonl"
    rows = journal.read_bytes().splitlines(keepends=True)
    rows[4] = rows[4][:10] + b"\n"
    journal.write_bytes(b"".join(rows))
    with pytest.raises(JournalError, match=r"line 5 is not a JSON object.*damaged"):
        Journal.read(trainer.run_dir)
    with pytest.raises(eg.ReplayError, match="line 5 is not a JSON object"):
        eg.replay(trainer.run_dir, trust_code=True)


def test_a_fit_appending_to_a_journal_with_a_torn_last_line_cuts_it_first(tmp_path):
    run = tmp_path / "run"
    _fit(run, max_epochs=1)
    journal = run / "journal.jsonl"
    journal.write_bytes(journal.read_bytes() + b'{"step": 6, "ep')  # a killed fit's last write
    with pytest.warns(UserWarning, match="line 8, the last, is incomplete"):
        _fit(run, max_epochs=1)
    lines = Journal.read(run)  # no warning: every line whole
    assert [x["step"] for x in lines].count(0) == 2 and lines[-1]["end"]


def test_a_real_full_disk_ends_the_fit_with_a_clear_error_and_a_readable_journal(tmp_path):
    mount = Path(f"/tmp/engine-full-disk-{uuid.uuid4().hex}")
    mount.mkdir()
    # room for the run directory's files (the task pickles to ~50 KB: its optimizer's
    # closures, the differentiable forms included) and the first lines; the fit fills the rest
    done = _procs.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"mount refused on this machine: {done.stderr.decode().strip()}")
    try:
        # the journal's next line or the start checkpoint still being written in the
        # background, whichever meets the full disk first, ends the fit saying so
        with pytest.raises((JournalWriteError, CheckpointError), match="the disk is full") as e:
            _fit(mount / "run", max_epochs=200)
        lines = Journal.read(mount / "run")  # every line whole: no warning, no error
        assert lines and lines[0]["start"]
        if e.type is JournalWriteError:
            assert len(lines) > 20  # it wrote until the disk was full
        assert (mount / "run" / "journal.jsonl").read_bytes().endswith(b"\n")
    finally:
        _procs.run(["umount", str(mount)], check=False)
        mount.rmdir()
