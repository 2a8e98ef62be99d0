"""What a Lightning user reads off the Trainer and sees the loop do, against Lightning itself:
the trainer's attributes, the run's length for schedules, resumes under changed limits and
accumulation, per-batch schedulers, and a hyperparameter that float16 cannot hold."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim
from engine.checkpoint import CheckpointError
from engine.listeners import EarlyStopping, LearningRateSchedule, ModelCheckpoint, ReduceLROnPlateau

pl = pytest.importorskip("pytorch_lightning")

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
ENGINE_QUIET = {**QUIET, "enable_journal": False}


def _dataset(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


class _PL(pl.LightningModule):
    """The Lightning side: the same model, loss and SGD; records the lr of each batch."""

    def __init__(self, lr: float = 0.1, scheduler=None, total=None):
        super().__init__()
        self.net = _model()
        self.lr, self.scheduler, self.total = lr, scheduler, total
        self.lrs: list[float] = []
        self.estimated: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return _loss(self.net, batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", _loss(self.net, batch))

    def configure_optimizers(self):
        self.estimated.append(self.trainer.estimated_stepping_batches)
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.scheduler(opt, self.trainer)}


def _pl_fit(module, loader, val=None, ckpt_path=None, **flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(**{**QUIET, **flags})
        trainer.fit(module, loader, val, ckpt_path=ckpt_path)
    return trainer


class _PLSaveAt(pl.Callback):
    def __init__(self, batch_idx: int, path: str, epoch: int = 0):
        self.batch_idx, self.path, self.epoch = batch_idx, path, epoch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


class _SaveAt(eg.Listener):
    def __init__(self, batch_idx: int, path: str, epoch: int = 0):
        self.batch_idx, self.path, self.epoch = batch_idx, path, epoch

    def on_train_batch_end(self, rec):
        if rec.batch_idx == self.batch_idx and rec.run.current_epoch == self.epoch:
            return eg.Save(self.path)
        return None


class _Batches(eg.Listener):
    """The lr (injected or of the task's schedule) of each training batch, and the count."""

    def __init__(self):
        self.lrs: list[float] = []

    def on_train_batch_start(self, rec):
        self.lrs.append(optim.get_hyperparams(rec.state.opt_state)["lr"])


# ----------------------------------------------------------------------- trainer attributes


def test_logger_checkpoint_and_early_stopping_callbacks_read_as_lightnings(tmp_path):
    from engine.loggers import CSVLogger

    stop, saver = EarlyStopping("val_loss"), ModelCheckpoint(dirpath=tmp_path / "c")
    engine_logger = CSVLogger(tmp_path)
    t = eg.Trainer(logger=[engine_logger], callbacks=[stop, saver], enable_progress_bar=False)
    assert t.logger is engine_logger and t.checkpoint_callback is saver
    assert t.early_stopping_callback is stop
    assert t.checkpoint_callbacks == [saver] and t.early_stopping_callbacks == [stop]
    # without them, Lightning's reads: None, a default ModelCheckpoint, None
    p = pl.Trainer(logger=False, enable_progress_bar=False)
    e = eg.Trainer(logger=False, enable_progress_bar=False)
    for name in ("logger", "early_stopping_callback"):
        assert getattr(p, name) is None and getattr(e, name) is None
    assert type(p.checkpoint_callback).__name__ == type(e.checkpoint_callback).__name__
    assert e.checkpoint_callback.dirpath is None  # resolved at fit start, as Lightning's
    assert pl.Trainer(enable_checkpointing=False).checkpoint_callback is None
    assert eg.Trainer(enable_checkpointing=False).checkpoint_callback is None


@pytest.mark.parametrize(
    ("name", "replacement"),
    [
        ("lightning_module", "trainer.state.params"),
        ("model", "engine.predict_step"),
        ("optimizers", "trainer.task.tx"),
        ("lr_scheduler_configs", "LearningRateSchedule"),
        ("fit_loop", "engine.loop.fit.fit"),
        ("precision_plugin", "trainer.precision"),
        ("training", "trainer.stage"),
    ],
)
def test_a_lightning_trainer_attribute_engine_lacks_names_its_replacement(name, replacement):
    assert hasattr(pl.Trainer(logger=False), name)  # a real attribute of Lightning's Trainer
    with pytest.raises(AttributeError, match=rf"Lightning's trainer\.{name}\)") as e:
        getattr(eg.Trainer(logger=False), name)
    assert replacement in str(e.value)
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_thing'$"):
        eg.Trainer(logger=False).no_such_thing  # noqa: B018


def test_trainer_strategy_is_the_flag_and_lightnings_strategy_attributes_name_engines():
    lightning = pl.Trainer(logger=False)
    assert lightning.strategy.root_device == torch.device("cpu")  # a Strategy object there
    trainer = eg.Trainer(logger=False)
    assert trainer.strategy == "auto" and isinstance(trainer.strategy, str)
    with pytest.raises(AttributeError, match=r"strategy\.root_device is trainer\.root_device"):
        trainer.strategy.root_device  # noqa: B018
    assert trainer.root_device == lightning.strategy.root_device


# ----------------------------------------------------------------------- the run's length

COMBOS = [
    (limit, accumulate, max_epochs, max_steps)
    for limit, accumulate, max_epochs, max_steps in itertools.product(
        [None, 3, 0.5], [1, 3], [1, 3, None], [-1, 5]
    )
    if not (max_epochs is None and max_steps == -1 and limit == 0.5)  # keep it short
]


def test_estimated_stepping_batches_is_lightnings():
    loader = DataLoader(_dataset(), batch_size=2)  # 8 batches
    for limit, accumulate, max_epochs, max_steps in COMBOS[::3]:
        flags = {
            "limit_train_batches": limit,
            "accumulate_grad_batches": accumulate,
            "max_epochs": max_epochs,
            "max_steps": max_steps,
            "limit_val_batches": 0,
        }
        module = _PL()
        _pl_fit(module, loader, **flags)
        task = eg.Task(_loss, optim.sgd(0.1))
        trainer = eg.Trainer(**ENGINE_QUIET, **flags)
        if trainer.max_epochs != -1:  # epochs count: the batches are known with the data
            with pytest.raises(RuntimeError, match="once fit"):
                trainer.estimated_stepping_batches  # noqa: B018
        trainer.fit(task, task.init(_model()), loader)
        assert trainer.estimated_stepping_batches == module.estimated[0], flags
    unlimited = eg.Trainer(**ENGINE_QUIET, max_epochs=-1)
    assert unlimited.estimated_stepping_batches == math.inf
    assert eg.Trainer(max_epochs=-1, max_steps=7).estimated_stepping_batches == 7


def _one_cycle_pl(opt, trainer):
    total = trainer.estimated_stepping_batches
    return {
        "scheduler": torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.5, total_steps=total, cycle_momentum=False
        ),
        "interval": "step",
    }


