"""Print where the suite's time went, from the JSON that ``pytest --durations-json=PATH`` wrote.

    python tests/durations_report.py [PATH] [--top N] [--files N]

PATH defaults to tests/durations.json.gz (the measurement kept in the repository). It prints the
session's total, the time by cause across the suite, the slowest N tests (30) with their cause
split, and the time per test file, slowest first, with its fresh interpreters and rank launches.
The causes and what each counts are described in tests/_durations.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).with_name("durations.json.gz")
CAUSES = ("ranks", "interpreter", "forked", "process", "compile", "lightning", "own")
SHORT = {"ranks": "ranks", "interpreter": "interp", "process": "proc", "compile": "compile"}
SHORT |= {"forked": "forked"}
SHORT |= {"lightning": "lightn", "own": "own"}


def load(path: str | Path) -> dict[str, Any]:
    """The measurement in ``path``, as the plugin wrote it."""
    if str(path).endswith(".gz"):
        import gzip

        with gzip.open(path, "rt") as f:
            data: dict[str, Any] = json.load(f)
        return data
    with open(path) as f:
        data = json.load(f)
    return data


def file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def by_file(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per test file: tests, wall seconds, seconds by cause and summed counts; slowest first."""
    files: dict[str, dict[str, Any]] = {}
    for test in data["tests"]:
        row = files.setdefault(
            file_of(test["id"]),
            {"tests": 0, "wall_s": 0.0, "by_cause": dict.fromkeys(CAUSES, 0.0), "counts": {}},
        )
        row["tests"] += 1
        row["wall_s"] += test.get("wall_s", 0.0)
        for cause, s in test.get("by_cause", {}).items():
            row["by_cause"][cause] = row["by_cause"].get(cause, 0.0) + s
        for key, n in test.get("counts", {}).items():
            row["counts"][key] = row["counts"].get(key, 0) + n
    return dict(sorted(files.items(), key=lambda kv: -kv[1]["wall_s"]))


def _split(by_cause: dict[str, float]) -> str:
    return " ".join(f"{by_cause.get(c, 0.0):7.1f}" for c in CAUSES)


def _header() -> str:
    return " ".join(f"{SHORT[c]:>7}" for c in CAUSES)


def report(data: dict[str, Any], top: int = 30, files: int | None = None) -> str:
    """The whole report as text."""
    tests = data["tests"]
    wall = sum(t.get("wall_s", 0.0) for t in tests)
    out = [
        f"session {data['session_s']:,.1f} s (collection {data['collection_s']:,.1f} s) on "
        f"{data.get('cpus')} CPUs; {data['collected']:,} tests collected, "
        f"{data.get('selected', data['collected']):,} selected, {len(tests):,} run, "
        f"in tests {wall:,.1f} s",
    ]
    outcomes: dict[str, int] = {}
    for t in tests:
        outcomes[t["outcome"]] = outcomes.get(t["outcome"], 0) + 1
    out.append("outcomes: " + ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items())))

    total = dict.fromkeys(CAUSES, 0.0)
    counts: dict[str, int] = {}
    for t in tests:
        for cause, s in t.get("by_cause", {}).items():
            total[cause] = total.get(cause, 0.0) + s
        for key, n in t.get("counts", {}).items():
            counts[key] = counts.get(key, 0) + n
    what = {
        "ranks": f"{counts.get('rank_launches', 0):,} launches "
        f"({counts.get('rank_processes', 0):,} run_ranks processes)",
        "interpreter": f"{counts.get('interpreters', 0):,} fresh interpreters",
        "forked": f"{counts.get('forked', 0):,} forked from the fork server (tests/_procs.py)",
        "process": f"{counts.get('processes', 0):,} other processes",
        "compile": f"{counts.get('compiles', 0):,} compiles",
        "lightning": f"{counts.get('lightning_runs', 0):,} Trainer runs",
        "own": "the tests' own work",
    }
    out += ["", "time by cause", f"  {'cause':<12} {'seconds':>9} {'share':>6}"]
    for cause in CAUSES:
        share = 100 * total[cause] / wall if wall else 0.0
        out.append(f"  {cause:<12} {total[cause]:9,.1f} {share:5.1f}%  {what.get(cause, '')}")

    out += [
        "",
        f"slowest {min(top, len(tests))} tests (seconds)",
        f"  {'wall':>7} {_header()}  test",
    ]
    for t in sorted(tests, key=lambda t: -t.get("wall_s", 0.0))[:top]:
        out.append(f"  {t.get('wall_s', 0.0):7.1f} {_split(t.get('by_cause', {}))}  {t['id']}")

    rows = list(by_file(data).items())[:files]
    out += [
        "",
        "time per file, slowest first (seconds; interp/ranks/lightn: how many started or run)",
        f"  {'wall':>7} {'share':>6} {'tests':>5} {_header()} {'interp':>6} {'ranks':>5} "
        f"{'lightn':>6}  file",
    ]
    for name, row in rows:
        c = row["counts"]
        share = 100 * row["wall_s"] / wall if wall else 0.0
        out.append(
            f"  {row['wall_s']:7.1f} {share:5.1f}% {row['tests']:5} {_split(row['by_cause'])} "
            f"{c.get('interpreters', 0):6} {c.get('rank_launches', 0):5} "
            f"{c.get('lightning_runs', 0):6}  {name}"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(DEFAULT), help="the JSON (%(default)s)")
    parser.add_argument("--top", type=int, default=30, help="slowest tests to list (%(default)s)")
    parser.add_argument("--files", type=int, default=None, help="files to list (all)")
    args = parser.parse_args(argv)
    try:
        data = load(args.path)
    except (OSError, ValueError) as e:
        print(
            f"cannot read the measurement {args.path}: {e}; write one with "
            f"`pytest --durations-json={args.path}`",
            file=sys.stderr,
        )
        return 2
    print(report(data, top=args.top, files=args.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
