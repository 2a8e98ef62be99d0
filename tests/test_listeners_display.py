"""The progress bar and the model summary against the fake fit loop (tests/_fake_fit.py) and
against Lightning's documented counts and output."""

from __future__ import annotations

import io
import math
import pickle
import sys
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import pytest
import torch
from _fake_fit import FakeFit
from torch import nn

import engine as eg
from engine import optim
from engine.events import Event
from engine.listeners import (
    ModelSummary,
    ProgressBar,
    summarize,
)
from engine.listeners.summary import _readable

# ---------------------------------------------------------------------- ProgressBar


class _CountingTrainer(FakeFit):
    """Records the batch index at every read of the view's progress_bar_metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reads: list[int] = []
        super().__init__(*args, **kwargs)

    def _shown(self) -> Mapping[str, float]:
        return _Reads(dict(self._pbm), self.reads, self.state.batch_idx)


class _Reads(Mapping[str, float]):
    """A mapping that records ``at`` in ``reads`` whenever its keys are read."""

    def __init__(self, data: dict[str, float], reads: list[int], at: int) -> None:
        self._data, self._reads, self._at = data, reads, at

    def keys(self) -> Any:
        self._reads.append(self._at)
        return self._data.keys()

    def __getitem__(self, key: str) -> float:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        self._reads.append(self._at)
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def _screen(out: io.StringIO) -> list[str]:
    """The lines tqdm drew last, one per carriage return / newline."""
    return [s.strip() for s in out.getvalue().replace("\n", "\r").split("\r") if s.strip()]


def test_progress_bar_draws_epochs_validation_and_the_sanity_check():
    out = io.StringIO()
    fit = FakeFit(
        [ProgressBar(file=out)],
        max_epochs=2,
        num_training_batches=4,
        num_val_batches=[2],
        num_sanity_val_steps=1,
        val_metrics=lambda e: {"val/loss": 0.5},
    ).fit()
    lines = _screen(out)
    assert any(s.startswith("Sanity Checking DataLoader 0: 100%") and "1/1" in s for s in lines)
    assert any(s.startswith("Validation DataLoader 0: 100%") and "2/2" in s for s in lines)
    epoch1 = [s for s in lines if s.startswith("Epoch 1: 100%") and "4/4" in s]
    assert epoch1 and "it/s" in epoch1[-1]
    assert "train/loss=0.125" in epoch1[-1] and "val/loss=0.5" in epoch1[-1]
    assert fit.events[-1] == "teardown"


def test_progress_bar_reads_metrics_only_on_refresh_steps():
    fit = _CountingTrainer(
        [ProgressBar(refresh_rate=2, file=io.StringIO(), min_interval=0.0)],
        max_epochs=1,
        num_training_batches=5,
        num_val_batches=[],
    )
    fit.fit()
    # batches 2 and 4 (refresh_rate), 5 (the last one), then the epoch end
    assert fit.reads == [2, 4, 5, 5]


def test_progress_bar_outside_a_terminal_prints_lines_and_reads_no_loss_per_batch(capsys):
    assert not sys.stdout.isatty()  # pytest captures stdout
    fit = _CountingTrainer([ProgressBar()], max_epochs=2, num_sanity_val_steps=1)
    fit.fit()
    assert fit.reads == [2, 2, 2, 2]  # at validation ends and epoch ends only, never per batch
    out = capsys.readouterr().out
    assert "\r" not in out
    assert [s.split(":")[0] for s in out.splitlines()] == [
        "Validation DataLoader 0",
        "Epoch 0",
        "Validation DataLoader 0",
        "Epoch 1",
    ]
    out = io.StringIO()
    fit = _CountingTrainer([ProgressBar(refresh_rate=0, file=out)], max_epochs=1)
    fit.fit()
    assert fit.reads == [] and out.getvalue() == ""


def test_progress_bar_switches_between_validation_dataloaders():
    out = io.StringIO()
    FakeFit([ProgressBar(file=out)], max_epochs=1, num_val_batches=[2, 3]).fit()
    lines = _screen(out)
    assert any(s.startswith("Validation DataLoader 0: 100%") and "2/2" in s for s in lines)
    assert any(s.startswith("Validation DataLoader 1: 100%") and "3/3" in s for s in lines)


def test_progress_bar_without_a_known_length_counts_batches():
    out = io.StringIO()
    bar = ProgressBar(file=out)
    fit = FakeFit([bar], max_epochs=1, num_training_batches=3, num_val_batches=[])
    fit.num_training_batches = math.inf  # what the listener sees: an unsized loader
    fit.emit(Event.ON_TRAIN_START)
    fit.emit(Event.ON_TRAIN_EPOCH_START)
    for b in range(3):
        fit.emit(Event.ON_TRAIN_BATCH_END, batch_idx=b)
    fit.emit(Event.ON_TRAIN_END)
    assert any(s.startswith("Epoch 0:") and "3/?" in s for s in _screen(out))


def test_progress_bar_test_and_predict_bars_and_the_logger_version():
    out = io.StringIO()
    bar = ProgressBar(file=out, leave=True)
    fit = FakeFit([bar], loggers=[mock.Mock(version=7)], max_epochs=1, num_val_batches=[])
    fit.num_test_batches, fit.num_predict_batches = [2], [3]
    fit.fit()
    fit.emit(Event.ON_TEST_START, "test")
    for b in range(2):
        fit.emit(Event.ON_TEST_BATCH_END, "test", batch_idx=b)
    fit.emit(Event.ON_TEST_END, "test")
    fit.emit(Event.ON_PREDICT_START, "predict")
    for b in range(3):
        fit.emit(Event.ON_PREDICT_BATCH_END, "predict", batch_idx=b)
    fit.emit(Event.ON_PREDICT_END, "predict")
    lines = _screen(out)
    assert any(s.startswith("Epoch 0: 100%") and "v_num=7" in s for s in lines)
    assert any(s.startswith("Testing DataLoader 0: 100%") and "2/2" in s for s in lines)
    assert any(s.startswith("Predicting DataLoader 0: 100%") and "3/3" in s for s in lines)
    assert bar.train_progress_bar is None and bar.val_progress_bar is None


def test_progress_bar_closes_its_bars_on_exception():
    bar = ProgressBar(file=io.StringIO())
    fit = FakeFit([bar], num_val_batches=[2])
    fit.emit(Event.ON_TRAIN_START)
    fit.emit(Event.ON_TRAIN_EPOCH_START)
    fit.emit(Event.ON_VALIDATION_START)
    train, val = bar.train_progress_bar, bar.val_progress_bar
    fit.emit(Event.ON_EXCEPTION, exception=RuntimeError("boom"))
    assert bar.train_progress_bar is None and train.disable and val.disable  # closed
    assert pickle.loads(pickle.dumps(bar)).refresh_rate == 1


def test_progress_bar_rejects_a_bad_refresh_rate():
    with pytest.raises(ValueError, match="-1"):
        ProgressBar(refresh_rate=-1)


# ---------------------------------------------------------------------- ModelSummary


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.Sequential(nn.ReLU(), nn.Linear(8, 8)),
        nn.Linear(8, 3),
    )


@pytest.mark.parametrize(
    ("n", "text"),  # Lightning's get_human_readable_count examples
    [
        (123, "123"),
        (1234, "1.2 K"),
        (2_000_000, "2.0 M"),
        (3_000_000_000, "3.0 B"),
        (400_000_000_000_000, "400 T"),
        (5_000_000_000_000_000, "5,000 T"),
        (0, "0"),
    ],
)
def test_parameter_counts_are_abbreviated_like_lightning(n, text):
    assert _readable(n) == text


def test_summary_counts_trainable_frozen_and_buffer_bytes():
    model = _net()
    model[3].weight.requires_grad_(False)
    state = eg.TrainState.create(model, optim.sgd(0.1))
    text = summarize(state)
    n_all = sum(p.numel() for p in model.parameters())
    n_frozen = model[3].weight.numel()
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert f"{n_all - n_frozen:<10}Trainable params" in text
    assert f"{n_frozen:<10}Non-trainable params" in text
    assert f"{n_all:<10}Total params" in text
    assert f"{nbytes / 1e6:<10,.3f}Total size (MB)" in text
    rows = [line.split(" | ") for line in text.splitlines()[2:6]]
    assert [[c.strip() for c in r] for r in rows] == [
        ["0", "0", "Linear", "40"],
        ["1", "1", "BatchNorm1d", "16"],
        ["2", "2", "Sequential", "72"],
        ["3", "3", "Linear", "27"],
    ]


def test_summary_matches_lightnings_counts():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.utilities.model_summary import summarize as pl_summarize

    class Wrapped(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.net[0].bias.requires_grad_(False)

    lit = Wrapped()
    reference = pl_summarize(lit, max_depth=-1)
    text = summarize(eg.TrainState.create(lit, optim.sgd(0.1)), max_depth=-1)
    ours = {r.split(" | ")[1].strip(): r.split(" | ")[3].strip() for r in text.splitlines()[2:-5]}
    assert ours == dict(
        zip(reference.layer_names, map(_readable, reference.param_nums), strict=True)
    )
    assert f"{_readable(reference.trainable_parameters):<10}Trainable" in text
    assert f"{_readable(reference.total_parameters):<10}Total params" in text


@pytest.mark.parametrize(
    ("max_depth", "names"),
    [
        (0, []),
        (1, ["0", "1", "2", "3"]),
        (2, ["0", "1", "2", "2.0", "2.1", "3"]),
        (-1, ["0", "1", "2", "2.0", "2.1", "3"]),
    ],
)
def test_summary_lists_layers_down_to_max_depth(max_depth, names):
    text = summarize(eg.TrainState.create(_net(), optim.sgd(0.1)), max_depth=max_depth)
    rows = [line for line in text.splitlines() if " | " in line][1:]
    assert [r.split(" | ")[1].strip() for r in rows] == names
    assert text.splitlines()[-4].endswith("Trainable params")


def test_summary_of_a_pure_function_state_has_a_row_per_tensor():
    state = eg.TrainState.create(
        {"w": torch.zeros(3, 2), "b": torch.zeros(2)},
        optim.sgd(0.1),
        buffers={"scale": torch.ones(4, dtype=torch.float64)},
    )
    text = summarize(state)
    rows = [[c.strip() for c in line.split(" | ")] for line in text.splitlines()[2:5]]
    assert rows == [
        ["0", "w", "Parameter", "[3, 2]", "6"],
        ["1", "b", "Parameter", "[2]", "2"],
        ["2", "scale", "Buffer", "[4]", "0"],
    ]
    assert "8         Trainable params" in text and "0         Non-trainable" in text
    assert f"{(8 * 4 + 4 * 8) / 1e6:<10,.3f}Total size" in text


def test_model_summary_prints_at_fit_start_unless_max_depth_is_zero():
    out = io.StringIO()
    fit = FakeFit([ModelSummary(max_depth=1, file=out)], max_epochs=1)
    fit.fit()
    assert out.getvalue() == summarize(fit.state) + "\n"
    out = io.StringIO()
    FakeFit([ModelSummary(max_depth=0, file=out)], max_epochs=1).fit()
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="-2"):
        ModelSummary(max_depth=-2)
    with pytest.raises(TypeError, match="TrainState"):
        summarize(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_progress_bar_draws_at_most_once_per_min_interval_but_always_the_last_batch():
    fit = _CountingTrainer(
        [ProgressBar(refresh_rate=1, file=io.StringIO(), min_interval=3600.0)],
        max_epochs=1,
        num_training_batches=50,
        num_val_batches=[],
    )
    fit.fit()
    # the first batch draws, then nothing until the last batch and the epoch end
    assert fit.reads == [1, 50, 50]