@pytest.mark.parametrize(("limit", "accumulate", "max_epochs", "max_steps"), COMBOS[1::4])
def test_total_steps_auto_is_the_runs_length_as_lightning_estimates_it(
    limit, accumulate, max_epochs, max_steps
):
    """A OneCycleLR over ``self.trainer.estimated_stepping_batches`` in Lightning is
    ``one_cycle(total_steps="auto")`` in engine: the same learning rates, the same weights."""
    loader = DataLoader(_dataset(), batch_size=2)
    flags = {
        "limit_train_batches": limit,
        "accumulate_grad_batches": accumulate,
        "max_epochs": max_epochs,
        "max_steps": max_steps,
        "limit_val_batches": 0,
    }
    module = _PL(scheduler=_one_cycle_pl)
    _pl_fit(module, loader, **flags)
    total = module.estimated[0]

    def task(total_steps):
        return eg.Task(_loss, optim.sgd(optim.one_cycle(0.5, total_steps=total_steps)))

    trainer = eg.Trainer(**ENGINE_QUIET, **flags)
    auto = trainer.fit(task("auto"), task("auto").init(_model()), loader)
    assert trainer.task.tx.recipe.arguments["lr"](0) == optim.one_cycle(0.5, total)(0)
    torch.testing.assert_close(auto.params["weight"], module.net.weight.detach())
    given = eg.Trainer(**ENGINE_QUIET, **flags).fit(task(total), task(total).init(_model()), loader)
    assert auto.fingerprint() == given.fingerprint()  # bitwise the hand-computed length


