"""benchmarks/fsdp.py and the 2-GPU FSDP check (benchmarks/gpu_fsdp.py) cannot rot: the
benchmark's JSON path runs on 2 gloo ranks with a small model and its memory figures hold
against what the shapes say; the peak tracker measures known allocations exactly; the check
runs end to end on the CPU; the report carries it or says why it was skipped."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import _procs
import pytest
import torch

from benchmarks import fsdp, gpu_report

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_step_peak_counts_known_allocations_and_frees() -> None:
    cpu = torch.device("cpu")

    def two_then_one() -> None:
        a = torch.empty(2048)  # 8 KiB
        b = torch.empty(1024)  # 4 KiB: 12 KiB at once
        del a
        c = torch.empty(1024)  # 8 KiB
        del b, c

    assert fsdp.step_peak_bytes(two_then_one, cpu) == 12 * 1024
    # a step that frees what the previous step made before making its own: no growth. The
    # profiler knows the freed block's size only because the lead calls allocated it in view.
    box = [torch.empty(4096)]

    def replace() -> None:
        box[0] = None  # type: ignore[call-overload]
        box[0] = torch.empty(4096)

    assert fsdp.step_peak_bytes(replace, cpu) == 0
    box[0] = torch.empty(4096)
    assert fsdp.step_peak_bytes(replace, cpu, lead=0) == 4 * 4096  # why the lead calls exist


def test_local_bytes_counts_every_tensor_leaf() -> None:
    assert (
        fsdp.local_bytes({"w": torch.zeros(3, 4), "b": [torch.zeros(2, dtype=torch.int64)]}) == 64
    )
    assert fsdp.local_bytes(None) == 0
    assert fsdp.local_bytes({"w": torch.zeros(3, 4), "n": 5}) == 48


@pytest.mark.slow
def test_benchmark_json_on_two_ranks() -> None:
    done = _procs.run(
        [sys.executable, "-m", "benchmarks.fsdp", "--quick", "--json"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    sizes = fsdp.QUICK
    assert (r["world_size"], r["backend"], r["per_rank_batch"]) == (2, "gloo", sizes["batch"])
    numel = sum(p.numel() for p in fsdp.model(sizes["width"], sizes["blocks"]).parameters())
    assert r["params"] == numel
    # DDP holds every parameter, AdamW's two moments of each (and its step counters), and the
    # gradient sum of an accumulated step: what the shapes say
    assert r["ddp_held_params_bytes"] == r["ddp_held_grads_bytes"] == 4 * numel
    assert 8 * numel <= r["ddp_held_opt_state_bytes"] <= 8 * numel + 1024
    assert r["torch_ddp_vs_ddp_held_total_ratio"] == 1.0  # torch's DDP holds the same
    assert r["torch_ddp_step_start_bytes"] == r["torch_ddp_held_total_bytes"]  # with its .grad
    for kind in fsdp.SHARDED:
        # every dim 0 of this model is even: each rank holds exactly half of each parameter
        assert r[f"{kind}_vs_ddp_held_params_ratio"] == 0.5
        assert r[f"{kind}_vs_ddp_held_grads_ratio"] == 0.5
        assert 0.5 <= r[f"{kind}_vs_ddp_held_opt_state_ratio"] < 0.501  # counters replicated
        assert r["rank1_held_total_bytes"][kind] == r[f"{kind}_held_total_bytes"]
        assert r[f"{kind}_step_peak_bytes"] < r["ddp_step_peak_bytes"]
        lo, hi = r[f"{kind}_step_peak_above_start_range_bytes"]
        assert 0 < lo <= r[f"{kind}_step_peak_above_start_bytes"] <= hi
        # engine's step keeps no gradients between steps (accumulate=1): it starts from the state
        held = r[f"{kind}_held_params_bytes"] + r[f"{kind}_held_opt_state_bytes"]
        assert r[f"{kind}_step_start_bytes"] == held
    # ZeRO-2 keeps every block's gathered weights to the backward, ZeRO-3 frees each after its
    # forward: at the forward's end ZeRO-3 holds less, ZeRO-2 at least the full weights
    assert r["zero3_forward_peak_bytes"] < r["zero2_forward_peak_bytes"]
    assert r["zero2_forward_peak_above_start_bytes"] >= 4 * numel  # all the weights, gathered
    for kind in fsdp.VARIANTS:
        assert r[f"{kind}_step_ms"] > 0
    assert r["zero2_vs_ddp_step_ratio"] > 0 and r["ddp_vs_torch_ddp_step_ratio"] > 0


def test_report_carries_the_fsdp_check_or_why_it_was_skipped(tmp_path: Path) -> None:
    base = ["--tests-log", str(tmp_path / "none.log"), "--tests-rc", "5"]
    base += ["--bench-json", str(tmp_path / "none.json"), "--bench-rc", "0"]
    why = "2-GPU FSDP check skipped: torch sees 1 GPU(s), it needs 2"
    args = [*base, "--ddp-skipped", "no", "--fsdp-skipped", why]
    gpu_report.main(["--out", str(tmp_path / "skipped.json"), *args])
    report = json.loads((tmp_path / "skipped.json").read_text())
    assert report["fsdp"] == {"skipped": why} and report["ddp"] == {"skipped": "no"}
    out, log = tmp_path / "fsdp.json", tmp_path / "fsdp.log"
    out.write_text(json.dumps({"equality": {"ok": True}, "complete": False}))
    log.write_text("Traceback ...\nNCCL error: unhandled system error\n")
    args = [*base, "--fsdp-json", str(out), "--fsdp-log", str(log), "--fsdp-rc", "124"]
    gpu_report.main(["--out", str(tmp_path / "ran.json"), *args])
    report = json.loads((tmp_path / "ran.json").read_text())
    assert "ddp" not in report
    fs = report["fsdp"]
    assert (fs["rc"], fs["timed_out"], fs["complete"]) == (124, True, False)
    assert fs["equality"] == {"ok": True} and "NCCL error" in fs["tail"]


@pytest.mark.slow
def test_fsdp_check_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    """benchmarks.gpu_fsdp's whole path on the CPU under torchrun: its equality figures are
    real (FSDP against DDP and one process) and must hold here too."""
    out = tmp_path / "fsdp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "benchmarks.gpu_fsdp", "--device", "cpu", "--quick", "--json", str(out)]
    done = _procs.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["complete"] is True and r["ok"] is True, r
    assert (r["world_size"], r["backend"]) == (2, "gloo")
    eq = r["equality"]
    assert eq["moved"] > 100 * eq["tol"]  # the parameters trained: the match is not vacuous
    for kind in ("ddp", *fsdp.SHARDED):
        assert eq[f"{kind}_max_abs_diff"] <= eq["tol"] == 1e-5, kind
    ms = r["memory_speed"]
    assert "error" not in ms, ms
    assert ms["zero3_vs_ddp_held_params_ratio"] == ms["zero2_vs_ddp_held_params_ratio"] == 0.5
    assert set(ms["rank1_step_peak_bytes"]) == set(fsdp.VARIANTS)
    tr = r["trainer"]
    assert "error" not in tr, tr
    assert tr["steps"] == tr["one_gpu_steps"] == 10
    assert tr["max_abs_diff"] <= 1e-5 and tr["val_loss_diff"] <= 1e-6 * max(1.0, tr["val_loss"])
