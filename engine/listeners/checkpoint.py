"""``ModelCheckpoint``: save checkpoints while fitting and keep the best ``k`` of them.

Lightning 2.x's ``ModelCheckpoint`` semantics, as a listener that returns
:class:`~engine.events.Save` requests (each an engine checkpoint directory, see
:mod:`engine.checkpoint`), which the driver writes once the event has reached every listener:

* **Where.** ``dirpath``, else ``<rec.run.log_dir>/checkpoints`` (the first logger's directory,
  else ``default_root_dir``), resolved at ``setup``. Checkpoints are directories named after
  ``filename`` with no suffix (``FILE_EXTENSION = ""``): ``<dirpath>/epoch=0-step=4/``.
* **Names.** ``filename`` is a template: ``"{epoch}-{step}"`` (the default) renders
  ``"epoch=0-step=4"``, ``"{epoch}-{val/loss:.2f}"`` renders ``"epoch=0-val_loss=0.12"``. Each
  field becomes ``name=value`` unless ``auto_insert_metric_name=False``; a metric missing from
  the metrics renders as 0. Unlike Lightning, a rendered name never contains a path separator:
  ``/`` (a metric's namespace) becomes ``_``, so every checkpoint sits directly in ``dirpath``
  (where ``fit(ckpt_path="last")`` looks). A name already on disk gets ``-v1``, ``-v2``, ...
  (``enable_version_counter``).
* **When.** After ``every_n_train_steps`` optimizer steps, or ``train_time_interval`` of
  training time (checked after each training batch); otherwise every ``every_n_epochs`` epochs
  (default 1) at the end of the training epoch or after validation. ``save_on_train_epoch_end``
  picks which; ``None`` decides with Lightning's rule: at the end of the training epoch when
  ``check_val_every_n_epoch == 1`` and validation runs either not at all or at the end of the
  epoch only (``val_check_interval == 1``), after validation otherwise. Never outside ``fit``,
  during the sanity check, under ``fast_dev_run``, or twice at the same ``global_step``. A
  step- or time-triggered save whose monitored metric is not logged yet, or that would read a
  stale one because validation follows the epoch's last batch, waits for the next validation.
* **Which to keep.** With ``monitor``, the ``save_top_k`` best by that metric (``mode``
  ``"min"`` or ``"max"``; NaN counts as the worst); the one that falls out is deleted.
  ``save_top_k=-1`` keeps all, ``0`` saves none. Without ``monitor``, ``save_top_k=1`` keeps
  the latest and ``-1`` all. A monitored metric that is missing raises once a validation has
  run in this fit (the metric should exist then); before that it warns and skips, as Lightning.
  The one that falls out is in the new one's ``Save(replaces=...)``: the driver deletes it once
  the new one is on disk.
* **last.** ``save_last=True`` also saves ``<dirpath>/last`` whenever a checkpoint is saved (a
  second save, not a copy), and once at the end of training if nothing was saved.
  ``save_last="link"`` is treated like ``True``: no symbolic links, which would dangle when a
  top-k checkpoint is deleted.
* **One run per directory.** From ``on_fit_start`` to the end of the fit (an exception
  included) the listener holds ``dirpath`` (``<dirpath>/.engine-run.lock``, see
  :class:`engine.checkpoint._RunLock`): a second live run saving there is refused before its
  first step, naming the directory and the owner's pid and host; a dead run's lock is taken
  over. The ``ModelCheckpoint`` listeners of one process share it.
* **Failed saves.** A checkpoint that cannot be written (a full disk) fails the fit with a
  ``CheckpointError`` (an asynchronous one at the driver's next check); the driver tells the
  listener (:meth:`ModelCheckpoint.checkpoint_settled`), which takes it out of
  ``best_k_models`` / ``best_model_path`` / ``last_model_path``: they name only checkpoints
  that were written, and the one it would have replaced is kept.
* **Resume.** ``state_dict`` holds the top-k bookkeeping and when this listener last saved;
  the Trainer stores it in every checkpoint under :attr:`ModelCheckpoint.state_key` and
  restores it on ``fit(ckpt_path=...)``, so a resumed run keeps ranking against the same ``k``
  checkpoints and saves (or skips a save) exactly where the run that never stopped did.
"""