def test_total_steps_auto_follows_a_resume_that_raised_max_epochs_and_resumes_bitwise(tmp_path):
    loader = DataLoader(_dataset(), batch_size=4)  # 4 batches an epoch
    # Lightning: resumed with max_epochs raised, configure_optimizers reads the longer run
    _pl_fit(_PL(), loader, max_epochs=2, callbacks=[_PLSaveAt(1, str(tmp_path / "pl.ckpt"))])
    resumed_pl = _PL()
    _pl_fit(resumed_pl, loader, ckpt_path=str(tmp_path / "pl.ckpt"), max_epochs=5)
    assert resumed_pl.estimated == [20]

    def task(total_steps):
        tx = optim.inject_hyperparams(optim.adamw)(
            lr=optim.warmup_cosine(0.05, warmup_steps=2, total_steps=total_steps)
        )
        return eg.Task(_loss, tx)

    first = eg.Trainer(**ENGINE_QUIET, max_epochs=2, callbacks=[_SaveAt(1, str(tmp_path / "c"))])
    first.fit(task("auto"), task("auto").init(_model()), loader)
    assert first.estimated_stepping_batches == 8
    longer = eg.Trainer(**ENGINE_QUIET, max_epochs=5)
    end = longer.fit(task("auto"), task("auto").init(_model()), loader, ckpt_path=tmp_path / "c")
    schedule = longer.task.tx.recipe.arguments["lr"]
    assert [schedule(n) for n in range(21)] == [
        optim.warmup_cosine(0.05, 2, total_steps=20)(n) for n in range(21)
    ]
    # the same resume with the length given by hand: bitwise
    by_hand = eg.Trainer(**ENGINE_QUIET, max_epochs=5).fit(
        task(20), task(20).init(_model()), loader, ckpt_path=tmp_path / "c"
    )
    assert end.fingerprint() == by_hand.fingerprint()
    # and under unchanged flags a resume is the uninterrupted run, bitwise
    whole = eg.Trainer(**ENGINE_QUIET, max_epochs=2).fit(
        task("auto"), task("auto").init(_model()), loader
    )
    again = eg.Trainer(**ENGINE_QUIET, max_epochs=2).fit(
        task("auto"), task("auto").init(_model()), loader, ckpt_path=tmp_path / "c"
    )
    assert whole.fingerprint() == again.fingerprint()


def test_a_run_with_total_steps_auto_replays_bitwise(tmp_path):
    loader = DataLoader(_dataset(), batch_size=4)
    task = eg.Task(_loss, optim.adamw(optim.one_cycle(0.05, total_steps="auto")))
    trainer = eg.Trainer(
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
    )
    trainer.fit(task, task.init(_model()), loader)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical and report.steps == 12, str(report)


def test_total_steps_auto_outside_a_trainer_or_in_an_endless_run_says_what_to_do():
    schedule = optim.warmup_cosine(1e-3, warmup_steps=2, total_steps="auto")
    with pytest.raises(RuntimeError, match="total_steps=N"):
        schedule(0)
    with pytest.raises(ValueError, match="warmup_steps"):
        optim.warmup_cosine(1e-3, warmup_steps=-1, total_steps="auto")  # checked now
    task = eg.Task(_loss, optim.sgd(schedule))
    endless = eg.Trainer(**ENGINE_QUIET, max_epochs=-1)
    with pytest.raises(ValueError, match="run's length is unknown"):
        endless.fit(task, task.init(_model()), DataLoader(_dataset(), batch_size=4))
    short = eg.Trainer(**ENGINE_QUIET, max_steps=2)
    with pytest.raises(ValueError, match="takes 2 optimizer steps"):
        short.fit(task, task.init(_model()), DataLoader(_dataset(), batch_size=4))


# ----------------------------------------------------------------------- resumes


def _count_batches() -> tuple[eg.Listener, list[int]]:
    seen: list[int] = []
    return eg.on(eg.Event.ON_TRAIN_BATCH_START, lambda rec: seen.append(rec.state.step)), seen


