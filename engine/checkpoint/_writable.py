"""Writing files so that a failure says what failed: which file, and why, in words.

:func:`explain` turns an ``OSError`` from a write into one that names the path and says what is
wrong for the usual causes (a full disk, a read-only or forbidden directory), keeping the
``errno``. :func:`check_writable` is the check a fit makes before its first step on every
directory it will write, each with the flag that set it, so a directory that cannot be written
is an error before any work rather than after N steps of it.

:func:`append_whole` and :func:`replace_whole` are the two ways the journal and the loggers
write: whole lines appended to an open file (a failed write cut back, so no line is torn) and
whole files replaced by rename (a reader sees the old file or the new one).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterable

__all__ = ["append_whole", "check_writable", "explain", "replace_whole"]

_WHY = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def explain(error: OSError, path: str | os.PathLike[str], doing: str = "write") -> OSError:
    """``error``, raised writing ``path``, with a message that names ``path`` and says what is
    wrong; the same ``errno`` (and so the same ``OSError`` subclass).

    Example:
        >>> import errno
        >>> e = explain(OSError(errno.ENOSPC, "No space left on device"), "/logs/metrics.csv")
        >>> e.errno
        28
        >>> "/logs/metrics.csv: the disk is full" in e.strerror
        True
    """
    why = _WHY.get(error.errno or 0)
    if why is None:
        why = error.strerror or str(error)
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):
        why += "; free space or write elsewhere"
    else:
        why += "; write to a directory you can write to"
    return OSError(error.errno, f"could not {doing} {os.fspath(path)}: {why}")


def append_whole(fd: int, data: bytes, size: int) -> None:
    """Append all of ``data`` to the open file ``fd``, which holds ``size`` bytes: a raw write
    may write part of it (a filling disk), so it is continued; one that fails cuts the file
    back to ``size`` and raises the ``OSError``, so no line is ever torn."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        with contextlib.suppress(OSError):  # the write's error is the one to report
            os.ftruncate(fd, size)
        raise


def replace_whole(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``: written to a temporary file beside it, then
    renamed over it. A failed write leaves ``path`` as it was, removes the temporary file and
    raises the ``OSError``."""
    tmp = f"{os.fspath(path)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            append_whole(fd, data, 0)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _nearest_existing(path: str) -> str:
    """``path``, or the closest of its parents that exists (what creating it will write)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_writable(directories: Iterable[tuple[str | os.PathLike[str], str]]) -> None:
    """Check that each directory can be written, by writing: a temporary file created and
    removed in it (or in its nearest existing parent, which creating it will write). Being
    root, or a read-only mount, makes permission bits say nothing: only a write tells.

    Args:
        directories: ``(directory, what set it)`` pairs, e.g.
            ``("/ckpt", "ModelCheckpoint(dirpath='/ckpt')")``.

    Raises:
        OSError: naming the directory, the flag that set it and why it cannot be written (a
            ``PermissionError`` for permission denied; ``NotADirectoryError`` for a file).

    Example:
        >>> import os, tempfile
        >>> from engine.checkpoint._writable import check_writable
        >>> check_writable([(os.path.join(tempfile.mkdtemp(), "new", "dir"), "Trainer(...)")])
    """
    seen: set[str] = set()
    for directory, flag in directories:
        probe = _nearest_existing(os.fspath(directory))
        if not os.path.isdir(probe):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"{flag}: {os.fspath(directory)} cannot be a directory, {probe} is a file; "
                "pass a directory path",
            )
        if probe in seen:
            continue
        seen.add(probe)
        try:
            fd, tmp = tempfile.mkstemp(dir=probe, prefix=".engine-write-check-")
            os.close(fd)
            os.remove(tmp)
        except OSError as e:
            why = _WHY.get(e.errno or 0, e.strerror or str(e))
            where = "" if probe == os.path.abspath(directory) else f" ({probe}, where it goes)"
            raise OSError(
                e.errno,
                f"{flag}: the directory {os.fspath(directory)} cannot be written{where}: {why}. "
                "Checked when the fit starts, before any step: pass a directory you can write "
                "to",
            ) from e
