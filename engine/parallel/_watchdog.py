"""Bounded waits for engine's own collectives, and what a rank says when one ends badly.

The process group is joined with a timeout (``DDP(timeout=...)``, default
:data:`DEFAULT_TIMEOUT`): every collective on it (the steps' too) fails once it has waited that
long. Engine's own collectives (the driver's agreements, broadcasts and barriers, the metrics'
epoch reductions, a sharded save's exchanges) run inside :func:`guard`, which adds:

* when one has waited the whole timeout, this rank's Python stacks (every thread's,
  ``faulthandler``) go to stderr, and every other rank is asked (through the process group's
  store, which a thread of each rank polls every few seconds) to dump its own, and to say in
  which of engine's collectives it is, if any;
* when one fails (the timeout, or a peer gone: its connection closed), a
  :class:`~engine.errors.CollectiveError` naming the collective, the ranks that did not join it
  (and where each of them was instead, as far as it answered) and the first cause.

Nothing here runs per tensor or per step: :func:`guard` records which collective this thread
waits in (two assignments) and the watcher thread wakes once a second.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from engine.errors import CollectiveError

__all__ = ["DEFAULT_TIMEOUT", "check_timeout", "guard", "start", "stop", "timeout"]

#: the process group's timeout when none is given: torch's (and Lightning's) 30 minutes. It
#: bounds every wait, the steps' all-reduces and a rank waiting while rank 0 writes a large
#: checkpoint included, so it must exceed the longest of those: shorten it (``DDP(timeout=)``)
#: where they are short and a dead peer should fail the run sooner.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_KEY = "engine/watchdog"
_POLL = 1.0  # seconds between the watcher's looks (and store reads every _ASK_EVERY of them)
_ASK_EVERY = 3
_GRACE = 5.0  # seconds a failed rank waits for the others to say where they are


def check_timeout(owner: str, value: Any) -> datetime.timedelta:
    """``value`` (seconds or a ``timedelta``; ``None``: :data:`DEFAULT_TIMEOUT`) as a
    ``timedelta``, refused unless positive and finite."""
    if value is None:
        return DEFAULT_TIMEOUT
    seconds: float | None = None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{owner}(timeout={value!r}): pass how long a collective may wait for the other "
            "ranks before it fails, as seconds > 0 or a datetime.timedelta (default: 30 "
            "minutes); it must exceed the longest legitimate wait (a step, rank 0 writing a "
            "checkpoint)"
        )
    return datetime.timedelta(seconds=seconds)


class _Watch:
    """This process's watcher: which collective each thread waits in, since when."""

    def __init__(self, timeout: float, rank: int, world: int, store: Any) -> None:
        self.timeout, self.rank, self.world, self.store = timeout, rank, world, store
        self.waiting: dict[int, tuple[str, float]] = {}  # thread id -> (collective, since)
        self.dumped: set[Any] = set()  # the requests (and own timeouts) already answered
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def where(self) -> str:
        waits = list(self.waiting.values())
        if not waits:
            return "outside engine's collectives (in a step, a listener, or its own code)"
        return "; ".join(f"in {name} for {time.monotonic() - t:.0f} s" for name, t in waits)

    def dump(self, why: str) -> None:
        """Every thread's Python stack on this process's stderr (the file descriptor: a
        replaced ``sys.stderr`` may have none); never raises."""
        with contextlib.suppress(Exception):
            out = sys.__stderr__ or sys.stderr
            out.write(f"engine watchdog: rank {self.rank}: {why}; its Python stacks:\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()

    def publish(self, why: str) -> None:
        """Ask every rank for its stacks and its place; say ours."""
        if self.store is None:
            return
        with contextlib.suppress(Exception):
            self.store.set(f"{_KEY}/at/{self.rank}", self.where())
            self.store.set(f"{_KEY}/request", why)

    def _run(self) -> None:
        ticks = 0
        while not self.stopped.wait(_POLL):
            ticks += 1
            now = time.monotonic()
            for name, since in list(self.waiting.values()):
                if now - since >= self.timeout and (name, since) not in self.dumped:
                    self.dumped.add((name, since))
                    why = f"waited {now - since:.0f} s in {name} (timeout {self.timeout:g} s)"
                    self.publish(f"rank {self.rank} {why}")
                    self.dump(why)
            if self.store is None or ticks % _ASK_EVERY:
                continue
            try:
                if not self.store.check([f"{_KEY}/request"]):
                    continue
                request = self.store.get(f"{_KEY}/request").decode(errors="replace")
            except Exception:  # the store is gone (the group destroyed, rank 0 dead)
                return
            if request not in self.dumped and not request.startswith(f"rank {self.rank} "):
                self.dumped.add(request)
                with contextlib.suppress(Exception):
                    self.store.set(f"{_KEY}/at/{self.rank}", self.where())
                self.dump(f"asked by {request}; this rank is {self.where()}")

    def others(self) -> dict[int, str | None]:
        """Where each other rank says it is (``None``: it did not answer in time)."""
        keys = {r: f"{_KEY}/at/{r}" for r in range(self.world) if r != self.rank}
        found: dict[int, str | None] = dict.fromkeys(keys)
        if self.store is None:
            return found
        deadline = time.monotonic() + min(_GRACE, self.timeout)
        with contextlib.suppress(Exception):
            while True:
                for r, key in keys.items():
                    if found[r] is None and self.store.check([key]):
                        found[r] = self.store.get(key).decode(errors="replace")
                if (
                    all(v is not None for v in found.values())
                    or time.monotonic() > deadline
                    or _signalled  # being shut down (torchrun's SIGTERM after a peer died)
                ):
                    break
                time.sleep(0.1)
        return found


_watch: _Watch | None = None
_signalled = False


def signalled() -> None:
    """Say that this process received SIGTERM or SIGINT (called from the signal handler: an
    assignment only). A collective that fails from now on reports at once, instead of waiting
    up to ``_GRACE`` seconds for the other ranks to say where they are: torchrun sends its
    SIGTERM to the survivors when a rank dies, and a restart should not wait on diagnostics
    nobody reads."""
    global _signalled
    _signalled = True


_timeout: datetime.timedelta = DEFAULT_TIMEOUT


def timeout() -> datetime.timedelta:
    """The timeout of the process group this process joined (for the groups engine makes
    beside it: the asynchronous saves' gloo group)."""
    return _timeout


def start(timeout: datetime.timedelta) -> None:
    """Watch this process's collectives (once its default process group is joined, with
    ``timeout``)."""
    global _watch, _timeout, _signalled
    import torch.distributed as dist

    stop()
    _timeout = timeout
    _signalled = False
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a group without a store (joined by hand, another backend)
        store = None
    _watch = _Watch(timeout.total_seconds(), dist.get_rank(), dist.get_world_size(), store)
    _watch.thread.start()
    if not _at_exit:
        _at_exit.append(atexit.register(stop))


_at_exit: list[Any] = []


def stop() -> None:
    """Stop watching: the watcher thread ends (waited for a moment: at the interpreter's exit
    it must not be inside the store's client code)."""
    global _watch
    watch, _watch = _watch, None
    if watch is not None:
        watch.stopped.set()
        if watch.thread is not threading.current_thread():
            watch.thread.join(timeout=2.0)
        watch.store = None  # the store ends with its process group, not with this thread


@contextlib.contextmanager
def guard(name: str) -> Iterator[None]:
    """Run one of engine's collectives, called ``name`` in what a rank says (e.g. "the
    agreement at a check"), under the watch: a :class:`CollectiveError` naming it and the
    ranks that did not join when it fails (see the module)."""
    watch = _watch
    if watch is None:
        yield
        return
    me = threading.get_ident()
    watch.waiting[me] = (name, time.monotonic())
    try:
        yield
    except Exception as e:
        since = watch.waiting.pop(me, (name, time.monotonic()))[1]
        raise _failed(watch, name, time.monotonic() - since, e) from e
    finally:
        watch.waiting.pop(me, None)


def _failed(watch: _Watch, name: str, waited: float, cause: BaseException) -> CollectiveError:
    if isinstance(cause, CollectiveError):
        return cause
    watch.waiting[threading.get_ident()] = (name, time.monotonic() - waited)
    why = f"rank {watch.rank}'s {name} failed after {waited:.1f} s"
    watch.publish(why)
    watch.waiting.pop(threading.get_ident(), None)
    others = watch.others()
    absent = [r for r, at in others.items() if at is None or name not in at]
    said = "; ".join(
        f"rank {r} {'did not answer (dead, or blocked outside Python)' if at is None else at}"
        for r, at in sorted(others.items())
        if r in absent
    )
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    if watch.timeout <= waited + 1:
        watch.dump(f"{name} timed out")
    return CollectiveError(
        f"{name} failed on rank {watch.rank} of {watch.world} after {waited:.1f} s (timeout "
        f"{watch.timeout:g} s): "
        + (f"rank(s) {absent} did not join it ({said})" if absent else "every rank was in it")
        + f"; cause: {type(cause).__name__}: {first[:300]}. Every rank that still runs printed "
        "its Python stacks on stderr. A rank that died or was killed is the cause to look "
        "for; if a rank legitimately takes longer (a long step, rank 0 writing a large "
        "checkpoint), raise the strategy's timeout (DDP(timeout=...), FSDP(timeout=...))"
    )
