"""The Trainer against real references: hand-written loops over the same pure steps, raw
torch.optim loops, metrics computed independently with torch, and Lightning's documented rules
(or Lightning itself, where the rule is only in its code).

Hook order and loop counters are pinned against Lightning in ``test_lightning_parity.py``; this
file covers what that one does not: flag validation, numerics, metrics, logging, data sources,
event filters and the process-wide modes a run switches on and off.
"""

from __future__ import annotations

import logging
import warnings
from datetime import timedelta

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}


def _trainer(**kwargs) -> eg.Trainer:
    return eg.Trainer(**{**QUIET, **kwargs})


def _linear() -> nn.Linear:
    # initialised from its own generator: the tests leave the global RNG alone too
    model = nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 3, generator=g))
        model.bias.copy_(torch.randn(1, generator=g))
    return model


def _batches(n: int = 10, size: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)
    ]


def _uneven_loader(n: int = 10, batch_size: int = 4, seed: int = 2) -> DataLoader:
    """Batches of 4, 4 and 2 samples: a plain mean of batch means would be wrong."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _task(**kwargs) -> eg.Task:
    return eg.Task(_mse, optim.sgd(0.1, momentum=0.9), **kwargs)


class FakeLogger:
    """Any object with log_metrics(metrics, step) and finalize(status) is a logger."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.statuses: list[str] = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def finalize(self, status):
        self.statuses.append(status)


class Recorder(eg.Listener):
    """Records (event, stage, batch_idx, dataloader_idx) for every event."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, int | None, int]] = []

    def __getattr__(self, name):
        if not name.startswith(("on_", "setup", "teardown")):
            raise AttributeError(name)

        def handle(rec):
            self.rows.append((name, rec.stage, rec.batch_idx, rec.dataloader_idx))

        return handle

    def of(self, event: str) -> list[tuple[str, str, int | None, int]]:
        return [r for r in self.rows if r[0] == event]


def _quiet_lightning():
    pl = pytest.importorskip("pytorch_lightning")
    warnings.filterwarnings("ignore")
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return pl


def _as_loader(batches) -> DataLoader:
    """The same batches as a DataLoader (what Lightning takes)."""
    xs, ys = zip(*batches, strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=len(xs[0]))


def _lightning(**kwargs):
    """A Lightning Trainer and a LightningModule that train like ``_task()`` on ``_linear()``."""
    pl = _quiet_lightning()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = _linear()

        def training_step(self, batch, batch_idx):
            loss = _mse(self.layer, batch)
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    off = {"enable_checkpointing": False, "enable_progress_bar": False}
    kwargs = {"logger": False, "enable_model_summary": False, **off, **kwargs}
    return pl.Trainer(**kwargs), Module()


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


def _hand_fit(task, state, batches, epochs, *, accumulate=1, clip=None):
    """The loop fit runs, written out over task.train_step(): Lightning steps the optimizer on
    the epoch's last batch even if the accumulation window is partial (flush=True)."""
    step = task.train_step(accumulate=accumulate, clip=clip)
    for epoch in range(epochs):
        for i, batch in enumerate(batches):
            state, _ = step(state, batch, flush=i == len(batches) - 1)
        state = state.replace(epoch=epoch + 1, batch_idx=0)
    return state


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


def _eval_fn(model, batch):
    x, y = batch
    mse = F.mse_loss(model(x), y)
    return {"mse": mse, "n": torch.tensor(float(len(x))), "hi": mse, "lo": mse}


def _expected_eval(model, loader):
    """The same metrics computed without the engine: sample-weighted MSE over the whole set."""
    with torch.no_grad():
        per_batch = [F.mse_loss(model(x), y) for x, y in loader]
        xs, ys = zip(*loader, strict=True)
        whole = F.mse_loss(model(torch.cat(xs)), torch.cat(ys))
    return {
        "mse": float(whole),
        "n": float(sum(len(x) for x in xs)),
        "hi": float(max(per_batch)),
        "lo": float(min(per_batch)),
    }


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
