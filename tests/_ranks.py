"""Run a function on N gloo ranks in fresh processes, for the distributed tests.

``run_ranks(fn, n, *args)`` starts ``n`` processes, each with the variables torchrun would set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port), one
thread, and calls ``fn(rank, *args)`` there; it returns the ranks' results in rank order. A rank
that raises fails the call with its traceback; every wait has a deadline, so a hang fails the
test instead of the suite.

The ranks are forked from the suite's fork server (``_procs.context()``: torch and engine
imported once per session), not started cold: each is a new process with the environment of
the call, without the seconds of import. Tests about a launcher start their ranks for real.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
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
    fn: Callable[..., Any], rank: int, world: int, port: int, out: Any, args: tuple, env: dict
) -> None:
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
    import torch

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
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, out, args, environ), daemon=True)
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
            raise AssertionError(f"rank {rank} raised:\n{errors[rank]}")
        return [_load(results[r]) for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()) if not errors else 5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
