"""A fit checks every directory it will write before its first step
(``engine.checkpoint._writable``): a read-only or forbidden one is an error naming it and the
flag that set it, not an ``OSError`` at the first save after N steps of work.

Tests run as root, where permission bits do not stop a write: the read-only case is a real
read-only tmpfs (skipped where ``mount`` is refused), the forbidden one an injected ``EACCES``.
"""

from __future__ import annotations

import errno
import os
import tempfile

import _procs
import pytest
import torch
import torch.nn.functional as F

import engine as eg
import engine.checkpoint._writable as writable
from engine import optim
from engine.listeners import ModelCheckpoint
from engine.loggers import CSVLogger, TensorBoardLogger

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "max_epochs": 1}


@pytest.fixture
def read_only(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    done = _procs.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield where
    _procs.run(["umount", str(where)], check=True)


def _fit(calls=None, **flags):
    """A fit counting its steps in ``calls``; returns the number the loss function ran."""
    calls = [] if calls is None else calls

    def loss_fn(m, b):
        calls.append(1)
        return F.mse_loss(m(b[0]), b[1])

    task = eg.Task(loss_fn, optim.sgd(0.1))
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
    eg.Trainer(**QUIET, **flags).fit(task, task.init(torch.nn.Linear(2, 1)), data)
    return len(calls)


def _cases(bad, good):
    return {
        "default_root_dir": ({"default_root_dir": bad / "runs"}, "Trainer(default_root_dir="),
        "ModelCheckpoint.dirpath": (
            {"default_root_dir": good, "callbacks": [ModelCheckpoint(dirpath=bad / "ckpt")]},
            "ModelCheckpoint(dirpath=",
        ),
        "CSVLogger.save_dir": (
            {"default_root_dir": good, "logger": CSVLogger(bad)},
            "CSVLogger(save_dir=",
        ),
        "TensorBoardLogger.save_dir": (
            {"default_root_dir": good, "logger": TensorBoardLogger(bad / "tb")},
            "TensorBoardLogger(save_dir=",
        ),
    }


CASES = [
    "default_root_dir",
    "ModelCheckpoint.dirpath",
    "CSVLogger.save_dir",
    "TensorBoardLogger.save_dir",
]


@pytest.mark.parametrize("case", CASES)
def test_a_read_only_directory_is_refused_before_the_first_step(read_only, tmp_path, case):
    flags, flag = _cases(read_only, tmp_path / "ok")[case]
    steps: list[int] = []
    with pytest.raises(OSError, match="read-only") as caught:
        _fit(steps, **flags)
    message = str(caught.value)
    assert flag in message and str(read_only) in message and "before any step" in message
    assert caught.value.errno == errno.EROFS
    assert steps == []  # refused before training, not after it


@pytest.mark.parametrize("case", CASES)
def test_a_forbidden_directory_is_refused_before_the_first_step(tmp_path, monkeypatch, case):
    bad = tmp_path / "forbidden"
    bad.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir).startswith(str(bad)):
            raise PermissionError(errno.EACCES, "Permission denied", dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(writable.tempfile, "mkstemp", mkstemp)
    flags, flag = _cases(bad, tmp_path / "ok")[case]
    calls_before: list[int] = []
    with pytest.raises(PermissionError, match="permission denied") as caught:
        _fit(calls_before, **flags)
    assert flag in str(caught.value) and str(bad) in str(caught.value)
    assert calls_before == []


def test_a_file_where_a_directory_goes_is_named(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(NotADirectoryError, match=r"ModelCheckpoint\(dirpath=.*taken.* is a file"):
        _fit(
            default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "taken" / "c")]
        )


def test_writable_directories_pass_and_nothing_is_left_behind(tmp_path):
    assert _fit(default_root_dir=tmp_path / "new", logger=CSVLogger(tmp_path / "logs")) == 3
    leftovers = [p for p in tmp_path.rglob(".engine-write-check-*")]
    assert leftovers == []
