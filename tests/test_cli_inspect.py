"""``engine inspect`` on what is not a readable engine checkpoint: one ``error:`` line, exit
status 2, never a traceback; a Lightning ``.ckpt`` is named as one, with the way in
(``checkpoint.from_lightning``)."""

from __future__ import annotations

import builtins
import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import _procs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import checkpoint, cli, optim

NOBODY = 65534


def _inspect(
    path: Path, as_user: Sequence[str] = (), **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return _procs.run(
        [*as_user, sys.executable, "-m", "engine", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        **kwargs,
    )


def _one_error_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory an unprivileged user can reach (pytest's tmp_path is private to its user)."""
    root = Path(tempfile.mkdtemp(prefix="engine-inspect-"))
    root.chmod(0o755)
    yield root
    root.chmod(0o755)  # give back what the tests took away, then remove
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(root)


def _unprivileged() -> dict[str, Any]:
    """The arguments of ``_inspect`` that drop root (for whom chmod 000 reads as usual)."""
    if os.geteuid() != 0:
        return {}
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv(1) to drop privileges: chmod 000 reads")
    as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    probe = _procs.run(
        [*as_user, sys.executable, "-c", "import engine"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if probe.returncode != 0:
        pytest.skip(f"the unprivileged user {NOBODY} cannot run this Python: {probe.stderr[-200:]}")
    return {"as_user": as_user}


def _checkpoint(root: Path) -> Path:
    state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
    path = checkpoint.save(state, root / "ckpt")
    for p in (path, *path.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return path


@pytest.mark.slow
def test_an_unreadable_file_exits_2_in_one_line(shared_dir):
    how = _unprivileged()
    target = shared_dir / "weights.ckpt"
    target.write_bytes(b"PK\x03\x04 not really")
    target.chmod(0)
    _one_error_line(_inspect(target, cwd=shared_dir, **how), "cannot be read", "ermission")


@pytest.mark.slow
def test_a_checkpoint_in_a_directory_without_permission_exits_2_in_one_line(shared_dir):
    how = _unprivileged()
    ckpt = _checkpoint(shared_dir)
    ckpt.chmod(0)  # the checkpoint directory itself
    _one_error_line(_inspect(ckpt, cwd=shared_dir, **how), "ermission")
    ckpt.chmod(0o755)
    (ckpt / checkpoint.META).chmod(0)  # its meta.json
    _one_error_line(_inspect(ckpt, cwd=shared_dir, **how), "ermission")
    (ckpt / checkpoint.META).chmod(0o644)
    shared_dir.chmod(0o311)  # a directory above it that cannot be listed or read, x only
    inner = shared_dir / "ckpt"
    assert _inspect(inner, cwd="/", **how).returncode == 0  # reachable: inspect still works
    shared_dir.chmod(0)
    _one_error_line(_inspect(inner, cwd="/", **how), "ermission")


def test_unreadable_files_inside_a_checkpoint_exit_2_with_injected_eacces(
    tmp_path, monkeypatch, capsys
):
    """Everywhere (also as root): each read of the checkpoint's files fails with EACCES."""
    ckpt = _checkpoint(tmp_path)
    real_open = io.open

    def refuse(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and str(ckpt) in os.fspath(file):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", refuse)
    monkeypatch.setattr(builtins, "open", refuse)
    assert cli.main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Permission denied" in err, err
    assert len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(os, "stat", _refusing(os.stat, str(ckpt)))  # is_dir() itself fails
    assert cli.main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot be read" in err and "Traceback" not in err


def _refusing(real: Any, inside: str) -> Any:
    def fake(path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, (str, os.PathLike)) and inside in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    return fake


def test_a_lightning_checkpoint_is_named_and_pointed_to_from_lightning(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    done = _inspect(ckpt, cwd=tmp_path)
    _one_error_line(done, "a Lightning checkpoint", f"pytorch-lightning {pl.__version__}")
    assert "engine.checkpoint.from_lightning(" in done.stderr
    # what it points to works on this file
    net = checkpoint.from_lightning(ckpt, torch.nn.Linear(4, 2))
    assert torch.equal(net.weight, module.net.weight)
    # a plain torch.save file is told apart, and so is any other file
    torch.save(module.state_dict(), tmp_path / "weights.pt")
    _one_error_line(_inspect(tmp_path / "weights.pt", cwd=tmp_path), "a torch.save file")
    (tmp_path / "notes.txt").write_text("hello")
    _one_error_line(_inspect(tmp_path / "notes.txt", cwd=tmp_path), "is a file", "meta.json")
    _one_error_line(_inspect(tmp_path / "nowhere", cwd=tmp_path), "no such file or directory")


def test_an_engine_checkpoint_still_inspects(tmp_path):
    done = _inspect(_checkpoint(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "all verify" in done.stdout
    assert stat.S_ISDIR(os.stat(tmp_path / "ckpt").st_mode)


def test_inspect_says_what_it_checked(tmp_path, capsys):
    """The checks are named, not only "checksums all verify" (a sharded checkpoint's index and
    what it holds: tests/test_checkpoint_confined.py)."""
    ckpt = _checkpoint(tmp_path)
    info = checkpoint.inspect(ckpt)
    assert [c.split(":")[0] for c in info["checked"]] == [
        "meta.json",
        "files",
        "sizes",
        "checksums",
        "tensors.pt",
    ]
    assert info["index"] is None and info["layout"] == "full"
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "checked         meta.json: its own checksum, format version and schema" in out
    assert "weights_only=True" in out and "all verify" in out


def test_inspect_a_run_directory_lists_its_parts_and_sizes(tmp_path, capsys):
    """``engine inspect RUN_DIR``: each file and checkpoint with its size and what it is, the
    pickles described from their opcodes (nothing unpickled), the journal's starts and end."""
    import json

    g = torch.Generator().manual_seed(0)
    data = DataLoader(
        TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)),
        batch_size=8,
    )
    task = eg.Task(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    trainer = eg.Trainer(
        max_epochs=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, task.init(torch.nn.Linear(4, 1)), data)
    run = trainer.run_dir
    assert cli.main(["inspect", str(run)]) == 0
    printed = capsys.readouterr().out
    assert f"run directory   {run}" in printed
    assert "fit started at step 0; last step 8; ended" in printed
    assert "data.pkl" in printed and "torch.utils.data.dataloader.DataLoader" in printed
    assert "holding tensors" in printed  # the TensorDataset's tensors are in it
    assert "model.pkl" in printed and "torch.nn.modules.linear.Linear" in printed
    assert cli.main(["inspect", str(run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    names = {f["name"]: f for f in info["files"]}
    assert names["data.pkl"]["bytes"] == (Path(run) / "data.pkl").stat().st_size
    assert info["journal"]["starts"] == [0] and info["config"]["world_size"] == 1
    assert info["bytes"] == sum(f["bytes"] for f in info["files"])
