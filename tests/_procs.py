"""Fresh Python processes for the tests, forked from a warm one instead of started cold.

``run(args, ...)`` and ``Popen(args, ...)`` take what :func:`subprocess.run` and
:class:`subprocess.Popen` take for a Python command line, ``[sys.executable, *flags, -c CODE |
-m MODULE | SCRIPT, *arguments]``, and answer as they do (a ``CompletedProcess``,
``TimeoutExpired``, ``CalledProcessError``; ``pid``, ``poll``, ``wait``, ``communicate``,
``send_signal``, ``kill``, pipes). The process is forked from the suite's fork server
(multiprocessing's ``forkserver``, started once per session, which imported torch and engine
and nothing else ran in it), so a test gets a new pid and a new interpreter state as far as it
can tell: its own ``sys.argv``, ``sys.path`` (a cold interpreter's, with ``PYTHONPATH`` and the
script's directory), ``os.environ``, working directory, standard streams, ``__main__``,
threads joined and ``atexit`` run at the end, exceptions and ``SystemExit`` turned into the exit
status as ``python`` does, a signal's death reported as ``-signum``. What it does not pay is
the 3-5 s of importing torch and engine.

When to use which (every helper that starts processes for the tests is in this file or in
``_ranks.py``):

- ``_procs.run`` / ``_procs.Popen``: a test that needs *a* new process (a resume in a new
  process, a process killed at a random moment, the ``engine`` command's exit codes and
  output). The default.
- ``subprocess`` with ``sys.executable``: what only a cold start shows: the
  installed ``engine`` script, ``torchrun``, engine's own launchers (they start their ranks
  with ``sys.executable``), an environment that must be read when torch is imported (a
  ``PYTHONHASHSEED``, ``PYTHONWARNINGS``, interpreter flags this module does not know). ``Popen``
  falls back to a cold start by itself for those environments and flags.
- ``_ranks.run_ranks``: N gloo ranks running a test's function, forked from the same server.
  Tests about a launcher itself start it for real (torchrun, self-launch, spawn, two nodes).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from typing import Any

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL

# What every forked process has imported already: what nearly every child imports first.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "engine",
    "engine.checkpoint",
    "engine.cli",
    "_procs",
    "_ranks",
]
# Environment variables a cold interpreter reads before any code runs, which a fork cannot
# take: with one of them set, Popen starts the process cold.
_COLD_ENV = ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONSTARTUP")
_FLAGS_WITH_VALUE = ("-W", "-X")
# the signals whose disposition a started process takes from its parent when ignored
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
_SIGNALS += (signal.SIGUSR2, signal.SIGALRM)
_RUNPY = ("<frozen runpy>", os.path.join(os.path.dirname(os.__file__), "runpy.py"))


def context() -> Any:
    """The suite's fork server (one per session, started at its first use, with this
    directory on its ``PYTHONPATH``: python 3.11's server does not take the caller's
    ``sys.path`` for its preloading)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


# the fork server's own main process (this module is preloaded there): what the forked
# processes become again
_MAIN = mp.current_process()
_COLD_PATH: list[str] = []
_COLD_PATH_LOCK = threading.Lock()


def _cold_path() -> list[str]:
    """``sys.path[1:]`` of a cold interpreter started without ``PYTHONPATH`` (site-packages
    and the editable installs' entries, not the test runner's additions): computed once."""
    with _COLD_PATH_LOCK:
        if not _COLD_PATH:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            code = "import json, sys; print(json.dumps(sys.path[1:]))"
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
            )
            _COLD_PATH[:] = json.loads(out.stdout)
        return list(_COLD_PATH)


