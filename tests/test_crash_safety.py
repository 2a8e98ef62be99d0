"""Checkpoints under a crashing machine: a process killed at any instant of a save, a
replacement or a deletion loses no completed checkpoint, leaves nothing damaged under a
checkpoint's name, and leaves only what ``clean_leftovers`` removes.

Two kinds of kill: deterministic ones, at every line the save executes in engine's checkpoint
code and in ``shutil`` (a forked child ends itself with ``os._exit`` there, as SIGKILL would:
no cleanup, no ``finally``), and SIGKILLs at random instants of a real fit with a top-k
``ModelCheckpoint``.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import _procs
import pytest
import torch
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import _cleanup, _files, _load, _lock, _meta, _read, _report, _save, _weights

KILLED = 77
pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork"),
    pytest.mark.budget(
        share=0.14,
        why="a kill at every line of nine save, replace and delete paths: about a thousand "
        "forked children, each directory verified and cleaned after (60-80 s)",
    ),
]


def _state(scale: float) -> eg.TrainState:
    torch.manual_seed(0)
    state = eg.TrainState.create(nn.Linear(4, 3), optim.adam(1e-2), seed=3)
    return state.replace(params={k: v * scale for k, v in state.params.items()})


OLD, NEW, TEMPLATE = _state(1.0), _state(2.0), _state(0.0)
PRINTS = {OLD.fingerprint(): "old", NEW.fingerprint(): "new"}
# the checkpoint package's code of saving, removing and cleaning (once engine/checkpoint.py) and
# the files and meta.json it writes
TRACED = {
    m.__file__
    for m in (checkpoint, _save, _cleanup, _lock, _read, _load, _weights, _report, _files, _meta)
} | {shutil.__file__}


def _start_killed_at(line: int, operation: Callable[[], object]) -> int:
    """Start ``operation`` in a forked child that dies (``os._exit``) when it reaches the
    ``line``-th line executed in :data:`TRACED`, on any thread; returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        count = 0
        lock = threading.Lock()

        def tracer(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename not in TRACED:
                return None
            if event == "line":
                with lock:
                    count += 1
                    if count == line:
                        os._exit(KILLED)
            return tracer

        threading.settrace(tracer)
        sys.settrace(tracer)
        try:
            operation()
            checkpoint.wait()
        except BaseException:
            os._exit(1)
        os._exit(0)
    return pid


def _died(pid: int) -> bool:
    """Whether the child :func:`_start_killed_at` started died at its line (``False``: the
    operation finished first)."""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, KILLED), f"the operation failed in the child (exit status {code})"
    return code == KILLED


def _visible(root: Path) -> dict[str, str]:
    """What is under a checkpoint's name in ``root``: every one must verify."""
    found = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith(_files._TMP_PREFIX):
            continue
        info = checkpoint.inspect(p)
        assert info["verified"], f"{p.name} is visible and damaged: {info['problem']}"
        found[p.name] = PRINTS[checkpoint.load(p, TEMPLATE).fingerprint()]
    return found


