"""ModelCheckpoint through the real Trainer: which checkpoints exist on disk after ``fit``.

Expected rankings come from an independent record (a small listener that reads
``trainer.callback_metrics`` at each validation), not from ModelCheckpoint's own bookkeeping;
the last tests run the same configurations through Lightning's ModelCheckpoint and compare the
names it leaves on disk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from datetime import timedelta
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from _trainer_kit import _linear

import engine as eg
from engine import checkpoint, optim

N_BATCHES = 4  # training batches per epoch: epoch e ends at global step 4 * (e + 1)


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


TRAIN, VAL = _batches(N_BATCHES, seed=1), _batches(2, seed=2)
# heavy momentum makes the validation loss go up and down over epochs:
# about [0.51, 5.34, 7.22, 2.22, 0.72, 0.48] for epochs 0..5, so rankings are not by recency
LR, MOMENTUM = 0.05, 0.95


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _task() -> eg.Task:
    return eg.Task(_mse, optim.sgd(LR, momentum=MOMENTUM))


def _trainer(root: Path, listeners: list, **kw) -> eg.Trainer:
    kw = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False} | kw
    return eg.Trainer(default_root_dir=root, callbacks=listeners, **kw)


def _fit(root: Path, listeners: list, val=VAL, ckpt_path=None, **kw) -> eg.Trainer:
    trainer = _trainer(root, listeners, **kw)
    task = _task()
    trainer.fit(task, task.init(_linear()), TRAIN, val, ckpt_path=ckpt_path)
    return trainer


class ValLosses(eg.Listener):
    """The independent record: ``(epoch, global_step, val/loss)`` after each validation."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float]] = []

    def on_validation_end(self, rec):
        if rec.stage == "fit" and not rec.run.sanity_checking:
            t = rec.run
            self.rows.append((t.current_epoch, t.global_step, t.callback_metrics["val/loss"]))


def _on_disk(mc: eg.ModelCheckpoint) -> set[str]:
    assert mc.dirpath is not None
    return {p.name for p in Path(mc.dirpath).iterdir()} if os.path.isdir(mc.dirpath) else set()


def _name(epoch: int, step: int) -> str:
    return f"epoch={epoch}-step={step}"


def _step_of(path: str | Path) -> int:
    return checkpoint.read_meta(path)["step"]


# ------------------------------------------------------------------------- when it saves


