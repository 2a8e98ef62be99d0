"""benchmarks.data runs (tiny sizes, one round) and reports every case against the plain loader
over the same samples: the benchmark cannot rot unnoticed. Its figures are benchmarks/README.md's,
measured alone, never here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import data


def test_every_case_reads_the_same_number_of_batches_as_its_plain_loader():
    for name, (ours, plain) in data.cases(512).items():
        assert ours() == plain() > 0, name
    out = data.measure(512, rounds=1)
    assert set(out["cases"]) == {
        "shuffle_w0",
        "shuffle_w2",
        "shuffle_w4",
        "shard_w0",
        "shard_w2",
        "resumed_w0",
        "resumed_w2",
        "control_w2",
    }
    assert out["worst_case"] in out["cases"] and out["data_engine_vs_plain"] > 0
    assert out["worst_case"] != "control_w2"  # the control is not engine's
