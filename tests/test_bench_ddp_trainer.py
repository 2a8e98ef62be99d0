"""benchmarks.ddp_trainer runs (a few steps, one quiet round, the raw loop and engine's Trainer
with its defaults) and reports a ratio per variant: the benchmark cannot rot unnoticed. Its
figures are benchmarks/README.md's, measured alone, never here."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import ddp_trainer

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_the_trainer_and_the_raw_loop_each_report_a_time(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = ddp_trainer.run(
        rounds=1,
        warmup=2,
        steps=3,
        loaded=False,
        variants=("raw", "engine_defaults"),
        timeout=240,
    )
    assert out["ddp_raw_step_ms"] > 0
    assert out["ddp_engine_defaults_vs_raw"] > 0
    assert len(out["ddp_engine_defaults_vs_raw_rounds"]) == 1
