"""Replay of a data-parallel run compiled with ``steps_per_call``: the journal names the blocks,
and the replay runs them again as blocks on as many ranks (each one graph with the gradients'
all-reduce in it), bitwise. Its own file: two compiled 2-rank runs are most of its time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_ddp_resume import _two
from test_ddp_trainer import _ok

import engine as eg

pytestmark = pytest.mark.budget(
    share=0.08,
    why="a compiled 2-rank run and its replay, each rank compiling its blocks with a cold "
    "Inductor cache on a clean machine: 51 s in CI's run (5.4%), 22 s warm",
)


@pytest.mark.slow
def test_replay_of_a_compiled_ddp_run_runs_its_blocks_again_on_every_rank(tmp_path):
    # 20 batches a rank over 2 epochs, K=4, a journal line every 5 steps: blocks at steps
    # 0 and 5 of each epoch, each one compiled graph with the gradients' all-reduce in it
    run = tmp_path / "run"
    flags = dict(batch=8, epochs=2, compile=True, steps_per_call=4, log_every=5, every=5)
    _ok(_two(run, **flags))
    run_dir = run / "lightning_logs" / "version_0"
    lines = [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines()]
    assert [b for x in lines for b in x.get("blocks", ())] == [[1, 4], [6, 4], [11, 4], [16, 4]]
    report = eg.replay(run_dir, trust_code=True)
    assert report.identical, str(report)
    assert report.steps == 20 and report.compared >= 20
    later = eg.replay(run_dir, from_step=12, to_step=13, trust_code=True)
    assert later.identical and later.start_step == 10, str(later)
