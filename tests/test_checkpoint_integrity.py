"""Every byte of a checkpoint that steers a resume is verified, and every malformed value is
refused where it enters, with an error that names the file, the key and what was expected."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
import xxhash
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import CheckpointError


def _state() -> eg.TrainState:
    torch.manual_seed(0)
    tx = optim.adamw(1e-2)
    state = eg.TrainState.create(nn.Linear(3, 2), tx, seed=11)
    step = eg.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]), tx, accumulate=2)
    for _ in range(3):  # one step and a half: grad_accum, counters and Adam's state all set
        state, _ = step(state, (torch.randn(4, 3), torch.randn(4, 2)))
    return state.replace(extra={"ema": {"w": torch.ones(2)}, "n": 3, "name": "x"})


def _template() -> eg.TrainState:
    return eg.TrainState.create(nn.Linear(3, 2), optim.adamw(1e-2)).replace(
        extra={"ema": {"w": torch.zeros(2)}, "n": 0, "name": ""}
    )


def _saved(tmp_path: Path) -> Path:
    return checkpoint.save(
        _state(),
        tmp_path / "c",
        metrics={"val/loss": 0.25, "inf": float("inf")},
        extra={"listeners": {"EarlyStopping": {"wait_count": 2, "best_score": 0.5}}},
        fingerprint=True,
    )


def _forge(path: Path, meta: dict) -> None:
    """Rewrite meta.json with ``meta`` and a checksum that matches it, as docs/checkpoints.md
    defines it (computed here, not by the engine): what a forger, not damage, would do."""
    meta = {k: v for k, v in meta.items() if k != "meta_checksum"}
    head = json.dumps(meta, indent=2, sort_keys=True)[: -len("\n}")].encode()
    tail = f',\n  "meta_checksum": "xxh3-128:{xxhash.xxh3_128(head).hexdigest()}"\n}}\n'
    (path / "meta.json").write_bytes(head + tail.encode())


QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def _fitted(tmp_path: Path) -> tuple[eg.Task, list, Path]:
    """A task, its data and a checkpoint the Trainer saved after one epoch of it."""
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    trainer = eg.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    trainer.fit(task, task.init(nn.Linear(3, 1), seed=0), data)
    return task, data, trainer.save_checkpoint(tmp_path / "c")


def test_meta_json_carries_the_xxh3_128_of_its_own_bytes(tmp_path):
    raw = (_saved(tmp_path) / "meta.json").read_bytes()
    meta = json.loads(raw)
    head, sep, rest = raw.rpartition(b',\n  "meta_checksum": "')
    assert sep and rest == meta["meta_checksum"].encode() + b'"\n}\n'
    assert meta["meta_checksum"] == "xxh3-128:" + xxhash.xxh3_128(head).hexdigest()
    assert meta["format_version"] == checkpoint.FORMAT_VERSION == 5


@pytest.mark.parametrize("bit", [0, 3, 5, 7])
def test_a_flipped_bit_anywhere_in_meta_json_is_refused(tmp_path, bit):
    path = _saved(tmp_path)
    good = (path / "meta.json").read_bytes()
    template = _template()
    assert checkpoint.load(path, template).seed == 11
    for at in range(len(good)):
        bad = bytearray(good)
        bad[at] ^= 1 << bit
        (path / "meta.json").write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=r"meta\.json"):
            checkpoint.load(path, template)
        with pytest.raises(CheckpointError, match=r"meta\.json"):
            checkpoint.read_meta(path)  # what inspect, resume and replay read


@pytest.mark.slow
def test_a_flipped_bit_anywhere_in_tensors_pt_is_refused(tmp_path):
    # every byte: zip headers, the pickle, each tensor's storage, the central directory
    path = _saved(tmp_path)
    f = path / "tensors.pt"
    good = f.read_bytes()
    template = _template()
    for at in range(0, len(good), 3 if len(good) > 6000 else 1):
        bad = bytearray(good)
        bad[at] ^= 1 << (at % 8)
        f.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=r"tensors\.pt"):
            checkpoint.load(path, template)
    f.write_bytes(good)
    assert checkpoint.load(path, template).fingerprint() == _state().fingerprint()


def test_engine_inspect_reports_a_damaged_meta_json_and_exits_1(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray((path / "meta.json").read_bytes())
    at = raw.index(b'"seed": 11') + len(b'"seed": ')
    raw[at] ^= 0x08  # 11 -> 91 ("1" is 0x31, "9" 0x39): valid JSON, another seed
    (path / "meta.json").write_bytes(bytes(raw))
    done = _procs.run(
        [sys.executable, "-m", "engine", "inspect", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "checksum check failed" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_a_resume_from_a_checkpoint_whose_seed_was_flipped_is_refused(tmp_path):
    task, data, path = _fitted(tmp_path)
    raw = bytearray((path / "meta.json").read_bytes())
    at = raw.index(b'"seed": 0') + len(b'"seed": ')
    raw[at] ^= 0x08  # 0 -> 8, the flip the issue found loading silently
    (path / "meta.json").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum check failed"):
        eg.Trainer(max_epochs=2, **QUIET).fit(
            task, task.init(nn.Linear(3, 1)), data, ckpt_path=path
        )


# --------------------------------------------------------------------------- schema

BAD_VALUES = [
    ("step", "5", "an int >= 0"),
    ("step", -1, "an int >= 0"),
    ("step", 5.0, "an int >= 0"),
    ("step", True, "an int >= 0"),
    ("epoch", None, "an int >= 0"),
    ("batch_idx", [1], "an int >= 0"),
    ("micro_step", "0", "an int >= 0"),
    ("seed", 1.5, r"an int in \[0, 2\*\*63\)"),
    ("seed", 2**63, r"an int in \[0, 2\*\*63\)"),
    ("seed", -3, r"an int in \[0, 2\*\*63\)"),
    ("num_params", "26", "an int >= 0"),
    ("fingerprint", 7, "a string or null"),
    ("has_grad_accum", "yes", "true or false"),
    ("has_grad_accum", 1, "true or false"),
    ("weights_only", 0, "true or false"),
    ("trees", [], "an object"),
    ("trees", {"extra": {}, "other": 1}, "an object"),
    ("opt_state_scalars", {"count": [1]}, "an object of numbers"),
    ("metrics", {"val/loss": "low"}, "an object of numbers"),
    ("metrics", [0.5], "an object of numbers"),
    ("extra", "listeners", "an object"),
    ("files", {"tensors.pt": 5}, "an object of checksum strings"),
    ("files", {}, "an object of checksum strings"),
    ("engine_version", 1, "a string"),
    ("torch_version", None, "a string"),
]


@pytest.mark.parametrize(("key", "value", "expected"), BAD_VALUES)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path, key, value, expected):
    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta[key] = value
    _forge(path, meta)
    with pytest.raises(CheckpointError, match=rf"meta\.json: '{key}[^']*' must be {expected}"):
        checkpoint.load(path, _template())
    with pytest.raises(CheckpointError, match=key):
        checkpoint.inspect(path)


@pytest.mark.parametrize(
    "key", ["step", "epoch", "batch_idx", "micro_step", "seed", "files", "meta_checksum"]
)
def test_a_missing_key_is_named(tmp_path, key):
    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    del meta[key]
    (path / "meta.json").write_text(json.dumps(meta))  # no checksum either: the key comes first
    with pytest.raises(CheckpointError, match=rf"meta\.json: '{key}' is missing"):
        checkpoint.load(path, _template())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "holds a JSON list, not an object"),
        ('"step"', "holds a JSON str, not an object"),
        ("", "not valid JSON"),
        ("\xff\xfe", "not valid JSON"),
        ('{"format": "other"}', "not an engine checkpoint"),
        ('{"format": "engine.checkpoint", "format_version": "3"}', r"an int >= 1 \(got '3'\)"),
        ('{"format": "engine.checkpoint", "format_version": 3.0}', r"an int >= 1 \(got 3\.0\)"),
        ('{"format": "engine.checkpoint", "format_version": 0}', r"an int >= 1 \(got 0\)"),
        ('{"format": "engine.checkpoint", "format_version": 99}', "newer than this engine"),
    ],
)
def test_malformed_metadata_is_a_checkpoint_error_in_load_and_in_the_cli(tmp_path, text, message):
    path = _saved(tmp_path)
    (path / "meta.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(path, _template())
    done = _procs.run(
        [sys.executable, "-m", "engine", "inspect", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr


def test_an_unknown_dtype_in_a_stored_tree_is_named(tmp_path):
    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["trees"]["extra"]["ema"]["w"] = {"$data": "AACAPw==", "dtype": "float33", "shape": [1]}
    _forge(path, meta)
    with pytest.raises(CheckpointError, match="'float33' is not a torch dtype"):
        checkpoint.load(path, _template())
    meta["trees"]["extra"]["ema"]["w"] = {"$tensor": "extra/nowhere"}
    _forge(path, meta)
    with pytest.raises(CheckpointError, match="'extra/nowhere': no such tensor"):
        checkpoint.load(path, _template())


def test_an_optimizer_scalar_of_another_type_is_refused(tmp_path):
    tx = optim.from_torch(torch.optim.SGD, lr=0.1)  # holds plain-number leaves
    state = eg.TrainState.create(nn.Linear(3, 2), tx)
    path = checkpoint.save(state, tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    assert meta["opt_state_scalars"] == {".started": False}
    meta["opt_state_scalars"][".started"] = "fast"
    _forge(path, meta)
    with pytest.raises(CheckpointError, match="optimizer state"):
        checkpoint.load(path, eg.TrainState.create(nn.Linear(3, 2), tx))


def test_a_forged_run_state_in_extra_is_refused_at_resume(tmp_path):
    task, data, path = _fitted(tmp_path)
    good = json.loads((path / "meta.json").read_text())
    for where, value in [("total_batch_idx", "3"), ("phase", "somewhere"), ("event", 5)]:
        meta = json.loads(json.dumps(good))
        meta["extra"]["trainer"][where] = value
        _forge(path, meta)
        with pytest.raises(CheckpointError, match=r"meta\.json: the run's state in 'extra'"):
            eg.Trainer(max_epochs=2, **QUIET).fit(
                task, task.init(nn.Linear(3, 1)), data, ckpt_path=path
            )


def test_last_passes_over_a_checkpoint_whose_meta_json_is_damaged(tmp_path):
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1)
    eg.Trainer(max_epochs=2, callbacks=[saver], **QUIET).fit(task, task.init(nn.Linear(3, 1)), data)
    newest = tmp_path / "ckpts" / "epoch=1-step=6"
    raw = bytearray((newest / "meta.json").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (newest / "meta.json").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        checkpoint.verify(newest)
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1)
    with pytest.warns(UserWarning, match=r"passing over each checkpoint .* fails verification"):
        state = eg.Trainer(max_epochs=2, callbacks=[saver], **QUIET).fit(
            task, task.init(nn.Linear(3, 1)), data, ckpt_path="last"
        )
    assert state.step == 6  # resumed at step 3, ran the second epoch again


def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')")
    for target in (tmp_path / "notes.txt", project):
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            checkpoint.save(_state(), target)
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            checkpoint.save_async(_state(), target).result()
    with pytest.raises(CheckpointError, match="only checkpoints"):
        checkpoint.remove(project)
    with pytest.raises(CheckpointError, match="cannot create the directory"):
        checkpoint.save(_state(), tmp_path / "notes.txt" / "c")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (project / "train.py").read_text() == "print('mine')"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "project"]
    (tmp_path / "empty").mkdir()  # an empty directory is replaced, as a checkpoint would be
    assert checkpoint.verify(checkpoint.save(_state(), tmp_path / "empty")) is None


# ----------------------------------------------------------------- a checkpoint's own files


@pytest.mark.parametrize("name", ["/etc/passwd", "../secret.txt", "sub/tensors.pt", "..", ""])
def test_meta_json_naming_a_file_outside_the_checkpoint_is_refused_re_signed_or_not(tmp_path, name):
    from engine.checkpoint._checksum import _checksum

    path = _saved(tmp_path)
    (tmp_path / "secret.txt").write_text("not yours")
    (path / "sub").mkdir()
    (path / "sub" / "tensors.pt").write_bytes((path / "tensors.pt").read_bytes())
    target = (path / name).resolve() if name else path
    meta = json.loads((path / "meta.json").read_text())
    sizes = meta.setdefault("sizes", {})
    if target.is_file():  # what a forger writes: the file's true checksum and size
        meta["files"][name] = _checksum(target)
        sizes[name] = target.stat().st_size
    else:
        meta["files"][name] = meta["files"]["tensors.pt"]
        sizes[name] = sizes.get("tensors.pt", 0)
    _forge(path, meta)
    for read in (
        checkpoint.read_meta,
        checkpoint.verify,
        lambda p: checkpoint.load(p, _template()),
    ):
        with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint"):
            read(path)


def _sparse(path: Path, size: int = 20 << 30) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # a hole: no disk space, but 20 GiB to read and hash
    return path


def test_a_tensors_pt_linked_to_a_file_outside_the_checkpoint_is_refused(tmp_path):
    path = _saved(tmp_path)
    outside = tmp_path / "elsewhere.pt"
    os.replace(path / "tensors.pt", outside)  # the right bytes, but not the checkpoint's
    (path / "tensors.pt").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        checkpoint.load(path, _template())
    (path / "tensors.pt").unlink()
    (path / "tensors.pt").symlink_to(_sparse(tmp_path / "huge"))
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        checkpoint.verify(path)
    assert time.monotonic() - started < 2
    (path / "tensors.pt").unlink()
    os.replace(outside, path / "inside.pt")
    (path / "tensors.pt").symlink_to("inside.pt")  # a link within the checkpoint is its own
    assert checkpoint.load(path, _template()).fingerprint() == _state().fingerprint()


def test_a_file_of_another_size_is_refused_before_it_is_hashed(tmp_path):
    path = _saved(tmp_path)
    size = (path / "tensors.pt").stat().st_size
    assert checkpoint.read_meta(path)["sizes"] == {"tensors.pt": size}
    good = (path / "tensors.pt").read_bytes()
    _sparse(path / "tensors.pt")  # a 20 GiB file in its place
    started = time.monotonic()
    with pytest.raises(
        CheckpointError,
        match=rf"{21474836480} bytes, where meta\.json records "
        rf"{size}; .* \(refused before reading it\)",
    ):
        checkpoint.load(path, _template())
    assert time.monotonic() - started < 2  # hashing it took 45 s
    (path / "tensors.pt").write_bytes(good[:-1])
    with pytest.raises(CheckpointError, match=rf"{size - 1} bytes, where meta\.json records"):
        checkpoint.verify(path)


def test_a_format_4_checkpoint_without_sizes_still_loads_its_names_checked(tmp_path):
    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["sizes"]
    meta["format_version"] = 4
    _forge(path, meta)
    assert checkpoint.load(path, _template()).fingerprint() == _state().fingerprint()
    meta["files"]["../secret.txt"] = meta["files"]["tensors.pt"]
    _forge(path, meta)
    with pytest.raises(CheckpointError, match="not a plain file name"):
        checkpoint.read_meta(path)
    del meta["files"]["../secret.txt"]
    meta["format_version"] = 5  # from version 5 the sizes must be there
    _forge(path, meta)
    with pytest.raises(CheckpointError, match="'sizes' is missing"):
        checkpoint.read_meta(path)
    meta["sizes"] = {"tensors.pt": 1, "other": 2}
    _forge(path, meta)
    with pytest.raises(CheckpointError, match="'sizes' must name the files of 'files'"):
        checkpoint.read_meta(path)