@pytest.mark.parametrize(
    ("save_epoch", "save_batch", "limits"),
    [
        (1, 1, {"max_epochs": 1}),  # step 6, in epoch 1: already reached
        (0, 2, {"max_epochs": 1}),  # step 3, in epoch 0: finishes it
        (1, 1, {"max_steps": 5}),  # step 6: past max_steps
    ],
)
def test_a_resume_under_limits_the_checkpoint_reached_trains_what_lightning_trains(
    tmp_path, save_epoch, save_batch, limits
):
    loader = DataLoader(_dataset(), batch_size=4)  # 4 batches an epoch
    pl_ckpt = str(tmp_path / "pl.ckpt")
    _pl_fit(_PL(), loader, max_epochs=2, callbacks=[_PLSaveAt(save_batch, pl_ckpt, save_epoch)])
    module = _PL()
    resumed = _pl_fit(module, loader, ckpt_path=pl_ckpt, **limits)

    task = eg.Task(_loss, optim.sgd(0.1))
    saver = _SaveAt(save_batch, str(tmp_path / "c"), save_epoch)
    eg.Trainer(**ENGINE_QUIET, max_epochs=2, callbacks=[saver]).fit(
        task, task.init(_model()), loader
    )
    counter, seen = _count_batches()
    trainer = eg.Trainer(**ENGINE_QUIET, callbacks=[counter], **limits)
    trainer.fit(task, task.init(_model()), loader, ckpt_path=tmp_path / "c")
    assert len(seen) == len(module.lrs)
    assert (trainer.global_step, trainer.current_epoch) == (
        resumed.global_step,
        resumed.current_epoch,
    )


def test_a_resume_inside_an_accumulation_window_refuses_another_accumulate(tmp_path):
    loader = DataLoader(_dataset(), batch_size=2)  # 8 batches
    task = eg.Task(_loss, optim.sgd(0.1))
    eg.Trainer(
        **ENGINE_QUIET,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[_SaveAt(2, str(tmp_path / "inside")), _SaveAt(1, str(tmp_path / "edge"))],
    ).fit(task, task.init(_model()), loader)
    trainer = eg.Trainer(**ENGINE_QUIET, max_epochs=1, accumulate_grad_batches=4)
    with pytest.raises(CheckpointError) as e:
        trainer.fit(task, task.init(_model()), loader, ckpt_path=tmp_path / "inside")
    message = str(e.value)
    assert "accumulate_grad_batches=2" in message and "accumulates 4" in message
    assert "after step 1" in message
    # the same value continues the window
    eg.Trainer(**ENGINE_QUIET, max_epochs=1, accumulate_grad_batches=2).fit(
        task, task.init(_model()), loader, ckpt_path=tmp_path / "inside"
    )


class _PLSteps(pl.Callback):
    def __init__(self):
        self.steps: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append((batch_idx, trainer.global_step))


