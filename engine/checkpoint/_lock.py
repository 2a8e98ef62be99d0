"""A run's claim on its checkpoint directory (private): :data:`RUN_LOCK` and :class:`_RunLock`,
its owner recorded for the refusal, a dead owner's lock taken over or cleaned."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: the lock file alone is the claim
    fcntl = None  # type: ignore[assignment]

from engine.errors import CheckpointError

__all__ = ["RUN_LOCK"]


RUN_LOCK = ".engine-run.lock"  # in a checkpoint directory while a run saves there (_RunLock)
_RUN_LOCKS: dict[str, list[Any]] = {}  # this process's: directory -> [fd, holders, created]
_RUN_LOCKS_OF = [os.getpid()]  # a forked child holds none of its parent's
_RUN_LOCKS_GUARD = threading.Lock()


class _RunLock:
    """A live run's claim on a checkpoint directory, so that a second run saving there is
    refused rather than deleting and overwriting the first one's checkpoints.

    The claim is an ``flock`` on ``<directory>/.engine-run.lock``, a file holding the owner's
    pid, host and start time (for the refusal's message). The kernel drops the lock when the
    owner's process dies, so the lock of a dead run is taken over by the next; the file is
    deleted while the lock is held, on release, and by :func:`clean_leftovers` once its owner is
    gone (a run that locks the file just deleted sees it is no longer the one at the name, and
    starts anew). The listeners of one process share its claim (several ``ModelCheckpoint`` of
    one run may save into one directory). Without ``flock`` (not POSIX) the file alone is the
    claim, and one naming a dead pid of this host is taken over.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.key: str | None = None

    def acquire(self) -> None:
        """Claim the directory (created if need be) for this process.

        Raises:
            CheckpointError: another live process holds it, naming the directory and the owner.
        """
        if self.key is not None:
            return
        key = os.path.realpath(self.directory)
        with _RUN_LOCKS_GUARD:
            if _RUN_LOCKS_OF[0] != os.getpid():
                _RUN_LOCKS.clear()
                _RUN_LOCKS_OF[0] = os.getpid()
            held = _RUN_LOCKS.get(key)
            if held is None:
                created = not self.directory.is_dir()
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise CheckpointError(
                        f"cannot create the checkpoint directory {self.directory}: {e}"
                    ) from e
                held = _RUN_LOCKS[key] = [self._take(), 0, created]
            held[1] += 1
        self.key = key

    def release(self) -> None:
        """Give the claim up (the lock file is deleted once no listener of this process holds
        it; the directory too if the claim created it and it is empty)."""
        key, self.key = self.key, None
        if key is None:
            return
        with _RUN_LOCKS_GUARD:
            held = _RUN_LOCKS.get(key) if _RUN_LOCKS_OF[0] == os.getpid() else None
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del _RUN_LOCKS[key]
            fd, _, created = held
            with contextlib.suppress(OSError):  # while holding it: see the class
                os.unlink(self.directory / RUN_LOCK)
            os.close(fd)
            if created:
                with contextlib.suppress(OSError):  # not empty: checkpoints were saved
                    os.rmdir(self.directory)

    def _take(self) -> int:
        lock = self.directory / RUN_LOCK
        while True:
            try:
                if fcntl is None:
                    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    break
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except FileExistsError:  # without flock: a live owner, or a dead one's file
                if _owner_alive(lock):
                    raise CheckpointError(self._refusal(lock)) from None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            except OSError as e:
                raise CheckpointError(
                    f"cannot create the lock file {lock} of the checkpoint directory: {e}"
                ) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise CheckpointError(self._refusal(lock)) from None
            try:  # unless it was deleted (released, or cleaned) before it was locked: anew
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv[:4],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        return fd

    def _refusal(self, lock: Path) -> str:
        owner = _read_owner(lock)
        who = (
            f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('started')}"
            if owner
            else "its owner not recorded yet"
        )
        return (
            f"{self.directory} is the checkpoint directory of another live run ({who}; its "
            f"lock file {lock}). Two runs saving into one directory delete and overwrite each "
            "other's checkpoints: give this run another dirpath (ModelCheckpoint(dirpath=...)), "
            "or wait for that run to end (the lock of a run that died is taken over)"
        )


def _read_owner(lock: Path) -> dict[str, Any]:
    for _ in range(20):  # the owner writes it right after it locks: a moment
        try:
            owner = json.loads(lock.read_text())
            if isinstance(owner, dict):
                return owner
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    return {}


def _owner_alive(lock: Path) -> bool:
    """Without ``flock``: whether the lock file names a live process (one of another host is
    taken for alive: it cannot be asked)."""
    owner = _read_owner(lock)
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return bool(owner) or os.path.lexists(lock)
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, someone else's
        return True
    return True


def _remove_stale_run_lock(root: Path) -> Path | None:
    """Delete the lock file of a run that is gone (see :class:`_RunLock`)."""
    lock = root / RUN_LOCK
    if fcntl is None or not os.path.lexists(lock):
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(lock).st_ino != os.fstat(fd).st_ino:
            return None
        os.unlink(lock)  # while holding it
        return lock
    except OSError:  # held: a live run's
        return None
    finally:
        os.close(fd)
