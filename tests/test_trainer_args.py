"""Every ``Trainer`` argument is checked at construction: a wrong type or an out-of-range value
raises a ValueError that names the flag and the value, ``Trainer(flag=<value>): ...``; the
values Lightning documents (that this release supports) still construct.

The tables below have an entry for each parameter of ``Trainer.__init__``, so a new flag without
a test fails ``test_every_trainer_flag_has_bad_and_good_values``.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
from datetime import timedelta

import pytest
import torch

import engine as eg
from engine.listeners import EarlyStopping, LearningRateMonitor, Timer

NAN, INF = float("nan"), float("inf")
QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "enable_journal": False,
}


class FakeLogger:
    def log_metrics(self, metrics, step):
        pass


class Handlerless(eg.Listener):
    """A Listener subclass with no event method: nothing would ever call it."""


class _Path:
    """An os.PathLike that is not a pathlib.Path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


class _BytesPath:
    def __fspath__(self) -> bytes:
        return b"/tmp"


_BOOL_FLAG = [0, 1, "yes", "False", 1.0]

# flag -> values that must raise ValueError naming the flag
BAD: dict[str, list[object]] = {
    "accelerator": [None, 1, True, "cpus", "CPU ", ["cpu"], "tpu", "hpu"],
    "strategy": [None, 0, "single", ["auto"], "dp", "fsdp2", "DDP"],
    "devices": [0, 1.0, True, "two", -2, [0.0], [True], (0.0,), [0, 1], "0,1", [1], [], [0, 0]],
    "num_nodes": [0, -1, 1.0, True, "1"],
    "precision": [32.0, "fp32", True, 0, "32-bit", 8, "16-MIXED", "bf16-Mixed", "transformer"],
    "logger": [
        "tensorboard",
        1,
        0,
        object(),
        eg.TensorBoardLogger,
        [FakeLogger(), "csv"],
        [eg.CSVLogger],
        [None],
        {"tb": FakeLogger()},
    ],
    "callbacks": [
        "EarlyStopping",
        5,
        True,
        False,
        object(),
        EarlyStopping,
        [EarlyStopping],
        [LearningRateMonitor(), "EarlyStopping"],
        [[LearningRateMonitor()]],
        [lambda rec: None],
        Handlerless(),
        {"lr": LearningRateMonitor()},
    ],
    "fast_dev_run": [-1, 1.5, 2.0, NAN, "yes"],
    "max_epochs": [-2, 1.5, True, "10", INF, NAN],
    "min_epochs": [-1, 1.0, True, "1"],
    "max_steps": [-2, None, 10.0, True, INF],
    "min_steps": [-1, 0.5, False, "5"],
    "max_time": [
        "1:00",
        60,
        True,
        {"hourz": 1},
        {"hours": INF},
        {"hours": NAN},
        {"hours": True},
        {"hours": "1"},
        {1: 2},
        timedelta(seconds=-1),
        "99999999999:00:00:00",
        ["00:01:00:00"],
    ],
    "limit_train_batches": [-1, 1.5, NAN, INF, True, "all", [1]],
    "limit_val_batches": [-1, 2.0, NAN, -0.5, False, "1"],
    "limit_test_batches": [-3, 1.01, INF, True, "0.5"],
    "limit_predict_batches": [-1, NAN, True, (1,)],
    "overfit_batches": [-1, 1.5, NAN, True, "1"],
    "val_check_interval": [0, -1, 0.0, 1.5, NAN, INF, True, "half"],
    "check_val_every_n_epoch": [0, -1, 1.5, True, "1"],
    "num_sanity_val_steps": [-2, 0.5, True, "2", INF],
    "log_every_n_steps": [0, -1, 5.0, True, "50"],
    "enable_checkpointing": _BOOL_FLAG,
    "enable_progress_bar": _BOOL_FLAG,
    "enable_model_summary": _BOOL_FLAG,
    "accumulate_grad_batches": [0, -1, 2.0, True, "2", None],
    "gradient_clip_val": [-1, -0.5, NAN, INF, -INF, True, "1", [1.0]],
    "gradient_clip_algorithm": ["l2", "", 1, True],
    "deterministic": ["yes", "true", 1, 0],
    "benchmark": ["on", 1, 0],
    "inference_mode": [None, 1, "true"],
    "use_distributed_sampler": [None, 1, "no"],
    "profiler": [1, True, "simpel"],
    "detect_anomaly": ["on", 1, None],
    "barebones": [1, None, "yes"],
    "plugins": [1, True, "", ["bitsandbytes"], object()],
    "sync_batchnorm": [None, 0, "no"],
    "reload_dataloaders_every_n_epochs": [-1, 1.0, True, "1", None],
    "steps_per_call": [0, -1, 1.5, True, "2", None],
    "default_root_dir": [123, 0, False, 1.5, b"/tmp", ["/tmp"], _BytesPath()],
    "compile": [
        "max-autotune",
        1,
        None,
        ["mode"],
        {1: True},
        {"mode": "default", 2: 3},
        {"fullgrpah": True},
        {"model": None},
        {"mode": "nonsense"},
        {"mode": 3},
        {"backend": "inductr"},
        {"backend": 3},
        {"fullgraph": "yes"},
        {"dynamic": "auto"},
    ],
    "enable_journal": _BOOL_FLAG,
    "enable_autolog_hparams": [None, *_BOOL_FLAG],
    "model_registry": ["my-model", "", 1, True],
}

