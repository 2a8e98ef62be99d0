"""What fails while saving says so: a full disk, an unreadable checkpoint, two runs in one
checkpoint directory. Faults are injected (``ENOSPC`` / ``EACCES`` on the write and read paths)
everywhere, and a real full disk (a 1 MiB tmpfs) is used where the machine lets us mount one."""

from __future__ import annotations

import builtins
import errno
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import CheckpointError, _save

QUIET = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_journal=False
)


def _batches(n: int, seed: int, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, width, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


TRAIN, VAL = _batches(3, 1), _batches(1, 2)


def _mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _task() -> eg.Task:
    return eg.Task(_mse, optim.adamw(1e-2), eval_fn=lambda m, b: {"val/loss": _mse(m, b)})


def _model(width: int = 8, hidden: int = 512) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def _fit(
    root: Path, listeners: list, *, max_epochs: int, ckpt_path: str | None = None, **kw
) -> eg.Trainer:
    trainer = eg.Trainer(
        default_root_dir=root, callbacks=listeners, max_epochs=max_epochs, **(QUIET | kw)
    )
    task = _task()
    trainer.fit(task, task.init(_model()), TRAIN, VAL, ckpt_path=ckpt_path)
    return trainer


def _named(mc: eg.ModelCheckpoint) -> set[str]:
    """Every checkpoint the listener's bookkeeping names."""
    return {
        p
        for p in (mc.best_model_path, mc.last_model_path, mc.kth_best_model_path, *mc.best_k_models)
        if p
    }


def _assert_names_only_landed_checkpoints(mc: eg.ModelCheckpoint) -> None:
    named = _named(mc)
    assert mc.best_k_models, "nothing landed before the disk filled: make the disk larger"
    for path in named:
        checkpoint.verify(path)  # on disk, whole, every checksum matching
    assert mc.best_model_path in mc.best_k_models
    assert mc.best_model_score == mc.best_k_models[mc.best_model_path]
    assert mc.best_model_score == min(mc.best_k_models.values())


class _FullDisk:
    """A disk that holds ``size`` bytes of checkpoint files: ``engine.checkpoint``'s writes
    past that raise ``OSError(ENOSPC)``, as ``write(2)`` does on a full file system."""

    def __init__(self, size: int) -> None:
        self.size, self.used = size, 0

    def open(self, file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115  # closed by the writer
        return _Filling(f, self, os.fspath(file)) if "w" in mode else f


class _Filling:
    def __init__(self, f, disk: _FullDisk, name: str) -> None:
        self._f, self._disk, self._name = f, disk, name

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if self._disk.used + n > self._disk.size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)
        self._disk.used += n
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _checkpoint_size(tmp_path: Path) -> int:
    state = _task().init(_model())
    path = checkpoint.save(state, tmp_path / "probe")
    size = sum(f.stat().st_size for f in path.iterdir())
    checkpoint.remove(path)
    return size


# ----------------------------------------------------------------- a full disk, injected


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_on_a_full_disk_fails_the_fit_and_the_ranking_names_only_landed_checkpoints(
    tmp_path, monkeypatch, asynchronous
):
    disk = _FullDisk(int(2.5 * _checkpoint_size(tmp_path)))  # two saves fit, the third fails
    monkeypatch.setattr(_save, "open", disk.open, raising=False)
    mc = eg.ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="val/loss", save_top_k=5, asynchronous=asynchronous
    )
    with pytest.raises(CheckpointError) as raised:
        _fit(tmp_path, [mc], max_epochs=12)
    message = str(raised.value)
    assert "the disk is full" in message
    assert str(tmp_path / "ckpts" / "epoch=") in message  # the checkpoint that failed
    if asynchronous:
        assert "asynchronous" in message
    monkeypatch.undo()
    assert len(mc.best_k_models) == 2
    _assert_names_only_landed_checkpoints(mc)
    assert {Path(p).name for p in _named(mc)} == {p.name for p in (tmp_path / "ckpts").iterdir()}


