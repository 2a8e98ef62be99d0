"""Where the suite's time goes: each test's wall time split by cause, written as JSON.

Enable it with ``pytest --durations-json=PATH`` (or ``ENGINE_DURATIONS=PATH``); read the file
with ``python tests/durations_report.py PATH``. Disabled, it only registers the option.

For every test id it records the setup/call/teardown times pytest measured, the outcome, and the
test's wall time (from the start of its setup to the end of its teardown) split into causes. At
each instant the time goes to one cause, the first of these, in this order, that is active, so
nested time is counted once: a Lightning fit or a compile inside a child process is the child's,
a compile inside a Lightning fit in the test's own process is the compile's.

- ``ranks``: a rank launch: ``_ranks.run_ranks`` or ``_ranks.torchrun`` from its call to its
  return, or a child process whose argv runs ``torchrun`` or
  ``torch.distributed.run``/``launch``, or a Python child given
  ``MASTER_PORT``/``NODE_RANK``/``WORLD_SIZE`` in its ``env=`` (a node started by hand), while
  it lives. A script that launches its own ranks (engine's self-launch) is an interpreter: the
  parent does not see inside it.
- ``interpreter``: a fresh Python interpreter, from its start until the test reaps it: a
  ``subprocess`` child whose argv runs Python (``sys.executable``, ``python*``, a script with a
  Python ``#!`` line such as ``.venv/bin/engine``), or a ``multiprocessing`` process of the
  spawn method (start until a ``join`` sees it ended). While a child lives the test
  is taken to wait on it (reading its output, polling, sleeping), so parent work done alongside
  a child counts as the child's.
- ``forked``: a ``multiprocessing`` process of the forkserver method: the suite's fork server
  (``_procs``), which imported torch and engine once, forks it (a new process, no import).
- ``process``: any other child: a program that is not Python (``make``, ``git``, a shell
  script), or a forked ``multiprocessing`` process (no fresh import).
- ``compile``: inside ``torch.compile``'s compilation, as torch reports it through
  ``torch._dynamo.callback_handler`` (each frame Dynamo compiles, with its Inductor backend, and
  the backward AOTAutograd compiles lazily): the cost of a cold cache, not the running of the
  compiled code. Compiles inside child processes are the child's; children started during a
  compile (Inductor's compile workers, the C++ compiler) are the compile's.
- ``lightning``: inside ``Trainer.fit/validate/test/predict`` of ``pytorch_lightning`` or
  ``lightning.pytorch``.
- ``own``: the rest, the test's own work.

A child still alive when its test ends (a server a module fixture started) is counted up to that
test's end and not after. Children of ``os.fork``/``os.system`` are not seen (own time).

It wraps only these entry points, once per process, at the class level (``Popen.__init__``,
``wait``, ``poll``; ``BaseProcess.start``/``join``; the Trainer's four methods, wrapped when
Lightning is imported; ``run_ranks``, when ``_ranks`` is imported), so a test that monkeypatches
``subprocess.run`` or ``subprocess.Popen`` still gets its own fake; the wrappers are plain calls
and two clock reads, and they are removed when the session ends. Each record also carries
counts: fresh interpreters, forked processes, rank launches and their processes, other
processes, compiles, Lightning runs. Under pytest-xdist the workers measure and send their
records with the test reports, and the controller writes the file (written for it, not yet
tried: xdist is not installed here).

The file: ``session_s`` (from pytest's configure to the end), ``collection_s``, ``collected`` /
``selected`` / ``deselected``, ``cpus``, ``argv``, and ``tests``: one record per test id with
``outcome``, ``setup_s``/``call_s``/``teardown_s``, ``wall_s``, ``by_cause`` (seconds, summing
to ``wall_s``) and ``counts``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import multiprocessing.context
import multiprocessing.process
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

ENV = "ENGINE_DURATIONS"
# first wins; then "own"
CAUSES = ("ranks", "interpreter", "forked", "process", "compile", "lightning")
COUNTS = (
    "interpreters",
    "forked",
    "rank_launches",
    "rank_processes",
    "processes",
    "compiles",
    "lightning_runs",
)
_PROPERTY = "engine_durations"
_LIGHTNING = ("pytorch_lightning", "lightning.pytorch")
_TRAINER_METHODS = ("fit", "validate", "test", "predict")
_PYTHON = re.compile(r"python[0-9.]*$")
_RANK_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_RENDEZVOUS = {"MASTER_PORT", "NODE_RANK", "WORLD_SIZE"}  # in a child's own env=: a rank
_WRAPPERS = {"env", "timeout", "nice", "taskset", "stdbuf", "setpriv", "sudo", "sh", "bash"}

_now = time.perf_counter


class _Span:
    __slots__ = ("cause", "end", "start")

    def __init__(self, cause: str, start: float) -> None:
        self.cause, self.start, self.end = cause, start, None

    def close(self, when: float) -> None:
        if self.end is None:
            self.end = when


def split(spans: Iterable[tuple[str, float, float]], start: float, end: float) -> dict[str, float]:
    """Seconds of ``[start, end]`` per cause: each instant goes to the first active cause of
    CAUSES, the rest to ``own``."""
    marks: list[tuple[float, int, int]] = []
    for cause, a, b in spans:
        a, b = max(a, start), min(b, end)
        if a < b:
            rank = CAUSES.index(cause)
            marks += [(a, 1, rank), (b, -1, rank)]
    marks.sort()
    out = dict.fromkeys((*CAUSES, "own"), 0.0)
    active = [0] * len(CAUSES)
    last = start
    for t, step, rank in marks:
        if t > last:
            top = next((i for i, n in enumerate(active) if n), None)
            out[CAUSES[top] if top is not None else "own"] += t - last
            last = t
        active[rank] += step
    out["own"] += max(0.0, end - last)
    return out


def classify(args: Any, shell: bool = False) -> str:
    """``ranks``, ``interpreter`` or ``process``: what a ``subprocess`` child with ``args`` runs.

    Its program is Python (or a Python script), or a wrapper (``env``, ``timeout``, ``bash -c``
    ...) whose words name one; a word anywhere naming torchrun makes it a rank launch.
    """
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        words = text.split() if shell else [text]
    else:
        words = [os.fsdecode(a) for a in args]
    if not words:
        return "process"
    if any(w in _RANK_MODULES or os.path.basename(w) == "torchrun" for w in words):
        return "ranks"
    program = os.path.basename(words[0])
    if shell or program in _WRAPPERS:
        words = [part for w in words for part in w.split()]
        if any(w == sys.executable or _PYTHON.match(os.path.basename(w)) for w in words):
            return "interpreter"
    if words[0] == sys.executable or _PYTHON.match(program) or _python_script(words[0]):
        return "interpreter"
    return "process"


def _python_script(program: str) -> bool:
    path = program if os.sep in program else shutil.which(program)
    try:
        with open(path or program, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


class _Recorder:
    """One session's measurement: spans and counts of the running test, records of the done."""

    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config, self.path = config, path
        self.spans: list[_Span] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.test_start = _now()
        self.tests: dict[str, dict[str, Any]] = {}
        self.selected = self.deselected = 0
        self.session_start = self.collect_end = _now()

    # events, from the wrappers
    def open(self, cause: str, start: float) -> _Span:
        span = _Span(cause, start)
        self.spans.append(span)
        return span

    def count(self, key: str) -> None:
        self.counts[key] += 1

    # the test's window
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        self.test_start = _now()
        self.counts = dict.fromkeys(COUNTS, 0)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        report = yield
        if call.when != "teardown":
            return report
        end = _now()
        spans, self.spans = self.spans, []
        for span in spans:
            span.close(end)  # a child that outlives its test counts up to here
        causes = split(((s.cause, s.start, s.end or end) for s in spans), self.test_start, end)
        record = {"wall_s": end - self.test_start, "by_cause": causes, "counts": self.counts}
        report.user_properties.append((_PROPERTY, record))
        return report

    # the records, in the process that writes them (the xdist controller or the only one)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.tests.setdefault(report.nodeid, {"id": report.nodeid, "outcome": "passed"})
        rec[f"{report.when}_s"] = report.duration
        if report.failed:
            rec["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and rec["outcome"] == "passed":
            rec["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.when == "call" and hasattr(report, "wasxfail"):
            rec["outcome"] = "xpassed"
        for name, value in report.user_properties:
            if name == _PROPERTY:
                rec.update(value)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collect_end = _now()
        self.selected = len(session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.selected = max(self.selected, len(ids))  # each worker collects them all

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        _stop(self)
        if hasattr(self.config, "workerinput"):
            return  # an xdist worker: its records went to the controller with the reports
        data = {
            "version": 1,
            "argv": sys.argv[1:],
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "exitstatus": int(exitstatus),
            "session_s": _now() - self.session_start,
            "collection_s": self.collect_end - self.session_start,
            "collected": self.selected + self.deselected,
            "selected": self.selected,
            "deselected": self.deselected,
            "causes": [*CAUSES, "own"],
            "tests": list(self.tests.values()),
        }
        tmp = f"{self.path}.tmp"
        if str(self.path).endswith(".gz"):  # the one kept in the repository: ~190 KB, not 1.7 MB
            import gzip

            with gzip.open(tmp, "wt") as f:
                json.dump(data, f, separators=(",", ":"))
        else:
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
        os.replace(tmp, self.path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not hasattr(self.config, "workerinput"):
            terminalreporter.write_line(f"durations by cause: {self.path}")


# The wrappers. They are installed while at least one recorder is active (an in-process pytest
# run inside a measured test has its own) and report each event to every active recorder.
_RECORDERS: list[_Recorder] = []
_LOCK = threading.Lock()
_compiling = 0  # compiles in progress (Dynamo runs the callbacks for the outermost only)
_compile_spans: list[_Span] = []
_rank_depth = 0
_undo: list[Callable[[], None]] = []
_children: dict[int, list[_Span]] = {}  # id(Popen or Process) -> its spans, while it lives


def _open(cause: str, count: str | None, start: float | None = None) -> list[_Span]:
    with _LOCK:
        start = _now() if start is None else start
        if count:
            for r in _RECORDERS:
                r.count(count)
        return [r.open(cause, start) for r in _RECORDERS]


def _close(spans: list[_Span]) -> None:
    end = _now()
    for span in spans:
        span.close(end)


def _child_started(obj: object, cause: str, start: float) -> None:
    if _compiling and cause != "ranks":
        return  # Inductor's compile workers and C++ compiler: part of the compile
    if _rank_depth and cause in ("interpreter", "forked", "process"):
        with _LOCK:  # a rank of run_ranks: counted; run_ranks's own span holds the time
            for r in _RECORDERS:
                r.count("rank_processes")
        return
    count = {"ranks": "rank_launches", "interpreter": "interpreters", "process": "processes"}
    count["forked"] = "forked"
    _children[id(obj)] = _open(cause, count[cause], start)


def _child_ended(obj: object) -> None:
    spans = _children.pop(id(obj), None)
    if spans:
        _close(spans)


def _patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = owner.__dict__[name]
    setattr(owner, name, functools.wraps(original)(make(original)))
    _undo.append(lambda: setattr(owner, name, original))


def _wrap_popen() -> None:
    def init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: subprocess.Popen, args: Any, *a: Any, **kw: Any) -> None:
            start = _now()
            original(self, args, *a, **kw)
            if not _RECORDERS:
                return
            argv = args if kw.get("executable") is None else [kw["executable"], *_list(args)]
            text = " ".join(_list(argv))
            if "compile_worker" in text:
                return  # Inductor's pool: the compile's
            cause = classify(argv, bool(kw.get("shell")))
            if cause == "interpreter" and _RENDEZVOUS & set(kw.get("env") or ()):
                cause = "ranks"  # a node or rank of a group the test starts by hand
            _child_started(self, cause, start)

        return __init__

    def reaping(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: subprocess.Popen, *a: Any, **kw: Any) -> Any:
            try:
                return original(self, *a, **kw)
            finally:
                if self.returncode is not None and _children:
                    _child_ended(self)

        return method

    _patch(subprocess.Popen, "__init__", init)
    _patch(subprocess.Popen, "wait", reaping)
    _patch(subprocess.Popen, "poll", reaping)


def _list(args: Any) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return [os.fsdecode(args)]
    return [os.fsdecode(a) for a in args]


def _start_method(process: multiprocessing.process.BaseProcess) -> str:
    method = getattr(process, "_start_method", None)
    if method:
        return str(method)
    default = multiprocessing.context._default_context  # type: ignore[attr-defined]
    # without fixing the default (get_start_method() would, and set_start_method would then fail)
    ctx = default._actual_context or default._default_context
    return str(ctx._name)


def _wrap_multiprocessing() -> None:
    base = multiprocessing.process.BaseProcess

    def start(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: multiprocessing.process.BaseProcess) -> None:
            begin = _now()
            original(self)
            if _RECORDERS:
                method = _start_method(self)
                kind = {"spawn": "interpreter", "forkserver": "forked"}.get(method, "process")
                _child_started(self, kind, begin)

        return method

    def join(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: multiprocessing.process.BaseProcess, *a: Any, **kw: Any) -> None:
            try:
                original(self, *a, **kw)
            finally:
                if _children and self.exitcode is not None:
                    _child_ended(self)

        return method

    _patch(base, "start", start)
    _patch(base, "join", join)


def _timed(cause: str, count: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(*a: Any, **kw: Any) -> Any:
            if not _RECORDERS:
                return original(*a, **kw)
            spans = _open(cause, count)
            try:
                return original(*a, **kw)
            finally:
                _close(spans)

        return method

    return make


def _wrap_ranks(module: Any) -> None:
    timed = _timed("ranks", "rank_launches")

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        inner = timed(original)

        def launch(*a: Any, **kw: Any) -> Any:
            global _rank_depth
            _rank_depth += 1
            try:
                return inner(*a, **kw)
            finally:
                _rank_depth -= 1

        return launch

    _patch(module, "run_ranks", make)
    if hasattr(module, "torchrun"):
        _patch(module, "torchrun", make)


def _wrap_lightning(module: Any) -> None:
    trainer = module.Trainer
    for name in _TRAINER_METHODS:
        if name in trainer.__dict__:
            _patch(trainer, name, _timed("lightning", "lightning_runs"))


def _wrap_compile(module: Any) -> None:
    def started(args: Any) -> None:
        global _compiling
        _compiling += 1
        _compile_spans[:] = _open("compile", "compiles") if _RECORDERS else []

    def ended(args: Any) -> None:
        global _compiling
        _compiling = max(0, _compiling - 1)
        _close(_compile_spans)

    # around the handler's own calls, not registered with it: torch._dynamo.reset() (which
    # tests call) clears the registered callbacks
    handler = module.callback_handler
    run_start, run_end = handler.run_start_callbacks, handler.run_end_callbacks

    def run_start_callbacks(args: Any) -> None:
        started(args)
        run_start(args)

    def run_end_callbacks(args: Any) -> None:
        try:
            run_end(args)
        finally:
            ended(args)

    handler.run_start_callbacks, handler.run_end_callbacks = run_start_callbacks, run_end_callbacks

    def undo() -> None:
        del handler.run_start_callbacks, handler.run_end_callbacks  # the class's again

    _undo.append(undo)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``hooks[name](module)`` once module ``name`` has been executed, without importing
    anything itself: Lightning and torch's compiler are wrapped only in a session that uses them."""

    def __init__(self, hooks: dict[str, Callable[[Any], None]]) -> None:
        self.hooks = hooks

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if not isinstance(loader, importlib.machinery.SourceFileLoader):
            return spec  # not a plain source file's own loader (pytest's rewriter is shared)
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            hook = self.hooks.pop(name, None)  # only now: find_spec alone is not an import
            if hook is not None and _RECORDERS:
                hook(module)

        loader.exec_module = exec_module  # this module's loader only
        return spec


def _start(recorder: _Recorder) -> None:
    _RECORDERS.append(recorder)
    if len(_RECORDERS) > 1:
        return
    _wrap_popen()
    _wrap_multiprocessing()
    hooks: dict[str, Callable[[Any], None]] = {
        "_ranks": _wrap_ranks,
        "torch._dynamo.callback": _wrap_compile,
        **dict.fromkeys(_LIGHTNING, _wrap_lightning),
    }
    for name in list(hooks):
        if name in sys.modules:
            hooks.pop(name)(sys.modules[name])
    finder = _AfterImport(hooks)
    sys.meta_path.insert(0, finder)
    _undo.append(lambda: sys.meta_path.remove(finder))


def _stop(recorder: _Recorder) -> None:
    if recorder not in _RECORDERS:
        return
    _RECORDERS.remove(recorder)
    if _RECORDERS:
        return
    while _undo:
        _undo.pop()()
    _children.clear()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-json",
        metavar="PATH",
        default=os.environ.get(ENV) or None,
        help="write each test's wall time split by cause (fresh interpreter, rank launch, "
        f"compile, Lightning, own) to PATH as JSON (also ${ENV}); "
        "read it with tests/durations_report.py",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--durations-json")
    if path:
        recorder = _Recorder(config, os.path.abspath(path))
        config.pluginmanager.register(recorder, "engine-durations")
        _start(recorder)


def pytest_unconfigure(config: pytest.Config) -> None:
    recorder = config.pluginmanager.get_plugin("engine-durations")
    if isinstance(recorder, _Recorder):
        _stop(recorder)