@pytest.mark.parametrize("top_k", [-1, 1])
def test_every_n_train_steps_saves_every_n_optimizer_steps(tmp_path, top_k):
    mc = eg.ModelCheckpoint(every_n_train_steps=2, save_top_k=top_k)
    _fit(tmp_path, [mc], max_epochs=3)
    assert mc.dirpath == str(tmp_path / "checkpoints")
    saved = {_name((s - 1) // N_BATCHES, s) for s in range(2, 13, 2)}
    # without a monitor, save_top_k=1 keeps only the latest
    assert _on_disk(mc) == (saved if top_k == -1 else {_name(2, 12)})
    for name in _on_disk(mc):
        assert _step_of(Path(mc.dirpath) / name) == int(name.rsplit("=", 1)[1])
    assert mc.best_model_path == str(tmp_path / "checkpoints" / _name(2, 12))


@pytest.mark.parametrize(
    "every_n_epochs, check_val_every_n_epoch", [(2, 1), (1, 2)], ids=["every_2", "val_every_2"]
)
def test_epoch_wise_saves_follow_every_n_epochs_and_the_validation_schedule(
    tmp_path, every_n_epochs, check_val_every_n_epoch
):
    # (2, 1): saves at the end of every second training epoch; (1, 2): saves after each
    # validation, which runs every second epoch (Lightning's rule for save_on_train_epoch_end)
    mc = eg.ModelCheckpoint(every_n_epochs=every_n_epochs, save_top_k=-1)
    _fit(tmp_path, [mc], max_epochs=5, check_val_every_n_epoch=check_val_every_n_epoch)
    assert _on_disk(mc) == {_name(1, 8), _name(3, 16)}


def test_train_time_interval_zero_saves_after_every_step_and_an_hour_never(tmp_path):
    every = eg.ModelCheckpoint(tmp_path / "a", train_time_interval=timedelta(0), save_top_k=-1)
    never = eg.ModelCheckpoint(tmp_path / "b", train_time_interval=timedelta(hours=1))
    _fit(tmp_path, [every, never], max_epochs=2)
    assert _on_disk(every) == {_name((s - 1) // N_BATCHES, s) for s in range(1, 9)}
    assert _on_disk(never) == set()


def test_nothing_is_saved_under_fast_dev_run_or_outside_fit(tmp_path):
    mc = eg.ModelCheckpoint(every_n_train_steps=1, save_last=True)
    trainer = _fit(tmp_path, [mc], fast_dev_run=2)
    assert _on_disk(mc) == set()
    task = _task()
    trainer = _trainer(tmp_path, [mc], max_epochs=1)
    trainer.validate(task, task.init(_linear()), VAL, verbose=False)
    assert _on_disk(mc) == set()


def test_dirpath_defaults_to_the_loggers_directory(tmp_path):
    mc = eg.ModelCheckpoint()
    _fit(tmp_path, [mc], max_epochs=1, logger=eg.CSVLogger(tmp_path))
    # Lightning's <save_dir>/<name>/<version>/checkpoints
    assert mc.dirpath == str(tmp_path / "lightning_logs" / "version_0" / "checkpoints")
    assert _on_disk(mc) == {_name(0, 4)}


# ------------------------------------------------------------------------- top k


@pytest.mark.parametrize("mode", ["min", "max"])
def test_monitor_keeps_the_k_best_and_deletes_the_rest(tmp_path, mode):
    record, mc = ValLosses(), eg.ModelCheckpoint(monitor="val/loss", mode=mode, save_top_k=2)
    _fit(tmp_path, [record, mc], max_epochs=6)
    assert len(record.rows) == 6 and len({round(v, 3) for *_, v in record.rows}) == 6
    ranked = sorted(record.rows, key=lambda r: r[2], reverse=mode == "max")
    best, second = ranked[0], ranked[1]
    assert _on_disk(mc) == {_name(best[0], best[1]), _name(second[0], second[1])}
    root = Path(mc.dirpath)
    assert mc.best_model_path == str(root / _name(best[0], best[1]))
    assert mc.best_model_score == pytest.approx(best[2])
    assert mc.kth_best_model_path == str(root / _name(second[0], second[1]))
    assert mc.kth_value == pytest.approx(second[2])
    assert set(mc.best_k_models) == {mc.best_model_path, mc.kth_best_model_path}
    # the best checkpoint holds the state of its step
    meta = checkpoint.read_meta(mc.best_model_path)
    assert meta["step"] == best[1] and meta["epoch"] == best[0]
    assert meta["metrics"]["val/loss"] == pytest.approx(best[2])
    task = _task()
    state = checkpoint.load(mc.best_model_path, task.init(_linear()))
    assert state.step == best[1]


def test_save_top_k_minus_one_keeps_every_epoch(tmp_path):
    record, mc = ValLosses(), eg.ModelCheckpoint(monitor="val/loss", save_top_k=-1)
    _fit(tmp_path, [record, mc], max_epochs=4)
    assert _on_disk(mc) == {_name(e, s) for e, s, _ in record.rows}
    assert mc.best_model_score == pytest.approx(min(v for *_, v in record.rows))
    assert len(mc.best_k_models) == 4


@pytest.mark.parametrize("top_k", [1, 0])
def test_save_last_keeps_a_last_checkpoint(tmp_path, top_k):
    mc = eg.ModelCheckpoint(save_last=True, save_top_k=top_k)
    _fit(tmp_path, [mc], max_epochs=3)
    # with save_top_k=0 nothing else is saved, and "last" is written once when training ends
    assert _on_disk(mc) == ({"last", _name(2, 12)} if top_k else {"last"})
    assert mc.last_model_path == str(Path(mc.dirpath) / "last")
    assert _step_of(mc.last_model_path) == 12


def test_save_last_moves_only_with_a_top_k_save_as_in_lightning(tmp_path):
    # Lightning 2.x writes last.ckpt only at steps where a top-k checkpoint was saved
    record = ValLosses()
    mc = eg.ModelCheckpoint(monitor="val/loss", save_top_k=1, save_last=True)
    _fit(tmp_path, [record, mc], max_epochs=3)  # val/loss about 0.51, 5.34, 7.22
    first = record.rows[0]
    assert min(record.rows, key=lambda r: r[2]) == first
    assert _on_disk(mc) == {"last", _name(first[0], first[1])}
    assert _step_of(mc.last_model_path) == first[1]


def test_two_checkpoint_listeners_keep_separate_states(tmp_path):
    steps = eg.ModelCheckpoint(tmp_path / "steps", every_n_train_steps=2)
    best = eg.ModelCheckpoint(tmp_path / "best", monitor="val/loss")
    assert steps.state_key != best.state_key
    _fit(tmp_path, [steps, best], max_epochs=2)
    saved = checkpoint.read_meta(best.best_model_path)["extra"]["listeners"]
    assert saved[best.state_key]["best_model_path"] == best.best_model_path
    assert saved[steps.state_key]["dirpath"] == str(tmp_path / "steps")


def test_state_dict_is_json_and_round_trips_through_a_checkpoint(tmp_path):
    mc = eg.ModelCheckpoint(monitor="val/loss", save_top_k=3)
    _fit(tmp_path, [mc], max_epochs=1)
    json.dumps(mc.state_dict())  # plain values only (inf is JSON-encoded by the checkpoint)
    saved = checkpoint.read_meta(mc.best_model_path)["extra"]["listeners"][mc.state_key]
    assert saved == mc.state_dict()
    assert saved["kth_value"] == math.inf  # fewer than k kept: nothing to beat yet


def test_a_nan_score_ranks_last(tmp_path):
    def eval_fn(model, batch):
        return {"loss": _mse(model, batch), "score": torch.tensor(float("nan"))}

    mc = eg.ModelCheckpoint(monitor="val/score", mode="max", save_top_k=1)
    trainer = _trainer(tmp_path, [mc], max_epochs=3)
    task = eg.Task(_mse, optim.sgd(LR, momentum=MOMENTUM), eval_fn=eval_fn)
    trainer.fit(task, task.init(_linear()), TRAIN, VAL)
    # the first NaN is kept as -inf (nothing better yet); later ones do not beat it
    assert _on_disk(mc) == {_name(0, 4)}
    assert mc.best_model_score == -math.inf


# ------------------------------------------------------------------------- names


def test_filename_templates_render_metric_values_without_subdirectories(tmp_path):
    record = ValLosses()
    named = eg.ModelCheckpoint(
        tmp_path / "named", filename="{epoch:02d}-{val/loss:.3f}", monitor="val/loss", save_top_k=-1
    )
    bare = eg.ModelCheckpoint(
        tmp_path / "bare",
        filename="e{epoch}-{val/loss:.2f}",
        monitor="val/loss",
        save_top_k=-1,
        auto_insert_metric_name=False,
    )
    _fit(tmp_path, [record, named, bare], max_epochs=3)
    assert _on_disk(named) == {f"epoch={e:02d}-val_loss={v:.3f}" for e, _, v in record.rows}
    assert _on_disk(bare) == {f"e{e}-{v:.2f}" for e, _, v in record.rows}
    for mc in (named, bare):
        for name in _on_disk(mc):
            assert (Path(mc.dirpath) / name / checkpoint.META).is_file()


def test_a_metric_that_does_not_fit_the_format_spec_is_named():
    mc = eg.ModelCheckpoint(filename="{epoch}-{val/loss:d}")
    with pytest.raises(ValueError, match=r"val/loss = 0.5 does not format as \{val/loss:d\}"):
        mc.format_checkpoint_name({"epoch": 1, "val/loss": 0.5})


@pytest.mark.parametrize("counter", [True, False])
def test_version_counter_on_name_collisions(tmp_path, counter):
    # every top-k save renders the same name (without a monitor, as in Lightning, the latest
    # checkpoint replaces the previous one under its own name instead)
    mc = eg.ModelCheckpoint(
        filename="ckpt", monitor="val/loss", save_top_k=-1, enable_version_counter=counter
    )
    _fit(tmp_path, [mc], max_epochs=3)
    root = Path(mc.dirpath)
    if counter:
        assert _on_disk(mc) == {"ckpt", "ckpt-v1", "ckpt-v2"}
        assert [_step_of(root / n) for n in ("ckpt", "ckpt-v1", "ckpt-v2")] == [4, 8, 12]
    else:
        assert _on_disk(mc) == {"ckpt"} and _step_of(root / "ckpt") == 12


# ------------------------------------------------------------------------- errors


def test_a_missing_monitor_raises_naming_it_and_the_available_metrics(tmp_path):
    mc = eg.ModelCheckpoint(monitor="val/los")
    with pytest.raises(RuntimeError, match=r"'val/los'.*'val/loss'"):
        _fit(tmp_path, [mc], max_epochs=2)


def test_a_missing_monitor_without_validation_warns_and_saves_nothing(tmp_path):
    # Lightning's rule: an error only once a validation has run (the metric should exist then)
    mc = eg.ModelCheckpoint(monitor="val/loss")
    with pytest.warns(UserWarning, match="'val/loss'"):
        _fit(tmp_path, [mc], val=None, max_epochs=2)
    assert _on_disk(mc) == set()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mode": "mean"}, "'min' or 'max'"),
        ({"save_top_k": -2}, "save_top_k must be an int >= -1"),
        ({"save_top_k": 2}, "nothing to rank by"),
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, "mutually exclusive"),
        ({"every_n_epochs": -1}, "every_n_epochs must be an int >= 0"),
        ({"save_last": "yes"}, "save_last"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        eg.ModelCheckpoint(**kwargs)


# ------------------------------------------------------------------------- resume


def test_ckpt_path_best_and_last_resolve_through_the_listener(tmp_path):
    record = ValLosses()
    mc = eg.ModelCheckpoint(tmp_path / "custom", monitor="val/loss", save_top_k=2)
    trainer = _fit(tmp_path, [record, mc], max_epochs=3)
    best = min(record.rows, key=lambda r: r[2])
    newest = max(_step_of(p) for p in mc.best_k_models)
    task = _task()
    [result] = trainer.validate(task, task.init(_linear()), VAL, ckpt_path="best", verbose=False)
    assert result["val/loss"] == pytest.approx(best[2], rel=1e-5)

    # "last": the newest checkpoint in the listener's dirpath (not default_root_dir/checkpoints)
    seen = []
    probe = eg.on(eg.Event.ON_LOAD_CHECKPOINT, lambda rec: seen.append(rec.run.global_step))
    fresh = eg.ModelCheckpoint(tmp_path / "custom", monitor="val/loss", save_top_k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the directory is not empty; resuming mid-epoch
        _fit(tmp_path, [fresh, probe], max_epochs=3, ckpt_path="last")
    assert seen == [newest]


def test_top_k_state_survives_a_resume_and_later_saves_respect_k(tmp_path):
    kw = {"monitor": "val/loss", "save_top_k": 2, "save_last": True}
    first, mc1 = ValLosses(), eg.ModelCheckpoint(**kw)
    _fit(tmp_path, [first, mc1], max_epochs=3)
    before = dict(mc1.best_k_models)
    resumed_at = _step_of(mc1.last_model_path)  # "last" is rewritten by the resumed run

    second, mc2 = ValLosses(), eg.ModelCheckpoint(**kw)
    restored = []
    probe = eg.on(eg.Event.ON_FIT_START, lambda rec: restored.append(dict(mc2.best_k_models)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(tmp_path, [second, mc2, probe], max_epochs=6, ckpt_path=mc1.last_model_path)
    assert restored == [before]

    # the resumed run validates the epochs after the checkpoint; rank everything seen
    rows = [r for r in first.rows if r[1] <= resumed_at] + second.rows
    assert [r[0] for r in rows] == list(range(6))
    ranked = sorted(rows, key=lambda r: r[2])[:2]
    expected = {_name(e, s) for e, s, _ in ranked}
    assert set(map(os.path.basename, mc2.best_k_models)) == expected
    assert _on_disk(mc2) == expected | {"last"}  # run 1's checkpoints that fell out are gone
    assert mc2.best_model_score == pytest.approx(ranked[0][2])


# ------------------------------------------------------------------------- Lightning


class _Lightning:
    """The same model, optimizer and batches through Lightning's Trainer and ModelCheckpoint."""

    def __init__(self) -> None:
        self.pl = pytest.importorskip("pytorch_lightning")
        for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
            logging.getLogger(name).setLevel(logging.ERROR)

    def module(self):
        class Module(self.pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = _linear()

            def training_step(self, batch, batch_idx):
                return _mse(self.layer, batch)

            def validation_step(self, batch, batch_idx):
                self.log("val/loss", _mse(self.layer, batch))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        return Module()

    def fit(self, root: Path, trainer_kwargs: dict, mc_kwargs: dict, ckpt_path=None):
        """Fit; the ModelCheckpoint, and the checkpoint names it left (without ``.ckpt``)."""
        from torch.utils.data import DataLoader, TensorDataset

        def loader(batches):
            xs, ys = zip(*batches, strict=True)
            return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)

        mc = self.pl.callbacks.ModelCheckpoint(dirpath=root, **mc_kwargs)
        trainer = self.pl.Trainer(
            callbacks=[mc],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            **trainer_kwargs,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(self.module(), loader(TRAIN), loader(VAL), ckpt_path=ckpt_path)
        return mc, {p.name.removesuffix(".ckpt") for p in root.iterdir()}


def _base(path: str) -> str:
    return os.path.basename(path).removesuffix(".ckpt")


# (Trainer kwargs, ModelCheckpoint kwargs); val/loss goes up and down over the epochs
LIGHTNING_CONFIGS = {
    "every_3_steps": ({"max_epochs": 3}, {"every_n_train_steps": 3, "save_top_k": -1}),
    "every_2_epochs": ({"max_epochs": 5}, {"every_n_epochs": 2, "save_top_k": -1}),
    "top_2": ({"max_epochs": 6}, {"monitor": "val/loss", "save_top_k": 2, "save_last": True}),
    "top_1_every_2_epochs": (
        {"max_epochs": 4},
        {"monitor": "val/loss", "every_n_epochs": 2, "save_last": True},
    ),
    "top_0_last": ({"max_epochs": 3}, {"save_top_k": 0, "save_last": True}),
    # step-wise saves with a validation metric: deferred until validation has produced it
    "top_2_every_3_steps": (
        {"max_epochs": 4},
        {"monitor": "val/loss", "save_top_k": 2, "every_n_train_steps": 3},
    ),
    # validation every 2 batches: epoch-wise saves after each validation
    "val_every_2_batches": (
        {"max_epochs": 3, "val_check_interval": 2},
        {"monitor": "val/loss", "save_top_k": 2, "save_last": True},
    ),
    "val_every_2_epochs": (
        {"max_epochs": 5, "check_val_every_n_epoch": 2},
        {"monitor": "val/loss", "save_top_k": -1, "every_n_train_steps": 3},
    ),
    "accumulate_3": (
        {"max_epochs": 3, "accumulate_grad_batches": 3},
        {"every_n_train_steps": 1, "save_top_k": -1},
    ),
    "max_steps_mid_epoch": (
        {"max_steps": 7},
        {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True},
    ),
}


@pytest.mark.parametrize("config", list(LIGHTNING_CONFIGS))
def test_saves_the_same_checkpoints_as_lightning(tmp_path, config):
    trainer_kwargs, mc_kwargs = LIGHTNING_CONFIGS[config]
    theirs, their_names = _Lightning().fit(tmp_path / "pl", trainer_kwargs, mc_kwargs)
    ours = eg.ModelCheckpoint(tmp_path / "engine", **mc_kwargs)
    _fit(tmp_path, [ours], **trainer_kwargs)
    assert _on_disk(ours) == their_names
    assert _base(ours.best_model_path) == _base(theirs.best_model_path)
    assert _base(ours.last_model_path) == _base(theirs.last_model_path)


def test_a_resumed_top_k_run_ends_like_lightnings(tmp_path):
    lightning, kw = _Lightning(), {"monitor": "val/loss", "save_top_k": 2, "save_last": True}
    lightning.fit(tmp_path / "pl", {"max_epochs": 3}, kw)
    theirs, their_names = lightning.fit(tmp_path / "pl", {"max_epochs": 6}, kw, ckpt_path="last")
    _fit(tmp_path, [eg.ModelCheckpoint(tmp_path / "engine", **kw)], max_epochs=3)
    ours = eg.ModelCheckpoint(tmp_path / "engine", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(tmp_path, [ours], max_epochs=6, ckpt_path="last")
    assert _on_disk(ours) == their_names
    their_scores = {_base(k): float(v) for k, v in theirs.best_k_models.items()}
    assert {_base(k): v for k, v in ours.best_k_models.items()} == pytest.approx(their_scores)


# ------------------------------------------------------------------------- asynchronous


def test_asynchronous_saves_leave_the_same_checkpoints_as_synchronous_ones(tmp_path, monkeypatch):
    def run(root: Path, asynchronous: bool) -> tuple[eg.ModelCheckpoint, dict[str, str]]:
        mc = eg.ModelCheckpoint(
            monitor="val/loss", save_top_k=2, save_last=True, asynchronous=asynchronous
        )
        _fit(root, [mc], max_epochs=6, enable_journal=False)
        template = _task().init(_linear())
        files = {  # the step and the bits of the state each holds
            p.name: (_step_of(p), checkpoint.load(p, template).fingerprint())
            for p in Path(mc.dirpath).iterdir()
        }
        if asynchronous:  # the writer hashed the snapshot: the fingerprint of what was saved
            for p in Path(mc.dirpath).iterdir():
                assert checkpoint.read_meta(p)["fingerprint"] == files[p.name][1]
        return mc, files

    calls = []
    real = checkpoint.save_async
    monkeypatch.setattr(
        checkpoint, "save_async", lambda *a, **k: calls.append(a[1]) or real(*a, **k)
    )
    sync_mc, sync_files = run(tmp_path / "sync", False)
    assert calls == []
    async_mc, async_files = run(tmp_path / "async", True)
    assert len(calls) >= 6  # every save went through the background writer
    assert async_files == sync_files  # the same names, holding the same steps
    assert async_mc.best_model_score == sync_mc.best_model_score
    assert {Path(p).name for p in async_mc.best_k_models} == {
        Path(p).name for p in sync_mc.best_k_models
    }
    for path in Path(async_mc.dirpath).iterdir():
        assert checkpoint.inspect(path)["verified"]


def test_a_failed_asynchronous_save_keeps_the_checkpoint_it_would_replace(tmp_path, monkeypatch):
    from concurrent.futures import Future

    mc = eg.ModelCheckpoint(save_top_k=1, asynchronous=True)  # the latest, every epoch
    real, n = checkpoint.save_async, [0]

    def flaky(state, path, **kw):
        n[0] += 1
        if n[0] < 3:
            return real(state, path, **kw)
        failed: Future = Future()
        failed.set_exception(OSError("disk full"))
        return failed

    monkeypatch.setattr(checkpoint, "save_async", flaky)
    with pytest.raises(checkpoint.CheckpointError, match=r"asynchronous save .*disk full"):
        _fit(tmp_path, [mc], max_epochs=4, enable_journal=False)  # a failed save fails the fit
    # save 3 (and 4, if the fit got there before it heard) failed: the second epoch's
    # checkpoint was not deleted for them, and it is the one the listener names
    assert _on_disk(mc) == {_name(1, 2 * N_BATCHES)}
    assert mc.best_model_path == os.path.join(mc.dirpath, _name(1, 2 * N_BATCHES))


@pytest.mark.slow
def test_a_fit_start_cleans_what_a_crashed_save_left_in_dirpath(tmp_path):
    # as a process killed mid-replacement leaves it: the old checkpoint moved aside under its
    # name, and a half-written one, both by a writer that is gone
    import sys

    dead = int(
        _procs.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )
    ckpts = tmp_path / "ckpts"
    _fit(tmp_path / "first", [eg.ModelCheckpoint(dirpath=ckpts, filename="kept")])
    template = _task().init(_linear())
    before = checkpoint.load(ckpts / "kept", template).fingerprint()
    aside = ckpts / f".tmp-ckpt-old-{dead}-x"
    aside.mkdir()
    os.replace(ckpts / "kept", aside / "kept")
    half = ckpts / f".tmp-ckpt-{dead}-y"
    half.mkdir()
    (half / "tensors.pt").write_bytes(b"\0" * 8)
    mc = eg.ModelCheckpoint(dirpath=ckpts, filename="other")
    with pytest.warns(UserWarning, match="exists and is not empty"):  # the put-back checkpoint
        _fit(tmp_path / "second", [mc], max_epochs=1)
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["kept", "other"]
    assert checkpoint.load(ckpts / "kept", template).fingerprint() == before


@pytest.mark.parametrize("asynchronous", [False, True])
def test_save_weights_only_checkpoints_evaluate_but_do_not_resume(tmp_path, asynchronous):
    full = eg.ModelCheckpoint(dirpath=tmp_path / "full", monitor="val/loss")
    light = eg.ModelCheckpoint(
        dirpath=tmp_path / "light",
        monitor="val/loss",
        save_weights_only=True,
        asynchronous=asynchronous,
    )
    trainer = _fit(tmp_path, [full, light], max_epochs=3, enable_journal=False)
    assert Path(light.best_model_path).name == Path(full.best_model_path).name
    meta = checkpoint.read_meta(light.best_model_path)
    assert meta["weights_only"] and not checkpoint.read_meta(full.best_model_path)["weights_only"]
    assert meta["opt_state_scalars"] == {} and meta["trees"] == {}
    stored = torch.load(Path(light.best_model_path) / "tensors.pt", weights_only=True)
    assert {k.split("/")[0] for k in stored} == {"params"}  # nothing of the optimizer
    assert checkpoint.inspect(light.best_model_path)["weights_only"] is True
    # the weights are those of the full checkpoint of the same step
    template = _task().init(_linear())
    a = checkpoint.load(light.best_model_path, template)
    b = checkpoint.load(full.best_model_path, template)
    assert all(torch.equal(a.params[k], b.params[k]) for k in b.params)
    assert a.step == b.step and a.opt_state is template.opt_state
    # validate from either gives the same numbers
    task = _task()
    results = [
        _trainer(tmp_path, [], enable_checkpointing=False).validate(
            task, task.init(_linear()), VAL, ckpt_path=p
        )
        for p in (light.best_model_path, full.best_model_path)
    ]
    assert results[0] == results[1]
    # a fit cannot continue from the model alone, and says why
    with pytest.raises(ValueError, match="holds only the model's weights"):
        trainer.fit(task, task.init(_linear()), TRAIN, VAL, ckpt_path=light.best_model_path)
