"""Re-execution: :func:`replay` finds the checkpoint to start from, loads the run, and resumes
it to ``to_step`` under the checker (:func:`_run_checked`), on the run's ranks again for a
data-parallel run (:func:`_launch_ranks`, :func:`_replay_rank`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint._pickling import load_skeleton
from engine.replaying._checker import _Checker, _RankZeroChecker
from engine.replaying._journal import _checkpoints, _Lines, _overwritten, _untrusted
from engine.replaying._loading import _load_run, _privacy
from engine.replaying._report import ReplayError, ReplayReport, _Diverged, _WrongStart
from engine.replaying._transitions import _Transitions
from engine.state import TrainState


def replay(
    run_dir: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    *,
    trust_code: bool = False,
    detect_anomaly: bool = False,
    data: Any = None,
) -> ReplayReport:
    """Re-execute steps ``from_step`` to ``to_step`` of a journaled run and compare them with
    its journal.

    Args:
        run_dir: a run directory written by :class:`~engine.listeners.Journal` (each fit writes
            one by default).
        from_step: the first optimizer step to re-execute (default: the one after the earliest
            journaled checkpoint). The replay starts at the newest checkpoint taken before it
            that still holds the state its journal line describes, and re-executes (and checks)
            the steps in between too.
        to_step: the last step to re-execute (default: the run's last journaled step, its end).
        trust_code: allow unpickling the run's task, model structure and data (which runs code
            from the run directory). Required.
        detect_anomaly: run steps ``from_step`` .. ``to_step`` under
            ``torch.autograd.detect_anomaly``; the first anomaly ends the replay and is reported
            with the forward traceback.
        data: the training data (a dataloader or a datamodule) when the run directory has none
            (a data source too large to pickle).

    Returns:
        A :class:`ReplayReport`; ``report.identical`` says whether everything matched, and
        ``str(report)`` says what was replayed and the first difference with both values:
        its step, or the interval of steps it lies in when the journal lacks the per-step
        losses that would pin it (``report.first_divergent_step``, ``report.diverged_after``).

    Raises:
        UntrustedCodeError: without ``trust_code=True``.
        ReplayError: if the directory is not a replayable run, a journal line is malformed or
            lies outside its fit (named by line number), or the steps are out of range.
        engine.checkpoint.CheckpointError: if the checkpoint does not fit the model.
    """
    root = Path(run_dir)
    journal = _Lines(root)
    from_step, to_step = _span(journal, from_step, to_step)
    passed: list[str] = []
    found = _checkpoints(root, journal, from_step, passed, trust_code)
    first = next(found, None)
    if first is None and passed:
        raise _no_start(root, from_step, passed)
    if first is None:
        listed = sorted({x["step"] for x in journal.lines if isinstance(x.get("checkpoint"), str)})
        listed = [s for s in listed if s < from_step]
        raise ReplayError(
            f"{root}: no loadable checkpoint taken before step {from_step} (journaled checkpoint "
            f"steps before it: {listed or 'none'}); replay from a later step, or keep more "
            "checkpoints (ModelCheckpoint(save_top_k=-1, every_n_train_steps=...))"
        )
    if not trust_code:
        raise _untrusted(root)
    given = data
    task, model, data, flags, rebuilt, threads = _load_run(root, data)
    world = flags["devices"] if flags.get("strategy") in ("ddp", "fsdp") else 1
    if world > 1 and detect_anomaly:
        raise ReplayError(
            f"{root}: the run had {world} data-parallel ranks; replay re-executes it on "
            f"{world} ranks, where an anomaly raised on one rank would leave the others waiting "
            "in the step's collective: detect_anomaly=True is not available for it. Replay "
            "without it to find the first step that differs or is not finite"
        )
    for ckpt, start_line in itertools.chain([first], found):
        if world > 1:  # the run's ranks again, each process started here
            index = next(i for i, x in enumerate(journal.lines) if x is start_line)
            got = _launch_ranks(world, root, ckpt, index, from_step, to_step, given)
            if "wrong_start" in got:
                _pass_over(passed, ckpt, journal, start_line, got["wrong_start"])
                continue
            return ReplayReport(
                run_dir=str(root),
                checkpoint=str(ckpt),
                start_step=int(start_line["step"]),
                from_step=from_step,
                to_step=to_step,
                data_rebuilt=rebuilt,
                **got,
            )
        transitions = _Transitions(root, journal, start_line)
        kept = [x for x in journal.lines if id(x) not in transitions.deferred]
        checker = _Checker(journal, kept, start_line, to_step, (from_step, to_step))
        checker.transitions = transitions
        checker.blocks, run_to = _recorded_blocks(journal, start_line, to_step, flags)
        template = load_skeleton(model, task.tx)
        try:
            with _thread_count(threads):
                outcome = _run_checked(
                    task,
                    template,
                    data,
                    ckpt,
                    flags,
                    [checker, transitions],
                    run_to,
                    detect_anomaly,
                )
        except _WrongStart as e:
            _pass_over(passed, ckpt, journal, start_line, str(e))
            continue
        return ReplayReport(
            run_dir=str(root),
            checkpoint=str(ckpt),
            start_step=int(start_line["step"]),
            from_step=from_step,
            to_step=to_step,
            steps=checker.steps,
            compared=checker.compared,
            first_nonfinite_step=checker.first_nonfinite,
            first_nonfinite_loss=checker.first_nonfinite_loss,
            losses=dict(checker.losses),
            data_rebuilt=rebuilt,
            **outcome,
        )
    raise _no_start(root, from_step, passed)


def _pass_over(passed: list[str], ckpt: Path, journal: Any, start_line: Any, why: str) -> None:
    """Record (and warn) that ``ckpt`` is not the state its journal line names (``why``): the
    replay tries an older checkpoint."""
    where = f"journaled at step {start_line['step']} (line {journal.number(start_line)})"
    passed.append(f"{ckpt}, {where}: {why}")
    warnings.warn(_overwritten(ckpt, where, why), stacklevel=3)


def _launch_ranks(
    world: int,
    root: Path,
    ckpt: Path,
    start_index: int,
    from_step: int,
    to_step: int,
    data: Any,
) -> dict[str, Any]:
    """Replay from ``ckpt`` (the checkpoint of journal line ``start_index``) on ``world`` new
    processes, ranks of one gloo process group (:class:`~engine.parallel.launch.SpawnLauncher`),
    each of which loads the run from ``root`` itself; rank 0's findings, as the report's
    fields (or ``{"wrong_start": why}``)."""
    from engine.parallel.launch import SpawnLauncher

    launcher = SpawnLauncher(world, start_method="spawn")
    got = launcher.launch(_replay_rank, str(root), str(ckpt), start_index, from_step, to_step, data)
    assert isinstance(got, dict)
    return got


def _replay_rank(
    root_dir: str, ckpt: str, start_index: int, from_step: int, to_step: int, data: Any
) -> dict[str, Any] | None:
    """One rank of a data-parallel replay (see :func:`_launch_ranks`): the run loaded from its
    directory (the caller was told to trust its code), the fit resumed from ``ckpt`` on every
    rank, checked against the journal on rank 0 (:class:`_RankZeroChecker`); rank 0 returns
    what it found, the others ``None``."""
    root = Path(root_dir)
    journal = _Lines(root)
    start_line = journal.lines[start_index]
    task, model, data, flags, _, threads = _load_run(root, data)
    transitions = _Transitions(root, journal, start_line)
    kept = [x for x in journal.lines if id(x) not in transitions.deferred]
    rank = int(os.environ.get("RANK", "0"))
    sharded = flags.get("strategy") == "fsdp"
    checker = _RankZeroChecker(
        journal, kept, start_line, to_step, (from_step, to_step), sharded=sharded, rank=rank
    )
    checker.transitions = transitions
    checker.blocks, run_to = _recorded_blocks(journal, start_line, to_step, flags)
    template = load_skeleton(model, task.tx)
    listeners = [checker, transitions]
    try:
        with _thread_count(threads):
            outcome = _run_checked(
                task, template, data, Path(ckpt), flags, listeners, run_to, False
            )
    except _WrongStart as e:
        return {"wrong_start": str(e)}
    if rank:
        return None
    return {
        "steps": checker.steps,
        "compared": checker.compared,
        "first_nonfinite_step": checker.first_nonfinite,
        "first_nonfinite_loss": checker.first_nonfinite_loss,
        "losses": dict(checker.losses),
        **outcome,
    }


@contextlib.contextmanager
def _thread_count(threads: int | None) -> Iterator[None]:
    """This thread computes with ``threads`` threads (ATen's count is per calling thread), its
    own count back after; ``None`` (a run that did not record it) keeps the count as it is."""
    kept = torch.get_num_threads()
    if threads is None or threads == kept:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(kept)


def _recorded_blocks(
    journal: _Lines, start_line: dict[str, Any], to_step: int, flags: dict[str, Any]
) -> tuple[dict[int, int] | None, int]:
    """For a run compiled with ``steps_per_call`` (``flags`` has it, see ``_loading._flags``):
    the blocks its journal names (the step before each -> its steps), which the replay runs as
    blocks again, and the step to run to: ``to_step``, or the end of the block holding it (a
    block is one graph: cut short, it would not compute what it did). Else ``(None, to_step)``.
    """
    per_call = flags.get("steps_per_call", 1)
    if per_call == 1:
        return None, to_step
    index = next(i for i, x in enumerate(journal.lines) if x is start_line)
    fits = [i for i, x in enumerate(journal.lines) if x.get("start")]
    first = max((i for i in fits if i <= index), default=index)
    blocks: dict[int, int] = {}
    for line in journal.lines[first:]:
        if line.get("start") and line["step"] < to_step and not line.get("records_blocks"):
            raise ReplayError(
                f"{journal.path}: line {journal.number(line)}: the run was compiled with "
                f"steps_per_call={per_call}, and this fit's journal does not name its blocks "
                "(written before journals recorded them): each block was one graph, which "
                "single steps match only within compile's tolerance, so the replay cannot make "
                "the run's calls again. Replay a run journaled by this version"
            )
        for item in line.get("blocks", ()):
            ok = isinstance(item, list) and len(item) == 2
            ok = ok and all(type(v) is int and v >= 1 for v in item)
            if not ok:
                raise ReplayError(
                    f"{journal.path}: line {journal.number(line)}: blocks entry {item!r} is not "
                    "[first step, steps]"
                )
            blocks[item[0] - 1] = item[1]
    ends = [b + n for b, n in blocks.items() if b < to_step < b + n]
    return blocks, max(ends, default=to_step)


def _no_start(root: Path, from_step: int, passed: list[str]) -> ReplayError:
    return ReplayError(
        f"{root}: no journaled checkpoint before step {from_step} holds the state its journal "
        f"line describes ({'; '.join(passed)}); they were overwritten or replaced since the run"
    )


def _span(journal: _Lines, from_step: int | None, to_step: int | None) -> tuple[int, int]:
    """The steps to re-execute: checked, with the defaults filled in."""
    last = journal.last
    checkpointed = [x["step"] for x in journal.lines if isinstance(x.get("checkpoint"), str)]
    if from_step is None:
        from_step = (min(checkpointed) if checkpointed else 0) + 1
    if to_step is None:
        to_step = last
    for name, value in (("from_step", from_step), ("to_step", to_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReplayError(f"{name}={value!r}: pass a step number >= 1")
    if to_step < from_step:
        raise ReplayError(f"to_step={to_step} is before from_step={from_step}")
    if to_step > last:
        raise ReplayError(
            f"to_step={to_step} is past the journal's last step ({last}, where the run ended); "
            "nothing to compare"
        )
    return from_step, to_step


def _run_checked(
    task: Any,
    template: TrainState,
    data: Any,
    ckpt: Path,
    flags: dict[str, Any],
    listeners: list[Any],
    to_step: int,
    detect_anomaly: bool,
) -> dict[str, Any]:
    """Resume from ``ckpt`` to ``to_step`` with ``checker`` listening; returns the report's
    ``divergence`` (with ``diverged_after`` and ``first_divergent_step``), ``anomaly`` and
    ``anomaly_step``."""
    from engine.trainer import Trainer
    from engine.transforms import DetectAnomaly

    checker = listeners[0]
    checker.detect_anomaly = detect_anomaly
    # the Trainer's own detect_anomaly transform, on for the steps asked for
    plugins: list[Any] = [DetectAnomaly(active=checker.in_span)] if detect_anomaly else []
    private = _privacy(ckpt)  # a DP-SGD run's numbers are state: its checkpoint has them
    if private is not None:
        plugins.append(private)
    outcome: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="engine-replay-") as scratch:
        trainer = Trainer(
            max_steps=to_step,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_journal=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,  # validation cannot change the state
            callbacks=listeners,
            default_root_dir=scratch,
            plugins=plugins or None,
            **flags,
        )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(task, template, data, ckpt_path=str(ckpt))
            failure = getattr(checker, "failure", None)  # a data-parallel replay's, kept
            if failure is not None:
                raise failure
        except _Diverged as e:  # matched at its own step (an edited loss): pinned, not (n, n]
            outcome["divergence"] = e.divergence
            after = e.after if e.after is None else min(e.after, e.divergence.step - 1)
            outcome["diverged_after"], outcome["losses_matched"] = after, e.losses_matched
            if after is not None and after == e.divergence.step - 1:
                outcome["first_divergent_step"] = e.divergence.step
        except (_WrongStart, ReplayError):
            raise
        except RuntimeError as e:
            if not checker.in_span():
                raise
            forward = [str(w.message) for w in caught if "forward call" in str(w.message)]
            outcome["anomaly"] = "\n".join([f"{type(e).__name__}: {e}", *forward])
            outcome["anomaly_step"] = checker.current
        for w in caught:  # pass on what the replay warned about
            if "forward call" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return outcome
