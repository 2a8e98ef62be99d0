"""Which attempt of a torchrun job this worker group is, the same number on every node.

Since torch 2.4 torchrun's agent shares its TCP store with the workers
(``TORCHELASTIC_USE_AGENT_STORE``), and that store outlives a restart: workers that joined
through the same keys of it in every attempt could read the previous attempt's addresses
(pytorch/pytorch#135712). A prefix per attempt keeps them apart, but the number to key it by
must be the same on every rank, and ``TORCHELASTIC_RESTART_COUNT`` is not: it is each node's
agent's own count. When one node's worker dies, that node's agent counts a restart, and the
other nodes' agents restart their workers for the new rendezvous round without counting one
(measured here with two agents of one job: after a worker of one was killed, the other's
restarted worker read 0 where its peer read 1, and failed to connect).

So the workers agree on the attempt through the store (:func:`agree`): global rank 0 counts the
attempts there (``add``, one per attempt: rank 0 is started once in each) and answers each
other worker, which asks with a token unique to its process, so that no answer left from an
earlier attempt is taken for this one's. :func:`attempt` is that number once agreed, or the
restart count before a process group is joined (or without a shared store).
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["agree", "attempt", "run_id"]

_KEY = "engine/elastic"
_agreed: dict[str, int] = {}  # run id -> the attempt this process's group agreed on


def run_id() -> str | None:
    """``TORCHELASTIC_RUN_ID`` under torchrun (the job's ``--rdzv-id``), else ``None``."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def attempt() -> int | None:
    """This worker group's attempt under torchrun (0 for the first, more after a restart), or
    ``None`` outside torchrun: the number the ranks agreed on when they joined (the same on
    every node), else this node's ``TORCHELASTIC_RESTART_COUNT``.

    Example:
        >>> from engine.parallel.elastic import attempt
        >>> attempt() is None  # not started by torchrun
        True
    """
    rid = run_id()
    try:
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))
    except ValueError:
        return None
    if rid is None:
        return None
    return max(_agreed.get(rid, 0), count)


def shared_store() -> bool:
    """Whether torchrun's agent shares its store with the workers (its keys outlive an
    attempt, so each attempt needs keys of its own)."""
    return run_id() is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


@contextmanager
def agree(
    connect: Callable[[], Any], rank: int, world_size: int, timeout: datetime.timedelta
) -> Iterator[int]:
    """Agree with the other ranks on this attempt's number, through the store ``connect()``
    opens (a client of torchrun's shared store); yields it for the join, which happens inside
    the ``with`` block. Rank 0 counts the attempt and answers the others until the block ends
    (the process group joined, or failed to): each asks with a token of its own process and
    waits for the answer to that token, at most ``timeout``.

    Raises:
        torch.distributed.DistStoreError: a rank that got no answer within ``timeout`` (rank 0
            never came).
    """
    store = connect()
    if rank == 0:
        number = int(store.add(f"{_KEY}/attempts", 1)) - 1
        stop = threading.Event()
        answering = threading.Thread(
            target=_answer,
            args=(connect(), number, stop),  # a connection of its own: the join blocks on one
            name="engine-elastic-answers",
            daemon=True,
        )
        answering.start()
        try:
            _agreed[run_id() or ""] = number
            yield number
        finally:
            stop.set()
            answering.join(timeout=5.0)
        return
    token = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"
    store.append(f"{_KEY}/asks", token + ";")
    store.wait([f"{_KEY}/answer/{token}"], timeout)
    number = int(store.get(f"{_KEY}/answer/{token}"))
    _agreed[run_id() or ""] = number
    yield number


def _answer(store: Any, number: int, stop: threading.Event) -> None:
    """Rank 0's answers: every token asked, the attempt's number (tokens of earlier attempts
    too: nobody waits for those)."""
    answered: set[str] = set()
    while not stop.wait(0.02):
        try:
            asks = store.get(f"{_KEY}/asks").decode() if store.check([f"{_KEY}/asks"]) else ""
            for token in asks.split(";"):
                if token and token not in answered:
                    store.set(f"{_KEY}/answer/{token}", str(number))
                    answered.add(token)
        except Exception:  # the store is gone (the agent stopped the group): nothing to answer
            return