def test_a_failed_asynchronous_save_surfaces_at_the_next_event_not_only_at_the_end(
    tmp_path, monkeypatch
):
    disk = _FullDisk(int(1.5 * _checkpoint_size(tmp_path)))  # the second save fails
    monkeypatch.setattr(_save, "open", disk.open, raising=False)
    epochs: list[int] = []

    class Epochs(eg.Listener):
        def on_train_epoch_start(self, rec):
            epochs.append(rec.run.current_epoch)
            checkpoint.wait()  # the background write has ended by this event's check

    mc = eg.ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="val/loss", save_top_k=-1, asynchronous=True
    )
    with pytest.raises(CheckpointError, match=r"asynchronous save .*epoch=1-step=6"):
        _fit(tmp_path, [mc, Epochs()], max_epochs=50)
    assert epochs in ([0, 1], [0, 1, 2])  # stopped at the first check after the save failed
    assert list(mc.best_k_models) == [str(tmp_path / "ckpts" / "epoch=0-step=3")]
    _assert_names_only_landed_checkpoints(mc)


def test_a_failed_save_of_last_keeps_the_previous_last_named_and_intact(tmp_path, monkeypatch):
    mc = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    _fit(tmp_path / "first", [mc], max_epochs=2)
    last = tmp_path / "ckpts" / "last"
    template = _task().init(_model())
    before = checkpoint.load(last, template).fingerprint()
    disk = _FullDisk(int(1.5 * _checkpoint_size(tmp_path)))  # the latest is written, not last
    monkeypatch.setattr(_save, "open", disk.open, raising=False)
    mc = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    with pytest.raises(CheckpointError, match=r"previous checkpoint at .*last is intact"):
        _fit(tmp_path / "second", [mc], max_epochs=3, ckpt_path="last")  # saves last again
    monkeypatch.undo()
    assert mc.last_model_path == str(last)
    assert checkpoint.load(last, template).fingerprint() == before


