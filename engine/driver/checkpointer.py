"""The Trainer's checkpointing: save, resolve and restore checkpoints; carry out the listeners'
:class:`~engine.events.Save` requests; stop cleanly on signals.

Two objects the Trainer holds, neither of which reads the Trainer: a :class:`Checkpointer`
(made with the listeners, the loggers and the root directory, which a Trainer never replaces)
is handed everything else it needs on each call, the run's position as a :class:`RunRecord`
(the last ``state`` / ``progress`` the fit loop, :mod:`engine.loop.fit`, handed the Trainer,
the stage, the config and the metrics) and the Trainer's own steps (announcing a save, saving)
as functions; a :class:`~engine.driver._signals.SignalCatcher` (its own module) keeps the
signal received during a fit.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from engine import checkpoint
from engine.checkpoint import _opt_fit
from engine.driver import _best
from engine.events import Save
from engine.metrics import MetricReducer
from engine.parallel import elastic
from engine.parallel.positions import gather_to_rank_zero
from engine.plan.config import LoopConfig
from engine.plan.progress import Progress
from engine.state import TrainState

__all__: list[str] = []

_METRICS = ("callback_metrics", "logged_metrics", "progress_bar_metrics")


class RunRecord(NamedTuple):
    """What a checkpoint holds of the run besides the listeners: the state and the loop's
    progress, the stage, the flags, the metrics the listeners have seen so far and the task's
    hyperparameters."""

    state: TrainState
    progress: Progress
    stage: str | None
    config: LoopConfig
    callback_metrics: Mapping[str, float]
    logged_metrics: Mapping[str, float]
    progress_bar_metrics: Mapping[str, float]
    # the task's hyperparameters (Task(hparams=...)), recorded as meta.json's extra["hparams"]
    hparams: Mapping[str, Any] | None = None
    # the datamodule's state_dict(), recorded as extra["datamodule"] (JSON values)
    datamodule: Mapping[str, Any] | None = None
    # the run's world size (data-parallel ranks), recorded as extra["trainer"]["world_size"]
    world_size: int = 1
    # the training data's position unit: samples per rank per batch (batches, for a loader
    # with its own batch sampler; None when unknown), extra["trainer"]["position_unit"]
    position_unit: int | None = None
    # the fit's training order (Run.train_order), extra["trainer"]["train_order"]
    train_order: str | None = None
    # inside an accumulation window on several ranks: the partial gradient sums of ranks
    # 1.. (rank 0's is the state's), gathered to rank 0 by Checkpointer.save
    rank_grad_accum: Sequence[Mapping[str, Any]] = ()


class Restored(NamedTuple):
    """What a fit continues from, read from a checkpoint (:meth:`Checkpointer.restore_run`)."""

    progress: Progress
    metrics: dict[str, dict[str, float]]  # by name: callback_metrics, logged_metrics, ...


class Checkpointer:
    """Checkpoint writing, resolution and restoring for a Trainer's listeners, loggers and
    root directory; the asynchronous saves that replace older checkpoints, until they land."""

    def __init__(
        self,
        listeners: Sequence[Any],
        loggers: Sequence[Any],
        root: str,
        io: checkpoint.CheckpointIO | None = None,
    ) -> None:
        self.listeners, self.loggers, self.root = listeners, loggers, root
        self.io = io or checkpoint.CheckpointIO()
        # asynchronous saves requested by listeners, until they have landed (see reap)
        self.in_flight: list[_InFlight] = []
        #: whether this process writes (and deletes) checkpoints: every rank of a
        #: data-parallel run holds the same state, and rank 0 alone writes it
        self.writes = True
        #: this process's data-parallel rank and the world size (set by the Trainer per run):
        #: a save inside an accumulation window gathers every rank's partial gradient sum
        self.rank, self.world_size = 0, 1
        # set while a save is carried out for a listener that runs on rank 0 alone (the
        # journal): no other rank is there to join a collective
        self._rank_zero_alone = False
        #: the run's optimizer (set by the Trainer per run): named in meta.json, and in the
        #: refusal of a checkpoint whose optimizer state it cannot continue
        self.optimizer: Any = None

    def keyed_listeners(self, *, stateful_only: bool = True) -> list[tuple[str, Any]]:
        """The listeners by key: ``state_key`` or the class name, ``#n`` for the n-th of a key."""
        keyed: list[tuple[str, Any]] = []
        seen: dict[str, int] = {}
        for listener in self.listeners:
            if stateful_only and not callable(getattr(listener, "state_dict", None)):
                continue
            key = getattr(listener, "state_key", None) or type(listener).__qualname__
            seen[key] = seen.get(key, 0) + 1
            keyed.append((key if seen[key] == 1 else f"{key}#{seen[key]}", listener))
        return keyed

    def keyed_loggers(self) -> list[tuple[str, Any]]:
        """The loggers that keep a state, by class name, ``#n`` for the n-th of a name."""
        keyed: list[tuple[str, Any]] = []
        seen: dict[str, int] = {}
        for lg in self.loggers:
            if not callable(getattr(lg, "state_dict", None)):
                continue
            key = type(lg).__qualname__
            seen[key] = seen.get(key, 0) + 1
            keyed.append((key if seen[key] == 1 else f"{key}#{seen[key]}", lg))
        return keyed

    def _logger_states(self) -> dict[str, Any]:
        states = {}
        for key, lg in self.keyed_loggers():
            state = lg.state_dict()
            if state:
                states[key] = state
        return states

    def save(
        self,
        filepath: str | os.PathLike[str],
        announce: Callable[[str, _Landing | None], None],
        record: Callable[[], RunRecord],
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """``Trainer.save_checkpoint``'s work: ``announce(path, future)`` (the
        ``on_save_checkpoint`` event) first, since a listener's state must be in the checkpoint,
        then the write of the run as ``record()`` then says it is. For an asynchronous save
        listeners get a future that the write's future completes, whatever happens meanwhile."""
        landed = _Landing() if asynchronous else None
        chained = False
        try:
            announce(os.fspath(filepath), landed)
            run = record()
            if not weights_only:
                run = self._with_rank_sums(run)
            out = self.write(
                filepath,
                run,
                metrics=metrics,
                asynchronous=asynchronous,
                weights_only=weights_only,
            )
            if landed is not None:
                out.add_done_callback(partial(_complete, landed))
            chained = True
        except BaseException as e:
            if landed is not None and not chained and not landed.done():
                landed.set_exception(e)
            raise
        return out

    def _with_rank_sums(self, run: RunRecord) -> RunRecord:
        """``run`` with every rank's partial gradient sum when it is saved inside an
        accumulation window on several ranks: each rank has summed its own micro-batches, and
        the step's all-reduce comes at the window's end, so a resume needs each rank's own.

        Every rank saves the same checkpoints (a ``ModelCheckpoint`` decides on values every
        rank shares; a signal's save is agreed; ``Trainer.save_checkpoint`` is called on every
        rank, as Lightning's), so every rank joins this gather; a save for a listener that runs
        on rank 0 alone gathers nothing, and its checkpoint holds rank 0's sum only (a resume
        inside that window on several ranks is refused)."""
        state = run.state
        if self.world_size == 1 or state.grad_accum is None or self._rank_zero_alone:
            return run
        if state.sharded:  # its grad_accum: DTensors, saved by every rank
            return run
        return run._replace(rank_grad_accum=gather_to_rank_zero(state.grad_accum))

    def write(
        self,
        filepath: str | os.PathLike[str],
        run: RunRecord,
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """The checkpoint of ``run`` and the listeners' states, written (after its event); on a
        process that does not write (a rank other than 0), the path it would have, unwritten.

        A sharded state (``strategy="fsdp"``) is written by every rank together
        (``checkpoint.save`` is a collective: each rank writes its shards, rank 0 the
        ``meta.json``); a listener that runs on rank 0 alone cannot save one."""
        sharded = run.state.sharded
        if sharded and self._rank_zero_alone:
            raise checkpoint.CheckpointError(
                f"the checkpoint {os.fspath(filepath)} was asked for by a listener that runs on "
                "rank 0 alone (rank_zero_only), but the state is sharded over the ranks "
                "(strategy='fsdp'): every rank must join its save. Save from a listener that "
                "runs on every rank (ModelCheckpoint), or call trainer.save_checkpoint on "
                "every rank"
            )
        if not self.writes and not sharded:
            if asynchronous:
                done: Future[Path] = Future()
                done.set_result(Path(filepath))
                return done
            return Path(filepath)
        listeners = {}
        for key, listener in self.keyed_listeners():
            state = listener.state_dict()
            if state:
                listeners[key] = state
        progress = run.progress
        extra = {
            "listeners": listeners,
            # where each logger's log stands (rows and event files written): a resumed fit
            # continues it, dropping what a run that went on past this checkpoint wrote
            "loggers": self._logger_states() if self.writes else {},
            "trainer": {
                **progress.to_json(),  # the loop's position: total_batch_idx, phase, ...
                "stage": run.stage,
                # what listeners have seen so far
                "callback_metrics": _finite_or_str(run.callback_metrics),
                "logged_metrics": _finite_or_str(run.logged_metrics),
                "progress_bar_metrics": _finite_or_str(run.progress_bar_metrics),
                # breaks ties between checkpoints of one step for ckpt_path="last"
                "saved_at_ns": time.time_ns(),
                # the data position on another world size: state.batch_idx counts each rank's
                # batches, global sample batch_idx * position_unit * world_size
                "world_size": run.world_size,
                "position_unit": run.position_unit,
                # the training order (Run.train_order): kept by a resume on any world size
                "train_order": run.train_order,
            },
            "config": run.config.to_json(),  # the flags the run was made with
            # the epoch's metric reduction so far: logged epoch means survive a resume bitwise
            "train_metrics": None if progress.reducer is None else progress.reducer.state_dict(),
        }
        if run.hparams:  # a value JSON cannot hold is named here, before anything is written
            extra["hparams"] = checkpoint._hparams_doc(run.hparams)
        if run.datamodule:
            extra["datamodule"] = dict(run.datamodule)
        if self.optimizer is not None and _opt_fit.name_of(self.optimizer):
            extra[_opt_fit.EXTRA_KEY] = _opt_fit.name_of(self.optimizer)
        metrics = dict(run.callback_metrics) if metrics is None else metrics
        # other ranks' partial gradient sums, only where there are some: a CheckpointIO of
        # the user's own that takes no such argument still saves a one-process run
        ranks = {"rank_grad_accum": run.rank_grad_accum} if run.rank_grad_accum else {}
        if asynchronous:  # its fingerprint is hashed from the snapshot, off the loop (journal)
            return self.io.save_async(
                run.state,
                filepath,
                metrics=metrics,
                extra=extra,
                fingerprint=True,
                weights_only=weights_only,
                **ranks,
            )
        return self.io.save(
            run.state, filepath, metrics=metrics, extra=extra, weights_only=weights_only, **ranks
        )

    def resolve(self, ckpt_path: str | os.PathLike[str]) -> Path | None:
        """The checkpoint ``ckpt_path`` names: a path, ``"best"`` (of a ``ModelCheckpoint``) or
        ``"last"`` (the newest valid one); ``None`` when ``"last"`` finds none."""
        if ckpt_path not in ("last", "best"):
            return Path(ckpt_path)
        savers = [x for x in self.listeners if _is(x, "ModelCheckpoint")]
        if ckpt_path == "best":
            best = next((x.best_model_path for x in savers if x.best_model_path), None)
            if best:
                return Path(best)
            # ranked nothing in this process (a new one): the run's best, from its checkpoints
            return _best.best_on_disk(_best.search_roots(savers, self.root, self.loggers))
        roots = [Path(x.dirpath) for x in savers if getattr(x, "dirpath", None)]
        roots.append(Path(self.root) / "checkpoints")
        found, unreadable = [], []
        for root in dict.fromkeys(roots):
            try:
                checkpoint.clean_leftovers(root)
                entries = sorted(root.iterdir()) if root.is_dir() else []
            except OSError as e:  # a directory that cannot be listed: passed over, named
                unreadable.append(f"{root} ({e.strerror or e})")
                continue
            for p in entries:
                try:
                    real = os.path.realpath(p)
                    if p.is_symlink() and os.path.dirname(real) != os.path.realpath(root):
                        # a link out of the directory: not one of its checkpoints
                        unreadable.append(f"{p} (a symbolic link to {real}, outside {root})")
                        continue
                    if (p / checkpoint.META).is_file():
                        found.append(p)
                except OSError as e:  # cannot be entered (EACCES)
                    unreadable.append(f"{p} ({e.strerror or e})")
        ranked = []
        for path in found:
            try:
                ranked.append((_best.recency(path), path))
            except (checkpoint.CheckpointError, OSError) as e:  # its step is unknown: unranked
                unreadable.append(f"{path} ({e})")
        newest = [path for _, path in sorted(ranked, key=lambda x: x[0], reverse=True)]
        chosen = None
        for path in newest:
            try:
                checkpoint.verify(path)
            except (checkpoint.CheckpointError, OSError) as e:  # damaged, or unreadable
                unreadable.append(f"{path} ({e})")
                continue
            chosen = path
            break
        if unreadable:
            warnings.warn(
                'ckpt_path="last": passing over each checkpoint that cannot be read or fails '
                "verification: "
                + "; ".join(unreadable)
                + (f"; resuming from the newest valid checkpoint, {chosen}" if chosen else ""),
                stacklevel=3,
            )
        if chosen is None:
            searched = ", ".join(str(r) for r in dict.fromkeys(roots))
            restart = elastic.attempt() or 0  # the attempt every node agreed on
            again = (
                f"THIS IS RESTART {restart} OF TORCHRUN'S RUN "
                f"{elastic.run_id()!r} AND IT STARTS FROM STEP 0: "
                if restart > 0
                else ""
            )
            warnings.warn(
                f'{again}ckpt_path="last": no valid checkpoint found in {searched} (the '
                "directories of the ModelCheckpoint listeners and <default_root_dir>/"
                "checkpoints); training starts from the given state",
                stacklevel=3,
            )
        return chosen

    def load(
        self, path: Path, template: TrainState, *, stage: str | None, asked: Any
    ) -> TrainState:
        """The state in the checkpoint at ``path`` (``asked``: the ``ckpt_path`` given), with
        ``template``'s structure; a fit refuses a weights-only one, and any stage an optimizer
        state that does not fit (:mod:`engine.checkpoint._opt_fit`, naming the run's optimizer)."""
        with _opt_fit.loading(path, self.optimizer, stage=stage, asked=asked):
            return self._load(path, template, stage=stage, asked=asked)

    def _load(
        self, path: Path, template: TrainState, *, stage: str | None, asked: Any
    ) -> TrainState:
        if path.is_file():  # engine's checkpoints are directories
            raise checkpoint.CheckpointError(
                f"{stage}(ckpt_path={str(asked)!r}): {path} is a file, not an engine checkpoint "
                "(a directory). A Lightning .ckpt gives its weights to a new fit: state = "
                "checkpoint.from_lightning(path, task.init(model)), then trainer.fit(task, "
                "state, ...); a plain state_dict file: model.load_state_dict(torch.load(path, "
                "weights_only=True)) before task.init(model)"
            )
        if stage == "fit" and checkpoint.read_meta(path).get("weights_only"):
            raise ValueError(
                f"fit(ckpt_path={str(asked)!r}): {path} holds only the model's weights (saved "
                "with weights_only=True / ModelCheckpoint(save_weights_only=True)), not the "
                "optimizer state a fit continues from. Resume from a full checkpoint, or load "
                "the weights into the state you start from (checkpoint.load(path, state))"
            )
        if stage == "fit" and self.rank:  # its own partial gradient sum, inside a window
            return self.io.load(path, template, rank=self.rank)
        return self.io.load(path, template)

    def restore_run(
        self,
        path: Path,
        *,
        stage: str | None,
        progress: Progress,
        new_reducer: Callable[[], MetricReducer] | None,
    ) -> Restored | None:
        """The listeners' states, loaded from the checkpoint at ``path``; and, for a fit, the
        progress it continues from (``progress``'s batch counts kept, the epoch's metric
        reduction rebuilt in ``new_reducer()``) and the metrics its listeners had seen. Raises
        ``CheckpointError`` when the run's state in ``extra`` cannot be restored."""
        meta = checkpoint.read_meta(path)
        try:
            return self._restore_run(meta, stage, progress, new_reducer)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            # meta.json verified, so written like this: by hand, or by another engine
            raise checkpoint.CheckpointError(
                f"{path / checkpoint.META}: the run's state in 'extra' cannot be restored "
                f"({type(e).__name__}: {e}); was the file edited, or written by another engine?"
            ) from e

    def _restore_run(
        self,
        meta: dict[str, Any],
        stage: str | None,
        now: Progress,
        new_reducer: Callable[[], MetricReducer] | None,
    ) -> Restored | None:
        saved = meta.get("extra", {}).get("listeners", {})
        for key, listener in self.keyed_listeners():
            if key in saved and callable(getattr(listener, "load_state_dict", None)):
                listener.load_state_dict(saved[key])
        extra = meta.get("extra", {})
        saved_loop = extra.get("trainer", {})
        restored = Progress.from_checkpoint(saved_loop)
        if stage != "fit":  # nothing continues: only the checks above matter
            return None
        logs = extra.get("loggers") or {}
        for key, lg in self.keyed_loggers() if self.writes else ():  # rank 0 logs
            if key in logs and callable(getattr(lg, "load_state_dict", None)):
                lg.load_state_dict(logs[key])
        # the run continues: what its listeners had seen, they see
        metrics = {
            name: {k: float(v) for k, v in saved_loop[name].items()}
            for name in _METRICS
            if name in saved_loop
        }
        reducer = now.reducer
        if extra.get("train_metrics") and new_reducer is not None:
            reducer = new_reducer()
            reducer.load_state_dict(extra["train_metrics"])
        progress = restored._replace(
            num_training_batches=now.num_training_batches,
            val_check_batch=now.val_check_batch,
            reducer=reducer,
        )
        return Restored(progress, metrics)

    # ------------------------------------------------------------------ requested saves

    def save_requested(self, listener: Any, request: Save, save: Callable[..., Any]) -> None:
        """Carry out a listener's :class:`~engine.events.Save` with ``save`` (the Trainer's
        ``save_checkpoint``): write it, tell the loggers when a ``ModelCheckpoint`` asked
        (Lightning's ``after_save_checkpoint``), and delete what it replaces once it is on disk
        (an asynchronous one: once it has landed, see :meth:`reap`).

        The listener hears how the save ended (``checkpoint_settled(path, error)``, where it
        has that method): a ``ModelCheckpoint`` takes a checkpoint that was not written out of
        its ranking. A synchronous save that fails raises here, a ``CheckpointError``."""
        self._rank_zero_alone = bool(getattr(listener, "rank_zero_only", False))
        try:
            out = save(
                request.path, asynchronous=request.asynchronous, weights_only=request.weights_only
            )
        except BaseException as e:
            _settle(listener, request.path, e)
            raise
        finally:
            self._rank_zero_alone = False
        if not request.asynchronous:
            _settle(listener, request.path, None)
        if _is(listener, "ModelCheckpoint"):
            for logger in self.loggers:
                if callable(getattr(logger, "after_save_checkpoint", None)):
                    logger.after_save_checkpoint(listener)
        saved = os.path.abspath(request.path)
        doomed = tuple(p for p in request.replaces if os.path.abspath(p) != saved and self.writes)
        if request.asynchronous:
            self.in_flight.append(_InFlight(out, os.fspath(request.path), doomed, listener))
        else:
            for path in doomed:
                self.io.remove(path)

    def reap(self, *, wait: bool, report: bool = True) -> None:
        """Settle the asynchronous saves that have ended (all of them, waiting, with ``wait``),
        in the order they were asked for: delete what a landed one replaces; a save that failed
        leaves what it would have replaced, and its listener hears of it.

        A failed save raises ``CheckpointError`` naming its path and the cause, once every save
        still in flight has ended too (the fit stops there: the caller is the driver's check
        after each event, and the end of the run). With ``report=False`` (an exception is
        already on its way out) it warns instead.
        """
        failed: list[tuple[_InFlight, BaseException]] = []
        while self.in_flight:
            pending = self.in_flight[0]
            if not wait and not failed and not pending.future.done():
                return
            self.in_flight.pop(0)
            try:
                pending.future.result()
                error: BaseException | None = None
            except CancelledError as e:  # never ran: not a failure of the disk
                error = e
            except BaseException as e:
                error = e
                failed.append((pending, e))
            _settle(pending.listener, pending.path, error)
            if error is None:
                for path in pending.doomed:
                    self.io.remove(path)
        if not failed:
            return
        pending, first = failed[0]
        more = (
            f" ({len(failed) - 1} later asynchronous saves failed too: "
            + ", ".join(p.path for p, _ in failed[1:])
            + ")"
            if len(failed) > 1
            else ""
        )
        message = (
            f"the asynchronous save of checkpoint {pending.path} (asked for by "
            f"{type(pending.listener).__name__}) failed in the background: {first}{more}"
        )
        if any(_is(p.listener, "ModelCheckpoint") for p, _ in failed):
            message += (
                ". ModelCheckpoint's best_model_path, last_model_path and best_k_models name "
                "only the checkpoints that were written"
            )
        if not report:
            warnings.warn(message, stacklevel=2)
            return
        raise checkpoint.CheckpointError(message) from first

    def reap_at_exit(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        """:meth:`reap` as a run's exit callback (``ExitStack.push``): waits, and raises only
        when no other exception is leaving the run."""
        self.reap(wait=True, report=exc_type is None)
        return False


class _InFlight(NamedTuple):
    """An asynchronous save a listener asked for, until :meth:`Checkpointer.reap` settles it."""

    future: Future[Any]
    path: str
    doomed: tuple[str, ...]  # the checkpoints it replaces: deleted once it has landed
    listener: Any


def _settle(listener: Any, path: Any, error: BaseException | None) -> None:
    """Tell ``listener`` how the save of ``path`` it asked for ended."""
    settled = getattr(listener, "checkpoint_settled", None)
    if callable(settled):
        settled(os.fspath(path), error)


class _Landing(Future):
    """``EventRecord.checkpoint_future`` of an asynchronous save: the checkpoint's path once it
    is on disk. ``fingerprint`` is the one its writer recorded, read on the writer thread right
    after the write, before a later save to the same path can replace it."""

    fingerprint: str | None = None


def _complete(landed: _Landing, write: Future[Path]) -> None:
    """Complete ``landed`` as ``write`` completed (a done-callback, on the writer thread)."""
    if landed.done():  # the save was abandoned on the loop's side
        return
    if write.cancelled():
        landed.set_exception(CancelledError(f"the asynchronous save was cancelled: {write}"))
        return
    error = write.exception()
    if error is not None:
        landed.set_exception(error)
        return
    path = write.result()
    with contextlib.suppress(checkpoint.CheckpointError, OSError):
        landed.fingerprint = checkpoint.read_meta(path).get("fingerprint")
    landed.set_result(path)


def _finite_or_str(metrics: Mapping[str, float]) -> dict[str, Any]:
    """Metrics for meta.json: JSON has no NaN or infinity, so those travel as strings."""
    return {k: (v if math.isfinite(v) else repr(float(v))) for k, v in metrics.items()}


def _is(obj: Any, cls_name: str) -> bool:
    return any(c.__name__ == cls_name for c in type(obj).__mro__)