def _every_crash(
    root: Path,
    prepare: Callable[[Path], object],
    operation: Callable[[Path], object],
    allowed: list[dict[str, str]],
) -> tuple[int, set[tuple[tuple[str, str], ...]]]:
    """In a directory made by ``prepare``, kill ``operation`` at each of its lines in turn
    (a fresh directory each time); after each kill what is visible must verify, and after
    ``clean_leftovers`` the directory must hold one of ``allowed`` exactly. Returns the number
    of lines and the outcomes seen. The kills run one per CPU at a time, each in its own
    directory, the directories of one batch checked while the next batch runs (the lines past
    the end are more runs that finish)."""
    seen = set()
    width = max(1, min(4, len(os.sched_getaffinity(0))))
    finished = None  # the first line the operation got past: it finished
    running: list[tuple[int, Path, int]] = []
    line = 1
    while True:
        started = []
        while finished is None and len(started) < width:
            setup = root / f"run{line}"
            setup.mkdir()
            prepare(setup)
            started.append((line, setup, _start_killed_at(line, lambda s=setup: operation(s))))
            line += 1
        for n, setup, pid in running:  # the batch before, checked while this one runs
            died = _died(pid)
            _visible(setup)  # before any cleaning: nothing damaged under a real name
            checkpoint.clean_leftovers(setup)
            after = _visible(setup)
            assert sorted(p.name for p in setup.iterdir()) == sorted(after), "leftovers remain"
            assert after in allowed, f"killed at line {n}: {after}"
            seen.add(tuple(sorted(after.items())))
            shutil.rmtree(setup)
            if not died and finished is None:
                finished = n
        if not started:
            assert finished is not None
            return finished, seen
        running = started


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt", "last", "step=3"])
@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_replacement_killed_at_any_line_keeps_the_old_or_the_new_checkpoint(tmp_path, name, how):
    save = checkpoint.save if how == "sync" else checkpoint.save_async
    lines, seen = _every_crash(
        tmp_path,
        lambda d: checkpoint.save(OLD, d / name),
        lambda d: save(NEW, d / name),
        [{name: "old"}, {name: "new"}],
    )
    assert lines > 20 and seen == {((name, "old"),), ((name, "new"),)}  # both outcomes happened


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_new_save_killed_at_any_line_leaves_it_whole_or_absent_and_the_others_intact(
    tmp_path, how
):
    save = checkpoint.save if how == "sync" else checkpoint.save_async
    _, seen = _every_crash(
        tmp_path,
        lambda d: checkpoint.save(OLD, d / "other"),
        lambda d: save(NEW, d / "c"),
        [{"other": "old"}, {"other": "old", "c": "new"}],
    )
    assert len(seen) == 2


@pytest.mark.slow
def test_a_deletion_killed_at_any_line_leaves_the_whole_checkpoint_or_nothing(tmp_path):
    lines, seen = _every_crash(
        tmp_path,
        lambda d: (checkpoint.save(OLD, d / "doomed"), checkpoint.save(NEW, d / "kept")),
        lambda d: checkpoint.remove(d / "doomed"),
        [{"doomed": "old", "kept": "new"}, {"kept": "new"}],
    )
    assert lines > 10 and len(seen) == 2  # killed inside the recursive delete too


def test_remove_takes_files_links_and_missing_paths(tmp_path):
    target = checkpoint.save(OLD, tmp_path / "c")
    (tmp_path / "link").symlink_to(target)
    checkpoint.remove(tmp_path / "link")  # the link, not what it points to
    assert checkpoint.inspect(target)["verified"]
    (tmp_path / "file").write_text("x")
    checkpoint.remove(tmp_path / "file")
    checkpoint.remove(tmp_path / "missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_save_to_a_path_a_pending_write_is_replacing_is_not_refused(tmp_path, monkeypatch):
    """An asynchronous save to "last" checks the target while the writer thread replaces the
    previous "last" (moved aside between two renames): a directory gone when it is listed was
    a checkpoint, not something engine must refuse to replace."""
    state = eg.TrainState.create(nn.Linear(3, 2), optim.sgd(0.1))
    target = checkpoint.save(state, tmp_path / "last")
    listdir = os.listdir

    def moved_aside(path):
        if Path(path) == target:
            raise FileNotFoundError(path)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", moved_aside)
    _files._replaceable(target)  # no error
    monkeypatch.setattr(os, "listdir", listdir)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match=r"no meta\.json, not a checkpoint"):
        _files._replaceable(tmp_path / "data")