def test_a_synchronous_save_on_a_full_disk_is_a_checkpoint_error_not_torchs_runtime_error(
    tmp_path, monkeypatch
):
    small = eg.TrainState.create(nn.Linear(4, 3), optim.adam(1e-2), seed=1)
    previous = checkpoint.save(small, tmp_path / "c")
    saved = {k: v.clone() for k, v in small.params.items()}
    big = eg.TrainState.create(nn.Linear(256, 256), optim.adam(1e-2), seed=2)
    monkeypatch.setattr(_save, "open", _FullDisk(100_000).open, raising=False)
    with pytest.raises(CheckpointError) as raised:
        checkpoint.save(big, tmp_path / "c")
    message = str(raised.value)
    assert "inline_container" not in message and "unexpected pos" not in message
    assert "the disk is full" in message
    assert f"the previous checkpoint at {previous} is intact" in message
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    back = checkpoint.load(previous, eg.TrainState.create(nn.Linear(4, 3), optim.adam(1e-2)))
    assert back.fingerprint() == small.fingerprint()
    assert all(torch.equal(back.params[k], t) for k, t in saved.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary files left


# ----------------------------------------------------------------- a full disk, for real


@pytest.mark.parametrize("asynchronous", [False, True])
def test_top_k_saves_on_a_real_full_disk_fail_the_fit_and_name_only_what_landed(
    tmp_path, tiny_disk, asynchronous
):
    mc = eg.ModelCheckpoint(
        dirpath=tiny_disk / "ckpts",
        monitor="val/loss",
        save_top_k=30,
        save_last=True,
        asynchronous=asynchronous,
    )
    trainer = eg.Trainer(default_root_dir=tmp_path, callbacks=[mc], max_epochs=30, **QUIET)
    task = _task()
    with pytest.raises(CheckpointError, match="the disk is full") as raised:
        trainer.fit(task, task.init(_model(hidden=1024)), TRAIN, VAL)  # ~130 kB a checkpoint
    assert str(tiny_disk / "ckpts") in str(raised.value)
    assert "unexpected pos" not in str(raised.value)
    _assert_names_only_landed_checkpoints(mc)
    leftovers = [p.name for p in (tiny_disk / "ckpts").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_real_full_disk_keeps_the_previous_checkpoint_bitwise(tiny_disk):
    small = eg.TrainState.create(nn.Linear(16, 16), optim.adam(1e-2), seed=1)
    previous = checkpoint.save(small, tiny_disk / "c")
    bits = (previous / "tensors.pt").read_bytes(), (previous / "meta.json").read_bytes()
    big = eg.TrainState.create(nn.Linear(512, 512), optim.adam(1e-2), seed=2)  # 3 MB
    with pytest.raises(CheckpointError, match="the disk is full") as raised:
        checkpoint.save(big, tiny_disk / "c")
    assert f"the previous checkpoint at {previous} is intact" in str(raised.value)
    assert ((previous / "tensors.pt").read_bytes(), (previous / "meta.json").read_bytes()) == bits
    back = checkpoint.load(previous, eg.TrainState.create(nn.Linear(16, 16), optim.adam(1e-2)))
    assert back.fingerprint() == small.fingerprint()
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["c"]
    with pytest.raises(CheckpointError, match="the disk is full"):  # and in the background
        checkpoint.save_async(big, tiny_disk / "d").result()
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["c"]


# ----------------------------------------------------------------- ckpt_path="last"


def _saved_run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A fit's checkpoint directory with the checkpoints of steps 3 and 6."""
    dirpath = tmp_path / "ckpts"
    _fit(tmp_path, [eg.ModelCheckpoint(dirpath=dirpath, save_top_k=-1)], max_epochs=2)
    return dirpath, dirpath / "epoch=0-step=3", dirpath / "epoch=1-step=6"


def _resume_last(tmp_path: Path, dirpath: Path) -> eg.Trainer:
    trainer = eg.Trainer(
        default_root_dir=tmp_path,
        callbacks=[eg.ModelCheckpoint(dirpath=dirpath, save_top_k=-1)],
        max_epochs=2,
        **QUIET,
    )
    task = _task()
    trainer.fit(task, task.init(_model()), TRAIN, VAL, ckpt_path="last")
    return trainer


def test_last_passes_over_a_checkpoint_whose_tensors_cannot_be_read(tmp_path, monkeypatch):
    dirpath, older, newest = _saved_run(tmp_path)
    denied = str(newest / "tensors.pt")
    real_open = builtins.open

    def no_permission(file, *args, **kwargs):
        if os.fspath(file) == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_permission)
    with pytest.warns(UserWarning, match="Permission denied") as seen:
        trainer = _resume_last(tmp_path, dirpath)
    assert trainer.ckpt_path == str(older)
    assert any(str(newest) in str(w.message) for w in seen)


def test_last_passes_over_a_checkpoint_directory_that_cannot_be_entered(tmp_path, monkeypatch):
    dirpath, older, newest = _saved_run(tmp_path)
    real_stat = pathlib.Path.stat

    def no_permission(self, *args, **kwargs):
        if self.parent == newest:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", no_permission)
    with pytest.warns(UserWarning, match="Permission denied") as seen:
        trainer = _resume_last(tmp_path, dirpath)
    assert trainer.ckpt_path == str(older)
    assert any(str(newest) in str(w.message) for w in seen)


def test_last_that_finds_nothing_names_the_directories_it_searched(tmp_path):
    dirpath = tmp_path / "nowhere"
    with pytest.warns(UserWarning, match="no valid checkpoint") as seen:
        trainer = _resume_last(tmp_path, dirpath)
    assert trainer.ckpt_path is None and trainer.global_step == 6
    message = next(str(w.message) for w in seen if "no valid checkpoint" in str(w.message))
    assert str(dirpath) in message
    assert str(tmp_path / "checkpoints") in message


# ----------------------------------------------------------------- two runs, one dirpath

_RUN = textwrap.dedent("""
    import os, sys, time, torch, torch.nn.functional as F
    import engine as eg
    from engine import optim

    dirpath, root, mode = sys.argv[1:4]

    class Hold(eg.Listener):
        def on_train_batch_end(self, rec):
            if mode == "hold":
                print("holding", flush=True)
                time.sleep(0.05)

    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    mc = eg.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = eg.Trainer(max_epochs=10**6 if mode == "hold" else 2, default_root_dir=root,
                         callbacks=[mc, Hold()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_journal=False)
    try:
        trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
    except eg.checkpoint.CheckpointError as e:
        print("refused:", e, flush=True)
        sys.exit(3)
    print("done", trainer.global_step, flush=True)
""")


def _run(tmp_path: Path, dirpath: Path, mode: str, **kw) -> subprocess.Popen:
    return _procs.Popen(
        [sys.executable, "-c", _RUN, str(dirpath), str(tmp_path / uuid.uuid4().hex), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        **kw,
    )


def test_a_second_live_run_in_a_checkpoint_directory_is_refused_and_a_dead_ones_lock_taken(
    tmp_path,
):
    dirpath = tmp_path / "shared"
    first = _run(tmp_path, dirpath, "hold")
    try:
        assert first.stdout.readline().strip() == "holding", first.stderr.read()
        lock = dirpath / checkpoint.RUN_LOCK
        owner = json.loads(lock.read_text())
        assert (owner["pid"], owner["host"]) == (first.pid, socket.gethostname())
        second = _run(tmp_path, dirpath, "short")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 3, err
        assert str(dirpath) in out and f"pid {first.pid}" in out and socket.gethostname() in out
        assert "refused" in out
        assert "done" not in out  # refused before its first step
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    # the first run died holding the lock: its file is left, naming a dead pid
    assert json.loads((dirpath / checkpoint.RUN_LOCK).read_text())["pid"] == first.pid
    third = _run(tmp_path, dirpath, "short")
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0, out + err
    assert out.strip() == "done 4"
    assert not (dirpath / checkpoint.RUN_LOCK).exists()  # released at the end of its fit


def test_a_run_owns_its_checkpoint_directory_while_it_fits_and_releases_it_after(tmp_path):
    dirpath = tmp_path / "ckpts"
    seen = []

    class Look(eg.Listener):
        def on_train_batch_end(self, rec):
            seen.append(json.loads((dirpath / checkpoint.RUN_LOCK).read_text()))

    # two ModelCheckpoints of one run may share a directory
    savers = [
        eg.ModelCheckpoint(dirpath=dirpath, monitor="val/loss", filename="best"),
        eg.ModelCheckpoint(dirpath=dirpath, save_top_k=-1),
    ]
    _fit(tmp_path, [*savers, Look()], max_epochs=1)
    assert seen and {(s["pid"], s["host"]) for s in seen} == {(os.getpid(), socket.gethostname())}
    assert not (dirpath / checkpoint.RUN_LOCK).exists()

    class Boom(eg.Listener):
        def on_train_batch_end(self, rec):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, [eg.ModelCheckpoint(dirpath=dirpath), Boom()], max_epochs=1)
    assert not (dirpath / checkpoint.RUN_LOCK).exists()  # released on the exception too


def test_a_stale_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = int(
        _procs.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    (dirpath / checkpoint.RUN_LOCK).write_text(
        json.dumps({"pid": dead, "host": socket.gethostname(), "started": "then"})
    )
    mc = eg.ModelCheckpoint(dirpath=dirpath)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _fit(tmp_path, [mc], max_epochs=1)
    # a lock file alone is not another run's checkpoints
    assert not [w for w in seen if "not empty" in str(w.message)]
    assert os.path.isdir(mc.best_model_path)
    assert not (dirpath / checkpoint.RUN_LOCK).exists()


def test_a_lock_refusal_is_quick_and_names_the_owner(tmp_path):
    dirpath = tmp_path / "ckpts"
    holder = _procs.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from engine import checkpoint\n"
            "lock = checkpoint._RunLock(sys.argv[1]); lock.acquire(); print('held', flush=True)\n"
            "time.sleep(60)",
            str(dirpath),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(CheckpointError) as raised:
            _fit(tmp_path, [eg.ModelCheckpoint(dirpath=dirpath)], max_epochs=1)
        assert time.monotonic() - started < 30
        message = str(raised.value)
        assert str(dirpath) in message and f"pid {holder.pid}" in message
        assert "another dirpath" in message
    finally:
        holder.kill()
        holder.communicate()