def test_a_resume_at_a_window_boundary_may_change_accumulate_as_in_lightning(tmp_path):
    """Saved after batch 1 (an optimizer step of windows of 2), resumed with windows of 4:
    Lightning steps after batch 3 (a partial window) and 7; so does engine, and its weights
    are those of that partial window's gradient."""
    loader = DataLoader(_dataset(), batch_size=2)
    pl_ckpt = str(tmp_path / "pl.ckpt")
    _pl_fit(
        _PL(), loader, max_epochs=1, accumulate_grad_batches=2, callbacks=[_PLSaveAt(1, pl_ckpt)]
    )
    pl_steps = _PLSteps()
    resumed = _pl_fit(
        _PL(),
        loader,
        ckpt_path=pl_ckpt,
        max_epochs=1,
        accumulate_grad_batches=4,
        callbacks=[pl_steps],
    )
    assert pl_steps.steps == [(2, 1), (3, 2), (4, 2), (5, 2), (6, 2), (7, 3)]

    task = eg.Task(_loss, optim.sgd(0.1))
    eg.Trainer(
        **ENGINE_QUIET,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[_SaveAt(1, str(tmp_path / "c"))],
    ).fit(task, task.init(_model()), loader)
    steps: list[tuple[int, int]] = []
    record = eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda r: steps.append((r.batch_idx, r.state.step)))
    trainer = eg.Trainer(
        **ENGINE_QUIET, max_epochs=1, accumulate_grad_batches=4, callbacks=[record]
    )
    state = trainer.fit(task, task.init(_model()), loader, ckpt_path=tmp_path / "c")
    assert steps == pl_steps.steps and trainer.global_step == resumed.global_step

    # by hand: from the checkpoint's weights, SGD over batches 2-3 then 4-7, each loss / 4
    model = _model()
    eg.checkpoint.load_weights(tmp_path / "c", model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(loader)
    for window in (batches[2:4], batches[4:8]):
        for batch in window:
            (_loss(model, batch) / 4).backward()
        sgd.step()
        sgd.zero_grad()
    torch.testing.assert_close(state.params["weight"], model.weight.detach())
    torch.testing.assert_close(state.params["bias"], model.bias.detach())


# ----------------------------------------------------------------------- float16 hyperparameters


def test_an_eps_that_float16_rounds_to_zero_is_warned_about_by_name():
    # the reference: torch.optim.AdamW on a .half() model turns a zero gradient into NaN
    model = _model().half()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    reference.step()
    assert model.weight.isnan().all()

    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    task = eg.Task(_loss, optim.adamw(1e-3))
    with pytest.warns(RuntimeWarning) as caught:
        eg.Trainer(**ENGINE_QUIET, max_steps=1, precision="16-true").fit(
            task, task.init(_model()), data
        )
    (message,) = [str(w.message) for w in caught if "eps" in str(w.message)]
    for part in ("optim.adamw(eps=1e-08)", "torch.float16", "precision='16-true'", "NaN"):
        assert part in message
    assert "eps=0.0001" in message  # what to do
    # the same optimizer state under float16 from the foreach path: the NaN the warning names
    foreach = eg.Task(_loss, optim.adamw(1e-3, fused=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero_grad = eg.Task(lambda m, b: m(b[0] * 0).sum(), foreach.tx)  # weight: grad 0
        state = eg.Trainer(**ENGINE_QUIET, max_steps=1, precision="16-true").fit(
            zero_grad, zero_grad.init(_model()), data
        )
    assert state.params["weight"].isnan().all()
    # bfloat16 holds 1e-8, float32 parameters (mixed precision) too: no warning
    for precision in ("bf16-true", "16-mixed", "32-true"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            injected = eg.Task(_loss, optim.inject_hyperparams(optim.adamw)(lr=1e-3))
            eg.Trainer(**ENGINE_QUIET, max_steps=1, precision=precision).fit(
                injected, injected.init(_model()), data
            )
    # an injected eps is read from the state
    injected = eg.Task(_loss, optim.inject_hyperparams(optim.adam)(lr=1e-3, eps=1e-9))
    with pytest.warns(RuntimeWarning, match=r"eps=1e-09\)"):
        eg.Trainer(**ENGINE_QUIET, max_steps=1, precision="16-true").fit(
            injected, injected.init(_model()), data
        )


# ----------------------------------------------------------------------- per-batch schedulers


def test_a_schedule_stepped_per_batch_with_a_frequency_steps_where_lightning_does():
    """3 batches an epoch, StepLR(1, 0.5) every 2 batches: Lightning counts the batch index in
    the epoch, [1, 1, .5, .5, .5, .25], not the global step."""
    loader = DataLoader(TensorDataset(*_dataset(12).tensors), batch_size=4)

    def step_lr(opt, trainer):
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        return {"scheduler": scheduler, "interval": "step", "frequency": 2}

    module = _PL(lr=1.0, scheduler=step_lr)
    _pl_fit(module, loader, max_epochs=2)
    assert module.lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25]

    lrs = _Batches()
    schedule = LearningRateSchedule(optim.step_lr(1.0, 1, 0.5), interval="step", frequency=2)
    task = eg.Task(_loss, optim.inject_hyperparams(optim.sgd)(lr=1.0))
    eg.Trainer(**ENGINE_QUIET, max_epochs=2, callbacks=[schedule, lrs]).fit(
        task, task.init(_model()), loader
    )
    assert lrs.lrs == module.lrs


def _plateau_pl(opt, trainer):
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    return {"scheduler": scheduler, "interval": "step", "frequency": 3, "monitor": "val_loss"}


def _plateau_task() -> eg.Task:
    return eg.Task(
        _loss,
        optim.inject_hyperparams(optim.sgd)(lr=0.1),
        eval_fn=lambda m, b: {"val_loss": _loss(m, b)},
    )


def test_a_per_step_plateau_reads_the_validation_after_its_batch_as_lightning_does():
    """val_check_interval=3, frequency=3: each check reads the validation just run after its
    batch (today's engine: 'metric is not available', or with strict=False the previous
    validation's value)."""
    train = DataLoader(TensorDataset(*_dataset(12).tensors), batch_size=2)  # 6 batches
    val = DataLoader(TensorDataset(*_dataset(6).tensors), batch_size=3)
    flags = {"max_epochs": 3, "val_check_interval": 3, "num_sanity_val_steps": 0}
    module = _PL(lr=0.1, scheduler=_plateau_pl)
    _pl_fit(module, train, val, **flags)
    assert len(set(module.lrs)) > 2  # it reduced, more than once

    for strict in (True, False):
        lrs = _Batches()
        plateau = ReduceLROnPlateau(
            "val_loss", patience=0, factor=0.5, interval="step", frequency=3, strict=strict
        )
        task = _plateau_task()
        eg.Trainer(**ENGINE_QUIET, callbacks=[plateau, lrs], **flags).fit(
            task, task.init(_model()), train, val
        )
        assert lrs.lrs == pytest.approx(module.lrs, rel=0, abs=0), strict


def test_a_per_step_plateau_resumes_bitwise_from_a_check_waiting_for_its_validation(tmp_path):
    train = DataLoader(TensorDataset(*_dataset(12).tensors), batch_size=2)
    val = DataLoader(TensorDataset(*_dataset(6).tensors), batch_size=3)
    flags = {"max_epochs": 3, "val_check_interval": 3, "num_sanity_val_steps": 0}

    def run(callbacks, ckpt_path=None):
        plateau = ReduceLROnPlateau(
            "val_loss", patience=0, factor=0.5, interval="step", frequency=3
        )
        task = _plateau_task()
        trainer = eg.Trainer(**ENGINE_QUIET, callbacks=[plateau, *callbacks], **flags)
        return trainer.fit(task, task.init(_model()), train, val, ckpt_path=ckpt_path)

    whole = run([_SaveAt(2, str(tmp_path / "c"), epoch=1)])  # saved at the check, before val
    resumed = run([], ckpt_path=tmp_path / "c")
    assert optim.get_hyperparams(whole.opt_state)["lr"] < 0.1
    assert resumed.fingerprint() == whole.fingerprint()


def test_the_migration_guide_shows_a_listener_running_the_model_in_eval_mode():
    """docs/lightning.md is doctested: its example of Lightning's ``pl_module(x)`` in a
    callback (a prediction step on ``rec.state``) runs there; here, that it is there."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "lightning.md").read_text()
    blocks = guide.split("```python")[1:]
    (example,) = [b for b in blocks if "class Sample(eg.Listener)" in b]
    assert "eg.predict_step(" in example and "rec.state" in example
    assert "watched.fingerprint() == unwatched.fingerprint()" in example
    assert 'total_steps="auto"' in guide and "estimated_stepping_batches" in guide


def test_a_per_step_plateau_run_replays_bitwise(tmp_path):
    """Its reductions, asked for after the validations inside epochs, are journaled and
    applied again by a replay, which runs no validation."""
    train = DataLoader(TensorDataset(*_dataset(12).tensors), batch_size=2)
    val = DataLoader(TensorDataset(*_dataset(6).tensors), batch_size=3)
    plateau = ReduceLROnPlateau("val_loss", patience=0, factor=0.5, interval="step", frequency=3)
    task = _plateau_task()
    trainer = eg.Trainer(
        max_epochs=3,
        val_check_interval=3,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        callbacks=[plateau],
    )
    state = trainer.fit(task, task.init(_model()), train, val)
    assert optim.get_hyperparams(state.opt_state)["lr"] < 0.1 / 2  # reduced twice or more
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical and report.steps == 18, str(report)
