"""A checkpoint loaded for another optimizer: a CheckpointError that names the checkpoint, the
optimizer its state came from, the one the task builds (or what each state holds) and what to
do; a state of the same form (Adam's for AdamW) loads, and a fit says that it does."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.errors import CheckpointError

OPTIMIZERS = {
    "adamw": lambda: optim.adamw(0.01),
    "adam": lambda: optim.adam(0.01),
    "sgd": lambda: optim.sgd(0.05),
    "sgd-momentum": lambda: optim.sgd(0.05, momentum=0.9),
}
NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "sgd-momentum": "SGD"}
HOLDS = {
    "adamw": "step, exp_avg, exp_avg_sq",
    "adam": "step, exp_avg, exp_avg_sq",
    "sgd": "nothing",
    "sgd-momentum": "momentum_buffer",
}


def _task(opt: str) -> eg.Task:
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), OPTIMIZERS[opt]())


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]


def _trainer(root: Path, **kw) -> eg.Trainer:
    return eg.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_journal=False,
        default_root_dir=root,
        **kw,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint of one epoch's fit with each optimizer."""
    out = {}
    for opt in OPTIMIZERS:
        root = tmp_path_factory.mktemp(opt)
        trainer = _trainer(root, max_epochs=1)
        task = _task(opt)
        trainer.fit(task, task.init(nn.Linear(3, 1), seed=3), _data())
        out[opt] = Path(trainer.checkpoint_callback.best_model_path)
    return out


def test_the_trainer_records_the_optimizer_in_meta(saved):
    assert checkpoint.read_meta(saved["adamw"])["extra"]["optimizer"] == "AdamW"
    assert checkpoint.read_meta(saved["sgd-momentum"])["extra"]["optimizer"] == "SGD"


MISFITS = [("adamw", "sgd"), ("sgd", "adamw"), ("sgd-momentum", "sgd"), ("sgd", "sgd-momentum")]


def _says_it_clearly(message: str, path: Path, was: str, task: str) -> None:
    assert message.startswith(f"{path}: its optimizer state was saved by {NAMES[was]} and holds ")
    assert f"holds {HOLDS[was]}" in message and f"holds {HOLDS[task]}" in message
    assert "checkpoint.load_weights(path, model)" in message  # what to do for a new optimizer
    assert "KeyError" not in message and "\\'" not in message and "missing:" not in message


@pytest.mark.parametrize(("was", "task"), MISFITS, ids=["-".join(m) for m in MISFITS])
def test_load_for_another_optimizer_is_a_clear_error(saved, was, task):
    template = _task(task).init(nn.Linear(3, 1), seed=3)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(saved[was], template)
    _says_it_clearly(str(e.value), saved[was], was, task)
    assert "the template's optimizer state holds" in str(e.value)


@pytest.mark.parametrize(("was", "task"), MISFITS, ids=["-".join(m) for m in MISFITS])
def test_fit_resumed_with_another_optimizer_is_a_clear_error(saved, tmp_path, was, task):
    t = _task(task)
    with pytest.raises(CheckpointError) as e:
        _trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(
            t, t.init(nn.Linear(3, 1), seed=3), _data(), ckpt_path=saved[was]
        )
    message = str(e.value)
    _says_it_clearly(message, saved[was], was, task)
    assert f"the task's optimizer, {NAMES[task]}, holds {HOLDS[task]}" in message
    if NAMES[was] == NAMES[task]:  # SGD with momentum and without: the settings differ
        assert "build SGD with the settings it was saved with" in message
    else:
        assert f"build the task with {NAMES[was]}" in message


def test_a_checkpoint_that_does_not_name_its_optimizer_is_described_by_its_state(tmp_path):
    """checkpoint.save without the Trainer (or a checkpoint older than the record)."""
    state = _task("adamw").init(nn.Linear(3, 1), seed=3)
    path = checkpoint.save(state, tmp_path / "c")
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path, _task("sgd-momentum").init(nn.Linear(3, 1), seed=3))
    assert str(e.value).startswith(
        f"{path}: its optimizer state holds step, exp_avg, exp_avg_sq; the template's "
        "optimizer state holds momentum_buffer"
    )
    assert "build the task with the optimizer it was saved with" in str(e.value)


def test_the_fields_named_are_the_states_not_the_parameters_dotted_names(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))  # "0.weight", "1.bias", ...
    path = checkpoint.save(_task("adamw").init(model, seed=3), tmp_path / "c")
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path, _task("sgd-momentum").init(model, seed=3))
    assert "its optimizer state holds step, exp_avg, exp_avg_sq; the template's " in str(e.value)
    assert "optimizer state holds momentum_buffer:" in str(e.value)


def test_a_state_of_the_same_form_loads_and_a_fit_says_whose_it_continues(saved, tmp_path):
    template = _task("adamw").init(nn.Linear(3, 1), seed=3)
    loaded = checkpoint.load(saved["adam"], template)  # Adam's moments: the same form
    assert loaded.step == 5
    t = _task("adamw")
    with pytest.warns(UserWarning, match="was saved with Adam, the task builds AdamW"):
        _trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(
            t, t.init(nn.Linear(3, 1), seed=3), _data(), ckpt_path=saved["adam"]
        )
    t = _task("adam")
    with warnings.catch_warnings():  # the optimizer it was saved with: no word
        warnings.filterwarnings("error", message=".*was saved with")
        _trainer(tmp_path / "same", max_epochs=2, enable_checkpointing=False).fit(
            t, t.init(nn.Linear(3, 1), seed=3), _data(), ckpt_path=saved["adam"]
        )


# ---------------------------------------------------------------------- two ranks


def _ddp_resume_with_sgd(rank: int, root: str) -> str:
    """On each of 2 gloo ranks: a DDP fit with AdamW, then its resume with SGD; the error."""
    flags = dict(accelerator="cpu", strategy="ddp", devices=2, enable_checkpointing=True)
    trainer = _trainer(Path(root), max_epochs=1, **flags)
    task = _task("adamw")
    trainer.fit(task, task.init(nn.Linear(3, 1), seed=3), _data())
    path = trainer.checkpoint_callback.best_model_path
    sgd = _task("sgd")
    resumed = _trainer(Path(root) / "resumed", max_epochs=2, **flags)
    try:
        resumed.fit(sgd, sgd.init(nn.Linear(3, 1), seed=3), _data(), ckpt_path=path)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "resumed"


@pytest.mark.slow
def test_a_ddp_resume_with_another_optimizer_is_the_same_error_on_every_rank(tmp_path):
    from _ranks import run_ranks

    said = run_ranks(_ddp_resume_with_sgd, 2, str(tmp_path), timeout=120)
    assert said[0] == said[1], said
    assert "its optimizer state was saved by AdamW and holds step, exp_avg" in said[0]
    assert "the task's optimizer, SGD, holds nothing" in said[0]