# flag -> values Lightning documents (or this engine adds) that must construct
GOOD: dict[str, list[object]] = {
    "accelerator": ["auto", "cpu"],
    "strategy": ["auto", "single_device", "ddp", "ddp_spawn", "ddp_find_unused_parameters_true"],
    "devices": ["auto", 1, "1", -1, "-1", [0], (0,), "0,", 2, "3"],
    "num_nodes": [1, 2],
    "precision": [
        None,
        32,
        "32",
        "32-true",
        64,
        "64",
        "64-true",
        16,
        "16",
        "16-mixed",
        "bf16",
        "bf16-mixed",
        "16-true",
        "bf16-true",
    ],
    "logger": [
        None,
        True,
        False,
        [],
        FakeLogger(),
        [FakeLogger(), FakeLogger()],
        (FakeLogger(),),
        "csv",  # built in the test: a CSVLogger in tmp_path
    ],
    "callbacks": [
        None,
        [],
        EarlyStopping("val_loss"),
        [EarlyStopping("val_loss"), LearningRateMonitor()],
        (Timer("00:01:00:00"),),
        eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda rec: None, every=2),
    ],
    "fast_dev_run": [False, True, 0, 1, 5],
    "max_epochs": [None, -1, 0, 1, 1000],
    "min_epochs": [None, 0, 3],
    "max_steps": [-1, 0, 100],
    "min_steps": [None, 0, 10],
    "max_time": [
        None,
        "00:12:00:00",
        "1:00:00:00",
        timedelta(hours=1),
        {"hours": 12},
        {"minutes": 1.5},
    ],
    "limit_train_batches": [None, 0, 0.0, 0.25, 1.0, 1, 10],
    "limit_val_batches": [None, 0, 0.5, 1.0, 3],
    "limit_test_batches": [None, 0.1, 2],
    "limit_predict_batches": [None, 1.0, 4],
    "overfit_batches": [0.0, 0, 0.5, 1.0, 2],
    "val_check_interval": [None, 0.25, 1.0, 1, 100],
    "check_val_every_n_epoch": [1, 3, None],
    "num_sanity_val_steps": [None, 0, 2, -1],
    "log_every_n_steps": [None, 1, 50],
    "enable_checkpointing": [None, True, False],
    "enable_progress_bar": [None, True, False],
    "enable_model_summary": [None, True, False],
    "accumulate_grad_batches": [1, 4],
    "gradient_clip_val": [None, 0, 0.0, 0.5, 1, 1e6],
    "gradient_clip_algorithm": [None, "norm", "value"],
    "deterministic": [None, True, False, "warn"],
    "benchmark": [None, True, False],
    "inference_mode": [True, False],
    "use_distributed_sampler": [True, False],
    "profiler": [None, "simple", "pytorch"],
    "detect_anomaly": [True, False],
    "barebones": [True, False],
    "plugins": [
        None,
        [],
        (),
        eg.transforms.MixedPrecision(torch.bfloat16),
        [eg.transforms.TruePrecision(torch.float64), eg.checkpoint.CheckpointIO()],
        [eg.transforms.SingleDevice("cpu"), eg.transforms.DetectAnomaly()],
    ],
    "sync_batchnorm": [False, True],
    "reload_dataloaders_every_n_epochs": [0, 1, 5],
    "steps_per_call": [1, 4],
    "default_root_dir": [None, "", "tmp", "path", "pathlike"],  # built in the test
    "compile": [
        False,
        True,
        {},
        {"mode": "reduce-overhead"},
        {"fullgraph": True, "dynamic": False},
        {"backend": "eager"},
    ],
    "enable_journal": [None, True, False],
    "enable_autolog_hparams": [True, False],
    "model_registry": [None],
}


