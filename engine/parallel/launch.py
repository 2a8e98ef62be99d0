"""Launchers: how the processes of a distributed run start when no torchrun or srun started them.

* :class:`ScriptLauncher` (Lightning's ``"ddp"``): the launching process starts local ranks
  ``1..N-1`` as new processes running the same command line, then runs the work itself as local
  rank 0. Every process runs the whole script; when a child reaches the same Trainer call, its
  environment says it was created externally and it only joins. A thread watches the children:
  one that fails makes rank 0 fail within a bounded time, never hang.
* :class:`SpawnLauncher` (``"ddp_spawn"``, ``"ddp_fork"``): runs a function in N new processes
  (``torch.multiprocessing``) and returns rank 0's return value to the caller; a child's error is
  re-raised in the caller with the child's traceback.

Both set, in each process they start, the variables ``torch.distributed``'s ``env://`` reads
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, plus
``NODE_RANK``) and :data:`~engine.parallel.environments.LAUNCHED_BY_VAR`.

Example:
    >>> launcher = SpawnLauncher(2, start_method="spawn")
    >>> launcher.num_processes, launcher.start_method
    (2, 'spawn')
"""

from __future__ import annotations

import atexit
import ctypes
import io
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import torch
import torch.multiprocessing as mp

from engine.errors import CollectiveError
from engine.parallel import environments as _environments
from engine.parallel.environments import LAUNCHED_BY_VAR, ClusterEnvironment, find_free_port

__all__ = ["ChildProcessFailed", "ScriptLauncher", "SpawnLauncher", "find_free_port"]


class ChildProcessFailed(RuntimeError):
    """A process a launcher started ended with a non-zero exit status (or was still running when
    it had to have ended). The message names its rank and exit code."""

    def __init__(self, message: str | None = None) -> None:
        if message is None:
            # Raised in the main thread by the watcher (an asynchronous exception is raised by
            # class, without arguments): this __init__ runs in the main thread, so it got it.
            family = _family
            message = family.report() if family is not None else "a child process failed"
            if family is not None:
                family.handled.set()
        super().__init__(message)


def _exit_status(code: int) -> int:
    """A shell's exit status for a child's ``returncode`` (``-N``: killed by signal N)."""
    return code if code > 0 else 128 - code


def _describe(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name} (exit code {code})"
    except ValueError:
        return f"signal {-code} (exit code {code})"


_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "gloo",
    "NCCL",
)


