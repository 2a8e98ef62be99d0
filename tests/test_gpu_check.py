"""The prepared GPU check (benchmarks/gpu.py, gpu_check.sh, gpu_report.py) cannot rot: its
benchmark runs end to end on the CPU with tiny sizes, the shell script parses, and the report
reads pytest's summary line."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import _procs
import pytest

from benchmarks import gpu_report

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick"]
    cmd += ["--skip-compile", "--json", str(out)]
    done = _procs.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results == json.loads(done.stdout)  # printed and written alike
    assert results["complete"] is True
    assert results["env"]["torch"] == __import__("torch").__version__
    assert set(results["models"]) == {"mlp", "transformer"}
    for name, model in results["models"].items():
        assert model["errors"] == {}, name
        assert model["params"] > 0
        for precision in ("float32", "bf16-mixed"):
            variants = model["variants"][precision]
            assert set(variants) == {"raw", "engine_eager"}, (name, precision)
            for kind, v in variants.items():
                assert v["step_ms"] > 0 and v["steps_per_s"] > 0, (name, precision, kind)
                assert v["ratio_to_raw"] > 0
                assert v["peak_mem_mb"] is None  # measured on CUDA only
            assert variants["raw"]["ratio_to_raw"] == 1.0
        assert set(model["bf16_vs_float32"]) == {"raw", "engine_eager"}
        assert all(r > 0 for r in model["bf16_vs_float32"].values())


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses() -> None:
    done = _procs.run(
        ["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_report_reads_pytest_summary_and_a_partial_benchmark(tmp_path: Path) -> None:
    log = tmp_path / "tests.log"
    log.write_text("..F\nFAILED tests/x.py::t\n= 2 passed, 1 failed, 90 deselected in 3.1s =\n")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"models": {"mlp": {}}, "complete": False}))
    out = tmp_path / "report.json"
    args = ["--out", str(out), "--tests-log", str(log), "--tests-rc", "1"]
    args += ["--bench-json", str(bench), "--bench-rc", "124", "--note", "offline"]
    gpu_report.main(args)
    report = json.loads(out.read_text())
    assert set(report) == {"env", "notes", "tests", "bench"}
    assert report["notes"] == ["offline"]
    tests = report["tests"]
    assert (tests["rc"], tests["passed"], tests["failed"], tests["deselected"]) == (1, 2, 1, 90)
    assert report["bench"]["timed_out"] is True
    assert report["bench"]["complete"] is False and "mlp" in report["bench"]["models"]
    assert {"torch", "engine_commit", "engine_tree_sha256"} <= set(report["env"])


def test_report_carries_the_ddp_check_or_why_it_was_skipped(tmp_path: Path) -> None:
    base = ["--tests-log", str(tmp_path / "none.log"), "--tests-rc", "5"]
    base += ["--bench-json", str(tmp_path / "none.json"), "--bench-rc", "0"]
    why = "2-GPU data-parallel check skipped: torch sees 1 GPU(s), it needs 2"
    gpu_report.main(["--out", str(tmp_path / "skipped.json"), *base, "--ddp-skipped", why])
    assert json.loads((tmp_path / "skipped.json").read_text())["ddp"] == {"skipped": why}
    ddp, log = tmp_path / "ddp.json", tmp_path / "ddp.log"
    ddp.write_text(json.dumps({"equality": {"ok": True}, "complete": False}))
    log.write_text("Traceback ...\nNCCL error: unhandled system error\n")
    args = [*base, "--ddp-json", str(ddp), "--ddp-log", str(log), "--ddp-rc", "124"]
    gpu_report.main(["--out", str(tmp_path / "ran.json"), *args])
    report = json.loads((tmp_path / "ran.json").read_text())["ddp"]
    assert (report["rc"], report["timed_out"], report["complete"]) == (124, True, False)
    assert report["equality"] == {"ok": True} and "NCCL error" in report["tail"]


@pytest.mark.slow
def test_ddp_check_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    """benchmarks.gpu_ddp's whole path on the CPU: 2 gloo ranks under torchrun against one
    process on the whole batch (its equality figures are real: they must hold here too)."""
    out = tmp_path / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "benchmarks.gpu_ddp", "--device", "cpu", "--quick", "--json", str(out)]
    done = _procs.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["complete"] is True and results["ok"] is True, results
    assert (results["world_size"], results["backend"]) == (2, "gloo")
    eq = results["equality"]
    assert eq["ranks_bitwise_equal"] and eq["max_abs_diff"] <= eq["tol"] == 1e-5
    assert eq["moved"] > 100 * eq["tol"]  # the parameters trained: the match is not vacuous
    speed = results["speed"]["tiny"]
    assert "error" not in speed, speed
    for kind in ("engine_ddp", "torch_ddp", "engine_1gpu", "engine_1gpu_global_batch"):
        assert speed[f"{kind}_step_ms"] > 0, kind
    assert speed["engine_2gpu_vs_1gpu_ratio"] > 0
    tr = results["trainer"]
    assert tr["steps"] == tr["one_gpu_steps"] == 20 and tr["ranks_bitwise_equal"]
    assert tr["max_abs_diff"] <= 1e-5 and tr["val_loss_diff"] <= 1e-6 * max(1.0, tr["val_loss"])
