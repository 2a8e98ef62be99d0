"""The Trainer against real references, continued from ``test_trainer.py``: data sources,
metrics and loggers, event filters, time limits and dev runs, and the process-wide modes a
run switches on and off."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch
import torch.nn.functional as F
from _trainer_kit import (
    QUIET,
    FakeLogger,
    Recorder,
    _as_loader,
    _batches,
    _eval_fn,
    _expected_eval,
    _hand_fit,
    _lightning,
    _linear,
    _mse,
    _quiet_lightning,
    _task,
    _trainer,
    _uneven_loader,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim

# ------------------------------------------------------------------------ 6. data sources


class DataModule:
    """Lightning's datamodule protocol, with a count of each *_dataloader() call."""

    def __init__(self) -> None:
        self.calls = {"train": 0, "val": 0, "test": 0, "predict": 0}

    def train_dataloader(self):
        self.calls["train"] += 1
        return _batches(5)

    def val_dataloader(self):
        self.calls["val"] += 1
        return _uneven_loader()

    def test_dataloader(self):
        self.calls["test"] += 1
        return _uneven_loader()

    def predict_dataloader(self):
        self.calls["predict"] += 1
        return [torch.randn(2, 3)]


def test_a_datamodule_serves_fit_validate_test_and_predict():
    task, dm = _task(eval_fn=_eval_fn), DataModule()
    trainer = _trainer(max_epochs=2)
    state = trainer.fit(task, task.init(_linear()), datamodule=dm)
    assert state.step == 10 and "val/mse" in trainer.callback_metrics
    assert trainer.validate(task, state, datamodule=dm, verbose=False)[0].keys() == {
        "val/mse",
        "val/n",
        "val/hi",
        "val/lo",
    }
    assert "test/mse" in trainer.test(task, state, datamodule=dm, verbose=False)[0]
    assert len(trainer.predict(task, state, datamodule=dm)) == 1
    assert dm.calls == {"train": 1, "val": 2, "test": 1, "predict": 1}
    # passed positionally, as Lightning allows
    task2 = _task()
    assert _trainer(max_epochs=1).fit(task2, task2.init(_linear()), DataModule()).step == 5


@pytest.mark.parametrize("call", ["fit-train", "fit-val", "validate", "test", "predict"])
def test_dataloaders_and_a_datamodule_together_are_refused(call):
    task, state, trainer, dm = _task(), _task().init(_linear()), _trainer(), DataModule()
    with pytest.raises(ValueError, match="either dataloaders or datamodule"):
        if call == "fit-train":
            trainer.fit(task, state, _batches(2), datamodule=dm)
        elif call == "fit-val":
            trainer.fit(task, state, val_dataloaders=_batches(2), datamodule=dm)
        else:
            getattr(trainer, call)(task, state, _batches(2), datamodule=dm)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"train_dataloaders": 5}, "int"),
        ({"train_dataloaders": _batches(2), "val_dataloaders": object()}, "object"),
    ],
)
def test_a_non_iterable_dataloader_is_refused_naming_its_type(kwargs, name):
    task = _task()
    with pytest.raises(ValueError, match=rf"is a {name}, which is not iterable"):
        _trainer().fit(task, task.init(_linear()), **kwargs)


@pytest.mark.parametrize(("every", "train_calls", "val_calls"), [(0, 1, 1), (1, 4, 4), (2, 2, 2)])
def test_reload_dataloaders_every_n_epochs_counts_as_lightning(every, train_calls, val_calls):
    """Lightning 2.x (run with this datamodule, 4 epochs): 0 -> 1/1, 1 -> 4/4, 2 -> 2/2 calls of
    train_dataloader()/val_dataloader(); the sanity check's load counts as epoch 0's."""
    task, dm = _task(), DataModule()
    _trainer(max_epochs=4, reload_dataloaders_every_n_epochs=every).fit(
        task, task.init(_linear()), datamodule=dm
    )
    assert (dm.calls["train"], dm.calls["val"]) == (train_calls, val_calls)


