"""``Journal``: the run directory's record — configuration, code, data, a line per logged step.

A journal is what :func:`engine.replay` checks a re-execution against. The run directory holds:

* ``journal.jsonl``: JSON lines of ``step``, ``epoch``, ``batch_idx``, ``loss`` and ``lr`` every
  ``every_n_steps`` optimizer steps, with ``losses``: the loss of every optimizer step since the
  previous such line (the last one is this step's ``loss``) and, under
  ``Trainer(steps_per_call=K)``, ``blocks``: ``[first_step, steps]`` of each block among them
  that ran as one call (what a replay of a compiled run runs as one call again), the state's
  ``fingerprint`` every
  ``fingerprint_every_n_steps`` steps, and a line (with fingerprint and path) for every
  checkpoint, including the state the fit started from. An asynchronous checkpoint's line is
  written once it is on disk, with the fingerprint its writer hashed from the snapshot (so the
  loop does not wait for the hash), and not at all if the write failed; and a last line,
  ``"end": true``, with the fit's final step, the losses since the previous line and the final
  fingerprint. Each line is written whole (one write; a failed one is cut back and raises
  :class:`JournalWriteError`), and a reader leaves out a last line cut short by a killed fit;
* ``config.json``: the Trainer's resolved flags (``trainer.config.to_json()``),
  ``world_size``, the number of data-parallel ranks the run had, and ``sharded``, whether the
  state was sharded over them (``strategy="fsdp"``): a replay runs that many ranks again, with
  the same kind of strategy; its ``threads`` (``torch.get_num_threads()``) is the count a
  replay computes with (a CPU reduction's bits depend on it). Rank 0 alone writes the run
  directory (its losses, fingerprints and checkpoints are rank 0's); every other rank
  *follows*: it runs the same code with the writes left out, so it joins each collective
  rank 0 makes (a sharded state's fingerprint gathers every shard; its start checkpoint is
  saved by every rank) and asks for the same checkpoints;
* ``task.pkl``, ``model.pkl``, ``data.pkl``: the task's functions, the model's structure (its
  tensors as shapes only) and the training data source, pickled with cloudpickle so the run can be
  re-executed without its script. Loading them runs code, so replay asks for explicit trust;
* ``start-step=N``: a checkpoint of the state the fit started from (a fit that resumes from a
  checkpoint journals that checkpoint instead), which the journal asks the driver for with an
  asynchronous :class:`~engine.events.Save` at ``on_fit_start``; its line is written at once,
  with the fingerprint of the state it holds.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, NoReturn

import torch

from engine import checkpoint
from engine.checkpoint._writable import append_whole, replace_whole
from engine.events import EventRecord, Listener, Save

__all__ = ["Journal", "JournalError", "JournalWriteError"]

JOURNAL, CONFIG, TASK, MODEL, DATA = (
    "journal.jsonl",
    "config.json",
    "task.pkl",
    "model.pkl",
    "data.pkl",
)


class JournalError(ValueError):
    """The journal is damaged: a line (not the last, which an interrupted write may leave
    incomplete) that is not a JSON object."""


class JournalWriteError(OSError):
    """A file of the run directory could not be written (a full disk, say); the journal keeps
    the lines written before, whole."""


class Journal(Listener):
    """Write the run directory: configuration, code, data, the start state and the journal.

    The Trainer adds one to every fit unless ``enable_journal=False`` (or ``barebones`` /
    ``fast_dev_run``).

    Args:
        dirpath: the run directory; default the first logger's ``log_dir``, or a new
            ``<default_root_dir>/lightning_logs/version_N`` when there is no logger.
        every_n_steps: a line every this many optimizer steps (default: the run's
            ``log_every_n_steps``). The loss tensor of every optimizer step is kept until the
            next line, which reads them all to the host at once (one sync a line, none between
            lines) and writes them as its ``losses``: the losses of steps
            ``step - len(losses) + 1`` .. ``step``, in order (all the steps since the previous
            line of this fit; fewer after a resume or a step without a loss).
        fingerprint_every_n_steps: add the state's fingerprint (a hash of every byte of the
            state) every this many steps; ``0`` only at checkpoints.
        replayable: also save what a replay needs: the task, the model's structure, the
            training data (when it pickles to at most ``max_data_bytes``) and a checkpoint of
            the start state (one more copy of the state on disk, written in the background).
        max_data_bytes: the largest pickled data source saved; a larger one (an in-memory
            dataset, say) is left out with a warning, and a replay then takes ``data=``.

    Example:
        >>> import tempfile, torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.listeners import Journal
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1))] * 4
        >>> d = tempfile.mkdtemp()
        >>> trainer = eg.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False,
        ...                      callbacks=[Journal(d, every_n_steps=2)])
        >>> _ = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
        >>> [(line["step"], "checkpoint" in line, "end" in line) for line in Journal.read(d)]
        [(0, True, False), (2, False, False), (4, False, False), (4, False, True)]
        >>> line = Journal.read(d)[-2]
        >>> len(line["losses"]), line["losses"][-1] == line["loss"]  # steps 3 and 4
        (2, True)
    """

    # every rank hears the events: rank 0 writes, the others follow (the same fingerprints, a
    # collective for a sharded state, and the same Save requests), see on_fit_start
    rank_zero_only = False

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        fingerprint_every_n_steps: int = 1000,
        replayable: bool = True,
        max_data_bytes: int = 256 * 2**20,
    ) -> None:
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("fingerprint_every_n_steps", fingerprint_every_n_steps),
            ("max_data_bytes", max_data_bytes),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"Journal({name}={value!r}): pass an int >= 0")
        if not isinstance(replayable, bool):
            raise ValueError(f"Journal(replayable={replayable!r}): pass True or False")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps
        self.fingerprint_every_n_steps = fingerprint_every_n_steps
        self.replayable = replayable
        self.max_data_bytes = max_data_bytes
        self._file: IO[bytes] | None = None
        # whether this fit is journaled here (set at on_fit_start), and whether this process
        # writes (rank 0) or follows (every other rank: the same work, no files)
        self._on = False
        self._writes = True
        self._size = 0  # the journal's length: whole lines only
        self._last: tuple[Any, Any] | None = None  # the last optimizer step's record and loss
        self._last_step = -1
        # the loss tensors of the optimizer steps since the last line, and the step of the last
        self._losses: deque[Any] = deque()
        self._losses_to = -1
        self._blocks: list[tuple[int, int]] = []  # (first step, steps) of the blocks among them
        # lines of asynchronous checkpoints not yet on disk, in the order they were asked for
        self._landing: list[tuple[dict[str, Any], Future[Path]]] = []
        # the start checkpoint this journal asked for (its line is written already), and
        # whether the host copy its snapshot leaves is still to be freed
        self._start: str | None = None
        self._release = False
        self._transitions = 0

    # ------------------------------------------------------------------ events

    def on_fit_start(self, rec: EventRecord) -> Save | None:
        """Write the run directory; ask for a checkpoint of the start state (unless the fit
        resumed from one, which the start line names instead).

        On a rank other than 0 nothing is written: the journal follows rank 0's (its
        directory is rank 0's, which the Trainer hands every rank through :meth:`adopt`)."""
        run = rec.run
        self._writes = run.is_global_zero
        self._on = True
        root = self.dirpath or _run_dir(run.loggers, run.default_root_dir)
        self.dirpath = root
        if self._writes:
            root.mkdir(parents=True, exist_ok=True)
            checkpoint.clean_leftovers(root)  # a start checkpoint a crashed fit was writing
        if self.every_n_steps is None:
            self.every_n_steps = run.config.log_every_n_steps if run.config is not None else 50
        self._losses = deque(maxlen=self.every_n_steps or 1)
        self._losses_to = -1
        self._blocks = []
        self._start, self._release = None, False
        # the state transitions recorded in this run directory (a resumed fit appends)
        self._transitions = len(list(root.glob("transition-*.pkl"))) if self._writes else 0
        if self._writes:
            self._write_run(rec, root)
        if not self.replayable or rec.state is None:
            return None
        start = run.ckpt_path  # a resumed fit starts from that checkpoint
        if start is not None:
            self._put_start(rec, start)
            return None
        # else the state it was given, saved beside the journal; its start line is written
        # when the save is carried out (on_save_checkpoint), after every request of this
        # event: a Transition another listener asked for here is in the checkpoint, and its
        # line comes before the start line, so a replay does not apply it twice
        self._start = str(root / f"start-step={rec.state.step}")
        # a one-off: no later save of this journal reuses the snapshot's host memory, which
        # is freed at the next batch (the driver takes the snapshot after this event)
        self._release = True
        return Save(self._start, asynchronous=True)

    def _put_start(self, rec: EventRecord, start: str) -> None:
        """The fit's start line: the state it starts from (the checkpoint ``start`` holds)."""
        line = self._line(
            rec, loss=None, fingerprint=True, checkpoint=os.path.abspath(start), start=True
        )
        line["every_n_steps"] = self.every_n_steps  # a line at least this often: replay checks
        config = rec.run.config
        if config is not None and config.steps_per_call > 1:
            line["records_blocks"] = True  # the lines name the blocks (a replay runs them again)
        if self._transitions:  # made before the start checkpoint was saved: it holds them
            line["transitions"] = self._transitions
        self._put(line)

    def _write_run(self, rec: EventRecord, root: Path) -> None:
        """Rank 0's files of the run directory: the flags, the open journal and (replayable)
        the pickled task, model structure and data."""
        run = rec.run
        if run.config is not None:
            # the flags, the world size they resolved to (devices x num_nodes, or what a
            # launcher such as torchrun set) and whether the state was sharded over it: a
            # replay runs that many ranks again, with the same kind of strategy
            sharded = rec.state is not None and rec.state.sharded
            flags = {**run.config.to_json(), "world_size": run.world_size, "sharded": sharded}
            text = json.dumps(flags, indent=2, sort_keys=True)
            _write_file(root / CONFIG, text.encode())
        self._file = _open_whole(root / JOURNAL)
        self._size = os.fstat(self._file.fileno()).st_size
        if not self.replayable or rec.state is None:
            return
        from engine.checkpoint._data import dumps_data
        from engine.checkpoint._pickling import dump_skeleton, dumps_code

        self._dump(root / TASK, "the task", lambda: dumps_code(run.task))
        self._dump(root / MODEL, "the model's structure", lambda: dump_skeleton(rec.state))
        source = run.datamodule if run.datamodule is not None else run.train_dataloader
        limit = self.max_data_bytes
        # by reference where it can be made again, else pickled (a datamodule without its
        # trainer): engine.checkpoint._data. What it says (a reference, a large pickle) is
        # warned once data.pkl is written: a warning turned into an error leaves it whole
        notes: list[str] = []
        self._dump(
            root / DATA, "the training data", lambda: dumps_data(source, limit=limit, notes=notes)
        )
        for note in notes:
            warnings.warn(note, UserWarning, stacklevel=2)

    def claim(self, loggers: Sequence[Any], default_root_dir: str) -> str:
        """The run directory this journal will write (on rank 0 of a multi-process fit, before
        ``on_fit_start``): its ``dirpath``, else the first logger's ``log_dir``, else a new
        ``<default_root_dir>/lightning_logs/version_N``, claimed."""
        return os.fspath(self.dirpath or _run_dir(loggers, default_root_dir))

    def adopt(self, dirpath: str) -> None:
        """Take rank 0's run directory (:meth:`claim`): every rank names the same checkpoints."""
        self.dirpath = Path(dirpath)

    def on_train_end(self, rec: EventRecord) -> None:
        """The fit's last line, ``"end": true``: its final step, with the losses of the steps
        since the last line and the final state's fingerprint (unless
        ``fingerprint_every_n_steps=0``). Replay is bounded by it."""
        self._end(rec, fingerprint=bool(self.fingerprint_every_n_steps))

    handles_blocks = True  # a block ends at each line's step (block_ends); every loss is in it
    may_stop = False

    def block_ends(self) -> tuple[int, ...]:
        every = (self.every_n_steps, self.fingerprint_every_n_steps)
        return tuple(n for n in every if n)

    def on_train_batch_end(self, rec: EventRecord) -> None:
        if self._release:
            self._release = False
            checkpoint.release_buffers()
        if self._landing:
            self._write_landed(wait=False)
        state = rec.state
        if not self._on or state is None or state.micro_step or not self.every_n_steps:
            return
        fp_every = self.fingerprint_every_n_steps
        with_fp = bool(fp_every) and state.step % fp_every == 0
        if not self._writes:  # a follower: only the collective of rank 0's line, no host sync
            if state.step % self.every_n_steps == 0 and state.step != self._last_step:
                if with_fp and state.sharded:
                    state.fingerprint()
                self._last_step = state.step
            return
        if rec.block is not None:
            config = rec.run.config
            accumulate = config.accumulate_grad_batches if config is not None else 1
            self._keep_block(state.step, rec.block, accumulate)
        else:
            loss = rec.outputs.get("loss") if rec.outputs else None
            skipped = rec.outputs.get("skipped") if rec.outputs else None
            self._keep(state.step, loss, skipped)
        if state.step % self.every_n_steps or state.step == self._last_step:
            return
        taken = self._take(state.step)
        if taken is not None:  # this step's loss is the last of them: read with them
            losses, skips, blocks = taken
            line = self._line(rec, loss=losses[-1], fingerprint=with_fp, losses=losses)
            if skips:  # optimizer steps a loss scale skipped (an inf/NaN gradient)
                line["skipped"] = skips
            if blocks:
                line["blocks"] = blocks
            self._put(line)
        else:
            self._put(self._line(rec, loss=loss, fingerprint=with_fp))
        self._last_step = state.step

    def _keep(self, step: int, loss: Any, skipped: Any = None) -> None:
        """Keep optimizer step ``step``'s loss and whether it was skipped (tensors: no sync)
        for the next line."""
        if loss is None or step != self._losses_to + 1:
            self._losses.clear()  # the kept losses must be of consecutive steps up to the last
        if loss is None:
            self._losses_to = -1
            return
        detached = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self._losses.append((detached, skipped))
        self._losses_to = step

    def _keep_block(self, step: int, block: Mapping[str, Any], accumulate: int) -> None:
        """Keep the losses of a block of whole windows ending at optimizer step ``step``: each
        step's is its window's last micro-batch's, as :meth:`_keep` keeps after one batch."""
        losses = block.get("loss")
        if losses is None:
            self._keep(step, None)
            return
        stepped = losses[accumulate - 1 :: accumulate]
        skipped = block.get("skipped")
        first = step - len(stepped) + 1
        self._blocks.append((first, len(stepped)))
        for i, loss in enumerate(stepped):
            self._keep(first + i, loss, None if skipped is None else skipped[i])

    def _take(self, step: int) -> tuple[list[float], list[int], list[list[int]]] | None:
        """The kept losses (of the steps up to ``step``) on the host, the steps among them
        that were skipped, read with one sync, and the blocks among them (``[first, steps]``);
        the keeping starts over."""
        ran, self._blocks = self._blocks, []
        if not self._losses or self._losses_to != step:
            self._losses.clear()
            return None
        kept = list(self._losses)
        self._losses.clear()
        first = step - len(kept) + 1
        blocks = [[b, n] for b, n in ran if b >= first and b + n - 1 <= step]
        values = [v for v, _ in kept]
        skips = [(first + i, s) for i, (_, s) in enumerate(kept) if s is not None]
        tensors = [t for t in values if isinstance(t, torch.Tensor)]
        tensors += [s for _, s in skips if isinstance(s, torch.Tensor)]
        host: Iterator[Any] = iter(())
        if tensors:
            # one dtype that holds each value exactly (the losses normally share one)
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
            device = tensors[0].device
            stacked = torch.stack([t.to(device=device, dtype=dtype) for t in tensors])
            host = iter(stacked.tolist())  # the one host sync of a journal line
        losses = [float(next(host)) if isinstance(v, torch.Tensor) else float(v) for v in values]
        skipped = [at for at, s in skips if (next(host) if isinstance(s, torch.Tensor) else s)]
        return losses, skipped, blocks

    def on_state_transition(self, rec: EventRecord) -> None:
        """Record a listener's :class:`~engine.events.Transition`: a line with its position,
        name and the event that asked for it, and its function pickled beside the journal
        (``transition-<k>.pkl``, named in the line), which :func:`engine.replay` applies again."""
        if not self._on or rec.state is None or rec.transition is None:
            return
        assert self.dirpath is not None
        from engine.checkpoint._pickling import dumps_code

        index = self._transitions
        self._transitions += 1
        name = f"transition-{index}.pkl"
        state = rec.state
        line: dict[str, Any] = {
            "step": state.step,
            "epoch": state.epoch,
            "batch_idx": state.batch_idx,
            "transition": rec.transition.name,
            "index": index,
            "cause": rec.cause.value if rec.cause is not None else None,
        }
        if state.micro_step:
            line["micro_step"] = state.micro_step
        if self.replayable and self._writes:
            fn = rec.transition.fn
            what = f"the state transition {rec.transition.name or fn!r}"
            self._dump(self.dirpath / name, what, lambda: dumps_code(fn))
            if (self.dirpath / name).is_file():
                line["function"] = name
        self._put(line)

    def on_save_checkpoint(self, rec: EventRecord) -> None:
        if not self._on or rec.state is None:
            return
        if self._start is not None and rec.checkpoint_path == self._start:
            self._put_start(rec, self._start)  # the state it saves: the event's requests done
            self._start = None
            return
        path = os.path.abspath(rec.checkpoint_path) if rec.checkpoint_path else True
        if rec.checkpoint_future is None:
            line = self._line(rec, loss=None, fingerprint=True, checkpoint=path)
        else:
            line = self._line(rec, loss=None, fingerprint=False, checkpoint=path)
        if self._transitions:  # how many it holds (replay compares it after the last of them)
            line["transitions"] = self._transitions
        if rec.checkpoint_future is None:
            self._put(line)
        elif self._writes:
            self._landing.append((line, rec.checkpoint_future))

    def teardown(self, rec: EventRecord) -> None:
        # not at on_train_end: listeners after this one may still save a checkpoint there
        self._write_landed(wait=True)
        self._close()

    def on_exception(self, rec: EventRecord) -> None:
        if isinstance(rec.exception, JournalWriteError):  # the disk refused: nothing more
            with contextlib.suppress(OSError):
                self._close()
            return
        try:
            # where the fit stopped (no fingerprint: the step that failed may have consumed it)
            self._end(rec, fingerprint=False, error=type(rec.exception).__name__)
            self._write_landed(wait=True)
        except Exception as e:  # the fit's own error is the one to see
            warnings.warn(f"Journal: the fit's last lines were not written ({e})", stacklevel=2)
        finally:
            try:
                self._close()
            except OSError as e:
                warnings.warn(str(e), stacklevel=2)

    def _end(self, rec: EventRecord, *, fingerprint: bool, error: str | None = None) -> None:
        state = rec.state
        if not self._on or state is None:
            return
        if not self._writes:  # a follower: only the collective of rank 0's fingerprint
            if fingerprint and error is None and state.sharded:
                state.fingerprint()
            return
        line: dict[str, Any] = {"step": state.step, "epoch": state.epoch}
        line["batch_idx"], line["end"] = state.batch_idx, True
        if state.micro_step:
            line["micro_step"] = state.micro_step
        taken = self._take(state.step)
        if taken is not None:  # the steps since the last line
            line["losses"], skips, blocks = taken
            if skips:
                line["skipped"] = skips
            if blocks:
                line["blocks"] = blocks
        if error is not None:
            line["error"] = error
        elif fingerprint:
            line["fingerprint"] = state.fingerprint()
        self._put(line)

    # ------------------------------------------------------------------ writing and reading

    def _line(
        self,
        rec: EventRecord,
        *,
        loss: Any,
        fingerprint: bool,
        checkpoint: str | bool = False,
        start: bool = False,
        losses: list[float] | None = None,
    ) -> dict[str, Any]:
        assert rec.state is not None
        state = rec.state
        line: dict[str, Any] = {
            "step": state.step,
            "epoch": state.epoch,
            "batch_idx": state.batch_idx,
        }
        if state.micro_step:
            line["micro_step"] = state.micro_step
        if loss is not None:
            line["loss"] = float(loss)  # a host sync unless read with the line's losses
        lr = getattr(rec.run.task, "lr", None)
        if lr is not None:
            line["lr"] = float(lr(state.step) if callable(lr) else lr)
        if fingerprint and (self._writes or state.sharded):  # a follower joins a gather only
            line["fingerprint"] = state.fingerprint()
        if checkpoint:
            line["checkpoint"] = checkpoint
        if start:
            line["start"] = True
        if losses is not None:
            line["losses"] = losses
        return line

    def _put(self, line: dict[str, Any]) -> None:
        """Append ``line`` whole: one write of the line and its newline; a write that fails
        (a full disk) is cut back to the lines before it and raises :class:`JournalWriteError`.
        A following rank writes nothing."""
        if not self._writes:
            return
        assert self._file is not None and self.dirpath is not None
        data = (json.dumps(line) + "\n").encode()
        try:  # no torn line: a failed write is cut back, the journal ends whole
            append_whole(self._file.fileno(), data, self._size)
        except OSError as e:
            _refuse_write(self.dirpath / JOURNAL, e, f"its line of step {line.get('step')}")
        self._size += len(data)

    def _write_landed(self, *, wait: bool) -> None:
        """Write the lines of the asynchronous checkpoints that are on disk (all of them, once
        they land, with ``wait``), in order, each with the fingerprint its writer recorded."""
        while self._landing and (wait or self._landing[0][1].done()):
            line, future = self._landing.pop(0)
            if future.cancelled() or future.exception() is not None:
                continue  # never landed: no line points at it
            fingerprint = getattr(future, "fingerprint", None)  # the Trainer's, of this save
            if fingerprint is not None:
                line["fingerprint"] = fingerprint
            self._put(line)

    def _close(self) -> None:
        self._on = False
        if self._file is not None:
            file, self._file = self._file, None
            try:
                os.fsync(file.fileno())
            except OSError as e:
                assert self.dirpath is not None
                _refuse_write(self.dirpath / JOURNAL, e, "its last lines (fsync)")
            finally:
                file.close()

    @staticmethod
    def _dump(path: Path, what: str, dumps: Any) -> None:
        from engine.checkpoint._pickling import PayloadTooLarge

        try:
            payload = dumps()
        except PayloadTooLarge as e:  # an in-memory dataset, say: stopped before copied whole
            path.unlink(missing_ok=True)
            warnings.warn(
                f"Journal: {what} pickles to {e}, more than Journal(max_data_bytes=...) allows; "
                "it is not saved and a replay of this run takes it as "
                "engine.replay(..., data=...)",
                stacklevel=2,
            )
            return
        except Exception as e:  # something closing over an unpicklable object
            path.unlink(missing_ok=True)
            warnings.warn(
                f"Journal: {what} could not be pickled ({type(e).__name__}: {e}); replaying this "
                "run needs it passed in (engine.replay(..., data=...) for the data)",
                stacklevel=2,
            )
            return
        _write_file(path, payload)

    @staticmethod
    def read(dirpath: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The journal's lines, in order.

        A last line cut short (a fit killed while writing it, or an engine before whole-line
        writes on a full disk) is an interrupted write: it is left out, with a warning naming
        it. Any other line that is not a JSON object raises :class:`JournalError` naming its
        line number.
        """
        return [line for _, line in Journal.read_numbered(dirpath)]

    @staticmethod
    def read_numbered(dirpath: str | os.PathLike[str]) -> list[tuple[int, Any]]:
        """:meth:`read`, each line with its line number (from 1) in ``journal.jsonl``. A line
        is any JSON value here (a reader checks that each is an object)."""
        path = Path(dirpath) / JOURNAL
        raw = path.read_bytes()
        rows = raw.split(b"\n")
        out: list[tuple[int, Any]] = []
        for number, row in enumerate(rows, 1):
            if not row.strip():
                continue
            try:
                out.append((number, json.loads(row.decode())))
            except ValueError as e:  # not UTF-8, or not JSON
                if number == len(rows):  # no newline after it: a write that was interrupted
                    warnings.warn(
                        f"{path}: line {number}, the last, is incomplete ({len(row)} bytes "
                        "without their newline: a write interrupted by a killed fit or a full "
                        "disk); it is left out",
                        stacklevel=3,
                    )
                    break
                raise JournalError(
                    f"{path}: line {number} is not a JSON object ({e}); the journal is damaged "
                    "(only its last line can be left incomplete, by an interrupted write)"
                ) from None
        return out


def _refuse_write(path: Path, error: OSError, what: str) -> NoReturn:
    """Raise :class:`JournalWriteError` for a failed write of ``what`` to ``path``."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        cause = "the disk is full (no space left on its file system)"
        todo = "free space, then resume the fit from its last checkpoint"
    else:
        cause = f"{error.strerror or error}"
        todo = "make it writable, or pass Trainer(enable_journal=False)"
    raise JournalWriteError(
        error.errno,
        f"Journal: writing {what} to {path} failed: {cause}; the journal holds its lines up to "
        f"the one before, whole. {todo[0].upper()}{todo[1:]}",
    ) from error


def _write_file(path: Path, payload: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file, then renamed)."""
    try:
        replace_whole(path, payload)
    except OSError as e:
        _refuse_write(path, e, f"{len(payload)} bytes")


def _open_whole(path: Path) -> IO[bytes]:
    """Open the journal to append whole lines; an incomplete last line (a killed fit's) is cut
    off first, with a warning, so the lines appended do not follow a torn one."""
    try:
        file = open(path, "a+b", buffering=0)  # noqa: SIM115 - open for the whole fit
        size = os.fstat(file.fileno()).st_size
        if size:
            file.seek(max(0, size - 1))
            if file.read(1) != b"\n":
                file.seek(0)
                raw = file.read()
                end = raw.rfind(b"\n") + 1
                try:
                    json.loads(raw[end:].decode())
                    os.write(file.fileno(), b"\n")  # whole, without its newline
                except ValueError:
                    number = raw.count(b"\n") + 1
                    warnings.warn(
                        f"{path}: line {number}, the last, is incomplete (an interrupted "
                        "write); it is removed before this fit appends",
                        stacklevel=4,
                    )
                    os.ftruncate(file.fileno(), end)
    except OSError as e:
        _refuse_write(path, e, "its first line")
    return file


def _run_dir(loggers: Sequence[Any], default_root_dir: str) -> Path:
    for lg in loggers:
        if getattr(lg, "log_dir", None):
            return Path(lg.log_dir)
    from engine.loggers.base import claim_version, next_version

    # claimed (an atomic mkdir): a second run fitting into the same root at once, without a
    # logger either, takes the next version instead of sharing this journal
    root = Path(default_root_dir) / "lightning_logs"
    return root / f"version_{claim_version(root, next_version(root))}"
