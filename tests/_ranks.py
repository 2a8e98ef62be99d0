"""Run a function on N gloo ranks in fresh processes, for the distributed tests.

``run_ranks(fn, n, *args)`` starts ``n`` processes, each with the variables torchrun would set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port), one
thread, and calls ``fn(rank, *args)`` there; it returns the ranks' results in rank order. A rank
that raises fails the call with its traceback; every wait has a deadline, so a hang fails the
test instead of the suite.

``torchrun(args, n)`` runs a script on ``n`` ranks as torchrun would, for a test that is not
about torchrun. The ranks are forked from the suite's fork server (``_procs.context()``: torch
and engine imported once per session), not started cold: each is a new process with the
environment of the call, without the seconds of import. Tests about a launcher start their
ranks for real.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bytes(obj: Any) -> bytes:
    """``obj`` as torch.save bytes: a queue would share tensors through file descriptors of a
    process that is about to exit."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: Any,
    args: tuple,
    env: dict,
    streams: tuple[int, int],
) -> None:
    # the caller's stdout and stderr now (a test's captured output), not the fork server's
    for target, fd in zip((1, 2), streams, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)  # the caller's, at the call: a forked process has the server's
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import faulthandler

    import torch

    # a rank that dies of a fatal signal (SIGSEGV, SIGABRT: heap corruption in a library)
    # leaves every thread's Python stack in the test's output
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    out.put((rank, True, _bytes(result)))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, env: dict | None = None
) -> list[Any]:
    """``[fn(0, *args), ..., fn(world - 1, *args)]``, each in its own process."""
    import _procs

    ctx = _procs.context()
    out = ctx.Queue()
    port = free_port()
    environ = {**os.environ, **(env or {})}
    streams = (_procs._Fd(1), _procs._Fd(2))
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world, port, out, args, environ, streams), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results) - set(errors))} did not "
                    f"finish in {timeout} s; errors so far: {errors}"
                )
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and all(r not in results and r not in errors for r in dead):
                    time.sleep(1.0)  # its report may still be in the pipe
                    if out.empty():
                        raise RuntimeError(
                            f"rank(s) {dead} died with exit codes "
                            f"{[procs[r].exitcode for r in dead]} before reporting; "
                            f"errors so far: {errors}"
                        ) from None
                continue
            (results if ok else errors)[rank] = value
            if errors:
                break
        if errors:
            rank = min(errors)
            # what the other ranks did: a peer's "connection reset" names no cause, the rank that
            # died first does (its error, or its exit code when it died without a word)
            for p in procs:
                p.join(timeout=5.0)
            while not out.empty():
                r, ok, value = out.get()
                if not ok:
                    errors.setdefault(r, value)
            others = [
                f"rank {r} raised:\n{errors[r]}" if r in errors else f"rank {r}: exit {p.exitcode}"
                for r, p in enumerate(procs)
                if r != rank and r not in results
            ]
            raise AssertionError(
                f"rank {rank} raised:\n{errors[rank]}" + "".join(f"\n{o}" for o in others)
            )
        return [_load(results[r]) for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()) if not errors else 5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)


def torchrun(
    args: Sequence[Any],
    nproc: int = 2,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Any = None,
    timeout: float = 180.0,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node=nproc ARGS`` (``ARGS``: a script and its arguments, or
    ``-m MODULE ...``) for a test that is not about torchrun: the ranks are forked from the
    suite's fork server (tests/_procs.py) as ``python -u ARGS`` with the variables torchrun's
    agent gives its workers, and a rank that fails ends the others as the agent does (SIGTERM,
    then SIGKILL 30 s later). Returns what ``subprocess.run`` would for torchrun itself:
    exit status 0 when every rank exits 0 (else 1), and every rank's stdout and stderr, in
    rank order. A test about torchrun (its agent, restarts, its command line) starts it."""
    import _procs

    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun, for more than one process
    port = free_port()
    outputs = []
    procs = []
    try:
        for rank in range(nproc):
            rank_env = {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "ROLE_WORLD_SIZE": str(nproc),
                "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "PYTHONFAULTHANDLER": "1",  # a fatal signal leaves the Python stacks
            }
            out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in the finally
            err = tempfile.TemporaryFile("w+")  # noqa: SIM115
            outputs.append((out, err))
            procs.append(
                _procs.Popen(
                    [sys.executable, "-u", *map(os.fspath, args)],
                    env=rank_env,
                    cwd=cwd,
                    stdout=out,
                    stderr=err,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        stop_by = None  # after a failure: when the survivors are killed
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(["torchrun", *map(str, args)], timeout)
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed and stop_by is None:
                stop_by = now + 30.0
                for p in procs:
                    p.terminate()
            if stop_by is not None and now > stop_by:
                for p in procs:
                    p.kill()
            time.sleep(0.05)
        code = 0 if all(p.returncode == 0 for p in procs) else 1
        texts = []
        for out, err in outputs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
        stdout = "".join(t[0] for t in texts)
        stderr = "".join(t[1] for t in texts)
        return subprocess.CompletedProcess(["torchrun", *map(str, args)], code, stdout, stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in outputs:
            out.close()
            err.close()
