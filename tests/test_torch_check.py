"""The supported torch releases: ``import engine`` on an older torch stops first, with a message
that names the installed version, the supported range and the command that installs one; the
minimum is the one ``pyproject.toml`` declares."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import _torch_check

ROOT = Path(__file__).resolve().parents[1]
MINIMUM = ".".join(map(str, _torch_check.MINIMUM))


@pytest.mark.parametrize(
    "version",
    [
        "2.13.0",
        "2.13.0+cpu",
        "2.13.0a0+git1a2b3c",
        "2.13.0rc1",
        "2.14.0.dev20260101",
        "2.14.1+cu130",
        "3.0.0",
        "custom-build",
    ],
)
def test_a_supported_or_unreadable_version_passes(version):
    _torch_check.check(version)


@pytest.mark.parametrize("version", ["2.12.1+cu130", "2.12.0rc1", "2.10.0", "2.4.0+cpu", "1.13.1"])
def test_an_older_version_is_refused_naming_it_and_the_supported_range(version):
    with pytest.raises(ImportError) as raised:
        _torch_check.check(version, "/somewhere/torch")
    message = str(raised.value)
    assert f"torch {version} (/somewhere/torch)" in message
    assert f"torch {MINIMUM} or newer (torch>={MINIMUM})" in message
    assert f"pip install 'torch>={MINIMUM}'" in message


def test_the_release_numbers_are_read_past_local_and_pre_release_parts():
    assert _torch_check.release("2.13.0+cpu") == (2, 13)
    assert _torch_check.release("2.14.0.dev20260101") == (2, 14)
    assert _torch_check.release("2.12.0rc1") == (2, 12)
    assert _torch_check.release("10.2") == (10, 2)
    assert _torch_check.release("custom") is None


def test_the_installed_torch_is_supported():
    assert _torch_check.release(torch.__version__) >= _torch_check.MINIMUM, torch.__version__


def test_pyproject_declares_the_same_minimum():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"torch(>=[^"]*)"', pyproject) == [f">={MINIMUM}"]


def test_import_engine_on_an_older_torch_stops_first_with_the_message():
    """A fresh interpreter whose ``torch`` is a stand-in with only an old ``__version__``: the
    check is the first thing ``import engine`` runs (any other module would fail on the
    stand-in's missing attributes), and it leaves no engine module imported."""
    code = (
        "import sys, types\n"
        "torch = sys.modules['torch'] = types.ModuleType('torch')\n"
        "torch.__version__, torch.__path__ = '2.12.1+cu130', ['/opt/old/torch']\n"
        "try:\n"
        "    import engine\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'engine'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    message, modules = done.stdout.splitlines()
    assert message.startswith(
        f"engine supports torch {MINIMUM} or newer (torch>={MINIMUM}); this Python has torch "
        "2.12.1+cu130 (/opt/old/torch). Install a supported release: "
        f"pip install 'torch>={MINIMUM}'"
    ), message
    assert modules == "[]"


def test_the_escape_hatch_warns_instead_of_refusing(monkeypatch):
    monkeypatch.setenv("ENGINE_ALLOW_UNSUPPORTED_TORCH", "1")
    with pytest.warns(RuntimeWarning, match=r"torch 2\.11\.0\+cu130 because ENGINE_ALLOW"):
        _torch_check.check("2.11.0+cu130")
    monkeypatch.setenv("ENGINE_ALLOW_UNSUPPORTED_TORCH", "yes")  # only "1" opens it
    with pytest.raises(ImportError, match=r"2\.11\.0"):
        _torch_check.check("2.11.0+cu130")
