"""Checkpoints: exact round trips (also across processes), atomic writes, and every fault
named — damaged files, foreign models, pickled code, a full disk, interrupted saves."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import CheckpointError


def _model(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 3))


def _trained(accumulate: int = 1, calls: int = 5) -> eg.TrainState:
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, amsgrad=True))
    state = eg.TrainState.create(_model(), tx, seed=3, extra={"note": 1})
    step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx, accumulate=accumulate)
    g = torch.Generator().manual_seed(0)
    for _ in range(calls):
        batch = (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
        state, _ = step(state, batch)
    return state


def _template() -> eg.TrainState:
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, amsgrad=True))
    return eg.TrainState.create(_model(seed=99), tx)


def test_round_trip_is_bitwise_including_a_half_full_accumulation_window(tmp_path):
    state = _trained(accumulate=3, calls=7)  # 2 optimizer steps, 1 micro-batch pending
    assert state.micro_step == 1 and state.grad_accum is not None
    path = checkpoint.save(state, tmp_path / "c", metrics={"val/loss": 0.5}, fingerprint=True)
    back = checkpoint.load(path, _template())
    assert back.fingerprint() == state.fingerprint() == checkpoint.read_meta(path)["fingerprint"]
    assert (back.step, back.epoch, back.batch_idx, back.micro_step, back.seed) == (2, 0, 7, 1, 3)
    assert checkpoint.read_meta(path)["metrics"] == {"val/loss": 0.5}
    assert not back.consumed and back.module is not None


def test_a_checkpoint_written_by_another_process_loads_bitwise(tmp_path):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import _trained
        from engine import checkpoint
        s = _trained(calls=4)
        checkpoint.save(s, {str(tmp_path / "c")!r})
        print(s.fingerprint())
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    back = checkpoint.load(tmp_path / "c", _template())
    assert back.fingerprint() == out.stdout.strip().splitlines()[-1]
    assert back.fingerprint() == _trained(calls=4).fingerprint()


def test_saving_again_replaces_the_checkpoint_and_leaves_no_temporaries(tmp_path):
    checkpoint.save(_trained(calls=1), tmp_path / "c")
    newer = _trained(calls=2)
    checkpoint.save(newer, tmp_path / "c")
    assert checkpoint.load(tmp_path / "c", _template()).fingerprint() == newer.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_tensor_file_is_named_with_the_failed_check(tmp_path, damage):
    path = checkpoint.save(_trained(), tmp_path / "c")
    f = path / "tensors.pt"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensors\.pt: SHA-256 check failed"):
        checkpoint.load(path, _template())
    info = checkpoint.inspect(path)
    assert info["verified"] is False and "SHA-256" in info["problem"]


def test_damaged_or_missing_metadata_is_named(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    (path / "meta.json").write_text('{"format": "engine.checkpoint", "format_')
    with pytest.raises(CheckpointError, match=r"meta\.json: not valid JSON"):
        checkpoint.load(path, _template())
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        checkpoint.load(path, _template())


def test_a_newer_format_version_is_refused(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = checkpoint.FORMAT_VERSION + 1
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="newer than this engine reads"):
        checkpoint.load(path, _template())


class _Payload:
    """Unpickling this would create a file: the attack weights_only=True exists to stop."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_checkpoint_carrying_pickled_code_is_refused_and_nothing_runs(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"params/0.weight": _Payload(str(marker))}, buf)
    (path / "tensors.pt").write_bytes(buf.getvalue())
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["tensors.pt"] = checkpoint._sha256(path / "tensors.pt")  # a forger would
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="refused by the safe loader"):
        checkpoint.load(path, _template())
    assert not marker.exists()


def test_a_checkpoint_of_another_model_lists_what_does_not_fit(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    tx = optim.adamw(1e-2)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 3))
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, eg.TrainState.create(other, tx))
    msg = str(err.value)
    # saved: 0 Linear(4, 8), 1 BatchNorm(8), 3 Linear(8, 3); template: 0 Linear(4, 16),
    # 2 Linear(16, 3), 3 Linear(3, 3)
    assert "missing: ['2.bias', '2.weight']" in msg
    assert "unexpected: ['1.bias', '1.weight']" in msg
    assert "0.weight: checkpoint (8, 4) torch.float32, model (16, 4) torch.float32" in msg
    assert "3.weight: checkpoint (3, 8) torch.float32, model (3, 3) torch.float32" in msg


def test_a_full_disk_raises_clearly_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = _trained(calls=1)
    checkpoint.save(first, tmp_path / "c")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(CheckpointError, match="the disk is full; earlier checkpoints are intact"):
        checkpoint.save(_trained(calls=2), tmp_path / "c")
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "c", _template()).fingerprint() == first.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_leftovers_of_an_interrupted_save_are_cleaned_and_do_not_disturb(tmp_path):
    good = checkpoint.save(_trained(), tmp_path / "c")
    half = tmp_path / ".tmp-ckpt-abc123"  # what a crash between write and rename leaves
    half.mkdir()
    (half / "tensors.pt").write_bytes(b"\x00" * 10)
    assert checkpoint.clean_leftovers(tmp_path) == [half]
    assert not half.exists() and checkpoint.inspect(good)["verified"]


def test_engine_inspect_prints_the_summary_and_the_verdict(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c", metrics={"val/acc": 0.75})
    cmd = [sys.executable, "-m", "engine", "inspect", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "step            5" in out and "val/acc = 0.75" in out
    assert "checksums       all verify" in out
    info = json.loads(
        subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout
    )
    assert info["num_params"] == _trained().num_params() and info["verified"]
    (path / "tensors.pt").write_bytes(b"garbage")
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1 and "FAILED" in bad.stdout


def test_an_asynchronous_save_holds_the_state_of_the_moment_it_was_asked_for(tmp_path):
    tx = optim.adamw(1e-2)
    step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
    state = eg.TrainState.create(_model(), tx)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(20)
    ]
    state, _ = step(state, batches[0])
    expected = state.fingerprint()
    future = checkpoint.save_async(state, tmp_path / "c")
    for b in batches[1:]:  # training goes on, updating the live tensors in place
        state, _ = step(state, b)
    assert future.result() == tmp_path / "c"
    back = checkpoint.load(tmp_path / "c", eg.TrainState.create(_model(), tx))
    assert back.fingerprint() == expected != state.fingerprint()


def test_an_asynchronous_save_that_fails_reports_through_its_future(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    future = checkpoint.save_async(_trained(calls=1), tmp_path / "c")
    with pytest.raises(CheckpointError, match="disk is full"):
        future.result()
    checkpoint.wait()
