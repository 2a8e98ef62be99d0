"""``CSVLogger``: metrics to ``metrics.csv`` and hyperparameters to ``hparams.yaml``.

Lightning's ``CSVLogger`` layout: one row per :meth:`CSVLogger.log_metrics` call, a ``step``
column plus the union of every metric name logged so far (empty cells where a row lacks one).
Rows are buffered and written every ``flush_logs_every_n_steps`` steps and at :meth:`save` /
:meth:`finalize`; when a new metric name appears the file is rewritten with the wider header.
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections.abc import Mapping
from typing import Any

from engine.loggers.base import (
    Logger,
    _as_params,
    _to_float,
    _write_hparams_yaml,
    append_whole,
    write_atomically,
)

__all__ = ["CSVLogger"]


class CSVLogger(Logger):
    """Log metrics to ``<log_dir>/metrics.csv`` and hyperparameters to ``<log_dir>/hparams.yaml``.

    The run directory is ``save_dir/name/version_N`` (see :class:`~engine.loggers.Logger`); it is
    created at the first write. As in Lightning, an existing ``metrics.csv`` in it is replaced
    (with a warning) when this logger first writes, except on a resume: a fit resumed from a
    checkpoint this logger wrote into the same directory (a torchrun restart, or
    ``ckpt_path=`` with a pinned ``version``) keeps the rows written before the checkpoint and
    drops those after it, so each step is in the file once (:meth:`load_state_dict`).

    Args:
        save_dir: the directory that holds the experiments.
        name: the experiment's directory under ``save_dir``; ``None`` or ``""`` for none.
        version: ``None`` (next free ``version_N``), an int ``N`` or a directory name.
        flush_logs_every_n_steps: write buffered rows when ``(step + 1)`` is a multiple of this.

    Raises:
        ValueError: if ``flush_logs_every_n_steps`` is not a positive int.

    Example:
        >>> import csv, os, tempfile
        >>> from engine.loggers import CSVLogger
        >>> lg = CSVLogger(tempfile.mkdtemp(), name="exp")
        >>> lg.log_metrics({"train/loss": 0.5}, step=0)
        >>> lg.log_metrics({"train/loss": 0.25, "val/acc": 0.9}, step=1)
        >>> lg.finalize("success")
        >>> with open(os.path.join(lg.log_dir, "metrics.csv")) as f:
        ...     print(f.read(), end="")
        step,train/loss,val/acc
        0,0.5,
        1,0.25,0.9
    """

    METRICS_FILE = "metrics.csv"
    HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version)
        n = flush_logs_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"flush_logs_every_n_steps must be a positive int (got {n!r})")
        self.flush_logs_every_n_steps = n
        self.hparams: dict[str, Any] = {}
        self._rows: list[dict[str, Any]] = []  # buffered, not yet written
        self._columns: list[str] = []  # metric columns already in the file, sorted
        self._opened = False  # whether this logger has written its metrics file yet
        self._n_rows = 0  # rows logged so far
        self._written = 0  # rows in the file (this run's and, resumed, those kept before it)

    @property
    def metrics_file(self) -> str:
        """Path of ``metrics.csv``."""
        return os.path.join(self.log_dir, self.METRICS_FILE)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Buffer one row: ``step`` and the ``metrics`` (numbers or one-element tensors).

        Args:
            metrics: metric name -> value.
            step: the row's step; ``None`` numbers rows from 0 in the order logged.
        """
        if step is None:
            step = self._n_rows
        self._n_rows += 1
        row: dict[str, Any] = {k: _to_float(k, v) for k, v in metrics.items()}
        if "step" in row:
            raise ValueError(
                "'step' is the CSV logger's step column; rename the metric called 'step'"
            )
        row["step"] = int(step)
        self._rows.append(row)
        if (step + 1) % self.flush_logs_every_n_steps == 0:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Merge ``params`` into the recorded hyperparameters and rewrite ``hparams.yaml``."""
        self.hparams.update(_as_params(params))
        with self._writing():
            path = os.path.join(self._make_dir(), self.HPARAMS_FILE)
            _write_hparams_yaml(path, self.hparams)

    def save(self) -> None:
        """Write the buffered rows, rewriting the file first if they bring new columns.

        Rows are written whole: appended in one write that a failure undoes, or, with a wider
        header, the whole file rewritten beside the old one and renamed over it. A failed write
        (a full disk) raises an ``OSError`` naming the file and this logger; what the file held
        stays, and the rows stay buffered for the next :meth:`save`.
        """
        if not self._rows:
            return
        with self._writing():
            self._write_rows()

    def _write_rows(self) -> None:
        path = self.metrics_file
        if not self._opened:
            self._make_dir()
            if os.path.isfile(path):
                warnings.warn(
                    f"CSVLogger: {path} exists and is being replaced by this run's metrics; "
                    "pass a new version= (or version=None) to keep the old file",
                    stacklevel=4,  # the caller of save() or log_metrics()
                )
                os.remove(path)
            self._opened = True
        new = sorted({k for row in self._rows for k in row} - {"step", *self._columns})
        columns = sorted([*self._columns, *new])
        header = ["step", *columns]
        if not new and os.path.isfile(path):
            append_whole(path, _csv_text(header, self._rows, with_header=False))
        else:
            # a new file, or a wider header: the whole file (what is on disk under the new
            # header, missing cells empty, then the new rows), replacing the old one at once
            old: list[dict[str, Any]] = []
            if os.path.isfile(path):
                with open(path, newline="", encoding="utf-8") as f:
                    old = list(csv.DictReader(f))
            write_atomically(path, _csv_text(header, [*old, *self._rows], with_header=True))
        self._columns = columns
        self._written += len(self._rows)
        self._rows = []

    def state_dict(self) -> dict[str, Any]:
        """The rows written so far (buffered ones are written first) and the directory, for
        a checkpoint: a fit resumed from it keeps these rows (see :meth:`load_state_dict`)."""
        if not self._opened and not self._rows:  # nothing logged by this run: nothing to keep
            return {}
        self.save()
        return {"log_dir": os.path.realpath(self.log_dir), "rows": self._written}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue ``metrics.csv`` from a checkpoint's :meth:`state_dict`: in this logger's own
        directory, the rows written before the checkpoint stay and those after it (logged by
        a run that went on past it, and is logged again now) are dropped, in one atomic
        rewrite; the header keeps the columns those rows fill. A file with fewer rows than
        the checkpoint recorded is kept as it is, with a warning. Another directory: a new
        file, as without a checkpoint."""
        if not self._own_log(state):
            return
        self.save()  # rows an earlier fit of this logger buffered
        keep = int(state["rows"])
        path = self.metrics_file
        rows: list[dict[str, str]] = []
        with self._writing():
            if os.path.isfile(path):
                with open(path, newline="", encoding="utf-8") as f:
                    rows = list(csv.DictReader(f))
            if len(rows) < keep:
                warnings.warn(
                    f"CSVLogger: {path} holds {len(rows)} rows, fewer than the {keep} written "
                    "before the checkpoint this fit resumes from (was it edited or replaced?); "
                    "the rows logged from here on are appended to what it holds",
                    stacklevel=2,
                )
            kept = rows[:keep]
            columns = sorted({k for row in kept for k, v in row.items() if v} - {"step"})
            if len(kept) < len(rows) or (rows and list(rows[0]) != ["step", *columns]):
                header = ["step", *columns]
                text = _csv_text(
                    header, [{k: r[k] for k in header if k in r} for r in kept], with_header=True
                )
                write_atomically(path, text)
        self._opened = True  # continued: not replaced at the first write
        self._columns = columns
        self._written = self._n_rows = len(kept)

    def finalize(self, status: str) -> None:
        """Write what is buffered; the run's status is not recorded in the CSV. After a run that
        failed, a write that fails too is a warning (the run's own error is raised)."""
        self._finish(status, self.save)


def _csv_text(header: list[str], rows: list[dict[str, Any]], *, with_header: bool) -> str:
    """``rows`` as CSV text under ``header`` (built in memory: written in one call)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=header)
    if with_header:
        writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
