"""The examples train on real data to the accuracy the README promises."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def test_hand_written_loop_on_digits_reaches_97_percent(capsys):
    acc = _load("digits_loop").main(["--epochs", "30", "--seed", "0"])
    assert acc >= 0.97
    assert "test accuracy" in capsys.readouterr().out


def test_trainer_demo_on_digits_reaches_97_percent_and_writes_logs(tmp_path, capsys):
    acc = _load("digits").main(["--epochs", "30", "--seed", "0", "--root", str(tmp_path)])
    assert acc >= 0.97
    out = capsys.readouterr().out
    assert "test accuracy" in out
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard event file"
    assert list(tmp_path.rglob("metrics.csv")), "no CSV metrics"
    # the run directory replays: the last journaled stretch re-executes bitwise
    import engine as eg

    (journal,) = tmp_path.rglob("journal.jsonl")
    last = eg.Journal.read(journal.parent)[-1]["step"]
    report = eg.replay(journal.parent, last - 25, last, trust_code=True)
    assert report.identical and report.steps >= 25, str(report)


def test_gan_on_two_moons_learns_and_its_run_replays(tmp_path, capsys):
    out = _load("gan").main(["--epochs", "60", "--seed", "0", "--root", str(tmp_path)])
    # generated points end close to the moons (distances in standard deviations of the data)
    assert out["step"] == 60 * 16 and out["after"] < 0.2 and out["after"] < out["before"] / 3
    assert "before training" in capsys.readouterr().out
    import engine as eg

    (journal,) = tmp_path.rglob("journal.jsonl")
    report = eg.replay(journal.parent, 400, 480, trust_code=True)
    assert report.identical and report.steps >= 80, str(report)


def test_the_lightning_port_trains_checkpoints_on_val_loss_and_replays(tmp_path, capsys):
    import csv

    import engine as eg

    results = _load("lightning_port").main(["--epochs", "12", "--root", str(tmp_path)])
    assert results["test_acc"] >= 0.9 and 0.85 <= results["test_f1"] <= 1.0
    out = capsys.readouterr().out
    assert "best checkpoint" in out and "val_loss" in out
    # Lightning's names reach the loggers as written, each row with its epoch
    (metrics,) = tmp_path.rglob("metrics.csv")
    with open(metrics) as f:
        header = next(csv.reader(f))
    assert {"val_loss", "val_f1", "train_acc", "lr-AdamW", "epoch"} <= set(header), header
    (journal,) = tmp_path.rglob("journal.jsonl")
    report = eg.replay(journal.parent, trust_code=True)
    assert report.identical, str(report)


def test_dp_sgd_on_digits_learns_spends_less_privacy_with_more_noise_and_replays(tmp_path, capsys):
    pytest.importorskip("opacus")  # the accountant
    example = _load("dp_sgd")
    quiet = example.main(["--epochs", "2", "--noise", "2.0", "--root", str(tmp_path / "q")])
    loud = example.main(["--epochs", "2", "--noise", "1.0", "--root", str(tmp_path / "l")])
    assert quiet["steps"] == loud["steps"] == 2 * 23  # 1,437 images in batches of 64
    # well above chance (10 classes) after 46 private steps; the accountant's epsilon is finite
    # and smaller for the larger noise multiplier
    assert loud["acc"] > 0.6 and quiet["acc"] > 0.4
    assert 0 < quiet["epsilon"] < loud["epsilon"] < math.inf
    assert "test accuracy" in capsys.readouterr().out
    # the journaled run replays bitwise: replay rebuilds DPSGD from the checkpoint's numbers
    import engine as eg

    (journal,) = (tmp_path / "l").rglob("journal.jsonl")
    report = eg.replay(journal.parent, trust_code=True)
    assert report.identical and report.steps >= 46, str(report)


def test_maml_on_sinusoids_learns_to_adapt_in_one_step(tmp_path, capsys):
    # 200 meta-steps of 5 tasks: the query loss after one inner SGD step on held-out tasks
    # falls by 30% or more (seeds 0, 1, 2: 4.32 -> 2.75, 4.02 -> 2.07, 3.71 -> 1.91)
    # (the mean over 200 tasks, A in [0.1, 5]: about A^2 / 2 for a model that predicts 0)
    out = _load("maml_sinusoid").main(
        ["--steps", "200", "--meta-batch", "5", "--seed", "0", "--root", str(tmp_path)]
    )
    assert out["step"] == 200
    assert 3.5 < out["before"] < 5.5 and out["after"] < 0.7 * out["before"], out
    assert "after 200 meta-steps" in capsys.readouterr().out
    # the run directory replays: the meta-steps (inner loop included) re-execute bitwise
    import engine as eg

    (journal,) = tmp_path.rglob("journal.jsonl")
    report = eg.replay(journal.parent, 1, 10, trust_code=True)
    assert report.identical and report.steps >= 10, str(report)
