"""The seam between the checkpoint code and a strategy's checkpoints
(``engine/checkpoint/_layouts.py``): a layout is looked up by what the state or ``meta.json``
says, ``engine.parallel`` registers the sharded one, a lookup that finds none says so, and the
checkpoint package imports no strategy and no ``torch.distributed``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import CheckpointError, _layouts
from engine.parallel import _dcp_layout

PACKAGE = Path(checkpoint.__file__).parent


def test_the_full_layout_is_the_checkpoint_codes_own_and_sharded_is_registered():
    state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
    assert _layouts.of_state(state) is None
    assert _layouts.of_meta({"format_version": 5}) is None
    assert isinstance(_layouts.of_meta({"layout": "sharded"}), _dcp_layout.DCPLayout)


def test_a_layout_nobody_registered_is_a_checkpoint_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_layouts, "_LAYOUTS", {})
    with pytest.raises(CheckpointError, match="'sharded', and no such layout is registered"):
        _layouts.of_meta({"layout": "sharded"})
    state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
    path = checkpoint.save(state, tmp_path / "c")  # the full layout needs none
    assert checkpoint.load(path, state).fingerprint() == state.fingerprint()


def test_the_checkpoint_package_imports_no_strategy_and_no_torch_distributed():
    above = ("engine.parallel", "engine.transforms", "engine.listeners", "engine.loop")
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith("torch.distributed"), (path.name, name)
                assert not name.startswith(above), (path.name, name)
                assert name not in ("engine.trainer", "engine._resume"), (path.name, name)


def test_importing_engine_does_not_import_torchs_sharding():
    """The sharded layout is registered when ``engine.parallel`` is imported, but DTensor and
    DCP (~0.4 s to import) are imported only when a sharded checkpoint is first used: a run
    that never shards does not pay for them, and ``TrainState.sharded`` stays one lookup in
    ``sys.modules`` there. A cold interpreter: the test session's has them imported."""
    import subprocess
    import sys

    script = (
        "import sys, engine\n"
        "from engine.checkpoint import _layouts\n"
        "print(sorted(_layouts._LAYOUTS))\n"
        "print([m for m in ('torch.distributed.tensor', 'torch.distributed.checkpoint')"
        " if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['sharded']", "[]"]
