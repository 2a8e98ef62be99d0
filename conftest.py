import os
import subprocess
import sys
from pathlib import Path

import pytest

# tests/ on the path as pytest puts it for the test modules (`from _ranks import ...`), a little
# earlier, for the plugins that measure where the time goes (`--durations-json=PATH`) and keep
# each file within its share of it (`_budget`).
_TESTS = str(Path(__file__).parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
pytest_plugins = ["_durations", "_budget"]

# Inductor's compiled code (its FX graph and AOTAutograd caches too) in a directory the suite
# owns, reused across tests, across processes (every child inherits the variable) and across
# runs of this checkout: each compile is paid cold once per checkout, not once per machine's
# /tmp. Set TORCHINDUCTOR_CACHE_DIR yourself to measure a cold run elsewhere.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).parent / ".cache" / "torchinductor")
)


@pytest.fixture(autouse=True)
def _run_in_a_fresh_directory(tmp_path, monkeypatch):
    """Trainers write logs and checkpoints under the working directory by default (as
    Lightning's do): keep every test's out of the repository and out of each other's way."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _keep_the_thread_count():
    """A test that sets ``torch.set_num_threads`` gets the process's count back after it: CPU
    matrix products' bits depend on the thread count, so a later test comparing a run in this
    process with one in a child process (which starts with the environment's count) would
    otherwise compare two thread counts."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: without one they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system (tmpfs), where the machine allows ``mount`` (a full disk for
    the save-failure tests); skipped, saying why, where it does not."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run mount: {e}")
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
