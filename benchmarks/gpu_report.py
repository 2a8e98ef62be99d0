"""Assembles ``benchmarks/gpu_check.sh``'s one JSON file: ``env``, ``tests``, ``bench`` and,
when the script ran or skipped the 2-GPU data-parallel and FSDP checks, ``ddp`` and ``fsdp``.

Standard library only, so that it writes a report even where torch or engine fail to import::

    python benchmarks/gpu_report.py --out gpu_check.json --tests-log LOG --tests-rc RC \\
        --bench-json BENCH --bench-log LOG --bench-rc RC \\
        [--ddp-json DDP --ddp-log LOG --ddp-rc RC | --ddp-skipped WHY] \\
        [--fsdp-json FSDP --fsdp-log LOG --fsdp-rc RC | --fsdp-skipped WHY] [--note TEXT]...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TAIL = 4000  # characters of a log kept in the report
OUTCOMES = ("passed", "failed", "errors", "error", "skipped", "deselected", "xfailed", "xpassed")


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _tree_sha256() -> str:
    """One hash over engine/'s Python files (path and bytes): ties figures to code where the
    copy has no git history."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "engine").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> dict[str, Any]:
    """torch, CUDA, the device, and which engine tree ran."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "engine_commit": os.environ.get("ENGINE_COMMIT") or _run(["git", "rev-parse", "HEAD"]),
        "engine_dirty": None,
        "engine_tree_sha256": _tree_sha256(),
        "nvidia_smi": _run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ]
        ),
    }
    status = _run(["git", "status", "--porcelain", "--", "engine"])
    if status is not None:
        env["engine_dirty"] = bool(status)
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        env["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # a report is written whatever broke
        env["torch_error"] = f"{type(e).__name__}: {e}"
    return env


def parse_pytest(text: str) -> dict[str, int]:
    """The counts on pytest's summary line (``3 passed, 1 failed, 120 deselected in 2.1s``)."""
    pattern = rf"(\d+) ({'|'.join(OUTCOMES)})\b"
    lines = [ln for ln in text.splitlines() if re.search(pattern, ln)]
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped", "deselected"), 0)
    if not lines:
        return counts
    for n, word in re.findall(pattern, lines[-1]):
        key = "errors" if word == "error" else word
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def _read(path: str | None) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _timed_out(rc: int) -> bool:
    return rc in (124, 137)


def _run_section(rc: int, json_path: str | None, log_path: str | None) -> dict[str, Any]:
    """A stage that wrote JSON: its return code, the JSON (or why there is none), and the tail
    of its log when it failed."""
    section: dict[str, Any] = {"rc": rc, "timed_out": _timed_out(rc)}
    text = _read(json_path)
    try:
        section.update(json.loads(text) if text else {"error": "no JSON was written"})
    except json.JSONDecodeError as e:
        section["error"] = f"unreadable JSON: {e}"
    if rc != 0:
        section["tail"] = _read(log_path)[-TAIL:]
    return section


def report(args: argparse.Namespace) -> dict[str, Any]:
    log = _read(args.tests_log)
    tests: dict[str, Any] = {"rc": args.tests_rc, "timed_out": _timed_out(args.tests_rc)}
    tests.update(parse_pytest(log))
    if args.tests_rc == 5:
        tests["note"] = "pytest selected no test (rc 5): nothing is marked gpu"
    tests["tail"] = log[-TAIL:]
    bench = _run_section(args.bench_rc, args.bench_json, args.bench_log)
    out = {"env": environment(), "notes": args.note, "tests": tests, "bench": bench}
    for name in ("ddp", "fsdp"):
        skipped, rc = getattr(args, f"{name}_skipped"), getattr(args, f"{name}_rc")
        if skipped is not None:
            out[name] = {"skipped": skipped}
        elif rc is not None:
            out[name] = _run_section(
                rc, getattr(args, f"{name}_json"), getattr(args, f"{name}_log")
            )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tests-log")
    p.add_argument("--tests-rc", type=int, default=-1)
    p.add_argument("--bench-json")
    p.add_argument("--bench-log")
    p.add_argument("--bench-rc", type=int, default=-1)
    p.add_argument("--ddp-json")
    p.add_argument("--ddp-log")
    p.add_argument("--ddp-rc", type=int)
    p.add_argument("--ddp-skipped", help="why the data-parallel check did not run")
    p.add_argument("--fsdp-json")
    p.add_argument("--fsdp-log")
    p.add_argument("--fsdp-rc", type=int)
    p.add_argument("--fsdp-skipped", help="why the FSDP check did not run")
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args(argv)
    text = json.dumps(report(args), indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