class _Fd:
    """A file descriptor that travels to the forked child (through the fork server, as
    multiprocessing sends a connection's): the child gets its own copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup: Any) -> int:
    return int(dup.detach())


def _parse(args: Sequence[Any]) -> tuple[list[str], str, str, list[str]] | None:
    """``(flags, kind, what, argv)`` of a Python command line (kind ``-c``, ``-m`` or
    ``script``), or ``None`` when it is not one this module runs in a fork."""
    args = [os.fspath(a) for a in args]
    if not args or args[0] != sys.executable:
        return None
    flags: list[str] = []
    i = 1
    while i < len(args):
        a = args[i]
        if a in ("-c", "-m"):
            if i + 1 >= len(args):
                return None
            return flags, a, args[i + 1], args[i + 2 :]
        if a in ("-u", "-B", "-s"):
            flags.append(a)
        elif a in _FLAGS_WITH_VALUE or (a.startswith(("-W", "-X")) and len(a) > 2):
            return None  # warnings and -X options are read at start-up: a cold start
        elif a.startswith("-"):
            return None
        else:
            return flags, "script", a, args[i + 1 :]
        i += 1
    return None  # an interactive interpreter


def _std_stream(fd: int, mode: str, unbuffered: bool) -> Any:
    """A standard stream on ``fd`` as a starting interpreter makes it."""
    if mode == "r":
        return open(fd, closefd=False)
    if unbuffered:
        raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(raw, write_through=True, line_buffering=False)
    return open(fd, "w", closefd=False)


def _child(
    flags: list[str],
    kind: str,
    what: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    fds: tuple[int, int, int],
    cold_path: list[str],
    new_session: bool,
    ignored: list[int],
) -> None:
    """The forked process: become ``python [flags] kind what argv`` and exit as it would;
    ``ignored``: the signals the caller ignores (a process it started would too)."""
    import multiprocessing.process as mp_process

    # a main process again, as far as multiprocessing (and what asks it) can tell
    _MAIN.name = "MainProcess"  # spawn.prepare gave it the child's name
    mp_process._current_process = _MAIN  # type: ignore[attr-defined]
    mp_process._parent_process = None  # type: ignore[attr-defined]
    mp_process._children = set()  # type: ignore[attr-defined]
    if new_session:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    unbuffered = "-u" in flags or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _std_stream(0, "r", False)
    sys.stdout = sys.__stdout__ = _std_stream(1, "w", unbuffered)
    sys.stderr = sys.__stderr__ = _std_stream(2, "w", True)
    sys.dont_write_bytecode = "-B" in flags or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    import torch

    # the thread count a cold start would take from this environment (OpenMP read the
    # fork server's at import)
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else _cores())

    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = {"-c": "", "-m": os.getcwd(), "script": os.path.dirname(os.path.abspath(what))}[kind]
    sys.path[:] = [first, *extra, *cold_path]
    sys.path_importer_cache.clear()
    import importlib

    importlib.invalidate_caches()
    # as exec and python's start: an ignored signal stays ignored, the others are reset;
    # python then takes SIGINT (unless ignored) as KeyboardInterrupt
    for number in _SIGNALS:
        signal.signal(number, signal.SIG_IGN if number in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    import runpy
    import types

    code = 0
    try:
        try:
            if kind == "-c":
                sys.argv = ["-c", *argv]
                main = types.ModuleType("__main__")
                main.__dict__["__builtins__"] = __builtins__
                sys.modules["__main__"] = main
                exec(compile(what, "<string>", "exec"), main.__dict__)
            elif kind == "-m":
                sys.argv = [what, *argv]  # runpy puts the module's file first, as -m does
                runpy.run_module(what, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [what, *argv]
                runpy.run_path(what, run_name="__main__")
        finally:
            threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        _print_uncaught()
        code = -signal.SIGINT
    except BaseException:
        _print_uncaught()
        code = 1
    import atexit

    try:
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e.code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:  # python's death by SIGINT after a KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _print_uncaught() -> None:
    """The uncaught exception's traceback as python prints it: from the program's first frame
    (this module's and runpy's frames left out)."""
    kind, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, *_RUNPY):
        tb = tb.tb_next
    if value is not None:
        value.__traceback__ = tb  # what the default hook prints
    sys.excepthook(kind, value, tb)  # type: ignore[arg-type]


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    with contextlib.suppress(Exception):
        print(value, file=sys.stderr)
    return 1


def _cores() -> int:
    """torch's thread count in a cold interpreter without ``OMP_NUM_THREADS``: the CPUs."""
    return len(os.sched_getaffinity(0))


