"""The suite's time budget (tests/_budget.py): a file over its share of the run fails the run,
naming it; a marker that says why lets it take a larger share; a selection is not checked."""

import pytest

SLOW = "import time\n\ndef test_slow():\n    time.sleep(0.6)\n"
FAST = "def test_fast():\n    pass\n"
MARKED = "import pytest\n\npytestmark = pytest.mark.budget(share=1.0, why='it sleeps')\n"


def _run(root, capsys, *args):
    (root / "pytest.ini").write_text("[pytest]\n")
    argv = [str(root), "-q", "-p", "_budget", "-p", "no:cacheprovider", f"--rootdir={root}"]
    code = pytest.main([*argv, "-c", str(root / "pytest.ini"), *args])
    return code, capsys.readouterr().out


@pytest.fixture
def suite(tmp_path):
    (tmp_path / "test_a.py").write_text(SLOW)
    (tmp_path / "test_b.py").write_text(FAST)
    return tmp_path


@pytest.fixture(autouse=True)
def _fresh_modules(monkeypatch):
    """Each run imports its own test_a/test_b (the modules of an earlier run are not kept)."""
    import sys

    for name in ("test_a", "test_b"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in ("test_a", "test_b"):
        sys.modules.pop(name, None)


def test_a_file_over_its_share_fails_the_run_and_is_named(suite, capsys):
    code, out = _run(suite, capsys, "--budget=on")
    assert code == pytest.ExitCode.TESTS_FAILED, out
    assert "2 passed" in out and "time budget" in out
    assert "test_a.py:" in out and "test_b.py:" not in out.split("time budget")[1]
    assert "(its limit 5.0%)" in out


def test_a_marker_saying_why_allows_its_share(suite, capsys):
    (suite / "test_a.py").write_text(MARKED + SLOW)
    code, out = _run(suite, capsys, "--budget=on")
    assert code == pytest.ExitCode.OK, out
    (suite / "test_a.py").write_text(MARKED.replace("1.0", "0.5") + SLOW)
    for name in ("test_a", "test_b"):
        __import__("sys").modules.pop(name, None)
    code, out = _run(suite, capsys, "--budget=on")  # held to the share it declared
    assert code == pytest.ExitCode.TESTS_FAILED and "(its limit 50.0%)" in out, out


def test_a_marker_without_a_reason_or_with_a_bad_share_is_refused(suite, capsys):
    for bad in ("share=0.5", "share=2, why='x'", "why='x'"):
        marker = f"import pytest\npytestmark = pytest.mark.budget({bad})\n"
        (suite / "test_a.py").write_text(marker + FAST)
        __import__("sys").modules.pop("test_a", None)
        code, _ = _run(suite, capsys, "--budget=on")
        assert code == pytest.ExitCode.USAGE_ERROR, bad


def test_a_selection_is_not_checked_unless_asked(suite, capsys):
    code, out = _run(suite, capsys)  # a path on the command line: a selection
    assert code == pytest.ExitCode.OK and "time budget" not in out, out
    code, out = _run(suite, capsys, "--budget=off")
    assert code == pytest.ExitCode.OK, out
