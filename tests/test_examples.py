"""The examples train on real data to the accuracy the README promises."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_demo_reaches_97_percent_test_accuracy(capsys):
    acc = _load("digits").main(["--epochs", "30", "--seed", "0"])
    assert acc >= 0.97
    assert "test accuracy" in capsys.readouterr().out