def _is_communication_error(error: BaseException) -> bool:
    """An error a collective raises when a peer went away (gloo: "Connection closed by peer"):
    a consequence, when a child has just died, not a cause."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    if isinstance(error, CollectiveError):  # one of engine's collectives: a peer did not join
        return True
    if not isinstance(error, RuntimeError):
        return False
    if any(marker in str(error) for marker in _PEER_GONE):
        return True  # raised by a C++ collective (work.wait()) called from any Python frame
    frames = traceback.extract_tb(error.__traceback__)
    return any(f"torch{os.sep}distributed" in frame.filename for frame in frames[-3:])


def _async_raise(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in thread ``thread_id`` at its next Python bytecode (``None``: cancel
    a pending one). A thread blocked in C code gets it when it returns to Python."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )


class _Failure(NamedTuple):
    local_rank: int
    pid: int
    code: int


class _Family:
    """The processes a :class:`ScriptLauncher` started, and the thread that watches them. One per
    launching process (the children run the rest of the script too, so they live as long as it).
    """

    def __init__(
        self,
        procs: dict[int, subprocess.Popen[bytes]],
        global_rank0: int,
        *,
        poll_interval: float,
        kill_after: float,
        term_grace: float,
        join_timeout: float,
    ) -> None:
        self.procs = procs
        self.global_rank0 = global_rank0  # the global rank of local rank 0 (node_rank * N)
        self.poll_interval = poll_interval
        self.kill_after = kill_after
        self.term_grace = term_grace
        self.join_timeout = join_timeout
        self.lock = threading.RLock()
        self.failure: _Failure | None = None
        self.closing = False  # no more failures to report: one was, or we are stopping them
        self.terminated: set[int] = set()  # local ranks we stopped: their exit codes are ours
        self.handled = threading.Event()  # the main thread has the failure as an exception
        self.main_thread = threading.main_thread().ident or 0
        self.joined = False

    def report(self) -> str:
        f = self.failure
        if f is None:
            return "a child process failed"
        stopped = "; the other processes were stopped" if self.terminated else ""
        return (
            f"local rank {f.local_rank} (global rank {self.global_rank0 + f.local_rank}, pid "
            f"{f.pid}) exited with {_describe(f.code)}{stopped}. Its error, if it printed one, "
            "is above in this output"
        )

    # ------------------------------------------------------------------ the watcher

    def watch(self) -> None:
        thread = threading.Thread(target=self._watch, name="engine-launch-watcher", daemon=True)
        thread.start()

    def _poll(self) -> _Failure | None:
        """Record the first child that ended with a non-zero status of its own (not one we
        stopped), under the lock."""
        with self.lock:
            if self.failure is None:
                for rank, proc in self.procs.items():
                    code = proc.poll()
                    if code not in (None, 0) and rank not in self.terminated:
                        self.failure = _Failure(rank, proc.pid, code)
                        self.closing = True
                        break
            return self.failure

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_interval)
            with self.lock:
                if self.closing or self.joined:
                    return
                failure = self._poll()
                if failure is None:
                    if all(p.poll() == 0 for p in self.procs.values()):
                        return  # every child finished well: nothing left to watch
                    continue
                interrupt = not self.handled.is_set()
                if interrupt:
                    _async_raise(self.main_thread, ChildProcessFailed)
            print(f"engine launch: {self.report()}", file=sys.stderr, flush=True)
            self.stop_children()
            if interrupt and not self.handled.wait(self.kill_after):
                # The main thread is blocked in C code (a collective, a rendezvous) and did not
                # take the exception: end the process rather than let it hang.
                print(
                    f"engine launch: local rank 0 did not stop within {self.kill_after:g} s of "
                    f"local rank {failure.local_rank}'s failure (blocked outside Python, e.g. "
                    "in a collective or the rendezvous): exiting now",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(_exit_status(failure.code))
            return

    # ------------------------------------------------------------------ the main thread's side

    def settle(self, wait: float) -> _Failure | None:
        """The main thread has an error (or a result): take any pending failure as handled, so
        the watcher raises nothing more in it, and return it. ``wait``: how long to look for a
        child that is dying (its end is what the error is about)."""
        deadline = time.monotonic() + wait
        while True:
            failure = self._poll()
            if failure is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        with self.lock:
            self.handled.set()
            if failure is not None:
                self.closing = True
            _async_raise(self.main_thread, None)  # a raise the watcher queued, not yet taken
        return failure

    def stop_children(self, grace: float | None = None) -> None:
        """SIGTERM the children still running, SIGKILL those that outlive ``grace`` seconds."""
        grace = self.term_grace if grace is None else grace
        with self.lock:
            self.closing = True
            running = {r: p for r, p in self.procs.items() if p.poll() is None}
            self.terminated.update(running)
        for proc in running.values():
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in running.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def join(self, timeout: float | None = None) -> None:
        """Wait for every child to end (at most ``timeout`` seconds, then stop them).

        Raises:
            ChildProcessFailed: a child failed, or was still running at the timeout.
        """
        timeout = self.join_timeout if timeout is None else timeout
        with self.lock:
            self.joined = True
        deadline = time.monotonic() + timeout
        late = []
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late.append(rank)
        if late:
            self.stop_children()
            raise ChildProcessFailed(
                f"local ranks {late} were still running {timeout:g} s after local rank 0 "
                "finished, and were stopped: every process must make the same Trainer calls "
                "(pass a longer join_timeout if they only finish later)"
            )
        failure = self._poll() or self.failure
        if failure is not None:
            raise ChildProcessFailed(self.report())

    def join_at_exit(self) -> None:
        """At the end of the launching script: wait for the children; if one failed, say so and
        make the script's exit status non-zero (an exception in ``atexit`` would not)."""
        try:
            self.join()
        except ChildProcessFailed as error:
            print(f"engine launch: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            code = self.failure.code if self.failure is not None else 1
            os._exit(_exit_status(code))


_family: _Family | None = None


def _script_command() -> list[str]:
    """The command line that runs this script again: ``python script.py args`` or
    ``python -m module args``."""
    import __main__

    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-c":
        raise RuntimeError(
            "strategy 'ddp' starts the other processes by running the script again, but this "
            "one was started with `python -c`, which has no script to run: put the code in a "
            "file and run that, or use strategy='ddp_spawn'"
        )
    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    if not argv0 or not os.path.isfile(argv0):
        raise RuntimeError(
            "strategy 'ddp' starts the other processes by running the script again, but this "
            f"process has no script file (sys.argv[0]={argv0!r}: an interactive session or a "
            "notebook?): run a script file, or use strategy='ddp_spawn' (or 'ddp_notebook' "
            "where fork is available)"
        )
    return [sys.executable, os.path.abspath(argv0), *sys.argv[1:]]


class ScriptLauncher:
    """Start local ranks ``1..num_processes-1`` by running this script again, and run the work
    as local rank 0 (Lightning's ``"ddp"``).

    On each node, the launching process (``LOCAL_RANK`` unset or 0) picks ``MASTER_PORT`` if it
    is not set (several nodes must set it, and ``MASTER_ADDR``, ``NODE_RANK``), sets
    ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK`` and ``RANK``
    in its own environment and in each child's, and starts the children with
    ``sys.executable`` and ``sys.argv`` (``-m module`` when the script ran with ``-m``).
    Their output goes to this process's stdout and stderr.

    A child that exits non-zero makes local rank 0 fail: a watcher thread stops the other
    children (SIGTERM, SIGKILL after ``term_grace`` s) and raises :class:`ChildProcessFailed`
    in the main thread, naming the rank and its exit code; if the main thread is blocked in C
    code (a collective, the rendezvous) and has not taken it within ``kill_after`` s, the
    process exits with the child's status. An error of rank 0's own stops the children too.

    The children run the rest of the script as well (a ``fit`` then a ``test`` meet them at both
    calls), so they are waited for when the launching script ends (``atexit``, at most
    ``join_timeout`` s), and a failure there makes its exit status non-zero.

    Args:
        num_processes: processes on this node (the Trainer's ``devices``).
        num_nodes: nodes, each running one launching process.
        environment: who this process is; a :class:`~engine.parallel.environments.
            LocalEnvironment` here, whose ``creates_processes_externally`` is True in a child.

    Example:
        >>> from engine.parallel.environments import LocalEnvironment
        >>> launcher = ScriptLauncher(1, 1, LocalEnvironment(1, 1))
        >>> launcher.launch(lambda x: x + 1, 41)  # one process: nothing to start
        42
    """

    def __init__(
        self,
        num_processes: int,
        num_nodes: int,
        environment: ClusterEnvironment,
        *,
        kill_after: float = 10.0,
        term_grace: float = 3.0,
        join_timeout: float = 60.0,
        poll_interval: float = 0.1,
    ) -> None:
        for name, value in (("num_processes", num_processes), ("num_nodes", num_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ScriptLauncher({name}={value!r}): pass an int >= 1")
        if not isinstance(environment, ClusterEnvironment):
            raise TypeError(
                f"ScriptLauncher(environment={environment!r}): pass a ClusterEnvironment, "
                "e.g. engine.parallel.environments.select_environment(...)"
            )
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.environment = environment
        self.kill_after = float(kill_after)
        self.term_grace = float(term_grace)
        self.join_timeout = float(join_timeout)
        self.poll_interval = float(poll_interval)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the other local ranks (unless they exist), then return ``fn(*args, **kwargs)``.

        Raises:
            RuntimeError: the script cannot be run again (``python -c``, interactive), or this
                is not local rank 0 of a launching process.
            ValueError: the environment disagrees with ``num_processes``/``num_nodes``, or a
                later call in the launching process asks for a different world.
            ChildProcessFailed: a child failed while ``fn`` ran.
        """
        self.environment.validate(devices=self.num_processes, num_nodes=self.num_nodes)
        shape = (self.num_processes, self.num_nodes)
        if "script" in _environments._launched_here:
            if _environments._launched_here["script"] != shape:
                started = _environments._launched_here["script"]
                raise ValueError(
                    f"this script already launched devices={started[0]}, "
                    f"num_nodes={started[1]}, and those processes run to its end: every "
                    f"Trainer of the script must use them (got devices={shape[0]}, "
                    f"num_nodes={shape[1]})"
                )
        elif self.environment.creates_processes_externally:
            return fn(*args, **kwargs)  # a child (or torchrun's, srun's): only join
        elif shape == (1, 1):
            return fn(*args, **kwargs)  # one process in all: nothing to start or to tell
        else:
            self._start_children()
        return self._run_rank0(fn, args, kwargs)

    def _start_children(self) -> None:
        global _family
        env, n = self.environment, self.num_processes
        command = _script_command() if n > 1 else []
        if env.local_rank() != 0:
            raise RuntimeError(
                f"the launching process must be local rank 0 (LOCAL_RANK="
                f"{env.local_rank()}): unset LOCAL_RANK, or set {LAUNCHED_BY_VAR} if you "
                "started every process yourself"
            )
        node = env.node_rank()
        variables = {
            "MASTER_ADDR": env.main_address,
            "MASTER_PORT": str(env.main_port),
            "WORLD_SIZE": str(n * self.num_nodes),
            "NODE_RANK": str(node),
        }
        os.environ.update(variables, LOCAL_RANK="0", RANK=str(node * n))
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for local in range(1, n):
                child_env = dict(os.environ, LOCAL_RANK=str(local), RANK=str(node * n + local))
                child_env[LAUNCHED_BY_VAR] = f"script:{os.getpid()}"
                procs[local] = subprocess.Popen(command, env=child_env)
        except BaseException:
            for proc in procs.values():
                proc.kill()
                proc.wait()
            raise
        _environments._launched_here["script"] = (n, self.num_nodes)
        _family = _Family(
            procs,
            node * n,
            poll_interval=self.poll_interval,
            kill_after=self.kill_after,
            term_grace=self.term_grace,
            join_timeout=self.join_timeout,
        )
        atexit.register(_family.join_at_exit)
        _family.watch()

    def _run_rank0(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        family = _family
        if family is None:
            return fn(*args, **kwargs)
        ended = {r: p.returncode for r, p in family.procs.items() if p.poll() is not None}
        if ended and family.failure is None and not family.closing:
            raise ChildProcessFailed(
                f"the processes this script launched at its first Trainer call have ended "
                f"(local rank: exit code {ended}), so they cannot join this one: every process "
                "must make the same Trainer calls"
            )
        with family.lock:
            family.main_thread = threading.get_ident()  # the thread to raise a failure in
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:
            # A collective's error when a child has just died is about that death: look a
            # moment for it. Any other error is rank 0's own; the children cannot go on.
            failure = family.settle(1.0 if _is_communication_error(error) else 0.0)
            if failure is not None and (
                isinstance(error, ChildProcessFailed) or _is_communication_error(error)
            ):
                family.stop_children()
                raise ChildProcessFailed(family.report()) from error
            family.stop_children()
            raise
        with family.lock:  # the watcher checks and raises under the same lock
            failure = family._poll()
            if failure is not None:
                family.handled.set()
                _async_raise(family.main_thread, None)
        if failure is not None:
            family.stop_children()
            raise ChildProcessFailed(family.report())
        return result  # still watched: a later failure is raised wherever this thread is


# ---------------------------------------------------------------------------- spawn


class _RemoteTraceback(Exception):
    """The traceback of an error raised in a spawned process, as its text (the cause of the
    error re-raised in the caller)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _MainUnpickler(pickle.Unpickler):
    """A spawned child's ``__main__`` is named ``__mp_main__`` there: its classes come back as
    this process's ``__main__``'s."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class("__main__" if module == "__mp_main__" else module, name)


_pickle_module = types.ModuleType("engine_spawn_pickle")
_pickle_module.Unpickler = _MainUnpickler  # type: ignore[attr-defined]
_pickle_module.load = pickle.load  # type: ignore[attr-defined]


def _spawned(
    index: int,
    work: bytes | tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    world: int,
    address: str,
    port: int,
    outbox: str,
    parent: int,
) -> None:
    """The body of spawned process ``index``: set its variables, run ``fn``, and leave rank 0's
    result (or this process's error) in ``outbox`` for the caller."""
    os.environ.update(
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(index),
        LOCAL_RANK=str(index),
        NODE_RANK="0",
    )
    os.environ[LAUNCHED_BY_VAR] = f"spawn:{parent}"
    try:
        fn, args, kwargs = cloudpickle.loads(work) if isinstance(work, bytes) else work
        result = fn(*args, **kwargs)
    except BaseException as error:
        _write_error(Path(outbox) / f"error-{index}.pkl", error)
        raise
    if index == 0:
        part = Path(outbox) / "result.pt.part"
        # cloudpickle: what came by value (closures, the script's classes) goes back by value;
        # tensors on any device, which the caller maps to the CPU
        torch.save(result, part, pickle_module=cloudpickle)
        part.rename(Path(outbox) / "result.pt")


def _write_error(path: Path, error: BaseException) -> None:
    pickled: bytes | None
    try:
        pickled = pickle.dumps(error)
        pickle.loads(pickled)  # an exception whose __init__ takes other arguments fails here
    except Exception:
        pickled = None
    record = {
        "time": time.time(),  # which process failed first (see _root_cause)
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error),
        "traceback": traceback.format_exc(),
        "exception": pickled,
    }
    with open(path, "wb") as f:
        pickle.dump(record, f)


class SpawnLauncher:
    """Run a function in ``num_processes`` new processes and return rank 0's value (Lightning's
        ``"ddp_spawn"``; ``start_method="fork"`` is ``"ddp_fork"``).

        Each process gets ``LOCAL_RANK`` = ``RANK`` = its index, ``WORLD_SIZE``, ``MASTER_ADDR`` and
        ``MASTER_PORT`` (a free port unless ``main_port`` is given). ``fn`` and its arguments go to
    the processes by cloudpickle (closures and the script's own classes included) except under
    ``"fork"``, which copies them. Rank 0's return value comes
        back through a file (``torch.save``; its tensors on the CPU): a ``TrainState`` comes back
        usable. A process that raises has its error re-raised here, of its own type and message
        when it unpickles (else :class:`ChildProcessFailed`), caused by the child's traceback; the
        other processes get ``grace_period`` s to end, then SIGTERM, then SIGKILL after as long.

        Args:
            num_processes: processes to run ``fn`` in.
            start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` (the last two where the
                platform has them).
            main_address: where rank 0's rendezvous listens.
            main_port: its port; default: a free one, chosen at each ``launch``.
            grace_period: seconds the others get to end after one failed.
            timeout: seconds the whole run may take (then every process is killed and
                ``TimeoutError`` raised); default: no limit.

        Raises:
            ValueError: a bad ``num_processes`` or ``start_method``, or one the platform lacks.

        Example:
            >>> SpawnLauncher(2, start_method="thread")
            Traceback (most recent call last):
            ...
            ValueError: SpawnLauncher(start_method='thread'): pass 'spawn', 'fork' or 'forkserver'
    """

    def __init__(
        self,
        num_processes: int,
        start_method: str = "spawn",
        *,
        main_address: str = "127.0.0.1",
        main_port: int | None = None,
        grace_period: float = 5.0,
        timeout: float | None = None,
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int):
            raise ValueError(f"SpawnLauncher(num_processes={num_processes!r}): pass an int >= 1")
        if num_processes < 1:
            raise ValueError(f"SpawnLauncher(num_processes={num_processes!r}): pass an int >= 1")
        if start_method not in ("spawn", "fork", "forkserver"):
            raise ValueError(
                f"SpawnLauncher(start_method={start_method!r}): pass 'spawn', 'fork' or "
                "'forkserver'"
            )
        available = multiprocessing.get_all_start_methods()
        if start_method not in available:
            raise ValueError(
                f"start_method={start_method!r} is not available on this platform "
                f"({sys.platform}: {available}): use 'spawn' (strategy='ddp_spawn')"
            )
        self.num_processes = num_processes
        self.start_method = start_method
        self.main_address = main_address
        self.main_port = main_port
        self.grace_period = float(grace_period)
        self.timeout = timeout

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in every process; return rank 0's result.

        Raises:
            BaseException: the first failing process's error (see the class docstring).
            ChildProcessFailed: a process exited non-zero without raising (``os._exit``, a
                signal), naming its rank and exit code.
            TimeoutError: the run took longer than ``timeout``.
        """
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(
                "a spawned process, importing the main script again as spawn does, reached "
                "a launch: the script starts its run at import. Put the run under "
                "`if __name__ == '__main__':`, or use strategy='ddp' (or 'ddp_fork')"
            )
        port = self.main_port if self.main_port is not None else find_free_port()
        with tempfile.TemporaryDirectory(prefix="engine-spawn-") as outbox:
            work: Any = (fn, args, kwargs)
            if self.start_method != "fork":
                # the engine's optimizers and steps are closures, which pickle does not take:
                # cloudpickle them (fork copies the process and pickles nothing)
                work = cloudpickle.dumps(work)
            context = mp.start_processes(
                _spawned,
                args=(
                    work,
                    self.num_processes,
                    self.main_address,
                    port,
                    outbox,
                    os.getpid(),
                ),
                nprocs=self.num_processes,
                join=False,
                start_method=self.start_method,
            )
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            try:
                while not context.join(timeout=0.5, grace_period=self.grace_period):
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(
                            f"the {self.num_processes} spawned processes ran past "
                            f"SpawnLauncher(timeout={self.timeout:g}) and were killed"
                        )
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
                # torch names the first failed process it polled, which may be a rank that only
                # saw another one go (gloo's "Connection closed by peer"): report the cause
                index, code = _root_cause(Path(outbox), context.processes, error.error_index)
                if code is None:  # it raised (or called sys.exit): its own error, re-raised
                    raised = _child_error(Path(outbox), index, str(error))
                    raise raised from raised.__cause__  # the child's traceback, not torch's
                raise ChildProcessFailed(
                    f"spawned process {index} (pid {context.processes[index].pid}) exited with "
                    f"{_describe(code)} without raising an exception; the others were stopped"
                ) from None
            except BaseException:  # interrupted here: take the children down with us
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                    process.join()
                raise
            result = Path(outbox) / "result.pt"
            if not result.exists():
                raise ChildProcessFailed("spawned rank 0 ended without leaving its result")
            # the function's own return value, written by the child this call spawned into a
            # private temporary directory (mkdtemp: mode 0700) that only this process and its
            # children know: not a checkpoint, and no one else's code
            return torch.load(
                result, map_location="cpu", weights_only=False, pickle_module=_pickle_module
            )


# What a rank raises when another one went away: a consequence, never the cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(outbox: Path, processes: list[Any], detected: int) -> tuple[int, int | None]:
    """The process whose failure ended the run, and its exit code if it left no error.

    ``detected`` is the process torch saw fail first. Of the processes that recorded an error
    (``error-<i>.pkl``), the earliest is the cause, unless it is only a lost peer
    (:data:`_PEER_LOST`) and another process exited by itself (a positive exit code) without
    raising: that one took the peer away. A process torch saw exit without a record is the
    cause as it stands (it died before anyone could notice: a signal, ``os._exit``).
    """
    records: dict[int, dict[str, Any]] = {}
    for path in outbox.glob("error-*.pkl"):
        try:
            with open(path, "rb") as f:
                records[int(path.stem.split("-")[1])] = pickle.load(f)
        except Exception:  # a record half-written when its process was stopped: not the cause
            continue
    if detected not in records:
        return detected, processes[detected].exitcode
    first = min(records, key=lambda i: (records[i].get("time", float("inf")), i))
    if any(marker in records[first]["message"] for marker in _PEER_LOST):
        for index, process in enumerate(processes):
            if index not in records and (process.exitcode or 0) > 0:
                return index, process.exitcode
    return first, None


def _child_error(outbox: Path, index: int, fallback: str) -> BaseException:
    """The error spawned process ``index`` raised, rebuilt, with its traceback as the cause."""
    path = outbox / f"error-{index}.pkl"
    if not path.exists():
        return ChildProcessFailed(f"spawned process {index} failed:{fallback}")
    with open(path, "rb") as f:
        record = pickle.load(f)
    remote = _RemoteTraceback(f'\n\nspawned process {index} raised:\n"""\n{record["traceback"]}"""')
    error: BaseException | None = None
    if record["exception"] is not None:
        try:
            error = _MainUnpickler(io.BytesIO(record["exception"])).load()
        except Exception:
            error = None
    if error is None:
        error = ChildProcessFailed(
            f"spawned process {index} raised {record['type']}: {record['message']}"
        )
    error.__cause__ = remote
    return error
