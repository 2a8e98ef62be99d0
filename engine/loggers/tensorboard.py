"""``TensorBoardLogger``: scalars and hyperparameters as TensorBoard event files (tensorboardX).

Hyperparameters are written for TensorBoard's HParams dashboard: a session-start record with the
(flattened) values when they are logged, and a session-end record with the run's status at
:meth:`TensorBoardLogger.finalize`. No experiment record is written unless metrics are named, so
TensorBoard lists every scalar of the run as a metric of the session. They are also saved as
``hparams.yaml`` next to the event file, as Lightning does.

Events are written on the calling thread (:mod:`engine.loggers._event_file`), not by
tensorboardX's writer thread, so a write that fails (a full disk) raises an ``OSError`` naming
the file and the logger instead of hanging the fit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from engine.loggers.base import Logger, _as_params, _to_float, _write_hparams_yaml, flatten_params

__all__ = ["TensorBoardLogger"]

# TensorBoard's HParams plugin reads only these value types; others are shown as strings.
_HPARAM_TYPES = (bool, int, float, str)
_STATUS = {"success": "STATUS_SUCCESS", "failed": "STATUS_FAILURE"}


class TensorBoardLogger(Logger):
    """Log scalars and hyperparameters to TensorBoard event files in ``log_dir``.

    The ``tensorboardX.SummaryWriter`` (:attr:`experiment`) is created at the first write, so
    building the logger touches no files. View with ``tensorboard --logdir <save_dir>``.
    Its event file is written on the calling thread, ``max_queue`` events at a time and at
    :meth:`save` / :meth:`finalize`, whole records only: a write that fails (a full disk)
    raises an ``OSError`` naming the file and this logger, and leaves the events written
    before readable.

    A fit resumed from a checkpoint this logger wrote into the same directory (a torchrun
    restart, or ``ckpt_path=`` with a pinned ``version``) keeps the events written before the
    checkpoint and removes those after it, so each step's scalars are there once
    (:meth:`load_state_dict`).

    Args:
        save_dir: the directory that holds the experiments.
        name: the experiment's directory under ``save_dir``; ``None`` or ``""`` for none.
        version: ``None`` (next free ``version_N``), an int ``N`` or a directory name.
        **writer_kwargs: passed to ``tensorboardX.SummaryWriter`` (``flush_secs``,
            ``max_queue``, ...).

    Raises:
        OSError: from a write that fails, naming the file, this logger and the cause.

    Example:
        >>> import tempfile
        >>> from engine.loggers import TensorBoardLogger
        >>> lg = TensorBoardLogger(tempfile.mkdtemp(), name="exp")
        >>> lg.log_hyperparams({"lr": 0.1, "model": {"width": 64}})
        >>> lg.log_metrics({"train/loss": 0.5}, step=10)
        >>> lg.finalize("success")
        >>> lg.log_dir.endswith("exp/version_0")
        True
    """

    HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None
        self._writers_opened = 0
        self._resumed = False  # continues event files an earlier process wrote (see below)
        self.hparams: dict[str, Any] = {}

    @property
    def experiment(self) -> Any:
        """The ``tensorboardX.SummaryWriter``, created on first use."""
        if self._writer is None:
            from engine.loggers._event_file import SyncSummaryWriter

            kwargs = dict(self._writer_kwargs)
            suffix = kwargs.get("filename_suffix", "")
            if self._resumed:  # never the name of a file the resumed run wrote in its second
                suffix = f"{suffix}.{os.getpid()}"
            if self._writers_opened:
                # event files are named by the second they were opened: a writer reopened after
                # finalize() within that second would overwrite the first one's file
                suffix = f"{suffix}.{self._writers_opened}"
            if suffix:
                kwargs["filename_suffix"] = suffix
            with self._writing():
                self._writer = SyncSummaryWriter(self._make_dir(), **kwargs)
            self._writers_opened += 1
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Add each metric as a scalar at ``step`` (numbers or one-element tensors).

        Args:
            metrics: metric name (the TensorBoard tag) -> value.
            step: the global step; ``None`` lets TensorBoard use the wall time only.
        """
        values = {k: _to_float(k, v) for k, v in metrics.items()}
        writer = self.experiment
        with self._writing():
            for k, v in values.items():
                writer.add_scalar(k, v, step)

    def log_hyperparams(
        self, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None
    ) -> None:
        """Record hyperparameters for TensorBoard's HParams dashboard and in ``hparams.yaml``.

        Nested mappings are flattened with ``/`` (``{"opt": {"lr": 0.1}}`` -> ``opt/lr``); values
        other than bool, int, float and str are shown as their ``str()``.

        Args:
            params: the hyperparameters (merged with those logged before).
            metrics: optional initial metric values; naming metrics makes only these columns
                appear in the dashboard (otherwise every scalar of the run does).
        """
        self.hparams.update(_as_params(params))
        from tensorboardX.summary import hparams as hparams_summary

        flat = {
            k: v if isinstance(v, _HPARAM_TYPES) or v is None else str(v)
            for k, v in flatten_params(self.hparams).items()
        }
        metric_values = {k: _to_float(k, v) for k, v in (metrics or {}).items()}
        experiment, session_start, _ = hparams_summary(flat, metric_values)
        writer = self.experiment
        with self._writing():
            file_writer = writer._get_file_writer()  # tensorboardX has no public raw-summary API
            if metric_values:
                file_writer.add_summary(experiment)
            file_writer.add_summary(session_start)
            if metric_values:
                self.log_metrics(metric_values, 0)
            _write_hparams_yaml(os.path.join(self.log_dir, self.HPARAMS_FILE), self.hparams)

    def save(self) -> None:
        """Write every buffered event to the event file (and ``fsync`` it)."""
        if self._writer is not None:
            with self._writing():
                self._writer.flush()

    def state_dict(self) -> dict[str, Any]:
        """The event files in :attr:`log_dir` and their sizes once this logger's events are
        written, for a checkpoint: a fit resumed from it cuts them back to these sizes (see
        :meth:`load_state_dict`)."""
        self.save()
        files: dict[str, int] = {}
        with self._writing():
            for name in _event_files(self.log_dir):
                files[name] = os.path.getsize(os.path.join(self.log_dir, name))
        return {"log_dir": os.path.realpath(self.log_dir), "event_files": files}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the event files of a checkpoint's :meth:`state_dict`: in this logger's own
        directory, each file recorded is cut back to its recorded size and the files written
        after the checkpoint are removed, so the events logged after it (by a run that went
        on past it, logged again now) are not there twice; new events go to a new file.
        Another directory: nothing is touched."""
        if not self._own_log(state):
            return
        if self._writer is not None:  # an earlier fit's, still open: its events are written
            writer, self._writer = self._writer, None
            with self._writing():
                writer.close()
        recorded: Mapping[str, int] = state.get("event_files") or {}
        with self._writing():
            for name in _event_files(self.log_dir):
                path = os.path.join(self.log_dir, name)
                if name not in recorded:  # written after the checkpoint
                    os.remove(path)
                elif os.path.getsize(path) > int(recorded[name]):
                    os.truncate(path, int(recorded[name]))  # at a record's end: written whole
        self._resumed = True

    def finalize(self, status: str) -> None:
        """Record the session's end status (for the HParams dashboard), flush and close.

        The file is closed even when the last write fails; after a run that failed, that
        failure is a warning (the run's own error is raised)."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None

        def close() -> None:
            try:
                if self.hparams:
                    writer._get_file_writer().add_summary(_session_end(status))
                writer.close()
            finally:  # closed whatever failed: close() again only closes what is still open
                for file_writer in (writer.all_writers or {}).values():
                    with contextlib.suppress(OSError):
                        file_writer.close()

        self._finish(status, close)


def _event_files(log_dir: str) -> list[str]:
    """The TensorBoard event files directly in ``log_dir`` (none if it does not exist)."""
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith("events.out.tfevents."))


def _session_end(status: str) -> Any:
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    info = SessionEndInfo(status=Status.Value(_STATUS.get(status, "STATUS_UNKNOWN")))
    content = HParamsPluginData(session_end_info=info, version=0)
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name="hparams", content=content.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag="_hparams_/session_end_info", metadata=meta)])
