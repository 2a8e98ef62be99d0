"""What made a sharded save's write fail (private): the ``OSError`` behind it, so that a full
disk is called a full disk on every rank (:mod:`engine.parallel._dcp`).

``torch.distributed.checkpoint`` writes each rank's shards with ``torch.save`` into a file it
opened, and ``torch.save`` reports a failed write as a ``RuntimeError`` of its own
(``[enforce fail at inline_container.cc] ... unexpected pos``), which does not say that the disk
is full; DCP then wraps every rank's error in a ``CheckpointException`` (a ``BaseException``)
whose message is a nested traceback. :class:`NoticingFileSystem` is DCP's file system with the
first ``OSError`` of this rank's opens, writes, flushes and closes noted, and :func:`cause`
picks the error a rank reports: that ``OSError``, else its own among DCP's failures, else the
first other rank's in one line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["NoticingFileSystem", "cause", "noticing"]


class NoticingFileSystem(FileSystem):
    """DCP's ``FileSystem``, with the first ``OSError`` of a write noted in :attr:`error`."""

    def __init__(self) -> None:
        super().__init__()
        self.error: OSError | None = None

    def note(self, error: OSError) -> None:
        if self.error is None:
            self.error = error

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _Noticing(stream, self) if "w" in mode else stream
        except OSError as e:  # the open, or the close's last flush
            self.note(e)
            raise


class _Noticing:
    """A writable stream that notes the first ``OSError`` of its ``write`` and ``flush``."""

    def __init__(self, stream: Any, fs: NoticingFileSystem) -> None:
        self._stream, self._fs = stream, fs

    def write(self, data: Any) -> int:
        try:
            return int(self._stream.write(data))
        except OSError as e:
            self._fs.note(e)
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._fs.note(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def noticing(writer: Any) -> NoticingFileSystem | None:
    """``writer``'s (a ``FileSystemWriter``'s) file system replaced by a noticing one; ``None``
    where this torch's writer has no ``fs`` of DCP's own to replace."""
    if not isinstance(getattr(writer, "fs", None), FileSystem):
        return None
    writer.fs = NoticingFileSystem()
    return writer.fs


def cause(error: BaseException, noticed: OSError | None, rank: int) -> BaseException:
    """The error rank ``rank`` reports for a failed DCP write: the ``OSError`` it noticed, else
    its own among DCP's failures (DCP gathers every rank's), else, where only other ranks
    failed, the first of theirs in one line (their own reports name a full disk)."""
    if noticed is not None:
        return noticed
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    own = failures.get(rank)
    if own is not None:
        found = own[0] if isinstance(own, tuple) else own
        interrupt = (Exception, KeyboardInterrupt, SystemExit)  # an interrupt passes through
        return found if isinstance(found, interrupt) else error
    other, pair = min(failures.items(), key=lambda kv: kv[0])
    found = pair[0] if isinstance(pair, tuple) else pair
    return RuntimeError(f"rank {other} failed: {type(found).__name__}: {found}")
