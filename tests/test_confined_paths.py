"""Every path engine takes from a file stays inside the directory it belongs to (issue 24,
item 1, "treat it as a class"): a checkpoint's ``meta.json`` (not a link out of it), the
checkpoints ``ckpt_path="last"`` ranks (not links out of their directory), the paths a
ModelCheckpoint's restored state names (never loaded from or deleted outside its dirpath), and
the checkpoint paths a journal names (nothing outside the run directory is opened for a run
that is not trusted). The sharded index's paths are tests/test_checkpoint_confined.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import _meta
from engine.errors import CheckpointError

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def _task() -> eg.Task:
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))


def _data(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def test_a_meta_json_linked_to_a_file_outside_the_checkpoint_is_refused(tmp_path):
    state = _task().init(nn.Linear(3, 1))
    mine = checkpoint.save(state, tmp_path / "mine")
    other = checkpoint.save(state.replace(step=99), tmp_path / "other")  # same tensors
    (mine / "meta.json").unlink()
    (mine / "meta.json").symlink_to(other / "meta.json")
    for read in (checkpoint.read_meta, checkpoint.verify, lambda p: checkpoint.load(p, state)):
        with pytest.raises(CheckpointError, match=r"meta\.json: a symbolic link to .*outside"):
            read(mine)
    # a link to a file beside it is the checkpoint's own
    (mine / "meta.json").unlink()
    shutil.copyfile(other / "meta.json", mine / "kept.json")
    (mine / "meta.json").symlink_to("kept.json")
    assert checkpoint.read_meta(mine)["step"] == 99


def test_last_passes_over_a_link_out_of_the_checkpoint_directory(tmp_path):
    task, data = _task(), _data()
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1)
    eg.Trainer(max_epochs=1, callbacks=[saver], **QUIET).fit(task, task.init(nn.Linear(3, 1)), data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    later = checkpoint.save(task.init(nn.Linear(3, 1)).replace(step=50), elsewhere / "c")
    (tmp_path / "ckpts" / "zz-newest").symlink_to(later, target_is_directory=True)
    loaded: list[int] = []
    probe = eg.on(eg.Event.ON_LOAD_CHECKPOINT, lambda rec: loaded.append(rec.run.global_step))
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1)
    with pytest.warns(UserWarning, match=r"zz-newest \(a symbolic link to .*, outside"):
        eg.Trainer(max_epochs=2, callbacks=[saver, probe], **QUIET).fit(
            task, task.init(nn.Linear(3, 1)), data, ckpt_path="last"
        )
    assert loaded == [3]  # the directory's own newest, not the linked step 50


def _resign(path: Path, meta: dict) -> None:
    (path / "meta.json").write_bytes(_meta.encode(meta))


def test_a_resumed_model_checkpoint_never_deletes_a_path_its_state_names_outside(tmp_path):
    task = _task()
    data, val = _data(), _data(2)
    precious = checkpoint.save(task.init(nn.Linear(3, 1)), tmp_path / "precious")  # another's
    mc = eg.ModelCheckpoint(monitor="val/loss", save_top_k=1)
    trainer = eg.Trainer(max_epochs=1, callbacks=[mc], default_root_dir=tmp_path, **QUIET)
    trainer.fit(task, task.init(nn.Linear(3, 1)), data, val)
    path = Path(mc.best_model_path)
    meta = checkpoint.read_meta(path)
    evil = os.path.join(mc.dirpath, "..", "precious")  # <dirpath>/../precious
    assert Path(evil).resolve() == precious
    state = meta["extra"]["listeners"][mc.state_key]
    state.update(
        best_k_models={evil: 1e9},  # the worst score: the next save evicts (removes) it
        kth_best_model_path=evil,
        kth_value=1e9,
        best_model_path=evil,
        best_model_score=1e9,
    )
    _resign(path, meta)
    again = eg.ModelCheckpoint(monitor="val/loss", save_top_k=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        eg.Trainer(max_epochs=3, callbacks=[again], default_root_dir=tmp_path, **QUIET).fit(
            task, task.init(nn.Linear(3, 1)), data, val, ckpt_path=path
        )
    checkpoint.verify(precious)  # still there
    assert any("names paths outside its directory" in str(w.message) for w in said), [
        str(w.message) for w in said
    ]
    assert all(Path(p).parent == Path(again.dirpath) for p in again.best_k_models)


def test_an_untrusted_replay_opens_no_journaled_checkpoint_outside_the_run(tmp_path, monkeypatch):
    task = _task()
    trainer = eg.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    trainer.fit(task, task.init(nn.Linear(3, 1)), _data())
    run = Path(trainer.run_dir)
    outside = tmp_path / "outside"
    shutil.move(run / "start-step=0", outside)
    lines = (run / "journal.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["checkpoint"] = str(outside)
    (run / "journal.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    touched: list[str] = []
    for name in ("read_meta", "verify"):
        real = getattr(checkpoint, name)

        def spy(path, *args, real=real, **kwargs):
            touched.append(str(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(checkpoint, name, spy)
    with pytest.raises(eg.ReplayError, match="no loadable checkpoint"):
        eg.replay(run)
    assert not [p for p in touched if p.startswith(str(outside))], touched
    # a trusted run's journal may name its checkpoints wherever its ModelCheckpoint put them
    assert eg.replay(run, trust_code=True).identical
    assert [p for p in touched if p.startswith(str(outside))]
