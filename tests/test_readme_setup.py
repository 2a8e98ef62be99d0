"""The README's set-up, as a new user reads it: what ``make demo`` and ``make test`` install
(checked with ``make -n`` against a scratch virtual environment directory), the torch index a
CUDA-by-default machine needs, where the ``engine`` command lives, and where the snippets'
runs write."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _make(*args: str, venv: Path) -> str:
    """What ``make ARGS`` would run (``make -n``), with ``VENV=venv``."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _installs(plan: str) -> list[str]:
    return [line for line in plan.splitlines() if "pip install" in line]


def _pretend(plan: str) -> None:
    """Leave the stamps a run of ``plan`` would leave (its ``touch`` lines)."""
    for line in plan.splitlines():
        if line.startswith("touch "):
            Path(shlex.split(line)[1]).touch()


def test_make_demo_installs_only_what_the_demo_needs(tmp_path):
    plan = _make("demo", venv=tmp_path)
    installs = _installs(plan)
    assert any('-e ".[demo]"' in line for line in installs), plan
    assert not any(".[test]" in line for line in installs), plan
    assert plan.rstrip().endswith("examples/digits.py")


def test_make_test_after_make_demo_still_installs_the_test_extra(tmp_path):
    _pretend(_make("demo", venv=tmp_path))
    plan = _make("test", venv=tmp_path)
    installs = _installs(plan)
    assert installs == [next(line for line in installs if '-e ".[test]"' in line)], plan
    for step in ("ruff check", "ruff format --check", "mypy engine", "pytest -q"):
        assert step in plan, (step, plan)


def test_torch_comes_from_the_index_the_user_names_and_offline_by_default(tmp_path):
    default = [line for line in _installs(_make("test", venv=tmp_path)) if "torch==" in line]
    assert len(default) == 1 and "--index-url" not in default[0], default
    plan = _make("test", f"TORCH_INDEX={CPU_INDEX}", "PIP_ARGS=--no-cache-dir", venv=tmp_path)
    (torch_line,) = [line for line in _installs(plan) if "torch==" in line]
    assert f'--index-url "{CPU_INDEX}"' in torch_line, torch_line
    assert all("--no-cache-dir" in line for line in _installs(plan)), plan
    assert all("--index-url" not in line for line in _installs(plan) if "torch==" not in line)


def test_every_make_command_in_the_readme_is_one_the_makefile_takes(tmp_path):
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    commands = [
        line.split("#")[0].strip()
        for block in blocks
        for line in block.splitlines()
        if line.startswith("make ")
    ]
    assert "make test" in commands and "make demo" in commands, commands
    assert f"make test TORCH_INDEX={CPU_INDEX}" in commands, commands
    for command in commands:
        _make(*shlex.split(command)[1:], venv=tmp_path)


def test_the_readme_says_where_engine_lives_and_what_make_test_runs():
    assert ".venv/bin/engine" in README
    section = README[README.index("## The two commands") : README.index("## Use")]
    for tool in ("ruff check", "ruff format", "mypy", "pytest"):
        assert tool in section, tool
    assert re.search(r"about \d+ minutes", section), "say how long make test takes"
    assert "runs/digits/" in section  # where the demo's runs go


def test_the_readme_snippets_write_their_runs_where_they_say(tmp_path):
    """The README's python blocks, run in a fresh directory (conftest chdirs there), leave the
    checkpoint and run directory its comment names, and nothing else."""
    assert "checkpoints/ (here epoch=1-step=5)" in README
    assert "lightning_logs/version_0/" in README
    namespace = {"__name__": "__readme__"}
    for block in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        exec(compile(block, "README.md", "exec"), namespace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "lightning_logs"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch=1-step=5"]
    run = tmp_path / "lightning_logs" / "version_0"
    assert (run / "journal.jsonl").is_file()
    assert Path(namespace["trainer"].run_dir).resolve() == run.resolve()