def _cases(table: dict[str, list[object]]) -> list[tuple[str, object]]:
    return [(flag, value) for flag, values in table.items() for value in values]


def _id(case: tuple[str, object]) -> str:
    """The case's test id, the same in every process (no object's address in it: pytest-xdist's
    workers must collect the same ids)."""
    flag, value = case
    return re.sub(r" at 0x[0-9a-f]+", "", f"{flag}={value!r}")[:60]


def test_every_trainer_flag_has_bad_and_good_values():
    flags = set(inspect.signature(eg.Trainer).parameters)
    assert set(BAD) == flags, f"missing bad values: {flags - set(BAD)}"
    assert set(GOOD) == flags, f"missing good values: {flags - set(GOOD)}"
    assert all(len(values) >= 3 for values in BAD.values())


@pytest.mark.parametrize(("flag", "value"), _cases(BAD), ids=map(_id, _cases(BAD)))
def test_a_wrong_value_is_refused_at_construction_naming_the_flag_and_the_value(
    flag, value, tmp_path
):
    kwargs = {**QUIET, "default_root_dir": tmp_path, flag: value}
    with pytest.raises(ValueError, match=flag) as err:
        eg.Trainer(**kwargs)
    assert f"Trainer({flag}={value!r})" in str(err.value), str(err.value)


@pytest.mark.parametrize(("flag", "value"), _cases(GOOD), ids=map(_id, _cases(GOOD)))
def test_a_lightning_value_still_constructs(flag, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default_root_dir=None / "" and logger=True write under cwd
    if flag == "logger" and value == "csv":
        value = eg.CSVLogger(tmp_path)
    if flag == "default_root_dir" and value in ("tmp", "path", "pathlike"):
        value = {"tmp": str(tmp_path), "path": tmp_path, "pathlike": _Path(str(tmp_path))}[value]
    if flag == "num_nodes" and value > 1:  # several nodes find each other through these
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29999")
    kwargs = {**QUIET, "default_root_dir": tmp_path, flag: value}
    trainer = eg.Trainer(**kwargs)
    if flag == "default_root_dir":
        assert trainer.default_root_dir == os.fspath(value or os.getcwd())
    if flag == "callbacks" and value:
        given = list(value) if isinstance(value, (list, tuple)) else [value]
        assert trainer.callbacks[: len(given)] == given


@pytest.mark.parametrize("where", ["alone", "in a list"])
def test_a_listener_class_is_refused_asking_for_an_instance(where):
    callbacks = EarlyStopping if where == "alone" else [LearningRateMonitor(), EarlyStopping]
    with pytest.raises(ValueError, match=r"pass EarlyStopping\(\.\.\.\) \(an instance\), not the"):
        eg.Trainer(**QUIET, callbacks=callbacks)


def test_a_logger_class_is_refused_asking_for_an_instance():
    with pytest.raises(ValueError, match=r"pass CSVLogger\(\.\.\.\) \(an instance\), not the"):
        eg.Trainer(**{**QUIET, "logger": eg.CSVLogger})


def test_a_bad_logger_is_refused_even_with_fast_dev_run_which_drops_the_loggers():
    with pytest.raises(ValueError, match=r"Trainer\(logger='tensorboard'\)"):
        eg.Trainer(**{**QUIET, "logger": "tensorboard", "fast_dev_run": True})


def test_a_non_finite_clip_value_is_refused_at_construction_not_at_fit():
    for value in (NAN, INF):
        with pytest.raises(ValueError, match=r"gradient_clip_val=.*finite number >= 0"):
            eg.Trainer(**QUIET, gradient_clip_val=value)


def test_an_unknown_compile_option_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"'fullgrpah' is not a torch.compile option"):
        eg.Trainer(**QUIET, compile={"fullgrpah": True})