def test_a_save_to_a_path_listed_while_its_old_checkpoint_is_deleted_aside_is_not_refused(
    tmp_path, monkeypatch
):
    """The main thread's check of an asynchronous save to "last" lists the old "last" while the
    writer thread replaces it: renames it aside, puts the new one in place, deletes the old one
    (its meta.json first), so the listing may hold its files without meta.json. The path names
    another directory by then: it was a checkpoint being replaced (a full-suite run met this)."""
    state = eg.TrainState.create(nn.Linear(3, 2), optim.sgd(0.1))
    target = checkpoint.save(state, tmp_path / "last")
    fresh = checkpoint.save(state, tmp_path / "fresh")
    listdir = os.listdir

    def replaced_while_listed(path):
        names = listdir(path)
        if Path(path) == target:
            os.replace(target, tmp_path / "aside")
            os.replace(fresh, target)
            return [n for n in names if n != "meta.json"]  # read as the deletion went on
        return names

    monkeypatch.setattr(os, "listdir", replaced_while_listed)
    _files._replaceable(target)  # no error
    monkeypatch.setattr(os, "listdir", listdir)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")  # the same listing, nothing replaced
    with pytest.raises(checkpoint.CheckpointError, match=r"no meta\.json, not a checkpoint"):
        _files._replaceable(tmp_path / "data")


# --------------------------------------------------------------------------- random SIGKILLs

_FIT = textwrap.dedent("""
    import sys, torch, torch.nn.functional as F
    import engine as eg
    from engine import optim

    root, asynchronous = sys.argv[1], sys.argv[2] == "async"

    class Report(eg.Listener):
        # each checkpoint the fit saved, once it is written: its name and step
        pending = []  # synchronous saves: written once the next event comes

        def on_save_checkpoint(self, rec):
            self.flush()
            if rec.checkpoint_future is None:  # it is written after this event
                self.pending.append((rec.checkpoint_path, rec.state.step))
            else:
                rec.checkpoint_future.add_done_callback(
                    lambda f, p=rec.checkpoint_path, s=rec.state.step: f.exception()
                    or print(f"landed {p} {s}", flush=True)
                )

        def on_train_batch_start(self, rec):
            self.flush()

        def flush(self):
            for path, step in self.pending:
                print(f"landed {path} {step}", flush=True)
            self.pending.clear()

    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adam(1e-2))
    saver = eg.ModelCheckpoint(dirpath=root, monitor="train/loss", save_top_k=2, save_last=True,
                               every_n_train_steps=1, asynchronous=asynchronous)
    print("ready", flush=True)
    eg.Trainer(max_epochs=10**6, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_journal=False,
               callbacks=[saver, Report()]).fit(task, task.init(torch.nn.Linear(8, 1)), data)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "async"])
def test_sigkill_at_random_instants_of_a_top_k_fit_loses_nothing_completed(tmp_path, how):
    rng = random.Random(0)
    for run in range(4):
        root = tmp_path / f"run{run}"
        child = _procs.Popen(
            [sys.executable, "-c", _FIT, str(root), how],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.3, 1.5))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        landed = [line.split() for line in out.splitlines() if line.startswith("landed")]
        assert landed, "the child saved nothing before it was killed; kill later"
        # the run died holding the directory: its lock is left, and taken over by the next
        assert (root / checkpoint.RUN_LOCK).is_file()
        for p in root.iterdir():  # before cleaning: what is under a name verifies
            if not p.name.startswith(_files._TMP_PREFIX) and p.name != checkpoint.RUN_LOCK:
                assert checkpoint.inspect(p)["verified"], p
        checkpoint.clean_leftovers(root)
        on_disk = {p.name: checkpoint.inspect(p) for p in root.iterdir()}
        assert all(info["verified"] for info in on_disk.values())
        assert not any(n.startswith(_files._TMP_PREFIX) for n in on_disk)
        # "last" holds the newest step it landed with, or a later one being written
        last_step = max(int(step) for _, path, step in landed if Path(path).name == "last")
        assert on_disk["last"]["step"] >= last_step
        assert 2 <= len(on_disk) <= 4  # last, the top 2, and one whose deletion was pending
