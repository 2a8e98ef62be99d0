"""The validation schedule and stop conditions (``engine.loop.schedule``) against Lightning's rules,
and against what the Trainer's loop does; the resolved config a checkpoint records.

Each predicate is pinned on hand-worked cases of Lightning's documented semantics (and, where
Lightning's rule is a function that runs on a bare object, against that function). The grid at
the end runs small fits and checks that the validations the Trainer ran, its final
``global_step`` and ``current_epoch`` are what the predicates say, so the loop and the listeners
that ask them cannot drift apart.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.driver.resolve import resolve
from engine.plan import LoopConfig, Phase, schedule
from engine.plan.flags import Flags

INF = math.inf
QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}


# ---------------------------------------------------------------------- val_check_batch


@pytest.mark.parametrize(
    ("interval", "every", "batches", "expected"),
    [
        (None, 1, 10, 10),  # default 1.0: the end of the epoch
        (0.25, 1, 10, 2),  # int(10 * 0.25)
        (0.3, 1, 10, 3),
        (0.01, 1, 10, 1),  # at least every batch
        (1.0, 1, INF, INF),  # an unsized loader: the end of the data
        (3, 1, 10, 3),  # an int counts batches as given
        (3, 1, INF, 3),
        (25, None, 10, 25),  # counted across epochs: longer than an epoch is fine
    ],
)
def test_val_check_batch_follows_lightning(interval, every, batches, expected):
    config = resolve(val_check_interval=interval, check_val_every_n_epoch=every)
    assert schedule.val_check_batch(config, batches, True) == expected


def test_val_check_batch_refuses_what_lightning_refuses():
    longer = resolve(val_check_interval=11)
    with pytest.raises(ValueError, match=r"val_check_interval=11\) must be at most .*\(10\)"):
        schedule.val_check_batch(longer, 10, True)
    assert schedule.val_check_batch(longer, 10, False) == 11  # no validation: nothing to check
    with pytest.raises(ValueError, match=r"without a length, pass 1.0"):
        schedule.val_check_batch(resolve(val_check_interval=0.5), INF, True)


# ---------------------------------------------------------------------- when to validate


@pytest.mark.parametrize("every", [1, 2, 3, None])
def test_validates_this_epoch_follows_check_val_every_n_epoch(every):
    config = resolve(check_val_every_n_epoch=every, val_check_interval=1 if every is None else 1.0)
    epochs = [e for e in range(7) if schedule.validates_this_epoch(config, e, True)]
    assert epochs == (
        list(range(7)) if every is None else [e for e in range(7) if (e + 1) % every == 0]
    )
    assert not any(schedule.validates_this_epoch(config, e, False) for e in range(7))


def _validated(config: LoopConfig, batches: int, epochs: int) -> list[tuple[int, int]]:
    """(epoch, batch_idx) after which should_validate says yes, no stop requested."""
    vcb = schedule.val_check_batch(config, batches, True)
    out, total = [], 0
    for epoch in range(epochs):
        for b in range(batches):
            if schedule.validates_this_epoch(config, epoch, True) and schedule.should_validate(
                config,
                val_check_batch=vcb,
                batch_idx=b,
                total_batch_idx=total,
                is_last=b == batches - 1,
            ):
                out.append((epoch, b))
            total += 1
    return out


@pytest.mark.parametrize(
    ("flags", "batches", "expected"),
    [
        ({}, 4, [(0, 3), (1, 3)]),  # once per epoch, at its end
        ({"val_check_interval": 0.5}, 4, [(0, 1), (0, 3), (1, 1), (1, 3)]),
        # a fraction that does not divide the epoch: the last batch does not validate
        ({"val_check_interval": 0.4}, 5, [(0, 1), (0, 3), (1, 1), (1, 3)]),
        ({"val_check_interval": 2}, 5, [(0, 1), (0, 3), (1, 1), (1, 3)]),  # within each epoch
        # across epochs: every 3rd batch of the run
        ({"val_check_interval": 3, "check_val_every_n_epoch": None}, 4, [(0, 2), (1, 1)]),
        ({"check_val_every_n_epoch": 2}, 3, [(1, 2)]),
    ],
)
def test_should_validate_follows_lightnings_batch_rule(flags, batches, expected):
    assert _validated(resolve(**flags), batches, 2) == expected


def test_a_stop_that_may_end_the_fit_validates_first():
    config = resolve(val_check_interval=0.5, min_epochs=1)
    ask = {"val_check_batch": 2, "batch_idx": 0, "total_batch_idx": 0, "is_last": False}
    assert not schedule.should_validate(config, **ask)
    # requested in epoch 0 with min_epochs=1: it cannot end the fit yet, so no extra validation
    assert not schedule.should_validate(config, **ask, should_stop=True, epoch=0)
    assert schedule.should_validate(config, **ask, should_stop=True, epoch=1)


# ---------------------------------------------------------------------- when to stop


@pytest.mark.parametrize(
    ("flags", "epoch", "step", "expected"),
    [
        ({}, 0, 0, True),
        ({"min_epochs": 2}, 1, 100, False),
        ({"min_epochs": 2}, 2, 0, True),
        ({"min_steps": 10}, 5, 9, False),  # min_steps alone implies min_epochs=1 ...
        ({"min_steps": 10}, 0, 10, False),  # ... so the first epoch completes
        ({"min_steps": 10}, 1, 10, True),
        ({"min_epochs": 0, "min_steps": 0}, 0, 0, True),  # 0 is no minimum
    ],
)
def test_can_stop_early_needs_min_epochs_and_min_steps(flags, epoch, step, expected):
    assert schedule.can_stop_early(resolve(**flags), epoch, step) is expected


def test_max_steps_and_max_epochs_end_the_epoch_and_the_fit():
    config = resolve(max_steps=6, max_epochs=3)
    assert not schedule.epoch_done(config, global_step=5)
    assert schedule.epoch_done(config, global_step=6)
    assert not schedule.fit_done(config, epoch=2, global_step=5)
    assert schedule.fit_done(config, epoch=3, global_step=0)
    assert schedule.fit_done(config, epoch=0, global_step=6)
    unlimited = resolve(max_steps=-1, max_epochs=-1)
    assert not schedule.fit_done(unlimited, epoch=10**6, global_step=10**9)
    assert resolve().max_epochs == 1000  # Lightning's default without max_steps / max_time
    assert resolve(max_time={"hours": 1}).max_epochs == -1


def test_a_stop_request_ends_the_epoch_and_the_fit_once_the_minimums_are_met():
    config = resolve(min_epochs=2)
    for done in (schedule.epoch_done, schedule.fit_done):
        assert not done(config, epoch=1, global_step=9, should_stop=True)
        assert done(config, epoch=2, global_step=9, should_stop=True)
        assert not done(config, epoch=2, global_step=9, should_stop=False)


# ---------------------------------------------------------------------- the listeners' rules


_LISTENER_CASES = [  # (flags, validation batches)
    ({}, 2),
    ({}, 0),
    ({"val_check_interval": 0.5}, 2),
    ({"val_check_interval": 0.5}, 0),
    ({"val_check_interval": 1}, 2),
    ({"val_check_interval": 3}, 2),
    ({"check_val_every_n_epoch": 2}, 2),
    ({"check_val_every_n_epoch": 2}, 0),
    ({"val_check_interval": 4, "check_val_every_n_epoch": None}, 2),
]


@pytest.mark.parametrize(("flags", "num_val"), _LISTENER_CASES)
def test_saves_at_train_epoch_end_is_lightnings_model_checkpoint_rule(flags, num_val):
    callbacks = pytest.importorskip("pytorch_lightning.callbacks")
    config = resolve(**flags)
    trainer = SimpleNamespace(
        check_val_every_n_epoch=config.check_val_every_n_epoch,
        val_check_interval=config.val_check_interval,
        num_val_batches=[num_val],
    )
    lightning = callbacks.ModelCheckpoint()._should_save_on_train_epoch_end(trainer)
    assert schedule.saves_at_train_epoch_end(config, num_val) is lightning


@pytest.mark.parametrize(("flags", "num_val"), _LISTENER_CASES)
def test_checks_at_train_epoch_end_is_lightnings_early_stopping_rule(flags, num_val):
    callbacks = pytest.importorskip("pytorch_lightning.callbacks")
    config = resolve(**flags)
    trainer = SimpleNamespace(
        check_val_every_n_epoch=config.check_val_every_n_epoch,
        val_check_interval=config.val_check_interval,
    )
    es = callbacks.EarlyStopping("m")
    es.setup(trainer, None, "fit")
    ours = schedule.checks_at_train_epoch_end(config, num_val)
    if num_val == 0:  # the engine's choice: no validation to check after
        assert ours
    elif config.val_check_interval == 1 and isinstance(config.val_check_interval, int):
        assert not ours and es._check_on_train_epoch_end  # validates every batch: not once
    else:
        assert ours is es._check_on_train_epoch_end


@pytest.mark.parametrize(
    ("flags", "epoch", "batch_idx", "expected"),
    [
        ({}, 0, 3, True),  # the last batch of an epoch that validates
        ({}, 0, 2, False),
        ({"check_val_every_n_epoch": 2}, 0, 3, False),
        ({"check_val_every_n_epoch": 2}, 1, 3, True),
        ({"val_check_interval": 4, "check_val_every_n_epoch": None}, 5, 3, True),
    ],
)
def test_validation_follows_the_last_batch_of_a_validating_epoch(flags, epoch, batch_idx, expected):
    config = resolve(**flags)
    ask = {"batch_idx": batch_idx, "num_training_batches": 4, "epoch": epoch}
    assert schedule.validation_follows(config, **ask, num_val_batches=2) is expected
    assert not schedule.validation_follows(config, **ask, num_val_batches=0)


# ---------------------------------------------------------------------- the Trainer's loop


class _Record(eg.Listener):
    """The (epoch, batch_idx) after which each validation of the fit ran; asks to stop once."""

    def __init__(self, stop_at: int | None) -> None:
        self.stop_at, self.last, self.validations = stop_at, None, []

    def on_train_batch_end(self, rec):
        self.last = (rec.state.epoch, rec.batch_idx)
        if rec.state.step == self.stop_at:
            return eg.Stop("asked")
        return None

    def on_validation_start(self, rec):
        if not rec.run.sanity_checking:
            self.validations.append(self.last)


def _predicted(config: LoopConfig, batches: int, num_val: int, stop_at: int | None):
    """The fit the predicates describe: validations, final global_step and current_epoch."""
    enable = num_val > 0
    epoch = step = total = 0
    stop, validations = False, []
    while not schedule.fit_done(config, epoch=epoch, global_step=step, should_stop=stop):
        vcb = schedule.val_check_batch(config, batches, enable)
        validates = schedule.validates_this_epoch(config, epoch, enable)
        for b in range(batches):
            if schedule.epoch_done(config, global_step=step, should_stop=stop, epoch=epoch):
                break
            step += 1  # accumulate_grad_batches=1: each batch steps
            stop = stop or step == stop_at
            if validates and schedule.should_validate(
                config,
                val_check_batch=vcb,
                batch_idx=b,
                total_batch_idx=total,
                is_last=b == batches - 1,
                should_stop=stop,
                epoch=epoch,
                global_step=step,
            ):
                validations.append((epoch, b))
            total += 1
        epoch += 1
    return validations, step, epoch


_GRID = [
    (interval, every, limit, max_steps, stop)
    for interval, every, limit, max_steps, stop in itertools.product(
        [1.0, 0.5, 0.3, 1, 2, 5],  # val_check_interval
        [1, 2, None],  # check_val_every_n_epoch
        [3, 1.0],  # limit_train_batches (of 4)
        [-1, 7],  # max_steps
        [None, (5, None), (5, 2)],  # (a stop requested at this step, min_epochs)
    )
    if not (isinstance(interval, float) and every is None)  # refused at construction
]


@pytest.mark.parametrize(("interval", "every", "limit", "max_steps", "stop"), _GRID)
def test_the_trainer_validates_and_stops_where_the_schedule_says(
    interval, every, limit, max_steps, stop
):
    stop_at, min_epochs = stop or (None, None)
    flags = {
        "val_check_interval": interval,
        "check_val_every_n_epoch": every,
        "limit_train_batches": limit,
        "max_steps": max_steps,
        "max_epochs": 3,
        "min_epochs": min_epochs,
    }
    record = _Record(stop_at)
    trainer = eg.Trainer(barebones=True, callbacks=[record], **flags)
    batches, num_val = 3 if limit == 3 else 4, 2
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 3, generator=g), torch.randn(2, 1, generator=g)) for _ in range(4)]
    try:
        expected = _predicted(trainer.config, batches, num_val, stop_at)
    except ValueError as e:  # an int interval longer than the epoch: both refuse it alike
        with pytest.raises(ValueError, match=re.escape(str(e))):
            trainer.fit(task, task.init(nn.Linear(3, 1)), data, data[:num_val])
        return
    trainer.fit(task, task.init(nn.Linear(3, 1)), data, data[:num_val])
    assert (record.validations, trainer.global_step, trainer.current_epoch) == expected


def test_the_grid_covers_validation_stops_and_refusals():
    # the grid above is not vacuous: it has fits that validate mid-epoch and only at the end,
    # that a stop request shortens, that end at max_steps, and intervals refused
    seen = set()
    for interval, every, limit, max_steps, stop in _GRID:
        config = resolve(
            val_check_interval=interval,
            check_val_every_n_epoch=every,
            max_steps=max_steps,
            max_epochs=3,
            min_epochs=stop and stop[1],
        )
        batches = 3 if limit == 3 else 4
        try:
            validations, step, _ = run = _predicted(config, batches, 2, stop and stop[0])
        except ValueError:
            seen.add("refused")
            continue
        seen.add("mid-epoch" if any(b < batches - 1 for _, b in validations) else "at the end")
        if stop and run != _predicted(config, batches, 2, None):
            seen.add("stopped early")
        if step == max_steps:
            seen.add("max_steps")
    assert seen == {"refused", "mid-epoch", "at the end", "stopped early", "max_steps"}


# ---------------------------------------------------------------------- the config and the phase


def test_a_checkpoint_records_the_resolved_config_and_no_run_state(tmp_path):
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(3)]
    trainer = eg.Trainer(
        max_steps=4,
        num_sanity_val_steps=-1,
        max_time={"hours": 1},
        compile=False,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(task, task.init(nn.Linear(3, 1)), data, data[:1])
    saved = checkpoint.read_meta(trainer.save_checkpoint(tmp_path / "c"))["extra"]["config"]
    assert saved == json.loads(json.dumps(trainer.config.to_json()))
    assert set(saved) == {f.name for f in attrs.fields(LoopConfig)} | {"torch_version", "threads"}
    run_state = {"stage", "should_stop", "sanity_checking", "num_training_batches", "task"}
    assert not run_state & set(saved)
    assert saved["max_epochs"] == -1 and saved["max_time"] == 3600.0
    assert saved["num_sanity_val_steps"] == INF and saved["torch_version"] == torch.__version__
    # the run directory's config.json is the same record, with the run's world size (replay
    # runs that many ranks)
    assert trainer.run_dir is not None
    record = json.loads((Path(trainer.run_dir) / "config.json").read_text())
    assert record == {**saved, "world_size": 1, "sharded": False}


def test_the_config_is_frozen_and_the_trainers_flags_read_it():
    trainer = eg.Trainer(fast_dev_run=2, **QUIET)
    config = trainer.config
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.max_steps = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        trainer.max_steps = 5  # type: ignore[misc]
    for field in attrs.fields(LoopConfig):
        assert getattr(trainer, field.name) == getattr(config, field.name)
    assert (config.max_steps, config.limit_val_batches, config.enable_journal) == (2, 2, False)


@pytest.mark.parametrize("phase", list(Phase))
def test_a_phase_reads_back_from_its_checkpoint_value(phase):
    assert Phase.parse(phase.value) is phase
    assert Phase.parse(None) is Phase.BETWEEN  # a checkpoint that recorded none
    with pytest.raises(ValueError, match="none of the loop's phases"):
        Phase.parse("between_batches")


def test_the_trainers_signature_is_the_flag_table():
    """One table of the flags (``engine.plan.flags.Flags``): the Trainer's explicit signature
    (for IDEs and jsonargparse) has its names, defaults and annotations, in its order; the
    resolution takes it; every resolved field is a read-only attribute of the Trainer."""
    given = [p for p in inspect.signature(eg.Trainer.__init__).parameters.values()][1:]
    assert all(p.kind is p.KEYWORD_ONLY for p in given)
    assert [(p.name, p.default, p.annotation) for p in given] == [
        (f.name, f.default, f.type) for f in attrs.fields(Flags)
    ]
    assert resolve(Flags(max_steps=7)) == resolve(max_steps=7)
    trainer = eg.Trainer(max_steps=7, barebones=True)
    for field in attrs.fields(LoopConfig):
        assert getattr(trainer, field.name) == getattr(trainer.config, field.name), field.name
        with pytest.raises(AttributeError):
            setattr(trainer, field.name, None)