def test_a_compile_mode_or_backend_torch_lacks_is_refused_at_construction():
    # torch itself refuses these only when the first step is traced, after the run has started
    with pytest.raises(ValueError, match=r"mode='nonsense' is not a torch.compile mode.*'default'"):
        eg.Trainer(**QUIET, compile={"mode": "nonsense"})
    with pytest.raises(ValueError, match=r"backend='inductr' is not a torch.compile backend"):
        eg.Trainer(**QUIET, compile={"backend": "inductr"})


@pytest.mark.parametrize("value", ["00:01:00:00", timedelta(minutes=5), {"minutes": 5}])
def test_a_time_based_val_check_interval_says_it_is_not_supported_yet(value):
    # Lightning 2.6 takes these; this release counts batches only
    with pytest.raises(ValueError, match=r"val_check_interval=.*not supported yet"):
        eg.Trainer(**QUIET, val_check_interval=value)


def test_a_fractional_val_check_interval_needs_epochs_as_in_lightning():
    with pytest.raises(ValueError, match=r"val_check_interval=0.5.*check_val_every_n_epoch=None"):
        eg.Trainer(**QUIET, val_check_interval=0.5, check_val_every_n_epoch=None)
    trainer = eg.Trainer(**QUIET, val_check_interval=10, check_val_every_n_epoch=None)
    assert trainer.val_check_interval == 10


def test_default_root_dir_accepts_any_path_like(tmp_path):
    for value in (str(tmp_path), tmp_path, pathlib.PurePosixPath(tmp_path), _Path(str(tmp_path))):
        assert eg.Trainer(**QUIET, default_root_dir=value).default_root_dir == str(tmp_path)


def test_enable_autolog_hparams_false_keeps_the_tasks_hparams_from_the_loggers(tmp_path):
    """Lightning 2.6's flag: the hyperparameters reach the loggers only when it is on (they
    are still saved in checkpoints either way)."""
    import torch.nn.functional as F

    from engine import optim

    class Recording(FakeLogger):
        def __init__(self):
            self.hparams = []

        def log_hyperparams(self, params):
            self.hparams.append(dict(params))

    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1), hparams={"lr": 0.1})
    data = [(torch.randn(4, 3), torch.randn(4, 1))] * 2
    seen = {}
    for flag in (True, False):
        lg = Recording()
        quiet = {**QUIET, "logger": lg, "default_root_dir": tmp_path / str(flag)}
        trainer = eg.Trainer(max_epochs=1, enable_autolog_hparams=flag, **quiet)
        trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
        seen[flag] = lg.hparams
    assert seen == {True: [{"lr": 0.1}], False: []}


def test_model_registry_is_refused_saying_what_to_do_instead():
    with pytest.raises(ValueError, match=r"model_registry='hub'\): accepted values are None") as e:
        eg.Trainer(model_registry="hub", **QUIET)
    assert "checkpoint.export" in str(e.value)