from __future__ import annotations

import math
import operator
import os
import re
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from engine import checkpoint
from engine.events import EventRecord, Listener, RunView, Save
from engine.listeners import _confine
from engine.listeners.progress import write_message
from engine.plan import LoopConfig, schedule

__all__ = ["ModelCheckpoint"]

# a template field: "{name}" or "{name:spec}"; the name runs to the first ":" or "}"
_FIELD = re.compile(r"\{([^{}:]*)(?::([^{}]*))?\}")
_BETTER = {"min": operator.lt, "max": operator.gt}


class ModelCheckpoint(Listener):
    """Save checkpoints during ``fit``; keep the ``save_top_k`` best by ``monitor``.

    Args:
        dirpath: the directory for the checkpoints; default ``<rec.run.log_dir>/checkpoints``.
        filename: the name template (see the module); default ``"{epoch}-{step}"``.
        monitor: the metric to rank by, a key of ``rec.run.callback_metrics`` (``"val/loss"``);
            ``None`` ranks by recency.
        verbose: print what is saved and why.
        save_weights_only: save the model alone (parameters and buffers): smaller checkpoints
            that ``validate`` / ``test`` / ``predict`` (``ckpt_path="best"``, say) can start
            from but a fit cannot resume from.
        save_last: also keep ``<dirpath>/last``, the latest state (``"link"`` = ``True``).
        save_top_k: how many to keep: ``k >= 1``, ``-1`` (all) or ``0`` (none; ``save_last``
            still works). Without ``monitor`` only ``-1``, ``0`` and ``1`` make sense.
        mode: ``"min"`` (lower is better) or ``"max"``.
        auto_insert_metric_name: render ``{name}`` as ``name=value`` (else only the value).
        every_n_train_steps: save after every n optimizer steps (0 or ``None``: not by steps).
        train_time_interval: save when this much time has passed since the last check.
        every_n_epochs: save every n epochs (0: not by epochs); the default when no other
            trigger is given is 1. The three triggers are mutually exclusive.
        save_on_train_epoch_end: epoch-wise saves at the end of the training epoch (``True``) or
            after validation (``False``); ``None`` decides at each save (see the module).
        enable_version_counter: add ``-v1``, ``-v2``, ... to a name that exists, rather than
            overwriting it.
        asynchronous: (engine only) write in the background: training is blocked only while
            the state is snapshotted (:func:`engine.checkpoint.save_async`); a checkpoint a new
            one replaces is deleted once the new one is on disk, and the fit waits for pending
            writes before it returns.

    Attributes:
        best_model_path: the best checkpoint so far (the latest, without ``monitor``).
        best_model_score: its ``monitor`` value (``None`` before the first or without monitor).
        best_k_models: ``{path: score}`` of the kept checkpoints.
        kth_best_model_path, kth_value: the worst of the kept ones once ``k`` are kept (the
            one to beat); ``kth_value`` starts at ``inf`` (``-inf`` for ``"max"``).
        current_score: the score of the latest top-k save.
        last_model_path: the latest ``last`` checkpoint.

    Raises:
        ValueError: for a bad ``mode``, ``save_last``, ``save_top_k``, negative or combined
            triggers, or ``save_top_k > 1`` without ``monitor``.
        TypeError: for a ``monitor`` that is not a non-empty string, or a
            ``train_time_interval`` that is not a ``timedelta``.
        RuntimeError: while fitting, when ``monitor`` is missing from the metrics after a
            validation has run.

    Example:
        >>> from engine.listeners import ModelCheckpoint
        >>> mc = ModelCheckpoint(dirpath="/ckpts", filename="{epoch}-{val/loss:.2f}",
        ...                      monitor="val/loss", save_top_k=3, save_last=True)
        >>> mc.format_checkpoint_name({"epoch": 4, "step": 40, "val/loss": 0.12345})
        '/ckpts/epoch=4-val_loss=0.12'
        >>> mc.format_checkpoint_name({"epoch": 4, "step": 40}, ver=1)
        '/ckpts/epoch=4-val_loss=0.00-v1'
        >>> mc.state_key
        "ModelCheckpoint{'monitor': 'val/loss', 'mode': 'min', 'every_n_train_steps': 0, \
'every_n_epochs': 1, 'train_time_interval': None}"
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ""  # checkpoints are directories
    STARTING_VERSION = 1

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        *,
        verbose: bool = False,
        save_weights_only: bool = False,
        save_last: bool | str | None = None,
        save_top_k: int = 1,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        asynchronous: bool = False,
    ) -> None:
        if mode not in _BETTER:
            raise ValueError(f"mode must be 'min' or 'max' (got {mode!r})")
        if save_last not in (None, True, False, "link"):
            raise ValueError(f"save_last must be None, True, False or 'link' (got {save_last!r})")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise TypeError(f"monitor must be a metric name such as 'val/loss' (got {monitor!r})")
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise TypeError(
                f"train_time_interval must be a datetime.timedelta or None (got "
                f"{train_time_interval!r})"
            )
        _check_count("save_top_k", save_top_k, minimum=-1)
        _check_count("every_n_train_steps", every_n_train_steps or 0, minimum=0)
        _check_count("every_n_epochs", every_n_epochs or 0, minimum=0)
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1  # the default trigger: once per epoch
        self._every_n_train_steps = every_n_train_steps or 0
        self._every_n_epochs = every_n_epochs or 0
        self._train_time_interval = train_time_interval
        triggers = {
            "every_n_train_steps": self._every_n_train_steps >= 1,
            "every_n_epochs": self._every_n_epochs >= 1,
            "train_time_interval": train_time_interval is not None,
        }
        if sum(triggers.values()) > 1:
            raise ValueError(
                f"ModelCheckpoint: {' and '.join(k for k, on in triggers.items() if on)} are "
                "mutually exclusive; pass one, or use one ModelCheckpoint per trigger"
            )
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ValueError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None): without a monitor "
                "there is nothing to rank by; pass monitor=... or save_top_k in (-1, 0, 1)"
            )
        self.dirpath: str | None = _real(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._enable_version_counter = enable_version_counter
        for name, flag in (
            ("asynchronous", asynchronous),
            ("save_weights_only", save_weights_only),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False (got {flag!r})")
        self.asynchronous = asynchronous
        self.save_weights_only = save_weights_only

        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.best_k_models: dict[str, float] = {}
        self.kth_best_model_path = ""
        self.kth_value = math.inf if mode == "min" else -math.inf
        self.current_score: float | None = None
        self.last_model_path = ""
        self._last_global_step_saved = 0  # nothing to save before the first step
        self._last_checkpoint_saved = ""
        self._restored_last_saved = False  # a checkpoint said when this listener last saved
        # an event's saves and what they replace, asked for once its bookkeeping is final
        self._pending_saves: list[str] = []
        self._pending_removals: list[tuple[str, str]] = []
        self._last_time_checked: float | None = None
        self._defer_until_validation = False
        self._validated = False  # a validation has run in this fit: a missing monitor is an error
        self._stage: str | None = None  # the call's stage (set at setup, before a restore)
        self._warned_missing = False
        # unsettled saves by path, in order: what each changed, to undo if it fails
        self._unsettled: dict[str, list[tuple[str, str, float | None]]] = {}
        self._lock: checkpoint._RunLock | None = None  # this fit's claim on dirpath

    @property
    def state_key(self) -> str:
        """A checkpoint key telling several ModelCheckpoints apart (Lightning's format)."""
        key = {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self._every_n_train_steps,
            "every_n_epochs": self._every_n_epochs,
            "train_time_interval": self._train_time_interval,
        }
        return f"{type(self).__qualname__}{key!r}"

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    # ------------------------------------------------------------------ events

    def setup(self, rec: EventRecord) -> None:
        """Resolve ``dirpath`` (before a checkpoint's state is restored)."""
        self._stage = rec.stage
        if self.dirpath is None:
            root = rec.run.log_dir or rec.run.default_root_dir
            self.dirpath = os.path.join(root, "checkpoints")
        if not rec.run.is_global_zero:  # rank 0 writes the directory, and tidies it
            return
        if rec.stage == "fit":  # what a crashed save left (a replaced checkpoint is put back)
            checkpoint.clean_leftovers(self.dirpath)

    def on_fit_start(self, rec: EventRecord) -> None:
        """Claim ``dirpath`` for this run (see :func:`checkpoint._RunLock`): a second live run
        saving there is refused before its first step, naming the run that owns it."""
        self._validated = False
        self._defer_until_validation = False
        self._pending_saves, self._pending_removals = [], []  # left by a failed fit
        self._unsettled = {}
        if (
            rec.stage == "fit"
            and rec.run.is_global_zero
            and self.dirpath is not None
            and self.save_top_k != 0
            and _non_empty_dir(self.dirpath)
            and not _confine.directly_in(rec.run.ckpt_path, os.fspath(self.dirpath))  # resumed
        ):
            warnings.warn(
                f"ModelCheckpoint: the checkpoint directory {self.dirpath} exists and is not "
                "empty; checkpoints of another run may be overwritten or outrank this run's",
                stacklevel=2,
            )
        if (
            self.dirpath is not None
            and rec.run.is_global_zero  # the rank that writes claims the directory
            and not self._outside_fit(rec)
            and self._saves()
        ):
            lock = checkpoint._RunLock(self.dirpath)
            try:
                lock.acquire()
            except checkpoint.CheckpointError as e:
                raise checkpoint.CheckpointError(f"ModelCheckpoint: {e}") from None
            self._lock = lock

    def teardown(self, rec: EventRecord) -> None:
        self._release()

    def on_exception(self, rec: EventRecord) -> None:
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            checkpoint.wait()  # its pending writes land in the directory while it is claimed
            self._lock.release()
            self._lock = None

    def _saves(self) -> bool:
        return self.save_top_k != 0 or bool(self.save_last)

    def checkpoint_settled(self, path: str, error: BaseException | None) -> None:
        """The driver says how a save this listener asked for ended: written (``error`` is
        ``None``), or not. A checkpoint that was not written leaves the bookkeeping: the
        ranking, ``best_model_path`` and ``last_model_path`` go back to the checkpoints on disk
        (the one it would have replaced is still there: it is deleted only once its
        replacement has landed)."""
        changes = self._unsettled.get(path)
        if not changes:
            return
        change = changes.pop(0)
        if not changes:
            del self._unsettled[path]
        if error is None:
            return
        kind, before, score = change
        if kind in ("latest", "last"):
            # a later save that replaced this one (still in flight) replaces what it replaced:
            # if that one fails too, the name goes back to a checkpoint that is on disk
            for later in self._unsettled.values():
                for i, (later_kind, replaced, later_score) in enumerate(later):
                    if later_kind == kind and replaced == path:
                        later[i] = (later_kind, before, later_score)
        if kind == "top_k":
            self.best_k_models.pop(path, None)
            k = self.save_top_k
            room = before == path or k == -1 or len(self.best_k_models) < k
            if before and score is not None and room and _on_disk(before):
                self.best_k_models[before] = score
            self._rank()
        elif kind == "latest" and self.best_model_path == path:
            self.best_model_path = before if before and _on_disk(before) else ""
        elif kind == "last" and self.last_model_path == path:
            self.last_model_path = before if before and _on_disk(before) else ""

    def _rank(self) -> None:
        """``best_model_path`` / ``best_model_score`` and the k-th from ``best_k_models``."""
        worst, best = (max, min) if self.mode == "min" else (min, max)
        scores = self.best_k_models
        if scores and (self.save_top_k == -1 or len(scores) == self.save_top_k):
            self.kth_best_model_path = worst(scores, key=scores.__getitem__)
            self.kth_value = scores[self.kth_best_model_path]
        else:
            self.kth_best_model_path = ""
            self.kth_value = math.inf if self.mode == "min" else -math.inf
        if scores:
            self.best_model_path = best(scores, key=scores.__getitem__)
            self.best_model_score = scores[self.best_model_path]
        else:
            self.best_model_path, self.best_model_score = "", None

    def _asked(self, path: str, kind: str, before: str, score: float | None = None) -> None:
        self._unsettled.setdefault(path, []).append((kind, before, score))

    def on_load_checkpoint(self, rec: EventRecord) -> None:
        """A checkpoint from an older engine does not say when this listener last saved: take
        the resumed step as saved (it is on disk already)."""
        if rec.stage == "fit" and not self._restored_last_saved:
            self._last_global_step_saved = rec.run.global_step
        self._restored_last_saved = False
        if rec.stage == "fit":
            self._forget_missing()

    def _forget_missing(self) -> None:
        """Leave out of the restored ranking the checkpoints no longer on disk (a save that
        failed after the checkpoint resumed from was written, or one deleted by hand)."""
        gone = sorted(p for p in self.best_k_models if not _on_disk(p))
        for path in gone:
            del self.best_k_models[path]
        if gone:
            self._rank()
        for name in ("best_model_path", "last_model_path"):
            path = getattr(self, name)
            if path and not _on_disk(path):
                gone.append(path)
                setattr(self, name, "")
        if not gone:
            return
        warnings.warn(
            f"ModelCheckpoint: the checkpoint resumed from names checkpoints that are not on "
            f"disk ({', '.join(gone)}); they are left out of the ranking",
            stacklevel=2,
        )

    def on_train_start(self, rec: EventRecord) -> None:
        self._last_time_checked = time.monotonic()

    # blocks end at every_n_train_steps' multiples (block_ends); it saves, never stops
    handles_blocks, may_stop = True, False

    def block_ends(self) -> tuple[int, ...]:
        return (self._every_n_train_steps,) if self._every_n_train_steps else ()

    def on_train_batch_end(self, rec: EventRecord) -> list[Save] | None:
        """Save by ``every_n_train_steps`` / ``train_time_interval``."""
        self._at_train_batch_end(rec)
        return self._flush(rec)

    def _at_train_batch_end(self, rec: EventRecord) -> None:
        by_steps = self._every_n_train_steps >= 1 and (
            rec.run.global_step % self._every_n_train_steps == 0
        )
        by_time = False
        now = time.monotonic()
        if self._train_time_interval is not None and self._last_time_checked is not None:
            by_time = now - self._last_time_checked >= self._train_time_interval.total_seconds()
        if not (by_steps or by_time):
            return
        if by_time:
            self._last_time_checked = now
        candidates = self._candidates(rec)
        if self.monitor is not None and (
            self.monitor not in candidates or self._validation_follows(rec)
        ):
            # the metric is missing, or stale because validation runs right after this batch:
            # save after the validation instead
            self._defer_until_validation = True
            return
        if self._skip(rec):
            return
        self._save_topk(rec, candidates)
        self._save_last(rec, candidates)

    def on_validation_end(self, rec: EventRecord) -> list[Save] | None:
        """Save after validation unless saves happen at the end of the training epoch."""
        self._at_validation_end(rec)
        return self._flush(rec)

    def _at_validation_end(self, rec: EventRecord) -> None:
        if rec.stage == "fit" and not rec.run.sanity_checking:
            self._validated = True
        if self._skip(rec) or self._on_train_epoch_end(rec.run):
            return
        candidates = self._candidates(rec)
        if self._defer_until_validation:
            self._defer_until_validation = False
            self._save_topk(rec, candidates)
            self._save_last(rec, candidates)
            return
        self._save_epochwise(rec, candidates)

    def on_train_epoch_end(self, rec: EventRecord) -> list[Save] | None:
        """Save at the end of the training epoch when that is where epoch-wise saves go."""
        self._at_train_epoch_end(rec)
        return self._flush(rec)

    def _at_train_epoch_end(self, rec: EventRecord) -> None:
        if self._skip(rec) or not self._on_train_epoch_end(rec.run):
            return
        self._save_epochwise(rec, self._candidates(rec))

    def on_train_end(self, rec: EventRecord) -> list[Save] | None:
        """With ``save_last``, save ``last`` if nothing was saved during training."""
        self._at_train_end(rec)
        return self._flush(rec)

    def _at_train_end(self, rec: EventRecord) -> None:
        if self._outside_fit(rec) or not self.save_last or self._last_checkpoint_saved:
            return
        self._save_last(rec, self._candidates(rec))

    # ------------------------------------------------------------------ when

    @staticmethod
    def _outside_fit(rec: EventRecord) -> bool:
        run = rec.run
        return rec.stage != "fit" or run.sanity_checking or bool(_config(run).fast_dev_run)

    def _skip(self, rec: EventRecord) -> bool:
        return self._outside_fit(rec) or self._last_global_step_saved == rec.run.global_step

    def _on_train_epoch_end(self, run: RunView) -> bool:
        """Where epoch-wise saves go: ``save_on_train_epoch_end``, else Lightning's rule
        (:func:`engine.plan.schedule.saves_at_train_epoch_end`)."""
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        return schedule.saves_at_train_epoch_end(_config(run), sum(run.num_val_batches))

    def _validation_follows(self, rec: EventRecord) -> bool:
        """Whether this was the epoch's last batch and validation runs next (and epoch-wise
        saves do not go to the end of the training epoch):
        :func:`engine.plan.schedule.validation_follows`."""
        run = rec.run
        if self._on_train_epoch_end(run) or rec.batch_idx is None:
            return False
        return schedule.validation_follows(
            _config(run),
            batch_idx=rec.batch_idx,
            num_training_batches=run.num_training_batches,
            num_val_batches=sum(run.num_val_batches),
            epoch=run.current_epoch,
        )

    def _save_epochwise(self, rec: EventRecord, candidates: dict[str, Any]) -> None:
        epoch = rec.run.current_epoch
        if self._every_n_epochs >= 1 and (epoch + 1) % self._every_n_epochs == 0:
            self._save_topk(rec, candidates)
        if self._last_global_step_saved == rec.run.global_step:
            self._save_last(rec, candidates)

    # ------------------------------------------------------------------ what

    @staticmethod
    def _candidates(rec: EventRecord) -> dict[str, Any]:
        """The metrics a name or a ranking may use, with ``epoch`` and ``step`` as ints."""
        candidates: dict[str, Any] = dict(rec.metrics)
        candidates["epoch"] = int(candidates.get("epoch", rec.run.current_epoch))
        candidates["step"] = int(candidates.get("step", rec.run.global_step))
        return candidates

    def _save_topk(self, rec: EventRecord, candidates: dict[str, Any]) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is None:
            self._save_latest(rec, candidates)
            return
        if self.monitor not in candidates:
            message = (
                f"ModelCheckpoint(monitor={self.monitor!r}): no metric of that name; the "
                f"metrics available are {sorted(candidates)}. Pass one of "
                "them as monitor=, or return the metric from the task's eval_fn / loss_fn"
            )
            if self._validated:
                raise RuntimeError(message)
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(message + " (not saving until it is)", UserWarning, stacklevel=3)
            return
        current = float(candidates[self.monitor])
        if self.check_monitor_top_k(current):
            self._update_best_and_save(rec, current, candidates)
        elif self.verbose:
            write_message(
                f"Epoch {candidates['epoch']}, global step {candidates['step']}: "
                f"{self.monitor!r} ({current:.5f}) was not in top {self.save_top_k}"
            )

    def check_monitor_top_k(self, current: float | None) -> bool:
        """Whether a checkpoint scoring ``current`` belongs in the top k."""
        if current is None:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        return _BETTER[self.mode](float(current), self.best_k_models[self.kth_best_model_path])

    def _update_best_and_save(
        self, rec: EventRecord, current: float, candidates: dict[str, Any]
    ) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        dropped, dropped_score = None, None
        if len(self.best_k_models) == k:
            dropped = self.kth_best_model_path
            dropped_score = self.best_k_models.pop(dropped)
        if math.isnan(current):
            current = math.inf if self.mode == "min" else -math.inf  # NaN ranks last
        path = self._free_name(candidates, keep=dropped)
        self.current_score = current
        self.best_k_models[path] = current
        worst, best = (max, min) if self.mode == "min" else (min, max)
        if len(self.best_k_models) == k:
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.__getitem__)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        self.best_model_path = best(self.best_k_models, key=self.best_k_models.__getitem__)
        self.best_model_score = self.best_k_models[self.best_model_path]
        if self.verbose:
            write_message(
                f"Epoch {candidates['epoch']}, global step {candidates['step']}: "
                f"{self.monitor!r} reached {current:.5f} (best {self.best_model_score:.5f}), "
                f"saving {path} as top {k}"
            )
        self._save(rec, path)
        self._asked(path, "top_k", dropped or "", dropped_score)
        if dropped:
            self._pending_removals.append((dropped, path))

    def _save_latest(self, rec: EventRecord, candidates: dict[str, Any]) -> None:
        path = self._free_name(candidates, keep=self.best_model_path)
        previous, self.best_model_path = self.best_model_path, path
        self._save(rec, path)
        self._asked(path, "latest", previous)
        if self.verbose:
            write_message(f"Epoch {candidates['epoch']}, global step {candidates['step']}: {path}")
        if self.save_top_k == 1 and previous:
            self._pending_removals.append((previous, path))

    def _save_last(self, rec: EventRecord, candidates: dict[str, Any]) -> None:
        if not self.save_last:
            return
        path = self._free_name(
            candidates, keep=self.last_model_path, template=self.CHECKPOINT_NAME_LAST
        )
        previous, self.last_model_path = self.last_model_path, path
        self._save(rec, path)
        self._asked(path, "last", previous)
        if previous:
            self._pending_removals.append((previous, path))

    def _save(self, rec: EventRecord, path: str) -> None:
        """Record a save of ``path``; :meth:`_flush` requests it at the end of the event."""
        self._last_global_step_saved = rec.run.global_step
        self._last_checkpoint_saved = path
        self._pending_saves.append(path)

    def _flush(self, rec: EventRecord) -> list[Save] | None:
        """The event's checkpoints, as requests, each with the checkpoints it replaces.

        Requested once all of the event's bookkeeping is done, so every checkpoint saved at one
        step (a top-k one and ``last``) holds the same, final state of this listener (the driver
        writes them after every listener has had the event): a run resumed from either saves,
        ranks and deletes exactly as the run that never stopped. The driver deletes a replaced
        checkpoint only once its replacement is on disk (an asynchronous one: once it landed),
        so a crash never leaves fewer checkpoints than ``k``, and a failed write deletes
        nothing.
        """
        if not self._pending_saves:
            return None
        saves, self._pending_saves = self._pending_saves, []
        removals, self._pending_removals = self._pending_removals, []
        return [
            Save(
                path,
                asynchronous=self.asynchronous,
                weights_only=self.save_weights_only,
                replaces=tuple(
                    previous
                    for previous, current in removals
                    if current == path and self._removable(rec, previous, current)
                ),
            )
            for path in saves
        ]

    def _free_name(
        self, candidates: Mapping[str, Any], *, keep: str | None, template: str | None = None
    ) -> str:
        """The rendered path; with the version counter, the first of ``-v1``, ``-v2``, ... not on
        disk (``keep``, the path this save replaces, may be reused)."""
        path = self.format_checkpoint_name(candidates, template)
        version = self.STARTING_VERSION
        while (
            self._enable_version_counter
            and (os.path.lexists(path) or path in self._pending_saves)
            and path != keep
        ):
            path = self.format_checkpoint_name(candidates, template, ver=version)
            version += 1
        return path

    def _removable(self, rec: EventRecord, previous: str, current: str) -> bool:
        """Delete ``previous`` only if it is another checkpoint inside ``dirpath`` and not the
        one this fit resumed from."""
        if previous == current or self.dirpath is None:
            return False
        old = Path(previous).absolute()
        resumed = rec.run.ckpt_path
        if resumed is not None and Path(resumed).absolute() == old:
            return False
        return _confine.directly_in(previous, self.dirpath)

    # ------------------------------------------------------------------ names

    def format_checkpoint_name(
        self, metrics: Mapping[str, Any], filename: str | None = None, ver: int | None = None
    ) -> str:
        """The checkpoint path for ``metrics``: ``dirpath`` / the rendered template (``filename``,
        else this listener's), with ``-v<ver>`` when ``ver`` is given.

        Example:
            >>> from engine.listeners import ModelCheckpoint
            >>> ModelCheckpoint(filename="{epoch:03d}").format_checkpoint_name({"epoch": 5})
            'epoch=005'
            >>> mc = ModelCheckpoint(filename="e{epoch}-{val/acc:.1f}",
            ...                      auto_insert_metric_name=False)
            >>> mc.format_checkpoint_name({"epoch": 2, "val/acc": 0.91})
            'e2-0.9'
        """
        template = filename or self.filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"

        def render(field: re.Match[str]) -> str:
            name, spec = field.group(1), field.group(2) or ""
            value = metrics.get(name, 0)
            try:
                text = format(value, spec)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"ModelCheckpoint(filename={template!r}): {name} = {value!r} does not "
                    f"format as {{{name}:{spec}}} ({e}); metrics are floats, epoch and step ints"
                ) from None
            return (
                f"{name}{self.CHECKPOINT_EQUALS_CHAR}{text}"
                if self.auto_insert_metric_name
                else text
            )

        name = _FIELD.sub(render, template)
        for sep in {"/", os.sep, os.altsep or "/"}:
            name = name.replace(sep, "_")  # a metric's namespace is no subdirectory
        if ver is not None:
            name = f"{name}{self.CHECKPOINT_JOIN_CHAR}v{ver}"
        name += self.FILE_EXTENSION
        return os.path.join(self.dirpath, name) if self.dirpath else name

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The top-k bookkeeping, for checkpoints (JSON values: paths, floats, ``None``)."""
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
            # when it last saved: a resumed run saves (or skips) exactly as one never stopped
            "last_global_step_saved": self._last_global_step_saved,
            "last_checkpoint_saved": self._last_checkpoint_saved,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values. If the checkpoint was written for another
        ``dirpath``, only ``best_model_path`` is restored (with a warning in a fit, as in
        Lightning; validate, test and predict save nothing, so they say nothing)."""
        saved_dir = state.get("dirpath", self.dirpath)
        state, dropped = _confine.confined(state, saved_dir)
        if saved_dir == self.dirpath:
            self.best_model_score = _opt_float(state.get("best_model_score"))
            self.current_score = _opt_float(state.get("current_score", self.current_score))
            self.best_k_models = {
                str(k): float(v) for k, v in state.get("best_k_models", {}).items()
            }
            self.kth_best_model_path = state.get("kth_best_model_path", self.kth_best_model_path)
            self.kth_value = float(state.get("kth_value", self.kth_value))
            self.last_model_path = state.get("last_model_path", self.last_model_path)
            if dropped and self.monitor is not None:
                self._rank()  # the k-th and the best among the paths kept
            if "last_global_step_saved" in state:
                self._last_global_step_saved = int(state["last_global_step_saved"])
                self._last_checkpoint_saved = str(state.get("last_checkpoint_saved", ""))
                self._restored_last_saved = True
        elif self._stage in (None, "fit"):  # validate/test/predict rank nothing: no news
            warnings.warn(
                f"ModelCheckpoint: the checkpoint was written with dirpath {saved_dir!r}, this "
                f"listener saves to {self.dirpath!r}; only best_model_path is restored, the "
                "top-k ranking starts afresh",
                stacklevel=2,
            )
        self.best_model_path = state.get("best_model_path", self.best_model_path)

    def __repr__(self) -> str:
        return (
            f"ModelCheckpoint(dirpath={self.dirpath!r}, monitor={self.monitor!r}, "
            f"mode={self.mode!r}, save_top_k={self.save_top_k}, "
            f"best_model_path={self.best_model_path!r})"
        )


def _check_count(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} (got {value!r})")


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _non_empty_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    with os.scandir(path) as entries:  # closed at once (no ResourceWarning)
        return any(e.name != checkpoint.RUN_LOCK for e in entries)


def _on_disk(path: str) -> bool:
    return os.path.isfile(os.path.join(path, checkpoint.META))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _config(run: RunView) -> LoopConfig:
    """The run's resolved flags (Lightning's defaults for a view without them: a test's)."""
    return run.config if run.config is not None else LoopConfig()
