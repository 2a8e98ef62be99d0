"""Every logger (and the journal) on a full disk: a clear error within seconds, never a hang.

A fit whose loggers write to a disk that fills mid-run ends with an ``OSError`` that says the
disk is full and names the file and the writer; what was written before stays readable (whole
TensorBoard records, whole CSV rows, whole journal lines), and checkpoints written elsewhere stay
intact. tensorboardX's writer thread used to die on the full disk and leave the fit waiting in
``Queue.put`` forever: each case runs in a forked child with a deadline, so a hang fails the test
(in seconds, not never). The real full disks are 300 KB tmpfs mounts (root only: skipped, saying
why, where ``mount`` is refused); the fault-injection cases (``os.write`` failing with ENOSPC)
run everywhere.
"""

from __future__ import annotations

import builtins
import csv
import errno
import glob
import math
import os
import pickle
import select
import signal
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.listeners import Journal, ModelCheckpoint
from engine.loggers import CSVLogger, TensorBoardLogger

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

DEADLINE = 60.0  # seconds a child may take; the fits below end in 1-5 s


# ---------------------------------------------------------------------- helpers


def _in_child(fn: Callable[[], Any], deadline: float = DEADLINE) -> dict[str, Any]:
    """Run ``fn`` in a forked child (this interpreter's imports, no new start-up) and return
    ``{"value": ...}`` or ``{"error": type name, "errno", "message", "seconds"}``, with the
    warnings it raised. A child that has not answered by ``deadline`` is killed and the test
    fails: that is the hang this file is about."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, then end without running pytest's exit
        os.close(r)
        start = time.monotonic()
        out: dict[str, Any]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                out = {"value": fn()}
            except BaseException as e:  # reported to the parent
                out = {"error": type(e).__name__, "errno": getattr(e, "errno", None)}
                out["message"] = str(e)
        out["seconds"] = time.monotonic() - start
        out["warnings"] = [str(x.message) for x in seen]
        data = pickle.dumps(out)
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
        os._exit(0)
    os.close(w)
    chunks, end = [], time.monotonic() + deadline
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"no answer in {deadline:.0f} s: the child hangs")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks))


@pytest.fixture
def full_disk() -> Iterator[Path]:
    """A directory on a real 300 KB tmpfs, unmounted afterwards."""
    where = Path(f"/tmp/engine-full-disk-{uuid.uuid4().hex}")
    where.mkdir()
    done = _procs.run(
        ["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        _procs.run(["umount", str(where)], check=False)
        where.rmdir()


def _records(path: str) -> list[bytes]:
    """The payloads of a TFRecord file; every record whole, both CRCs right."""
    from tensorboardX.record_writer import masked_crc32c

    data, out, i = Path(path).read_bytes(), [], 0
    while i < len(data):
        header = data[i : i + 8]
        assert len(header) == 8, f"{path}: a torn record at byte {i}"
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc32c(header)
        payload = data[i + 12 : i + 12 + length]
        tail = data[i + 12 + length : i + 16 + length]
        assert len(payload) == length and len(tail) == 4, f"{path}: a torn record at byte {i}"
        assert struct.unpack("<I", tail)[0] == masked_crc32c(payload)
        out.append(payload)
        i += 16 + length
    return out


def _scalar_steps(log_dir: str, tag: str) -> list[int]:
    from tensorboardX.proto.event_pb2 import Event

    steps = []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for raw in _records(path):
            ev = Event.FromString(raw)
            steps += [ev.step for v in ev.summary.value if v.tag == tag]
    return steps


def _csv_steps(path: str) -> list[int]:
    text = Path(path).read_text()
    assert text.endswith("\n")
    rows = list(csv.reader(text.splitlines()))
    assert all(len(r) == len(rows[0]) for r in rows), "a torn row"
    return [int(r[0]) for r in rows[1:]]


def _fit(
    root: Path, elsewhere: Path, kinds: tuple[str, ...], *, journal: bool
) -> Callable[[], Any]:
    """A fit logging every step to ``root`` with the loggers named, until something fails
    (the disk fills), checkpoints every 20 steps under ``elsewhere``."""

    def run() -> None:
        make = {"csv": lambda: CSVLogger(root), "tensorboard": lambda: TensorBoardLogger(root)}
        task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.05), lr=0.05)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]
        trainer = eg.Trainer(
            max_epochs=100_000,
            logger=[make[k]() for k in kinds],
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_journal=journal,
            default_root_dir=elsewhere,
            callbacks=[ModelCheckpoint(elsewhere / "ckpt", every_n_train_steps=20, save_top_k=-1)],
        )
        trainer.fit(task, task.init(nn.Linear(3, 1), seed=3), data)

    return run


def _every_step_from_0(steps: list[int]) -> None:
    """Rows of steps 0, 1, ... in order (an epoch's row repeats its last step), many of them:
    all that was written before the disk filled."""
    assert steps == sorted(steps) and set(steps) == set(range(steps[-1] + 1)), steps
    assert steps[-1] > 20


_WHO = {"csv": "CSVLogger", "tensorboard": "TensorBoardLogger"}


# ---------------------------------------------------------------------- a real full disk


@pytest.mark.slow
@pytest.mark.parametrize(
    "kinds", [("csv",), ("tensorboard",), ("csv", "tensorboard")], ids=["csv", "tb", "csv+tb"]
)
def test_a_logger_on_a_real_full_disk_ends_the_fit_saying_so(full_disk, tmp_path, kinds):
    out = _in_child(_fit(full_disk, tmp_path, kinds, journal=False))
    assert out.get("error") == "OSError", out
    assert out["errno"] == errno.ENOSPC
    message = out["message"]
    assert "the disk is full" in message and str(full_disk) in message, message
    assert any(message.startswith(f"[Errno 28] {_WHO[k]}: could not write ") for k in kinds)
    assert out["seconds"] < 30, out["seconds"]
    log_dir = str(full_disk / "lightning_logs" / "version_0")
    # what was written before the disk filled is all there, readable, whole
    if "tensorboard" in kinds:
        _every_step_from_0(_scalar_steps(log_dir, "train/loss"))
    if "csv" in kinds:
        _every_step_from_0(_csv_steps(os.path.join(log_dir, "metrics.csv")))
    saved = sorted((tmp_path / "ckpt").iterdir())
    assert saved, "the checkpoints elsewhere were written"
    for path in saved:
        checkpoint.verify(path)


def test_every_writer_of_the_run_on_a_real_full_disk_journal_included(full_disk, tmp_path):
    out = _in_child(_fit(full_disk, tmp_path, ("csv", "tensorboard"), journal=True))
    assert out.get("error") in ("OSError", "JournalWriteError"), out
    assert out["errno"] == errno.ENOSPC and "the disk is full" in out["message"], out
    assert any(w in out["message"] for w in ("CSVLogger", "TensorBoardLogger", "Journal"))
    run_dir = full_disk / "lightning_logs" / "version_0"
    lines = Journal.read(run_dir)  # every line whole: no warning, no error
    assert lines[0]["start"] and len(lines) > 5
    assert (run_dir / "journal.jsonl").read_bytes().endswith(b"\n")
    for path in sorted((tmp_path / "ckpt").iterdir()):
        checkpoint.verify(path)
    # the journal's checkpoint lines point at checkpoints that are whole
    for line in lines:
        if "checkpoint" in line:
            checkpoint.verify(line["checkpoint"])


# ---------------------------------------------------------------------- injected failures


def _enospc_on(
    monkeypatch: pytest.MonkeyPatch, match: str, *, after: float = math.inf
) -> Callable[[], None]:
    """``os.write`` to a file whose path holds ``match`` (opened with ``os.open``, as the
    loggers open theirs) writes half its bytes and fails with ENOSPC, from its ``after + 1``-th
    call on, or from the call of the function returned on: a disk that fills mid-record."""
    real_open, real_close, real_write = os.open, os.close, os.write
    matching: set[int] = set()
    calls: list[float] = [0, after]

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if match in os.fspath(path):
            matching.add(fd)
        return fd

    def close(fd: int) -> None:
        matching.discard(fd)
        real_close(fd)

    def write(fd: int, data: Any) -> int:
        if fd in matching:
            calls[0] += 1
            if calls[0] > calls[1]:
                real_write(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "close", close)
    monkeypatch.setattr(os, "write", write)

    def fill() -> None:
        calls[1] = calls[0]

    return fill


class _FillingFile:
    """A file opened for writing on a disk that fills: its first ``room`` writes are made,
    then ``write`` raises ENOSPC."""

    def __init__(self, f: Any, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data: Any) -> int:
        self._room -= 1
        if self._room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, close: the real file's
        return getattr(self._f, name)


def test_tensorboard_write_failing_is_an_error_in_the_caller_never_a_hang(tmp_path, monkeypatch):
    """The event file's writes fail (through ``os.write``, or through a file ``open`` gives,
    as tensorboardX's writer thread wrote): an error in the caller, within seconds."""
    real_open = builtins.open

    def opened(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        # room for the file's first event: tensorboardX writes a record in 4 calls
        return _FillingFile(f, 4) if "tfevents" in str(path) and "w" in mode else f

    def run() -> Any:
        _enospc_on(monkeypatch, "tfevents", after=1)  # the file's first event is written
        monkeypatch.setattr(builtins, "open", opened)
        lg = TensorBoardLogger(tmp_path, max_queue=3)
        for step in range(10_000):  # tensorboardX's queue held 3: this hung at step 4
            lg.log_metrics({"a": float(step)}, step=step)
        return "no error"

    out = _in_child(run)
    assert out.get("error") == "OSError" and out["errno"] == errno.ENOSPC, out
    assert "TensorBoardLogger: could not write " in out["message"]
    assert "events.out.tfevents." in out["message"] and "the disk is full" in out["message"]
    assert out["seconds"] < 10


def test_tensorboard_after_a_failed_write_keeps_whole_records_and_writes_them_later(
    tmp_path, monkeypatch
):
    fill = _enospc_on(monkeypatch, "tfevents")
    lg = TensorBoardLogger(tmp_path, max_queue=2)
    lg.log_metrics({"a": 0.0}, step=0)
    lg.save()
    fill()
    with pytest.raises(OSError, match=r"TensorBoardLogger: could not write .*the disk is full"):
        for step in range(1, 100):
            lg.log_metrics({"a": float(step)}, step=step)
    assert _scalar_steps(lg.log_dir, "a") == [0]  # the half-written records were cut back
    monkeypatch.undo()  # room again: the buffered events reach the file, in order
    lg.log_metrics({"a": 9.0}, step=step + 1)
    lg.finalize("success")
    assert _scalar_steps(lg.log_dir, "a") == list(range(step + 2))


def test_finalize_of_a_failed_run_on_a_full_disk_warns_and_closes(tmp_path, monkeypatch):
    """The Trainer finalizes every logger after the run's error: each one's own failure to
    write is a warning, so the run's error is the one raised and every logger is closed."""
    fill = _enospc_on(monkeypatch, str(tmp_path))
    loggers = [CSVLogger(tmp_path), TensorBoardLogger(tmp_path)]
    for lg in loggers:
        lg.log_hyperparams({"lr": 0.1})
        lg.log_metrics({"a": 1.0}, step=0)
    fill()
    for lg in loggers:
        with pytest.warns(UserWarning, match=rf"{type(lg).__name__}: .*the disk is full"):
            lg.finalize("failed")
    with pytest.raises(OSError, match=r"TensorBoardLogger: .*the disk is full"):
        lg = TensorBoardLogger(tmp_path, version=1)
        lg.log_metrics({"a": 1.0}, step=0)
        lg.finalize("success")  # a successful run's last write failing is its error


def test_no_writer_thread_is_left_to_wait_on(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    lg = TensorBoardLogger(tmp_path)
    lg.log_hyperparams({"lr": 0.1})
    for step in range(50):
        lg.log_metrics({"a": float(step)}, step=step)
    assert {t.ident for t in threading.enumerate()} == before
    lg.finalize("success")


def test_the_event_file_holds_what_tensorboardx_writes(tmp_path):
    """The same events written through tensorboardX's own SummaryWriter and through the
    logger's: the same records, byte for byte (but the first's wall time)."""
    from tensorboardX import SummaryWriter

    ours = TensorBoardLogger(tmp_path / "ours", name="", version="v")
    theirs = SummaryWriter(str(tmp_path / "theirs"))
    for writer in (ours.experiment, theirs):
        for step in range(30):
            writer.add_scalar("train/loss", 1.0 / (step + 1), step, walltime=1000.0 + step)
        writer.add_histogram("w", torch.arange(10.0), 3, walltime=2000.0)
        writer.add_text("note", "hello", 4, walltime=2001.0)
        writer.close()
    ours_files = glob.glob(str(tmp_path / "ours" / "v" / "events.out.tfevents.*"))
    theirs_files = glob.glob(str(tmp_path / "theirs" / "events.out.tfevents.*"))
    assert len(ours_files) == len(theirs_files) == 1
    assert Path(ours_files[0]).name.split(".")[4:] == Path(theirs_files[0]).name.split(".")[4:]
    a, b = _records(ours_files[0]), _records(theirs_files[0])
    assert len(a) == len(b) == 33 and a[1:] == b[1:]


@pytest.mark.parametrize("how", ["add_scalars", "add_hparams"])
def test_tensorboard_sub_writers_on_a_full_disk_raise_in_the_caller_never_hang(
    tmp_path, monkeypatch, how
):
    """``add_scalars`` (a writer per tag, in sub-directories) and ``add_hparams`` (a writer of
    its own) open more event files than the run's: theirs fail as the run's does."""
    real_open = builtins.open

    def opened(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        return _FillingFile(f, 4) if "tfevents" in str(path) and "w" in mode else f

    def run() -> Any:
        lg = TensorBoardLogger(tmp_path, max_queue=3)
        lg.log_metrics({"a": 0.0}, step=0)
        lg.save()
        _enospc_on(monkeypatch, "tfevents", after=0)  # full from here on
        monkeypatch.setattr(builtins, "open", opened)
        for step in range(1, 10_000):  # tensorboardX's threaded writers hung at step 4
            if how == "add_scalars":
                lg.experiment.add_scalars("loss", {"train": 1.0, "val": 2.0}, step)
            else:
                lg.experiment.add_hparams({"lr": 0.1}, {"hp/metric": float(step)}, name=str(step))
        lg.experiment.flush()
        return "no error"

    out = _in_child(run)
    assert out.get("error") == "OSError" and out["errno"] == errno.ENOSPC, out
    assert "could not " in out["message"] and "the disk is full" in out["message"], out
    assert str(tmp_path) in out["message"]
    assert out["seconds"] < 10


def test_tensorboard_sub_writers_write_what_tensorboardx_writes_on_the_callers_thread(tmp_path):
    from tensorboardX import SummaryWriter

    before = {t.ident for t in threading.enumerate()}
    ours = TensorBoardLogger(tmp_path / "ours", name="", version="v")
    for writer in (ours.experiment, None):
        if writer is None:  # tensorboardX's own, once ours is done (it starts threads)
            writer = SummaryWriter(str(tmp_path / "theirs"))
        for step in range(5):
            writer.add_scalars("loss", {"train": 1.0 / (step + 1), "val": 2.0}, step, 1000.0)
        if writer is ours.experiment:
            assert {t.ident for t in threading.enumerate()} == before  # no writer thread
        writer.add_hparams({"lr": 0.1, "layers": 2}, {"hp/acc": 0.5}, name="hp", global_step=3)
        writer.close()
    for sub in ("loss/train", "loss/val", "hp"):
        (a,) = glob.glob(str(tmp_path / "ours" / "v" / sub / "events.out.tfevents.*"))
        (b,) = glob.glob(str(tmp_path / "theirs" / sub / "events.out.tfevents.*"))
        ra, rb = _records(a), _records(b)
        assert len(ra) == len(rb) > 1
        if sub != "hp":  # the hparams writer stamps its events with the wall time
            assert ra[1:] == rb[1:], sub
