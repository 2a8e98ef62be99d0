"""TensorBoard event files written on the caller's thread, whole records at a time.

tensorboardX's ``FileWriter`` hands each event to a writer thread through a bounded queue. When
that thread's write fails (a full disk) the thread dies with the error, the queue fills up, and
the next ``add_event`` waits on it forever: a fit logging to a full disk would hang, saying
nothing. :class:`SyncSummaryWriter` is tensorboardX's ``SummaryWriter`` (every ``add_*`` method,
the same file name, framing and bytes) whose events are written by tensorboardX's own
synchronous ``EventsWriter`` on the calling thread, into a buffer of this module's
(:class:`_RecordFile`) that is appended to the file ``max_queue`` events at a time and at each
flush. A failed write raises there and then an ``OSError`` that names the file and says what is
wrong; it is cut back, so the file holds whole records (and TensorBoard reads all of them), and
the events stay buffered for a later flush once there is room. The writers ``add_scalars`` (one
per tag, in sub-directories) and ``add_hparams`` (one of its own) open are synchronous too.

The buffer is reached through tensorboardX's public writer-factory registry (the hook it has for
``s3://`` and ``gs://``): ``EventsWriter`` opens ``engine-whole-records:<path>`` and gets a
:class:`_RecordFile` writing ``<path>``. Only the writer of the run's own directory is
synchronous.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Any

from tensorboardX import SummaryWriter
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import register_writer_factory
from tensorboardX.summary import hparams
from tensorboardX.writer import FileWriter

from engine.checkpoint._writable import append_whole, explain

__all__ = ["SyncSummaryWriter"]

_SCHEME = "engine-whole-records"


class _RecordFile:
    """The file tensorboardX's ``RecordWriter`` writes framed records into: they are kept in
    memory until :meth:`drain` appends them in one write, which a failure cuts back."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pending = bytearray()
        self._size = 0
        try:
            self._fd: int | None = os.open(
                path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644
            )
        except OSError as e:
            raise explain(e, path, "create") from e

    def write(self, data: bytes) -> None:
        self._pending += data

    def drain(self) -> None:
        """Append the buffered records; a failure leaves the file as it was (whole records)
        and the records buffered, and raises an ``OSError`` naming the file."""
        if not self._pending or self._fd is None:
            return
        try:
            append_whole(self._fd, bytes(self._pending), self._size)
        except OSError as e:
            raise explain(e, self.path, "write") from e
        self._size += len(self._pending)
        self._pending.clear()

    def flush(self) -> None:
        """:meth:`drain`, then ``fsync`` (what tensorboardX's flush does to a local file)."""
        self.drain()
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise explain(e, self.path, "write") from e

    def close(self) -> None:
        """Flush and close; the descriptor is closed even when the flush fails."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)


class _Factory:
    """tensorboardX's writer factory for ``engine-whole-records:<path>``. ``open`` is called
    only under :data:`_OPENING`, by the ``EventsWriter`` :class:`_EventFile` builds, which then
    takes the file it opened."""

    def __init__(self) -> None:
        self.opened: _RecordFile | None = None

    def open(self, path: str) -> _RecordFile:
        self.opened = _RecordFile(path.split(":", 1)[1])
        return self.opened

    def directory_check(self, path: str) -> None:
        os.makedirs(path.split(":", 1)[1], exist_ok=True)


_FACTORY = _Factory()
_OPENING = threading.Lock()
register_writer_factory(_SCHEME, _FACTORY)


def _close_quietly(file: _RecordFile) -> None:
    """At exit or when a writer is dropped unclosed: write what is buffered if possible (the
    error, if any, has nobody to go to: tensorboardX's own exit handler drops it too)."""
    with contextlib.suppress(OSError):
        file.close()


class _EventFile:
    """What tensorboardX's ``EventFileWriter`` does (``add_event``, ``flush``, ``close``,
    ``get_logdir``, ``reopen``), on the caller's thread: an event is framed into the buffer at
    once and written with the ``max_queue - 1`` after it, or at the first ``add_event`` after
    ``flush_secs``, or at :meth:`flush`."""

    def __init__(self, logdir: str, max_queue: int, flush_secs: float, suffix: str) -> None:
        self._logdir = logdir
        self._max_queue = max(1, int(max_queue))
        self._flush_secs = flush_secs
        self._suffix = suffix
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        os.makedirs(self._logdir, exist_ok=True)
        with _OPENING:
            prefix = f"{_SCHEME}:{os.path.join(self._logdir, 'events')}"
            self._events = EventsWriter(prefix, self._suffix)  # writes the file_version event
            file, _FACTORY.opened = _FACTORY.opened, None
        assert file is not None
        self._file = file
        self._closed = False
        self._unwritten = 0
        weakref.finalize(self, _close_quietly, file)
        self.flush()  # the first event at once, as tensorboardX's thread writes it

    @property
    def path(self) -> str:
        """The event file."""
        return self._file.path

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event: Any) -> None:
        """Frame ``event`` into the buffer; write the buffer when it is due (ignored after
        :meth:`close`, as tensorboardX does)."""
        with self._lock:
            if self._closed:
                return
            self._events.write_event(event)
            self._unwritten += 1
            if time.monotonic() >= self._next_flush:
                self._flush()
            elif self._unwritten >= self._max_queue:
                self._file.drain()
                self._unwritten = 0

    def _flush(self) -> None:
        self._events.flush()  # its RecordWriter flushes the _RecordFile: drain and fsync
        self._unwritten = 0
        self._next_flush = time.monotonic() + self._flush_secs

    def flush(self) -> None:
        """Write every buffered event and ``fsync`` the file."""
        with self._lock:
            if not self._closed:
                self._flush()

    def close(self) -> None:
        """Flush and close the file; it is closed (and this writer too) even when the flush
        fails, which raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._file.close()

    def reopen(self) -> None:
        """After :meth:`close`: a new event file in the same directory."""
        if self._closed:
            self._open()


class _FileWriter(FileWriter):
    """tensorboardX's ``FileWriter`` on an :class:`_EventFile`: its ``add_event``,
    ``add_summary``, ``add_graph``, ``use_metadata`` ... unchanged."""

    def __init__(
        self,
        logdir: str,
        max_queue: int = 10,
        flush_secs: float = 120,
        filename_suffix: str = "",
    ) -> None:
        # FileWriter.__init__ would start tensorboardX's writer thread: these are the two
        # attributes it sets, with the synchronous file in place of the thread's
        self.event_writer = _EventFile(str(logdir), max_queue, flush_secs, filename_suffix)
        self._default_metadata: dict[str, Any] = {}


class SyncSummaryWriter(SummaryWriter):
    """tensorboardX's ``SummaryWriter`` whose own event file is written on the calling thread
    (see the module's docstring): a failed write raises an ``OSError`` naming the file, never a
    hang.

    Args:
        logdir: the directory of the event file.
        max_queue: events buffered before they are written (tensorboardX's meaning).
        flush_secs: the longest time an event stays buffered, counted at the next event.
        filename_suffix: appended to the event file's name.
        write_to_disk: ``False`` writes nothing (tensorboardX's dummy writer).
        purge_step: as tensorboardX's.
        **kwargs: passed to ``SummaryWriter`` (``comment``, ``comet_config``).
    """

    file_writer: Any  # tensorboardX's attributes, typed for mypy
    all_writers: Any

    def __init__(
        self,
        logdir: str,
        *,
        max_queue: int = 10,
        flush_secs: float = 120,
        filename_suffix: str = "",
        write_to_disk: bool = True,
        purge_step: int | None = None,
        **kwargs: Any,
    ) -> None:
        # SummaryWriter.__init__ opens the file writer (_get_file_writer): set what it reads first
        self._sync_options = (max_queue, flush_secs, filename_suffix)
        self._sync_to_disk = write_to_disk
        super().__init__(
            logdir=logdir,
            max_queue=max_queue,
            flush_secs=flush_secs,
            filename_suffix=filename_suffix,
            write_to_disk=write_to_disk,
            purge_step=purge_step,
            **kwargs,
        )

    @property
    def event_file(self) -> str | None:
        """The path of the event file being written (``None`` when none is open)."""
        fw = self.file_writer
        return fw.event_writer.path if isinstance(fw, _FileWriter) else None

    def _get_file_writer(self) -> Any:
        """The synchronous file writer, opened on first use and again after ``close()``
        (tensorboardX's hook for that, overridden)."""
        if not self._sync_to_disk or (
            self.all_writers is not None and self.file_writer is not None
        ):
            return super()._get_file_writer()
        fw = _FileWriter(self.logdir, *self._sync_options, **self.kwargs)
        if self.purge_step is not None:  # what tensorboardX writes for a purge_step
            fw.add_event(Event(step=self.purge_step, file_version="brain.Event:2"))
            fw.add_event(
                Event(step=self.purge_step, session_log=SessionLog(status=SessionLog.START))
            )
        self.file_writer = fw
        self.all_writers = {fw.get_logdir(): fw}
        return fw

    def add_scalars(
        self,
        main_tag: str,
        tag_scalar_dict: dict[str, Any],
        global_step: int | None = None,
        walltime: float | None = None,
    ) -> None:
        """tensorboardX's ``add_scalars``, its writer per tag synchronous as well (opened here
        under the directory tensorboardX gives it, which it then finds and uses)."""
        if self._sync_to_disk:
            logdir = str(self._get_file_writer().get_logdir())
            for tag in tag_scalar_dict:
                path = os.path.join(logdir, main_tag, tag)
                if path not in self.all_writers:
                    self.all_writers[path] = _FileWriter(path, *self._sync_options)
        super().add_scalars(main_tag, tag_scalar_dict, global_step, walltime)

    def add_hparams(
        self,
        hparam_dict: dict[str, Any],
        metric_dict: dict[str, Any],
        name: str | None = None,
        global_step: int | None = None,
    ) -> None:
        """tensorboardX's ``add_hparams`` (the same three summaries and metric scalars, in a
        sub-directory ``name``, the time by default), through a synchronous writer."""
        if not self._sync_to_disk:
            super().add_hparams(hparam_dict, metric_dict, name, global_step)
            return
        if type(hparam_dict) is not dict or type(metric_dict) is not dict:
            raise TypeError(
                "add_hparams takes two dicts, hparam_dict and metric_dict (got "
                f"{type(hparam_dict).__name__} and {type(metric_dict).__name__})"
            )
        summaries = hparams(hparam_dict, metric_dict)
        logdir = os.path.join(str(self._get_file_writer().get_logdir()), name or str(time.time()))
        with SyncSummaryWriter(logdir) as writer:
            for summary in summaries:
                writer.file_writer.add_summary(summary)
            for k, v in metric_dict.items():
                writer.add_scalar(k, v, global_step)
        self._get_comet_logger().log_parameters(hparam_dict, step=global_step)
