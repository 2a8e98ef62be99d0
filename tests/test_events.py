"""Listeners are checked when they are registered: a handler named after no event is an error
naming it, never a silent no-op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine as eg
from engine import optim
from engine.events import check_listener


class _Typo(eg.Listener):
    def on_validaton_end(self, rec):  # misspelt
        raise AssertionError("never called")

    def on_fit_start(self, rec):
        pass


class _LightningOnly(eg.Listener):
    def on_before_zero_grad(self, rec):
        pass


class _Fine(eg.Listener):
    def on_train_batch_end(self, rec):
        pass

    def _on_helper(self):  # private: not a handler
        pass

    on_value = 3  # not callable: not a handler


def test_a_misspelt_handler_is_named_with_the_event_it_resembles():
    with pytest.raises(
        ValueError, match=r"_Typo\.on_validaton_end .* did you mean on_validation_end"
    ):
        check_listener(_Typo())


def test_a_lightning_hook_engine_does_not_have_says_why():
    with pytest.raises(ValueError, match=r"a pure step has no \.grad buffers to zero"):
        check_listener(_LightningOnly())


def test_private_helpers_and_plain_attributes_are_not_handlers():
    check_listener(_Fine())
    check_listener(eg.on(eg.Event.ON_TRAIN_END, print))
    for listener in (eg.ModelCheckpoint(), eg.EarlyStopping("val/loss"), eg.ProgressBar()):
        check_listener(listener)


def test_the_trainer_refuses_a_misspelt_handler_before_training():
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    trainer = eg.Trainer(max_epochs=1, logger=False)
    trainer.callbacks.append(_Typo())  # after construction: the fit checks again
    with pytest.raises(ValueError, match="on_validaton_end is not an engine event"):
        trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)


class _OnlyTypo:  # its one handler is misspelt: without the check it would be "not a listener"
    def on_train_epoc_end(self, rec):
        raise AssertionError("never called")


def test_the_trainer_names_a_misspelt_handler_at_construction():
    with pytest.raises(ValueError, match=r"_Typo\.on_validaton_end .* did you mean"):
        eg.Trainer(callbacks=[_Typo()], logger=False)
    with pytest.raises(
        ValueError, match=r"_OnlyTypo\.on_train_epoc_end .* did you mean on_train_epoch_end"
    ):
        eg.Trainer(callbacks=_OnlyTypo(), logger=False)
    with pytest.raises(ValueError, match="is not a listener"):
        eg.Trainer(callbacks=[object()], logger=False)


# ------------------------------------------------------------------ the view and requests

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "enable_journal": False,
}


def _fit(listeners, tmp_path=None, **kw):
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    root = {"default_root_dir": tmp_path} if tmp_path is not None else {}
    trainer = eg.Trainer(callbacks=listeners, **(QUIET | root | kw))
    trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data, data[:1])
    return trainer


def test_reading_rec_trainer_says_what_replaces_it():
    seen = []

    def read(rec):
        with pytest.raises(AttributeError, match=r"rec\.run\.global_step.*return eg\.Save"):
            rec.trainer  # noqa: B018 - the Lightning habit
        seen.append(rec.run.global_step)

    _fit([eg.on(eg.Event.ON_TRAIN_BATCH_END, read)], max_epochs=1)
    assert seen == [1, 2, 3]


def test_the_view_has_the_runs_facts_and_is_a_snapshot():
    batches, validations = [], []
    trainer = _fit(
        [
            eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda rec: batches.append(rec.run)),
            eg.on(eg.Event.ON_VALIDATION_END, lambda rec: validations.append(rec.run)),
        ],
        max_epochs=2,
        log_every_n_steps=1,
    )
    sanity, first, last = validations[0], batches[0], validations[-1]
    assert sanity.sanity_checking and sanity.stage == "fit" and sanity.global_step == 0
    assert (first.stage, first.global_step, first.current_epoch) == ("fit", 1, 0)
    assert (last.global_step, last.current_epoch, last.sanity_checking) == (6, 1, False)
    assert first.num_training_batches == 3 and first.num_val_batches == (1,)
    assert first.config is trainer.config and first.task is trainer.task
    assert set(first.callback_metrics) == {"train/loss"}
    assert set(first.logged_metrics) == {"train/loss", "epoch"}  # Lightning adds the epoch
    assert "val/loss" in last.callback_metrics and "val/loss" not in first.callback_metrics
    assert batches[1].global_step == 2 and first.global_step == 1  # kept views do not move
    with pytest.raises(TypeError):
        first.callback_metrics["x"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        first.global_step = 5  # type: ignore[misc]


class _Order(eg.Listener):
    """Records what it sees, and asks for what it is given, in one event."""

    def __init__(self, name, log, *requests):
        self.name, self.log, self.requests = name, log, requests

    def on_validation_end(self, rec):
        if rec.stage != "fit" or rec.run.sanity_checking:
            return None
        self.log.append((self.name, rec.run.should_stop, dict(rec.run.logged_metrics)))
        return list(self.requests)

    def on_save_checkpoint(self, rec):
        self.log.append((self.name, "on_save_checkpoint", rec.run.should_stop))


def test_requests_are_carried_out_after_the_event_stops_and_logs_before_saves(tmp_path):
    log = []
    saver = _Order("saver", log, eg.Save(tmp_path / "c"))
    stopper = _Order("stopper", log, eg.Stop("enough"), eg.Log({"x": 2.0}))
    trainer = _fit([saver, stopper], max_epochs=3)
    # every listener had the event before anything was carried out; on_save_checkpoint fired
    # after it, and the checkpoint holds the stop and the log asked for by the later listener
    assert [entry[:2] for entry in log] == [
        ("saver", False),
        ("stopper", False),
        ("saver", "on_save_checkpoint"),
        ("stopper", "on_save_checkpoint"),
    ]
    assert "x" not in log[1][2] and log[2][2] is True  # the stop, before the save
    saved = eg.checkpoint.read_meta(tmp_path / "c")["extra"]["trainer"]
    assert saved["should_stop"] is True and saved["logged_metrics"]["x"] == 2.0
    assert trainer.should_stop and trainer.current_epoch == 1
    assert trainer.logged_metrics["x"] == 2.0


def test_save_replaces_deletes_only_once_the_new_checkpoint_is_written(tmp_path):
    class Rolling(eg.Listener):
        def __init__(self, asynchronous):
            self.previous, self.asynchronous = None, asynchronous

        def on_train_batch_end(self, rec):
            path = tmp_path / f"{self.asynchronous}-step={rec.run.global_step}"
            replaces = () if self.previous is None else self.previous
            self.previous = path
            return eg.Save(path, asynchronous=self.asynchronous, replaces=replaces)

    for asynchronous in (False, True):
        _fit([Rolling(asynchronous)], max_epochs=2)
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(str(asynchronous)))
        assert left == [f"{asynchronous}-step=6"]


def test_a_failed_write_deletes_nothing(tmp_path, monkeypatch):
    from engine import checkpoint

    keep = checkpoint.save(
        eg.TrainState.create(torch.nn.Linear(3, 1), optim.sgd(0.1)), tmp_path / "keep"
    )
    real = checkpoint.save_async

    def failing(state, path, **kw):
        raise_at = tmp_path / "new"
        if str(path) == str(raise_at):
            from concurrent.futures import Future

            failed: Future = Future()
            failed.set_exception(OSError("disk full"))
            return failed
        return real(state, path, **kw)

    monkeypatch.setattr(checkpoint, "save_async", failing)
    once = eg.on(
        eg.Event.ON_TRAIN_BATCH_END,
        lambda rec: eg.Save(tmp_path / "new", asynchronous=True, replaces=keep),
        once=1,
    )
    # the failure is not silent (issue 16): it fails the fit, naming the save and the cause
    with pytest.raises(checkpoint.CheckpointError, match=r"save of checkpoint .*new.*disk full"):
        _fit([once], max_epochs=1)
    assert (keep / "meta.json").is_file() and not (tmp_path / "new").exists()


def test_a_handler_returning_something_else_is_an_error():
    with pytest.raises(TypeError, match=r"on_train_batch_start.*returned -1; a handler returns"):
        _fit([eg.on(eg.Event.ON_TRAIN_BATCH_START, lambda rec: -1)], max_epochs=1)


def test_save_checkpoint_from_inside_an_event_is_refused(tmp_path):
    holder = {}

    def save(rec):
        holder["trainer"].save_checkpoint(tmp_path / "c")

    trainer = eg.Trainer(callbacks=[eg.on(eg.Event.ON_TRAIN_BATCH_END, save)], **QUIET)
    holder["trainer"] = trainer
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"while on_train_batch_end .* engine\.Save\(path\)"):
        trainer.fit(
            task, task.init(torch.nn.Linear(3, 1)), [(torch.randn(4, 3), torch.randn(4, 1))]
        )


def test_a_save_from_on_save_checkpoint_is_refused(tmp_path):
    once = eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda rec: eg.Save(tmp_path / "a"), once=1)
    again = eg.on(eg.Event.ON_SAVE_CHECKPOINT, lambda rec: eg.Save(tmp_path / "b"))
    with pytest.raises(RuntimeError, match="would fire on_save_checkpoint again"):
        _fit([once, again], max_epochs=1)


def test_log_requests_reach_the_loggers_at_their_step():
    class Logger:
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

    logger = Logger()
    logs = eg.on(eg.Event.ON_TRAIN_EPOCH_END, lambda rec: eg.Log({"seen": rec.run.global_step}))
    trainer = _fit([logs], max_epochs=2, logger=logger, log_every_n_steps=100)
    assert [r for r in logger.rows if "seen" in r[1]] == [
        (3, {"seen": 3.0, "epoch": 0.0}),  # a row the run logs carries its epoch, as Lightning's
        (6, {"seen": 6.0, "epoch": 1.0}),
    ]
    assert trainer.callback_metrics["seen"] == 6.0


def test_requests_check_their_arguments():
    with pytest.raises(TypeError, match=r"non-empty str or os\.PathLike"):
        eg.Save(3)
    with pytest.raises(TypeError, match="pass True or False"):
        eg.Save("c", asynchronous="yes")
    assert eg.Save("c", replaces=["a", "b"]).replaces == ("a", "b")
    with pytest.raises(TypeError, match=r"'loss' is a Tensor, not a number.*\.item\(\)"):
        eg.Log({"loss": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="int >= 0"):
        eg.Log({"a": 1.0}, step=-1)
    assert eg.Log({"a": 1}).metrics == {"a": 1.0}
    with pytest.raises(TypeError, match=r"Stop\(reason=5\): pass a str"):
        eg.Stop(5)
    with pytest.raises(TypeError, match=r"Transition\(name=3\): pass a str"):
        eg.Transition(lambda s: s, name=3)
    assert eg.Stop().reason == "" and eg.Transition(lambda s: s, name="t").name == "t"


def test_a_request_shows_in_the_views_of_the_next_batch():
    class Asks(eg.Listener):
        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, rec):
            self.seen.append((rec.run.global_step, rec.run.should_stop, "asked" in rec.metrics))

        def on_train_batch_end(self, rec):
            if rec.run.global_step == 1:
                return [eg.Stop(), eg.Log({"asked": 1.0})]
            return None

    asks = Asks()
    _fit([asks], max_epochs=3, min_epochs=1, log_every_n_steps=100)  # the epoch finishes
    assert asks.seen == [(0, False, False), (1, True, True), (2, True, True)]


def test_the_drivers_per_batch_copy_of_a_view_is_the_view_at_other_counters():
    import attrs

    from engine.events import _moved

    view = eg.RunView(stage="fit", global_step=3, num_val_batches=[2], callback_metrics={"a": 1})
    moved = _moved(view, 4, 1)
    assert moved == attrs.evolve(view, global_step=4, current_epoch=1)
    assert (view.global_step, view.current_epoch) == (3, 0)  # the original is untouched
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        moved.global_step = 5  # type: ignore[misc]


def test_setting_trainer_should_stop_says_to_return_stop():
    trainer = eg.Trainer(logger=False)
    with pytest.raises(AttributeError, match=r"returns engine\.Stop\('why'\)"):
        trainer.should_stop = True
    assert trainer.should_stop is False


def test_a_listeners_stop_is_not_carried_into_a_resume_with_raised_limits(tmp_path):
    """Lightning does not carry ``should_stop`` in a checkpoint: a fit stopped by a listener and
    resumed from the checkpoint saved in the same event, with more epochs, trains on (the
    listeners' own states are what carries over)."""
    stopper = _Order("stopper", [], eg.Save(tmp_path / "c"), eg.Stop("enough"))
    first = _fit([stopper], max_epochs=3)
    assert first.should_stop and first.global_step == 3  # stopped after the first epoch
    assert eg.checkpoint.read_meta(tmp_path / "c")["extra"]["trainer"]["should_stop"] is True

    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    again = eg.Trainer(max_epochs=3, **QUIET)
    state = again.fit(
        task, task.init(torch.nn.Linear(3, 1)), data, data[:1], ckpt_path=tmp_path / "c"
    )
    assert not again.should_stop and state.step == 9 and again.current_epoch == 3
