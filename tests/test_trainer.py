"""The Trainer against real references: hand-written loops over the same pure steps, raw
torch.optim loops, metrics computed independently with torch, and Lightning's documented rules
(or Lightning itself, where the rule is only in its code).

Hook order and loop counters are pinned against Lightning in ``test_lightning_parity.py``; this
file covers what that one does not: flag validation, numerics, metrics, logging, data sources,
event filters and the process-wide modes a run switches on and off.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from _trainer_kit import (
    FakeLogger,
    Recorder,
    _batches,
    _eval_fn,
    _expected_eval,
    _hand_fit,
    _linear,
    _task,
    _trainer,
    _uneven_loader,
)
from torch import nn

import engine as eg
from engine import optim

# ------------------------------------------------------------------------ 1. flag validation

# (flag, bad value, a fragment of the accepted values the message must name)
BAD_FLAGS = [
    ("max_epochs", -2, "int >= -1"),
    ("max_epochs", 1.5, "int >= -1"),
    ("min_epochs", -1, "int >= 0"),
    ("max_steps", -2, "int >= -1"),
    ("min_steps", -1, "int >= 0"),
    ("limit_train_batches", 1.5, "[0.0, 1.0]"),
    ("limit_train_batches", -1, ">= 0"),
    ("limit_train_batches", "all", "[0.0, 1.0]"),
    ("limit_val_batches", 2.0, "[0.0, 1.0]"),
    ("limit_test_batches", -3, ">= 0"),
    ("limit_predict_batches", True, "[0.0, 1.0]"),
    ("overfit_batches", -1, ">= 0"),
    ("val_check_interval", 0, ">= 1"),
    ("val_check_interval", 1.5, "(0.0, 1.0]"),
    ("val_check_interval", "half", "(0.0, 1.0]"),
    ("check_val_every_n_epoch", 0, "int >= 1"),
    ("accumulate_grad_batches", 0, "int >= 1"),
    ("accumulate_grad_batches", 2.0, "int >= 1"),
    ("gradient_clip_val", -1, ">= 0"),
    ("gradient_clip_val", "1", ">= 0"),
    ("gradient_clip_algorithm", "l2", "'norm', 'value'"),
    ("max_time", "1:00", "DD:HH:MM:SS"),
    ("max_time", 60, "timedelta"),
    ("max_time", {"hourz": 1}, "days, hours, minutes, seconds"),
    ("max_time", timedelta(seconds=-1), "not be negative"),
    ("num_sanity_val_steps", -2, "-1 (all validation batches)"),
    ("num_sanity_val_steps", 0.5, "int >= 0"),
    ("log_every_n_steps", 0, "int >= 1"),
    ("reload_dataloaders_every_n_epochs", -1, "int >= 0"),
    ("fast_dev_run", -1, "int >= 0"),
    ("fast_dev_run", "yes", "int >= 0"),
    ("profiler", "advanced", "'simple', 'pytorch'"),
    ("deterministic", "yes", "'warn'"),
    ("deterministic", 1, "True, False"),
    ("benchmark", "on", "True, False"),
    ("inference_mode", None, "True, False"),
    ("detect_anomaly", "on", "True, False"),
    ("barebones", 1, "True, False"),
    ("use_distributed_sampler", None, "True, False"),
    ("enable_progress_bar", "yes", "None, True, False"),
    ("enable_model_summary", 0, "None, True, False"),
    ("enable_checkpointing", "no", "None, True, False"),
    ("compile", "max-autotune", "dict of torch.compile options"),
    ("devices", True, "'auto'"),
    ("devices", 0, "'auto'"),
    ("plugins", ["bitsandbytes"], "precision transform"),
    ("plugins", [eg.transforms.Float32(), eg.transforms.Float32()], "pass one"),
    ("precision", "fp16", "'16-mixed'"),
    ("precision", 8, "'bf16-true'"),
    ("accelerator", "tpu", "'cuda'"),
    ("accelerator", "cpus", "'auto', 'cpu'"),
]

# values Lightning accepts that need processes this release lacks
STRATEGY_REFUSALS = [
    ({"strategy": "dp"}, "strategy='dp'", "strategy='ddp'"),
    ({"strategy": "xla"}, "strategy='xla'", "CPU, CUDA and MPS"),
    (
        {"strategy": "deepspeed_stage_3_offload_nvme"},
        "strategy='deepspeed_stage_3_offload_nvme'",
        "no FSDP2 equivalent",
    ),
    ({"strategy": "tpu_spawn"}, "strategy='tpu_spawn'", "'ddp_spawn'"),
    ({"strategy": 3}, "strategy=3", "engine.parallel.DDP"),
    ({"strategy": "single_device", "devices": 2}, "single_device", "strategy='ddp'"),
    ({"strategy": "single_device", "num_nodes": 2}, "single_device", "strategy='ddp'"),
    ({"num_nodes": 0}, "num_nodes=0", ">= 1"),
    ({"num_nodes": True}, "num_nodes=True", "int"),
    ({"sync_batchnorm": "yes"}, "sync_batchnorm='yes'", "True, False"),
]


@pytest.mark.parametrize(
    ("flag", "value", "accepted"), BAD_FLAGS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FLAGS]
)
def test_a_bad_flag_is_refused_naming_the_flag_the_value_and_what_is_accepted(
    flag, value, accepted
):
    with pytest.raises(ValueError) as err:
        _trainer(**{flag: value})
    message = str(err.value)
    assert f"{flag}={value!r}" in message, message
    assert accepted in message, message


@pytest.mark.parametrize(("kwargs", "named", "hint"), STRATEGY_REFUSALS)
def test_a_strategy_engine_does_not_run_is_refused_saying_what_it_runs(kwargs, named, hint):
    with pytest.raises(ValueError) as err:
        _trainer(accelerator="cpu", **kwargs)
    message = str(err.value)
    assert named in message and hint in message, message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"accelerator": "cpu", "devices": 1, "strategy": "single_device", "num_nodes": 1},
        {"accelerator": "auto", "devices": "auto", "precision": "32-true"},
        {"precision": 32, "devices": -1, "plugins": []},
        {"max_time": "00:00:01:00", "enable_progress_bar": False},
    ],
)
def test_the_single_process_cpu_values_are_accepted(kwargs):
    if "max_time" in kwargs:
        pytest.importorskip("engine.listeners")
    _trainer(**kwargs)


# ------------------------------------------------------------------------ 2. barebones


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("logger", True),
        ("logger", FakeLogger()),
        ("enable_progress_bar", True),
        ("enable_model_summary", True),
        ("enable_checkpointing", True),
        ("log_every_n_steps", 10),
        ("detect_anomaly", True),
        ("profiler", "simple"),
        ("num_sanity_val_steps", 2),  # Lightning refuses these two in barebones mode as well
        ("num_sanity_val_steps", -1),
        ("fast_dev_run", True),
        ("fast_dev_run", 3),
    ],
)
def test_barebones_refuses_each_per_step_feature_naming_it(flag, value):
    with pytest.raises(ValueError, match=rf"barebones=True.*`{flag}`"):
        eg.Trainer(barebones=True, **{flag: value})


def test_barebones_runs_without_loggers_sanity_check_or_training_metrics():
    assert eg.Trainer(barebones=True).callbacks == []
    rec = Recorder()
    trainer = eg.Trainer(barebones=True, max_epochs=1, callbacks=[rec])
    assert trainer.loggers == [] and trainer.callbacks == [rec]
    task = _task()
    state = trainer.fit(task, task.init(_linear()), _batches(3), _batches(2))
    assert state.step == 3
    assert rec.of("on_sanity_check_start") == []  # Lightning: num_sanity_val_steps=0
    assert [r[1] for r in rec.of("on_validation_batch_end")] == ["fit", "fit"]
    assert not any(k.startswith("train/") for k in trainer.callback_metrics)


# ------------------------------------------------------------------------ 3. defaults


@pytest.mark.parametrize(
    ("kwargs", "max_epochs"),
    [
        ({}, 1000),  # Lightning: "If both max_epochs and max_steps are not specified, 1000"
        ({"max_steps": 5}, -1),  # a step limit alone: no epoch limit
        ({"max_steps": 5, "max_epochs": 3}, 3),
        ({"max_epochs": -1}, -1),
    ],
)
def test_max_epochs_default_follows_lightning(kwargs, max_epochs):
    assert _trainer(**kwargs).max_epochs == max_epochs


def test_max_epochs_default_with_max_time_is_unbounded():
    pytest.importorskip("engine.listeners")
    assert _trainer(max_time={"minutes": 1}).max_epochs == -1


def test_max_steps_alone_trains_past_the_1000_epoch_default():
    trainer = _trainer(max_steps=7, num_sanity_val_steps=0)
    task = _task()
    trainer.fit(task, task.init(_linear()), _batches(2))
    assert (trainer.global_step, trainer.current_epoch) == (7, 4)  # 3 full epochs + 1 batch


# ------------------------------------------------------------------------ 4. fit vs a hand loop


@pytest.mark.parametrize("accumulate", [1, 3])
def test_fit_returns_the_state_of_a_hand_loop_bitwise(accumulate):
    task, batches = _task(), _batches(10)
    start = task.init(_linear(), seed=3)
    reference = _hand_fit(task, start.copy(), batches, 2, accumulate=accumulate)

    trainer = _trainer(max_epochs=2, accumulate_grad_batches=accumulate)
    state = trainer.fit(task, start, batches)

    assert isinstance(state, eg.TrainState) and state is trainer.state
    assert state.fingerprint() == reference.fingerprint()
    # Lightning: ceil(10 / accumulate) optimizer steps per epoch
    assert state.step == trainer.global_step == 2 * -(-10 // accumulate)
    assert state.epoch == trainer.current_epoch == 2 and state.grad_accum is None
    assert start.consumed
    with pytest.raises(eg.ConsumedStateError):
        trainer.fit(task, start, batches)


def test_gradient_clip_norm_is_the_steps_clip_argument_bitwise():
    task, batches = _task(), _batches(6)
    start = task.init(_linear())
    reference = _hand_fit(task, start.copy(), batches, 1, clip=optim.clip_by_global_norm(0.05))
    state = _trainer(max_epochs=1, gradient_clip_val=0.05).fit(task, start, batches)
    assert state.fingerprint() == reference.fingerprint()


@pytest.mark.parametrize(
    ("algorithm", "accumulate"), [("norm", 1), ("norm", 3), ("value", 1), ("value", 3)]
)
def test_gradient_clipping_matches_torch_clip_and_sgd(algorithm, accumulate):
    """Lightning clips the accumulated gradient just before the optimizer step, and divides
    each micro-batch loss by accumulate_grad_batches, a partial last window included."""
    limit, batches = 0.05, _batches(10)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    clipped = False
    for _ in range(2):
        for i, (x, y) in enumerate(batches):
            (F.mse_loss(model(x), y) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i == len(batches) - 1:
                if algorithm == "norm":
                    clipped |= float(nn.utils.clip_grad_norm_(model.parameters(), limit)) > limit
                else:
                    clipped |= any(bool((p.grad.abs() > limit).any()) for p in model.parameters())
                    nn.utils.clip_grad_value_(model.parameters(), limit)
                opt.step()
                opt.zero_grad()
    assert clipped, "the limit is too loose to test anything"

    task = _task()
    trainer = _trainer(
        max_epochs=2,
        gradient_clip_val=limit,
        gradient_clip_algorithm=algorithm,
        accumulate_grad_batches=accumulate,
    )
    state = trainer.fit(task, task.init(_linear()), batches)
    for name, p in model.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-6, atol=1e-6)


def test_gradient_clip_val_zero_means_no_clipping():
    task, batches = _task(), _batches(4)
    start = task.init(_linear())
    reference = _hand_fit(task, start.copy(), batches, 1)
    state = _trainer(max_epochs=1, gradient_clip_val=0).fit(task, start, batches)
    assert state.fingerprint() == reference.fingerprint()


# ------------------------------------------------------------------------ 5. evaluation


REDUCE = {"n": "sum", "hi": "max", "lo": "min"}


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_returns_batch_size_weighted_means_and_the_chosen_reductions(stage):
    fn = {"eval_fn": _eval_fn} if stage == "validate" else {"test_fn": _eval_fn}
    task, model, loader = _task(reduce=REDUCE, **fn), _linear(), _uneven_loader()
    assert [len(x) for x, _ in loader] == [4, 4, 2]
    prefix = "val" if stage == "validate" else "test"

    results = getattr(_trainer(), stage)(task, task.init(model), loader, verbose=False)

    expected = _expected_eval(model, loader)
    assert isinstance(results, list) and len(results) == 1
    assert set(results[0]) == {f"{prefix}/{k}" for k in expected}
    assert all(type(v) is float for v in results[0].values())
    for k, v in expected.items():
        assert results[0][f"{prefix}/{k}"] == pytest.approx(v, rel=1e-6), k


def test_several_eval_dataloaders_get_one_dict_each_with_the_dataloader_suffix():
    task, model = _task(eval_fn=_eval_fn, reduce=REDUCE, prog_bar=["mse"]), _linear()
    loaders = [_uneven_loader(seed=2), _uneven_loader(n=7, batch_size=3, seed=5)]
    state = task.init(model)
    trainer = _trainer()

    results = trainer.validate(task, state, loaders, verbose=False)

    assert len(results) == 2
    for i, (loader, result) in enumerate(zip(loaders, results, strict=True)):
        expected = _expected_eval(model, loader)
        assert set(result) == {f"val/{k}/dataloader_idx_{i}" for k in expected}
        for k, v in expected.items():
            assert result[f"val/{k}/dataloader_idx_{i}"] == pytest.approx(v, rel=1e-6)
    merged = {k: v for r in results for k, v in r.items()}
    assert {k: trainer.callback_metrics[k] for k in merged} == merged
    assert set(trainer.progress_bar_metrics) == {
        "val/mse/dataloader_idx_0",
        "val/mse/dataloader_idx_1",
    }
    assert not state.consumed, "evaluation reads the state, it does not consume it"


def test_the_default_eval_metric_is_the_loss_and_test_falls_back_to_eval_fn():
    model, loader = _linear(), _uneven_loader()
    expected = _expected_eval(model, loader)["mse"]
    task = _task()  # no eval_fn: validation reports loss_fn as "loss"
    (val,) = _trainer().validate(task, task.init(model), loader, verbose=False)
    assert val == {"val/loss": pytest.approx(expected, rel=1e-6)}
    task = _task(eval_fn=_eval_fn)  # no test_fn: test uses eval_fn
    (test,) = _trainer().test(task, task.init(model), loader, verbose=False)
    assert test["test/mse"] == pytest.approx(expected, rel=1e-6)


def test_predict_returns_the_module_outputs():
    model, task = _linear(), _task()
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    outputs = _trainer().predict(task, task.init(model), xs)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    assert len(outputs) == 3
    for out, exp in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, exp, rtol=0, atol=0)


def test_predict_with_several_dataloaders_returns_a_list_per_dataloader():
    model = _linear()
    task = _task(predict_fn=lambda m, b: m(b[0]))
    loaders = [_uneven_loader(seed=2), _uneven_loader(n=5, batch_size=5, seed=3)]
    outputs = _trainer().predict(task, task.init(model), loaders)
    assert [len(o) for o in outputs] == [3, 1]
    with torch.no_grad():
        for outs, loader in zip(outputs, loaders, strict=True):
            for out, (x, _) in zip(outs, loader, strict=True):
                torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_predict_with_return_predictions_false_returns_none_but_runs_every_batch():
    task, rec = _task(), Recorder()
    xs = [torch.randn(2, 3) for _ in range(3)]
    trainer = _trainer(callbacks=[rec])
    assert trainer.predict(task, task.init(_linear()), xs, return_predictions=False) is None
    assert [r[2] for r in rec.of("on_predict_batch_end")] == [0, 1, 2]
