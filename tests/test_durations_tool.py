"""The suite's time measurement (tests/_durations.py, tests/durations_report.py) puts each test's
time on the cause that spent it, and changes nothing a test sees."""

import json
import subprocess
import sys
import textwrap

import _durations
import durations_report
import pytest

GENERATED = textwrap.dedent(
    """
    import multiprocessing, os, subprocess, sys, time

    def test_child():
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"], check=True)
        time.sleep(0.3)  # the test's own, once the child is done

    def test_own():
        time.sleep(0.3)

    def test_spawned():
        p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.3,))
        p.start()
        p.join()

    def test_fork_server_started():  # its start and a cold interpreter's sys.path, once
        import _procs
        _procs.context()
        _procs._COLD_PATH.clear()  # found again here, whatever the session did before
        _procs._cold_path()

    def test_forked():  # from the suite's fork server: forked, not a fresh interpreter
        import _procs
        _procs.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)

    def test_torchrun(tmp_path):  # a stand-in for torchrun: a Python script of that name
        script = tmp_path / "torchrun"
        script.write_text(f"#!{sys.executable}\\nimport time\\ntime.sleep(0.3)\\n")
        script.chmod(0o755)
        subprocess.run([str(script)], check=True)

    def test_node():  # a rank started by hand, as the two-node tests do
        env = {**os.environ, "MASTER_PORT": "29500", "NODE_RANK": "1"}
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)

    def test_run_ranks():
        import importlib.util
        assert importlib.util.find_spec("_ranks")  # a look before the import: still wrapped
        import _ranks
        assert _ranks.run_ranks(print, 0) == []  # no rank: a launch that starts nothing
        assert _ranks.torchrun(["x.py"], 0).returncode == 0  # its script on no rank, too

    def test_a_patched_run_is_the_tests_own(monkeypatch):
        calls = []
        monkeypatch.setattr(subprocess, "run", lambda *a, **kw: calls.append(a))
        subprocess.run([sys.executable, "-c", "pass"])
        assert calls == [([sys.executable, "-c", "pass"],)]

    def test_a_patched_popen_is_the_tests_own(monkeypatch):
        class Fake:
            def __init__(self, args, **kw):
                self.args = args
            def wait(self, timeout=None):
                return 7
        monkeypatch.setattr(subprocess, "Popen", Fake)
        assert subprocess.Popen([sys.executable, "-c", "pass"]).wait() == 7
    """
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The generated tests run in this process by pytest with the plugin on: the JSON."""
    root = tmp_path_factory.mktemp("measured")
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "test_generated.py").write_text(GENERATED)
    out = root / "durations.json"
    wrapped = dict(vars(subprocess.Popen))
    args = [str(root), "-q", "-p", "_durations", f"--durations-json={out}", f"--rootdir={root}"]
    code = pytest.main([*args, "-p", "no:cacheprovider", "-c", str(root / "pytest.ini")])
    assert code == 0
    if not _durations._RECORDERS:  # the outer session is not measuring: all put back
        assert dict(vars(subprocess.Popen)) == wrapped
    data = json.loads(out.read_text())
    return data, {t["id"].split("::")[-1]: t for t in data["tests"]}, out


def _only(test, cause, counts):
    others = {k: v for k, v in test["by_cause"].items() if k not in (cause, "own")}
    assert others == dict.fromkeys(others, 0.0), test
    assert {k: n for k, n in test["counts"].items() if n} == counts, test


def test_a_python_child_is_a_fresh_interpreter_and_a_sleep_the_tests_own(measured):
    data, tests, _ = measured
    assert data["collected"] == data["selected"] == len(data["tests"]) == 10
    child, own = tests["test_child"], tests["test_own"]
    _only(child, "interpreter", {"interpreters": 1})
    assert child["by_cause"]["interpreter"] >= 0.5
    assert 0.3 <= child["by_cause"]["own"] < 0.5
    _only(own, "own", {})
    assert own["by_cause"]["own"] >= 0.3
    for test in data["tests"]:  # the causes share the test's time out, nothing twice
        assert test["outcome"] == "passed"
        assert sum(test["by_cause"].values()) == pytest.approx(test["wall_s"])
        phases = test["setup_s"] + test["call_s"] + test["teardown_s"]
        assert phases == pytest.approx(test["wall_s"], abs=0.05)


def test_a_spawned_process_is_a_fresh_interpreter(measured):
    test = measured[1]["test_spawned"]
    _only(test, "interpreter", {"interpreters": 1})
    assert test["by_cause"]["interpreter"] >= 0.3


def test_a_process_of_the_fork_server_is_forked_not_a_fresh_interpreter(measured):
    test = measured[1]["test_forked"]
    _only(test, "forked", {"forked": 1})
    assert test["by_cause"]["forked"] >= 0.3


def test_torchrun_a_node_and_run_ranks_are_rank_launches_not_interpreters(measured):
    torchrun, ranks = measured[1]["test_torchrun"], measured[1]["test_run_ranks"]
    _only(measured[1]["test_node"], "ranks", {"rank_launches": 1})
    _only(torchrun, "ranks", {"rank_launches": 1})
    assert torchrun["by_cause"]["ranks"] >= 0.3
    _only(ranks, "ranks", {"rank_launches": 2})  # run_ranks and _ranks.torchrun
    assert ranks["by_cause"]["ranks"] > 0


def test_tests_that_patch_subprocess_keep_their_fakes(measured):
    for name in ("test_a_patched_run_is_the_tests_own", "test_a_patched_popen_is_the_tests_own"):
        _only(measured[1][name], "own", {})


def test_nested_time_goes_to_the_outer_cost_once():
    spans = [("interpreter", 0, 1), ("lightning", 0.5, 2), ("compile", 1.5, 1.8), ("ranks", 4, 9)]
    assert (*_durations.CAUSES, "own") == durations_report.CAUSES
    got = _durations.split(spans, 0, 5)
    want = {"ranks": 1, "interpreter": 1, "forked": 0, "process": 0, "compile": 0.3}
    want["lightning"] = 0.7
    assert got == pytest.approx({**want, "own": 2.0})


@pytest.mark.parametrize(
    "args, shell, cause",
    [
        ([sys.executable, "-m", "engine", "inspect", "x"], False, "interpreter"),
        (["/usr/bin/python3.11", "-c", "pass"], False, "interpreter"),
        (["timeout", "60", "python", "x.py"], False, "interpreter"),
        ("cd /tmp && python3 -c pass", True, "interpreter"),
        ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "x.py"], 0, "ranks"),
        (["torchrun", "--standalone", "x.py"], False, "ranks"),
        (["make", "test", "PYTHON=/usr/bin/python3"], False, "process"),
        (["git", "status"], False, "process"),
    ],
)
def test_a_child_is_classified_by_what_it_runs(args, shell, cause):
    assert _durations.classify(args, bool(shell)) == cause


def test_the_report_prints_the_total_the_slowest_the_causes_and_the_files(measured, capsys):
    _, _, out = measured
    assert durations_report.main([str(out), "--top", "2"]) == 0
    text = capsys.readouterr().out
    for section in ("session ", "time by cause", "slowest 2 tests", "time per file"):
        assert section in text, text
    slowest = text.split("slowest 2 tests")[1].split("time per file")[0]
    assert "test_child" in slowest and "test_own" not in slowest
    assert "4 launches" in text and "3 fresh interpreters" in text, text
    assert "1 forked from the fork server" in text, text
    assert text.rstrip().endswith("test_generated.py")


def test_the_report_names_a_missing_measurement_and_how_to_make_one(tmp_path, capsys):
    assert durations_report.main([str(tmp_path / "none.json")]) == 2
    assert "--durations-json=" in capsys.readouterr().err
