"""The suite's time budget, kept: a file whose tests take more than its share of the run fails
the run, unless a marker says why it may take more.

Each test file may take at most ``SHARE`` of the whole run's test time (setup, call and
teardown, as pytest measured them; collection aside). A file that needs more says so, and why,
with a module marker::

    pytestmark = pytest.mark.budget(share=0.06, why="ten FSDP fits on two ranks")

and is then held to that share. The check runs when the whole suite runs (``make test``,
``pytest`` with no paths, ``-k`` or ``-m``: a selection's shares mean nothing) or when asked
with ``--budget=on``; ``--budget=off`` turns it off. A run that fails only the budget exits 1
and lists each file over its share, with its seconds, its share and the limit.

Shares, not seconds: a loaded machine slows every file alike, so a share moves only when a
file's cost moves against the rest.
"""

from __future__ import annotations

from typing import Any

import pytest

SHARE = 0.05  # of the run's test time, per file, without a marker
_KEY = pytest.StashKey[dict[str, Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--budget",
        choices=("auto", "on", "off"),
        default="auto",
        help="fail the run when a test file takes more than its share of the run's time "
        "(auto: when the whole suite runs)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "budget(share, why): this file may take up to `share` of the run's test time, because "
        "`why` (tests/_budget.py)",
    )
    config.stash[_KEY] = {"seconds": {}, "limits": {}, "over": []}


def _active(config: pytest.Config) -> bool:
    mode = config.getoption("--budget")
    if mode != "auto":
        return bool(mode == "on")
    whole = config.args_source != pytest.Config.ArgsSource.ARGS
    return whole and not config.option.keyword and not config.option.markexpr


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    limits = config.stash[_KEY]["limits"]
    for item in items:
        mark = item.get_closest_marker("budget")
        if mark is None:
            continue
        share, why = mark.kwargs.get("share"), mark.kwargs.get("why")
        if not isinstance(share, (int, float)) or not 0 < share <= 1 or not why:
            raise pytest.UsageError(
                f"{item.nodeid}: pytest.mark.budget needs share= (a fraction of the run, in "
                f"(0, 1]) and why= (what the time buys); got {mark.kwargs!r}"
            )
        limits[_file(item.nodeid)] = (float(share), str(why))


# the running sessions' per-file seconds, innermost last (a test may run pytest in-process)
_RUNNING: list[dict[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _RUNNING:
        seconds, key = _RUNNING[-1], _file(report.nodeid)
        seconds[key] = seconds.get(key, 0.0) + report.duration


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _RUNNING.append(session.config.stash[_KEY]["seconds"])


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash[_KEY]
    if _RUNNING and _RUNNING[-1] is state["seconds"]:
        _RUNNING.pop()
    if not _active(session.config) or exitstatus not in (0, 1):
        return
    seconds: dict[str, float] = state["seconds"]
    total = sum(seconds.values())
    if total <= 0:
        return
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        share, _ = state["limits"].get(name, (SHARE, ""))
        if s / total > share:
            state["over"].append((name, s, s / total, share))
    if state["over"] and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    over = config.stash[_KEY]["over"]
    if not over:
        return
    total = sum(config.stash[_KEY]["seconds"].values())
    terminalreporter.section("time budget (tests/_budget.py)", red=True)
    terminalreporter.line(
        f"{len(over)} file(s) took more than their share of the run's {total:.0f} s of tests; "
        "make them cheaper, or say why they may not be with "
        "pytestmark = pytest.mark.budget(share=..., why=...):"
    )
    for name, s, share, limit in over:
        terminalreporter.line(
            f"  {name}: {s:.1f} s, {share:.1%} of the run (its limit {limit:.1%})"
        )