class Popen:
    """:class:`subprocess.Popen` for a Python command line, forked from the fork server (see
    the module); any other command, or one that needs a cold start, is a real ``Popen``."""

    def __new__(cls, args: Sequence[Any], **kwargs: Any) -> Any:
        env = kwargs.get("env")
        parsed = _parse(args)
        cold = parsed is None
        cold = cold or any(k in (os.environ if env is None else env) for k in _COLD_ENV)
        if cold or set(kwargs) - _KNOWN:
            return subprocess.Popen(args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        args: Sequence[Any],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        universal_newlines: bool | None = None,
        encoding: str | None = None,
        errors: str | None = None,
        cwd: Any = None,
        env: Mapping[str, str] | None = None,
        start_new_session: bool = False,
    ) -> None:
        parsed = _parse(args)
        assert parsed is not None
        self.args = args
        self.returncode: int | None = None
        text = bool(text or universal_newlines or encoding or errors)
        self._text = (encoding, errors) if text else None
        self.stdin = self.stdout = self.stderr = None
        mine: list[int] = []  # the child's ends, closed here once it has them
        child: list[int] = []
        for i, (spec, mode) in enumerate(((stdin, "w"), (stdout, "r"), (stderr, "r"))):
            if spec is None:
                child.append(i)  # this process's own stream, as subprocess inherits it
            elif spec == PIPE:
                r, w = os.pipe()
                ours, theirs = (w, r) if mode == "w" else (r, w)
                mine.append(theirs)
                child.append(theirs)
                setattr(self, ("stdin", "stdout", "stderr")[i], self._wrap(ours, mode))
            elif spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                mine.append(fd)
                child.append(fd)
            elif spec == STDOUT and i == 2:
                child.append(child[1])
            elif isinstance(spec, int):
                child.append(spec)
            else:
                child.append(spec.fileno())
        env = dict(os.environ if env is None else env)
        flags, kind, what, argv = parsed
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        fds = tuple(_Fd(fd) for fd in child)
        ignored = [n for n in _SIGNALS if signal.getsignal(n) == signal.SIG_IGN]
        call = (flags, kind, what, argv, env, where, fds, _cold_path(), start_new_session, ignored)
        self._process = context().Process(target=_child, args=call, name="python", daemon=False)
        try:
            self._process.start()
        finally:
            for fd in mine:
                os.close(fd)
        self.pid = self._process.pid

    def _wrap(self, fd: int, mode: str) -> Any:
        if self._text is None:
            return open(fd, mode + "b")
        encoding, errors = self._text
        return open(fd, mode, encoding=encoding, errors=errors)

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
            if self._process.exitcode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            self.returncode = self._process.exitcode
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """As :meth:`subprocess.Popen.communicate`: feeds ``input``, reads both pipes to
        their end (each on a thread of its own, so neither fills), waits. After a
        ``TimeoutExpired`` it may be called again, as subprocess's."""
        if not hasattr(self, "_readers"):
            self._outs: dict[str, Any] = {}
            self._readers = []
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    t = threading.Thread(
                        target=lambda s=stream, n=name: self._outs.__setitem__(n, s.read()),
                        daemon=True,
                    )
                    t.start()
                    self._readers.append(t)
            if self.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ValueError):
                    if input is not None:
                        self.stdin.write(input)
                    self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                stream.close()
        return self._outs.get("stdout"), self._outs.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        self.wait()


_KNOWN = {
    "stdin",
    "stdout",
    "stderr",
    "text",
    "universal_newlines",
    "encoding",
    "errors",
    "cwd",
    "env",
    "start_new_session",
}


def run(
    args: Sequence[Any],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` for a Python command line, forked (see the module)."""
    if capture_output:
        kwargs.update(stdout=PIPE, stderr=PIPE)
    if input is not None:
        kwargs["stdin"] = PIPE
    with Popen(args, **kwargs) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    done = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def python(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``run([sys.executable, *args], capture_output=True, text=True, **kwargs)``."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return run([sys.executable, *map(os.fspath, args)], **kwargs)


__all__ = ["DEVNULL", "PIPE", "STDOUT", "Popen", "context", "python", "run"]
