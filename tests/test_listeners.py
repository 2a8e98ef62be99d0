"""Listeners against a fake driver that emits Lightning 2.x's fit events through the Emitter.

Golden cases come from Lightning's own tests (tests_pytorch/callbacks/test_early_stopping.py,
test_timer.py) and from torch.optim.lr_scheduler; the fake driver follows the event order of
Lightning's fit loop, so "stopped after epoch k" means what it means there.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch
from _fake_fit import FakeFit
from torch import nn

import engine as eg
from engine import optim
from engine.events import Event, EventRecord, Log
from engine.listeners import (
    EarlyStopping,
    EarlyStoppingReason,
    LearningRateMonitor,
    Timer,
    parse_duration,
)
from engine.listeners import timer as timer_module


def _series(values: Sequence[float], key: str) -> Callable[[int], dict[str, float]]:
    return lambda epoch: {key: float(values[epoch])}


# ---------------------------------------------------------------------- EarlyStopping


@pytest.mark.parametrize(
    ("losses", "patience", "expected_stop_epoch"),
    [([6, 5, 5, 5, 5, 5], 3, 4), ([6, 5, 4, 4, 3, 3], 1, 3), ([6, 5, 6, 5, 5, 5], 3, 4)],
)
def test_early_stopping_patience_matches_lightning(losses, patience, expected_stop_epoch):
    es = EarlyStopping("val/loss", patience=patience)
    fit = FakeFit([es], val_metrics=_series(losses, "val/loss")).fit()
    assert fit.current_epoch - 1 == expected_stop_epoch
    assert es.stopped_epoch == expected_stop_epoch
    assert es.stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert len(fit.stops) == 1 and "has not improved" in fit.stops[0].reason


@pytest.mark.parametrize("with_validation", [True, False])
@pytest.mark.parametrize(
    ("losses", "patience", "expected_stop_epoch"),
    [([6, 5, 5, 5, 5, 5], 3, 4), ([6, 5, 4, 4, 3, 3], 1, 3), ([6, 5, 6, 5, 5, 5], 3, 4)],
)
def test_early_stopping_on_train_epoch_end_matches_lightning(
    losses, patience, expected_stop_epoch, with_validation
):
    es = EarlyStopping("train/loss_epoch", patience=patience, check_on_train_epoch_end=True)
    fit = FakeFit(
        [es],
        num_val_batches=[1] if with_validation else [],
        train_epoch_metrics=_series(losses, "train/loss_epoch"),
    ).fit()
    assert fit.current_epoch - 1 == expected_stop_epoch


@pytest.mark.parametrize(
    ("stopping_threshold", "divergence_threshold", "losses", "expected_epoch", "reason"),
    [
        (None, None, [8, 4, 2, 3, 4, 5, 8, 10], 5, EarlyStoppingReason.PATIENCE_EXHAUSTED),
        (2.9, None, [9, 8, 7, 6, 5, 6, 4, 3, 2, 1], 8, EarlyStoppingReason.STOPPING_THRESHOLD),
        (None, 15.9, [9, 4, 2, 16, 32, 64], 3, EarlyStoppingReason.DIVERGENCE_THRESHOLD),
    ],
)
def test_early_stopping_thresholds_match_lightning(
    stopping_threshold, divergence_threshold, losses, expected_epoch, reason
):
    es = EarlyStopping(
        "abc", stopping_threshold=stopping_threshold, divergence_threshold=divergence_threshold
    )
    fit = FakeFit([es], max_epochs=20, val_metrics=_series(losses, "abc")).fit()
    assert fit.current_epoch - 1 == expected_epoch
    assert es.stopping_reason is reason
    assert es.stopping_reason_message == fit.stops[0].reason


@pytest.mark.parametrize("stop_value", [math.inf, math.nan])
def test_early_stopping_stops_on_a_non_finite_metric(stop_value):
    es = EarlyStopping("val/loss", check_finite=True)
    fit = FakeFit([es], val_metrics=_series([4, 3, stop_value, 2, 1], "val/loss")).fit()
    assert fit.current_epoch - 1 == 2 and es.stopped_epoch == 2
    assert es.stopping_reason is EarlyStoppingReason.NON_FINITE_METRIC
    assert "is not finite" in fit.stops[0].reason


def test_early_stopping_nan_without_check_finite_counts_as_no_improvement():
    es = EarlyStopping("val/loss", check_finite=False, patience=2)
    fit = FakeFit([es], val_metrics=_series([1, math.nan, math.nan, 0], "val/loss")).fit()
    assert fit.current_epoch - 1 == 2 and es.best_score == 1.0


@pytest.mark.parametrize("order", [0, 1])
def test_any_of_several_early_stoppings_stops_the_fit(order):
    # Lightning's test_multiple_early_stopping_callbacks: "cba" is constant 0 -> stops at 3
    listeners = [EarlyStopping("abc"), EarlyStopping("cba", patience=3)]
    losses = [8, 4, 2, 3, 4, 5, 8, 10]
    fit = FakeFit(
        listeners[order:] + listeners[:order],
        max_epochs=20,
        val_metrics=lambda e: {"abc": float(losses[e]), "cba": 0.0},
    ).fit()
    assert fit.current_epoch - 1 == 3


@pytest.mark.parametrize(
    ("mode", "values", "min_delta", "expected_stop_epoch"),
    [
        # a change of exactly min_delta is no improvement (Lightning's documented rule)
        ("min", [1.0, 0.75, 0.8, 0.5], 0.25, 2),
        ("min", [1.0, 0.5, 0.0, -0.5, -1.0, -1.5], 0.25, None),
        ("max", [0.0, 0.25, 0.2, 1.0], 0.25, 2),
        ("max", [0.0, 0.5, 1.0, 1.5], 0.25, None),
        ("max", [0.0, 0.25, 0.5, 0.75], 0.0, None),
    ],
)
def test_min_delta_is_an_absolute_margin_in_the_monitored_direction(
    mode, values, min_delta, expected_stop_epoch
):
    es = EarlyStopping("m", mode=mode, min_delta=min_delta, patience=2)
    fit = FakeFit([es], max_epochs=len(values), val_metrics=_series(values, "m")).fit()
    if expected_stop_epoch is None:
        assert not fit.stops and es.best_score == values[-1]
    else:
        assert fit.current_epoch - 1 == expected_stop_epoch
        assert es.best_score == values[0]


def test_early_stopping_waits_for_min_epochs_like_the_trainer():
    es = EarlyStopping("val/loss", patience=1)
    fit = FakeFit([es], min_epochs=5, val_metrics=lambda e: {"val/loss": 1.0}).fit()
    assert fit.current_epoch == 5  # stop requested at epoch 1, honoured after min_epochs
    assert es.stopped_epoch == 4 and es.wait_count == 4


def test_missing_metric_with_strict_raises_naming_the_monitor_and_the_keys():
    es = EarlyStopping("val/los")
    with pytest.raises(RuntimeError, match=r"val/los.*\['val/acc', 'val/loss'\]"):
        FakeFit([es], val_metrics=lambda e: {"val/loss": 1.0, "val/acc": 0.5}).fit()


def test_missing_metric_without_strict_skips_the_check_and_warns_when_verbose():
    es = EarlyStopping("val/los", strict=False, patience=1)
    fit = FakeFit([es], max_epochs=3, val_metrics=lambda e: {"val/loss": 1.0}).fit()
    assert not fit.stops and es.wait_count == 0
    with pytest.warns(RuntimeWarning, match="val/los"):
        FakeFit([EarlyStopping("val/los", strict=False, verbose=True)], max_epochs=1).fit()


def test_no_check_during_the_sanity_check_or_outside_fit():
    es = EarlyStopping("val/loss", check_on_train_epoch_end=False)
    es.evaluate = mock.Mock(return_value=(False, None))  # type: ignore[method-assign]
    fit = FakeFit([es], max_epochs=2, num_sanity_val_steps=2, val_metrics=lambda e: {"val/loss": 1})
    fit.callback_metrics["val/loss"] = 3.0  # present during the sanity check too
    fit.fit()
    assert es.evaluate.call_count == 2  # the two epochs, not the sanity check
    fit.validate([1], stage="validate")  # trainer.validate()
    assert es.evaluate.call_count == 2


@pytest.mark.parametrize(
    ("kwargs", "expected_checks_at"),
    [
        ({}, "on_train_epoch_end"),  # validation once per epoch, at its end
        ({"num_val_batches": []}, "on_train_epoch_end"),  # no validation
        ({"check_val_every_n_epoch": 2}, "on_validation_end"),
        ({"val_check_interval": 0.5, "num_training_batches": 4}, "on_validation_end"),
        ({"val_check_interval": 1, "num_training_batches": 4}, "on_validation_end"),
        ({"expose_schedule": False}, "on_validation_end"),  # schedule unknown: after validation
        ({"expose_schedule": False, "num_val_batches": [0]}, "on_train_epoch_end"),
    ],
)
def test_default_check_place_follows_lightnings_rule(kwargs, expected_checks_at):
    es = EarlyStopping("m", patience=100)
    places: list[str] = []
    real = es._run_check

    def spy(rec):
        places.append(rec.event.value)
        return real(rec)

    es._run_check = spy  # type: ignore[method-assign]
    FakeFit(
        [es],
        max_epochs=2,
        val_metrics=lambda e: {"m": 1.0},
        train_epoch_metrics=lambda e: {"m": 1.0},
        **kwargs,
    ).fit()
    assert places and set(places) == {expected_checks_at}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # Lightning's test_check_on_train_epoch_end_smart_handling: two checks, the second stops
        ({"val_check_interval": 0.3, "num_training_batches": 10}, ("global_step", 6)),
        ({"check_val_every_n_epoch": 2, "max_epochs": 5}, ("current_epoch", 4)),
    ],
)
def test_smart_check_placement_cases_from_lightning(kwargs, expected):
    es = EarlyStopping("foo")
    es.evaluate = mock.Mock(side_effect=[(False, "A"), (True, "B")])  # type: ignore[method-assign]
    fit = FakeFit([es], val_metrics=lambda e: {"foo": 1.0}, **{"max_epochs": 10, **kwargs}).fit()
    assert es.evaluate.call_count == 2
    assert getattr(fit, expected[0]) == expected[1]


def test_early_stopping_state_round_trips_and_accepts_lightnings_format():
    es = EarlyStopping("val/loss", patience=2)
    FakeFit([es], val_metrics=_series([3, 2, 2, 2], "val/loss")).fit()
    restored = EarlyStopping("val/loss", patience=7)
    restored.load_state_dict(es.state_dict())
    assert restored.state_dict() == es.state_dict()
    assert (restored.wait_count, restored.stopped_epoch, restored.best_score) == (2, 3, 2.0)
    assert restored.patience == 2 and restored.stopping_reason.name == "PATIENCE_EXHAUSTED"
    # a Lightning checkpoint's entry: tensor best_score, no stopping_reason
    old = EarlyStopping("val/loss")
    old.load_state_dict(
        {"wait_count": 2, "stopped_epoch": 5, "best_score": torch.tensor(0.5), "patience": 3}
    )
    assert old.best_score == 0.5 and old.stopping_reason is EarlyStoppingReason.NOT_STOPPED
    assert old.stopping_reason_message is None


def test_resumed_early_stopping_continues_its_wait_count():
    es = EarlyStopping("val/loss", patience=3)
    FakeFit([es], max_epochs=3, val_metrics=_series([1, 2, 2], "val/loss")).fit()
    assert es.wait_count == 2
    resumed = EarlyStopping("val/loss", patience=3)
    resumed.load_state_dict(es.state_dict())
    fit = FakeFit([resumed], val_metrics=lambda e: {"val/loss": 2.0}).fit()
    assert fit.current_epoch == 1  # one more non-improving check exhausts patience


def test_early_stopping_arguments_are_checked():
    with pytest.raises(ValueError, match="'unknown'"):
        EarlyStopping("m", mode="unknown")
    with pytest.raises(ValueError, match="-1"):
        EarlyStopping("m", patience=-1)
    assert (
        EarlyStopping("val_loss").state_key == "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"
    )


def test_early_stopping_pickles():
    es = EarlyStopping("foo")
    assert vars(pickle.loads(pickle.dumps(es))) == vars(es)


def test_verbose_early_stopping_prints_improvements_and_the_reason(capsys):
    es = EarlyStopping("val/loss", patience=1, verbose=True)
    FakeFit([es], val_metrics=_series([2.0, 1.0, 1.5], "val/loss")).fit()
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "val/loss improved; new best: 2.000",
        "val/loss improved by 1.000 >= min_delta = 0.0; new best: 1.000",
        "val/loss has not improved for 1 checks (best: 1.000); stopping.",
    ]


# ---------------------------------------------------------------------- LearningRateMonitor


class _Logger:
    def __init__(self) -> None:
        self.version = 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


class _Task:
    def __init__(self, lr: Any, momentum: Any = None) -> None:
        self.lr = lr
        self.tx = optim.sgd(0.1)  # torch.optim.SGD's: Lightning names its rate lr-SGD
        if momentum is not None:
            self.momentum = momentum


def test_lr_monitor_logs_what_torch_scheduler_gives_each_step():
    # reference: the lr torch.optim holds before each optimizer.step() under StepLR
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    expected = []
    for _ in range(8):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    monitor = LearningRateMonitor(logging_interval="step")
    fit = FakeFit(
        [monitor],
        max_epochs=2,
        num_training_batches=4,
        loggers=[_Logger()],
        task=_Task(optim.step_lr(0.1, 3, 0.5)),
    ).fit()
    assert [step for step, _ in fit.logged] == list(range(8))
    assert [m["lr-SGD"] for _, m in fit.logged] == pytest.approx(expected, rel=1e-12)
    assert monitor.lrs["lr-SGD"] == [m["lr-SGD"] for _, m in fit.logged]


def test_lr_monitor_epoch_interval_logs_at_each_epoch_start():
    monitor = LearningRateMonitor(logging_interval="epoch")
    fit = FakeFit(
        [monitor],
        max_epochs=3,
        num_training_batches=2,
        loggers=[_Logger()],
        task=_Task(lambda step: 1.0 / (step + 1)),
    ).fit()
    assert fit.logged == [(0, {"lr-SGD": 1.0}), (2, {"lr-SGD": 1 / 3}), (4, {"lr-SGD": 1 / 5})]


def test_lr_monitor_follows_log_every_n_steps_and_logs_once_per_optimizer_step():
    monitor = LearningRateMonitor()
    fit = FakeFit(
        [monitor], max_epochs=1, num_training_batches=6, loggers=[_Logger()], task=_Task(0.1)
    )
    fit.log_every_n_steps = 2
    fit.fit()
    # Lightning: (step + 1) % n == 0, and a rate without a scheduler at each epoch's start too
    assert [s for s, _ in fit.logged] == [0, 1, 3, 5]
    # micro-batches of one accumulation window share a step: logged once
    fit.logged.clear()
    fit.log_every_n_steps = 1
    state = fit.state.replace(step=10)
    requests = []
    for micro in (0, 1, 2):
        rec = EventRecord(
            Event.ON_TRAIN_BATCH_START, "fit", state.replace(micro_step=micro), {}, fit.view()
        )
        requests.append(monitor.on_train_batch_start(rec))
    assert requests == [Log({"lr-SGD": 0.1}, step=10), None, None]


def test_lr_monitor_logs_momentum_when_the_task_has_one():
    monitor = LearningRateMonitor(log_momentum=True)
    fit = FakeFit([monitor], max_epochs=1, loggers=[_Logger()], task=_Task(0.1, momentum=0.9)).fit()
    assert fit.logged[0] == (0, {"lr-SGD": 0.1, "lr-SGD-momentum": 0.9})  # Lightning's names
    with pytest.warns(RuntimeWarning, match="momentum"):
        FakeFit(
            [LearningRateMonitor(log_momentum=True)], loggers=[_Logger()], task=_Task(0.1)
        ).fit()


def _lightning_rate_names(groups, optimizer_cls=torch.optim.AdamW):
    """The names and rates Lightning's LearningRateMonitor logs for a torch optimizer over
    ``groups`` (param group dicts without params, one per group)."""
    pl = pytest.importorskip("pytorch_lightning")
    import logging
    import warnings

    logged: list[dict[str, float]] = []

    class Rows(pl.loggers.Logger):
        name, version = "rows", 0

        def log_metrics(self, metrics, step=None):
            logged.append({k: v for k, v in metrics.items() if k.startswith("lr")})

        def log_hyperparams(self, *args, **kwargs):
            pass

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.nets = nn.ModuleList(nn.Linear(2, 1) for _ in groups)

        def training_step(self, batch, batch_idx):
            return sum(net(batch[0]).sum() for net in self.nets)

        def configure_optimizers(self):
            return optimizer_cls(
                [{"params": n.parameters(), **g} for n, g in zip(self.nets, groups, strict=True)]
            )

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            max_steps=1,
            logger=Rows(),
            callbacks=[pl.callbacks.LearningRateMonitor()],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        ).fit(Module(), torch.utils.data.DataLoader([(torch.ones(2),)], batch_size=None))
    return next(row for row in logged if row)


def _engine_rate_names(tx, lr=None):
    rows: list[dict[str, float]] = []

    class Rows:
        def log_metrics(self, metrics, step):
            rows.append({k: v for k, v in metrics.items() if k.startswith("lr")})

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 1) for _ in range(2))

        def forward(self, x):
            return sum(layer(x) for layer in self.layers)

    task = eg.Task(lambda m, b: m(b[0]).sum(), tx, lr=lr)
    trainer = eg.Trainer(
        max_steps=1,
        logger=Rows(),
        callbacks=[LearningRateMonitor()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_journal=False,
    )
    trainer.fit(task, task.init(Two()), [(torch.ones(2),)])
    return next(row for row in rows if row)


def test_lr_monitor_names_rates_as_lightning_does_for_optimizers_and_param_groups():
    by_layer = lambda params: {k: int(k.split(".")[1]) for k in params}  # noqa: E731
    named = lambda params: {k: ("backbone", "head")[by_layer(params)[k]] for k in params}  # noqa: E731
    # one optimizer: lr-AdamW
    assert _engine_rate_names(optim.adamw(1e-3), lr=1e-3) == _lightning_rate_names([{"lr": 1e-3}])
    assert _engine_rate_names(optim.from_torch(torch.optim.RAdam, lr=0.1), lr=0.1) == (
        _lightning_rate_names([{"lr": 0.1}], torch.optim.RAdam)
    )
    # two param groups without names: lr-AdamW/pg1, lr-AdamW/pg2, each group's own rate (kept
    # in each group's state by inject_hyperparams)
    groups = optim.multi_transform(
        {i: optim.inject_hyperparams(optim.adamw)(lr=lr) for i, lr in enumerate((1e-3, 1e-2))},
        by_layer,
    )
    expected = _lightning_rate_names([{"lr": 1e-3}, {"lr": 1e-2}])
    assert set(expected) == {"lr-AdamW/pg1", "lr-AdamW/pg2"}
    assert _engine_rate_names(groups) == expected
    # named groups: the names; the rates given per group as Task(lr={label: rate})
    groups = optim.multi_transform({"backbone": optim.sgd(0.01), "head": optim.sgd(0.1)}, named)
    expected = _lightning_rate_names(
        [{"lr": 0.01, "name": "backbone"}, {"lr": 0.1, "name": "head"}], torch.optim.SGD
    )
    assert set(expected) == {"lr-SGD/backbone", "lr-SGD/head"}
    assert _engine_rate_names(groups, lr={"backbone": 0.01, "head": 0.1}) == expected


def test_lr_monitor_needs_a_logger_and_a_learning_rate():
    with pytest.raises(RuntimeError, match=r"no logger|has none"):
        FakeFit([LearningRateMonitor()], task=_Task(0.1)).fit()
    with pytest.raises(RuntimeError, match=r"Task\(lr=\.\.\.\)"):
        FakeFit([LearningRateMonitor()], loggers=[_Logger()], task=_Task(None)).fit()
    with pytest.raises(ValueError, match="'batch'"):
        LearningRateMonitor(logging_interval="batch")


# ---------------------------------------------------------------------- Timer


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float = 1.0) -> None:
        self.t += seconds


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(timer_module, "_monotonic", c)
    return c


@pytest.mark.parametrize(
    ("value", "expected"),
    [  # Lightning's test_timer_parse_duration cases
        (None, None),
        ("00:00:00:22", timedelta(seconds=22)),
        ("12:34:56:65", timedelta(days=12, hours=34, minutes=56, seconds=65)),
        (timedelta(weeks=52, milliseconds=1), timedelta(weeks=52, milliseconds=1)),
        ({"weeks": 52, "days": 1}, timedelta(weeks=52, days=1)),
        (" 100:00:00:01 ", timedelta(days=100, seconds=1)),
    ],
)
def test_parse_duration(value, expected):
    assert parse_duration(value) == expected


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("00:00:22", ValueError, "'00:00:22'.*DD:HH:MM:SS"),
        ("1:2:3:4", ValueError, "'1:2:3:4'"),
        ({"hour": 1}, ValueError, "'hour'"),
        (12, TypeError, "int 12"),
        (timedelta(seconds=-1), ValueError, "negative"),
    ],
)
def test_parse_duration_errors_name_the_value(value, error, match):
    with pytest.raises(error, match=match):
        parse_duration(value)
    with pytest.raises(error, match=match):
        Timer(duration=value)


def test_timer_interval_must_be_step_or_epoch():
    with pytest.raises(ValueError, match="'batch'"):
        Timer(interval="batch")


def test_timer_stops_once_training_time_reaches_the_duration(clock):
    timer = Timer(duration={"seconds": 5}, verbose=False)
    fit = FakeFit([timer], num_training_batches=4, on_batch=clock.tick).fit()
    assert fit.global_step == 5 and fit.current_epoch == 2  # stopped in epoch 1, mid-epoch
    assert timer.time_elapsed("train") == 5 and timer.time_remaining() == 0
    assert fit.stops[0].reason == "time limit reached: 0:00:05 of training"


def test_timer_epoch_interval_checks_only_at_epoch_end(clock):
    timer = Timer(duration="00:00:00:05", interval="epoch", verbose=False)
    fit = FakeFit([timer], num_training_batches=4, on_batch=clock.tick).fit()
    assert fit.global_step == 8 and fit.current_epoch == 2


def test_timer_measures_each_stage(clock):
    timer = Timer()

    def val_metrics(epoch: int) -> dict[str, float]:
        clock.tick(0.5)  # validation takes half a second
        return {}

    fit = FakeFit(
        [timer], max_epochs=2, num_sanity_val_steps=1, val_metrics=val_metrics, on_batch=clock.tick
    )
    fit.fit()
    assert timer.time_elapsed("fit") == timer.time_elapsed("train") == 2 * 2 + 2 * 0.5
    assert timer.time_elapsed("validate") == 0.5  # the latest validation loop
    assert timer.time_elapsed("sanity_check") == 0.0
    assert timer.end_time("train") - timer.start_time("train") == 5.0
    assert timer.time_elapsed("test") == 0 and timer.start_time("test") is None
    assert timer.time_remaining() is None
    with pytest.raises(ValueError, match="'training_step'"):
        timer.time_elapsed("training_step")


def test_timer_resumes_counting_and_stops_at_once_when_the_budget_is_spent(clock):
    first = Timer(duration={"seconds": 10}, verbose=False)
    FakeFit([first], max_epochs=1, num_training_batches=4, on_batch=clock.tick).fit()
    saved = first.state_dict()
    assert saved["time_elapsed"]["train"] == 4.0 and set(saved["time_elapsed"]) == {
        "train",
        "sanity_check",
        "validate",
        "test",
        "predict",
    }
    resumed = Timer(duration={"seconds": 10}, verbose=False)
    resumed.load_state_dict(saved)
    fit = FakeFit([resumed], max_epochs=10, num_training_batches=4, on_batch=clock.tick).fit()
    assert fit.global_step == 6  # 4 s restored + 6 s more
    spent = Timer(duration={"seconds": 4}, verbose=False)
    spent.load_state_dict(saved)
    fit = FakeFit([spent], max_epochs=10, on_batch=clock.tick).fit()
    assert fit.global_step == 0 and fit.stops  # stopped at on_fit_start


def test_timer_prints_when_the_limit_is_reached(clock, capsys):
    FakeFit([Timer(duration={"seconds": 1})], on_batch=clock.tick).fit()
    assert "Timer: time limit reached: 0:00:01 of training; stopping." in capsys.readouterr().out