class Stream:
    """An iterable of batches without __len__: each iter() is a fresh generator."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def test_any_iterable_of_batches_trains_like_a_list():
    task, batches = _task(), _batches(7)
    start = task.init(_linear())
    reference = _hand_fit(task, start.copy(), batches, 2, accumulate=2)
    trainer = _trainer(max_epochs=2, accumulate_grad_batches=2)
    state = trainer.fit(task, start, Stream(batches), val_dataloaders=Stream(_batches(2)))
    assert trainer.num_training_batches == float("inf")
    assert state.fingerprint() == reference.fingerprint()


# ------------------------------------------------------------------------ 7. metrics and loggers


def test_metrics_after_fit_hold_step_epoch_and_validation_values():
    task, val = _task(), _uneven_loader()
    batches = _batches(9) + _batches(1, size=2)  # the epoch mean must weight by batch size
    seen = []
    listener = eg.on(
        eg.Event.ON_TRAIN_BATCH_END, lambda rec: seen.append(rec.outputs["loss"].item())
    )
    trainer = _trainer(max_epochs=1, log_every_n_steps=5, callbacks=[listener])
    state = trainer.fit(task, task.init(_linear()), batches, val)

    # the step value is the loss of the last logged step (global step 10), the epoch value the
    # batch-size-weighted mean of every micro-batch loss
    assert trainer.callback_metrics["train/loss"] == pytest.approx(seen[9], rel=1e-6)
    sizes = [len(x) for x, _ in batches]
    assert trainer.callback_metrics["train/loss_epoch"] == pytest.approx(
        sum(v * n for v, n in zip(seen, sizes, strict=True)) / sum(sizes), rel=1e-6
    )
    model = state.load_into(_linear())
    assert trainer.callback_metrics["val/loss"] == pytest.approx(
        _expected_eval(model, val)["mse"], rel=1e-6
    )
    for key in ("train/loss", "train/loss_epoch", "val/loss"):
        assert trainer.logged_metrics[key] == trainer.callback_metrics[key]
    for key in ("train/loss", "val/loss"):  # the bar shows step values, not epoch means
        assert trainer.progress_bar_metrics[key] == trainer.callback_metrics[key]
    assert "train/loss_epoch" not in trainer.progress_bar_metrics


def test_a_logger_gets_every_nth_step_epoch_metrics_once_per_epoch_and_success():
    task, logger = _task(), FakeLogger()
    trainer = _trainer(max_epochs=2, log_every_n_steps=2, logger=logger, num_sanity_val_steps=2)
    trainer.fit(task, task.init(_linear()), _batches(5), _uneven_loader())

    step_logs = [s for s, m in logger.calls if "train/loss" in m]
    epoch_logs = [s for s, m in logger.calls if "train/loss_epoch" in m]
    val_logs = [s for s, m in logger.calls if "val/loss" in m]
    # Lightning's steps: the optimizer steps taken before the logged one
    assert step_logs == [1, 3, 5, 7, 9]
    assert epoch_logs == [4, 9] and val_logs == [4, 9]  # no sanity-check values
    assert logger.statuses == ["success"]
    assert trainer.loggers == [logger] and trainer.log_dir == trainer.default_root_dir


def test_logged_train_loss_matches_lightning():
    """Same model, data and SGD through Lightning: the same optimizer steps get logged with
    the same loss values, and the same epoch means.

    Both label a step's point with the count of steps *before* it (Lightning's
    ``_batches_that_stepped``).
    """
    pl = _quiet_lightning()

    class Capture(pl.loggers.logger.Logger):
        name, version = "capture", 0

        def __init__(self):
            super().__init__()
            self.calls = []

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    batches, theirs, ours = _batches(5), Capture(), FakeLogger()
    trainer, module = _lightning(max_epochs=2, log_every_n_steps=2, logger=theirs)
    trainer.fit(module, _as_loader(batches))
    task = _task()
    _trainer(max_epochs=2, log_every_n_steps=2, logger=ours).fit(
        task, task.init(_linear()), batches
    )

    def series(calls, key):
        return [(s, m[key]) for s, m in calls if key in m]

    their_steps, our_steps = series(theirs.calls, "loss_step"), series(ours.calls, "train/loss")
    assert len(their_steps) == 5
    assert [s for s, _ in their_steps] == [s for s, _ in our_steps]
    assert [v for _, v in our_steps] == pytest.approx([v for _, v in their_steps], rel=1e-5)
    their_epochs = [v for _, v in series(theirs.calls, "loss_epoch")]
    our_epochs = [v for _, v in series(ours.calls, "train/loss_epoch")]
    assert len(their_epochs) == 2 and our_epochs == pytest.approx(their_epochs, rel=1e-5)


def test_a_failing_loss_propagates_emits_on_exception_and_finalizes_failed():
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in loss_fn")
        return _mse(model, batch)

    task, logger, caught = eg.Task(loss_fn, optim.sgd(0.1)), FakeLogger(), []
    listener = eg.on(eg.Event.ON_EXCEPTION, lambda rec: caught.append(rec.exception))
    trainer = _trainer(max_epochs=1, logger=logger, callbacks=[listener])
    with pytest.raises(RuntimeError, match="boom in loss_fn"):
        trainer.fit(task, task.init(_linear()), _batches(5))
    assert len(caught) == 1 and str(caught[0]) == "boom in loss_fn"
    assert logger.statuses == ["failed"]


def test_a_logger_without_log_metrics_is_refused():
    with pytest.raises(ValueError, match="no log_metrics"):
        _trainer(logger=object())


# ------------------------------------------------------------------------ 8. events


def _fit_recording(event, **filters):
    seen = []
    listener = eg.on(event, lambda rec: seen.append(rec.batch_idx), **filters)
    task = _task()
    _trainer(max_epochs=1, callbacks=listener).fit(task, task.init(_linear()), _batches(10))
    return seen


def test_event_filters_fire_on_the_chosen_occurrences():
    end = eg.Event.ON_TRAIN_BATCH_END
    assert _fit_recording(end, every=3) == [2, 5, 8]
    assert _fit_recording(end(every=3)) == [2, 5, 8]
    assert _fit_recording(end, once=2) == [1]
    assert _fit_recording(end, filter=lambda rec: rec.batch_idx % 4 == 0) == [0, 4, 8]


@pytest.mark.parametrize(("min_epochs", "epochs"), [(None, 1), (0, 1), (3, 3)])
def test_stop_ends_fit_once_min_epochs_are_met(min_epochs, epochs):
    """Lightning: a stop request (``trainer.should_stop = True``) ends fitting at the next check
    unless ``min_epochs`` ("force training for at least these many epochs") is not yet met."""
    stop = eg.on(eg.Event.ON_TRAIN_EPOCH_END, lambda rec: eg.Stop("enough"))
    task = _task()
    trainer = _trainer(max_epochs=10, min_epochs=min_epochs, callbacks=[stop])
    trainer.fit(task, task.init(_linear()), _batches(4))
    assert trainer.current_epoch == epochs and trainer.global_step == 4 * epochs


@pytest.mark.parametrize("min_steps", [0, 2, 7])
def test_stop_mid_epoch_with_min_steps_matches_lightning(min_steps):
    """With min_steps (and no min_epochs) Lightning also finishes the first epoch
    (``_parse_loop_limits`` sets ``min_epochs=1``); run Lightning itself for the counters."""
    pl = _quiet_lightning()

    class StopAt2(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                trainer.should_stop = True

    theirs, module = _lightning(max_epochs=5, min_steps=min_steps, callbacks=[StopAt2()])
    theirs.fit(module, _as_loader(_batches(5)))

    def stop(rec):
        return eg.Stop() if rec.run.global_step == 2 else None

    task, listener = _task(), eg.on(eg.Event.ON_TRAIN_BATCH_END, stop)
    ours = _trainer(max_epochs=5, min_steps=min_steps, callbacks=[listener])
    ours.fit(task, task.init(_linear()), _batches(5))
    assert (ours.global_step, ours.current_epoch) == (theirs.global_step, theirs.current_epoch)


def test_listeners_cannot_change_the_state_or_the_record():
    errors = []

    def meddle(rec):
        for attempt in (
            lambda: setattr(rec.state, "step", 100),
            lambda: setattr(rec, "state", None),
            lambda: setattr(rec, "batch_idx", 7),
        ):
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                attempt()
            errors.append(1)

    task = _task()
    trainer = _trainer(max_epochs=1, callbacks=[eg.on(eg.Event.ON_TRAIN_BATCH_END, meddle)])
    state = trainer.fit(task, task.init(_linear()), _batches(3))
    assert len(errors) == 9 and state.step == 3


def test_a_single_listener_may_be_passed_without_a_list():
    assert _fit_recording(eg.Event.ON_TRAIN_BATCH_END, once=1) == [0]


# ------------------------------------------------------------------------ 9. time and dev runs


@pytest.mark.parametrize("max_time", [{"seconds": 0}, {"microseconds": 1}])
def test_max_time_stops_where_lightnings_timer_does(max_time):
    """Lightning's Timer checks the budget when fitting starts (a zero budget trains nothing)
    and after every batch (a tiny one trains exactly one batch)."""
    listeners = pytest.importorskip("engine.listeners")
    if not hasattr(listeners, "Timer"):
        pytest.skip("engine.listeners.Timer is not there yet")
    theirs, module = _lightning(max_time=max_time)
    theirs.fit(module, _as_loader(_batches(10)))
    task = _task()
    ours = _trainer(max_time=max_time)
    ours.fit(task, task.init(_linear()), _batches(10))
    assert ours.global_step == (0 if max_time == {"seconds": 0} else 1)
    assert (ours.global_step, ours.current_epoch) == (theirs.global_step, theirs.current_epoch)


def test_fast_dev_run_runs_n_batches_of_each_without_sanity_check_or_loggers():
    rec, logger = Recorder(), FakeLogger()
    task = _task()
    trainer = eg.Trainer(
        fast_dev_run=2,
        callbacks=[rec],
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    state = trainer.fit(task, task.init(_linear()), _batches(10), _batches(5))
    assert len(rec.of("on_train_batch_end")) == 2
    assert [r[1:] for r in rec.of("on_validation_batch_end")] == [("fit", 0, 0), ("fit", 1, 0)]
    assert rec.of("on_sanity_check_start") == []
    assert state.step == trainer.global_step == 2
    assert trainer.loggers == [] and logger.calls == []


# ------------------------------------------------------------------------ 10. records and modes


def test_event_records_carry_the_stage_and_the_dataloader_index():
    rec, task = Recorder(), _task()
    trainer = _trainer(max_epochs=1, callbacks=[rec], num_sanity_val_steps=1)
    vals = [_uneven_loader(seed=2), _uneven_loader(n=3, batch_size=3, seed=4)]
    state = trainer.fit(task, task.init(_linear()), _batches(2), vals)
    trainer.validate(task, state, vals[1], verbose=False)
    trainer.test(task, state, vals[0], verbose=False)
    trainer.predict(task, state, [torch.randn(2, 3)])

    val_rows = [r[1:] for r in rec.of("on_validation_batch_end")]
    assert val_rows == [
        ("sanity_check", 0, 0),
        ("sanity_check", 0, 1),
        ("fit", 0, 0),
        ("fit", 1, 0),
        ("fit", 2, 0),
        ("fit", 0, 1),
        ("validate", 0, 0),
    ]
    assert {r[1] for r in rec.of("on_train_batch_end")} == {"fit"}
    assert [r[1] for r in rec.of("on_test_batch_end")] == ["test"] * 3
    assert [r[1] for r in rec.of("on_predict_batch_end")] == ["predict"]


def test_detect_anomaly_runs_the_steps_under_autograd_anomaly_mode():
    inside = []

    def loss_fn(model, batch):
        inside.append(torch.is_anomaly_enabled())
        return F.mse_loss(model(batch[0]), batch[1])

    task = eg.Task(loss_fn, optim.sgd(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
        _trainer(max_epochs=1, detect_anomaly=True).fit(task, task.init(_linear()), _batches(2))
        assert inside == [True, True] and not torch.is_anomaly_enabled()

        # and it does what anomaly mode does: a NaN gradient raises, naming the function
        nan_task = eg.Task(lambda m, b: torch.sqrt(m(b[0]) * 0 - 1).mean(), optim.sgd(0.1))
        with pytest.raises(RuntimeError, match="returned nan"):
            _trainer(max_epochs=1, detect_anomaly=True).fit(
                nan_task, nan_task.init(_linear()), _batches(1)
            )
    assert not torch.is_anomaly_enabled()


@pytest.mark.parametrize(
    ("flag", "before", "inside"),
    [
        (True, (False, False), (True, False)),
        ("warn", (False, False), (True, True)),
        (False, (True, True), (False, False)),
    ],
)
def test_deterministic_switches_torch_deterministic_mode_for_the_run_and_restores_it(
    flag, before, inside
):
    seen = []

    def probe(rec):
        seen.append(
            (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            )
        )

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    try:
        task = _task()
        trainer = _trainer(
            max_epochs=1, deterministic=flag, callbacks=[eg.on(eg.Event.ON_TRAIN_BATCH_END, probe)]
        )
        trainer.fit(task, task.init(_linear()), _batches(2))
        after = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    assert seen == [inside, inside]
    assert after == before


def test_profiler_simple_writes_a_report_under_default_root_dir(tmp_path, capsys):
    task = _task()
    trainer = _trainer(max_epochs=1, profiler="simple", default_root_dir=tmp_path)
    trainer.fit(task, task.init(_linear()), _batches(2))
    report = tmp_path / "fit-profile.txt"
    assert report.is_file() and "fit took" in report.read_text()
    assert "Simple profiler" in capsys.readouterr().out
    # one timing per train step call, summarised per action
    row = next(line for line in report.read_text().splitlines() if line.startswith("train_step"))
    assert int(row.split()[1]) == 2 == len(trainer.profile["train_step"])
    trainer.test(task, trainer.state, _batches(3), verbose=False)
    assert len(trainer.profile["test_step"]) == 3


@pytest.mark.parametrize("call", ["fit", "validate", "test", "predict"])
def test_a_ckpt_path_that_is_not_a_checkpoint_is_named(call, tmp_path):
    from engine.checkpoint import CheckpointError

    task, trainer = _task(), _trainer()
    with pytest.raises(CheckpointError, match=r"nope is not a checkpoint: meta\.json is missing"):
        getattr(trainer, call)(task, task.init(_linear()), _batches(2), ckpt_path=tmp_path / "nope")


def test_fit_refuses_a_task_or_state_of_the_wrong_type():
    task = _task()
    with pytest.raises(TypeError, match=r"engine\.Task"):
        _trainer().fit(object(), task.init(_linear()), _batches(2))
    with pytest.raises(TypeError, match=r"engine\.TrainState"):
        _trainer().fit(task, _linear(), _batches(2))


def test_profiler_pytorch_writes_a_chrome_trace_into_the_log_dir(tmp_path, capsys):
    import json

    task = _task()
    trainer = _trainer(max_epochs=1, profiler="pytorch", default_root_dir=tmp_path)
    trainer.fit(task, task.init(_linear()), _batches(2))
    trace = json.loads((tmp_path / "fit-trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("addmm" in n or "linear" in n for n in names)


@pytest.mark.parametrize("flags", [{"barebones": True}, {**QUIET, "enable_checkpointing": False}])
def test_a_trainer_and_its_last_run_are_freed_without_a_garbage_collection(tmp_path, flags):
    """The Trainer keeps its last Run, which must not keep the Trainer: a cycle would keep the
    run's loaders (and a DataLoader's worker processes, joined when it is collected) alive
    until a garbage collection, long after the Trainer is gone."""
    import gc
    import weakref

    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    gc.collect()
    gc.disable()
    try:
        loader = DataLoader(data, batch_size=4)
        trainer = eg.Trainer(max_epochs=1, default_root_dir=tmp_path, **flags)
        state = trainer.fit(task, task.init(nn.Linear(3, 1)), loader)
        trainer.validate(task, state, loader, verbose=False)
        refs = weakref.ref(trainer), weakref.ref(loader)
        del trainer, loader
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
