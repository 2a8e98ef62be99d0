"""Replay: re-execute a stretch of a journaled run and check it, bitwise, against its journal.

A fit leaves a run directory (see :class:`engine.listeners.Journal`): the journal's lines (loss,
learning rate and state fingerprints at known steps), checkpoints, and the task, the model's
structure and the data pickled with cloudpickle. :func:`replay` loads the newest checkpoint taken
before step ``from_step``, runs the optimizer steps up to ``to_step`` again, and compares every
journaled value on the way: the loss of every step (a journal line's ``losses``), and the loss,
learning rate and fingerprint at the steps of the lines. Steps are numbered as in the journal:
the line ``"step": n`` is written after the ``n``-th optimizer step, so replaying
``from_step=n`` re-executes that step.

A journal that holds every step's loss pins a divergence to its step. One without (written by an
engine before ``losses``) pins it to an interval: the first differing value was seen at a line's
step, and the steps since the last value that matched hold no journaled value
(:attr:`ReplayReport.diverged_after`). A fingerprint that differs after every loss matched is
placed after the last fingerprint that matched, and the report says the losses matched.

Replay believes nothing it has not checked: every journal line is validated (a malformed one is
refused by line number), each fit's lines must lie between its start and end lines, the
checkpoint it starts from must hold the state its journal line describes (step and fingerprint:
a reused name such as ``last`` holds a later state, and an older checkpoint is taken instead),
every journaled value of the replayed steps is compared or reported, and pickled code is read
only from files inside the run directory.

The typical use is a loss that turned NaN: the journal shows roughly where, a replay of that
stretch names the first step with a non-finite loss, and replaying exactly that step with
``detect_anomaly=True`` reports the backward function that produced the NaN and the forward line
that called it (see docs/checkpoints.md).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from engine import checkpoint
from engine.checkpoint._pickling import Rebuild, load_skeleton, loads_code
from engine.events import EventRecord, Listener, Stop, Transition
from engine.listeners.journal import CONFIG, DATA, JOURNAL, MODEL, TASK, Journal, JournalError
from engine.state import TrainState

__all__ = [
    "Divergence",
    "ReplayError",
    "ReplayReport",
    "UntrustedCodeError",
    "replay",
]


# the Trainer flags that decide what the training steps compute (the rest only observe)
_REPLAYED_FLAGS = (
    "limit_train_batches",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "deterministic",
    "inference_mode",
    "reload_dataloaders_every_n_epochs",
    "compile",
    "sync_batchnorm",
    "use_distributed_sampler",
)


class ReplayError(RuntimeError):
    """The run directory cannot be replayed as asked (missing files, steps out of range)."""


class UntrustedCodeError(ReplayError):
    """Replay needs to unpickle the run's code and was not told to trust it."""


@attrs.frozen
class Divergence:
    """The first journaled point where the replay differs.

    Attributes:
        step: the optimizer step (journal numbering).
        epoch: the epoch at that point (the replay's).
        batch_idx: batches consumed in that epoch (the replay's).
        values: for each differing quantity (``"loss"``, ``"lr"``, ``"fingerprint"``, or the
            position, ``"epoch"`` / ``"batch_idx"`` / ``"position"``, of a line the replay never
            reached), the pair ``(journal, replay)``.
        line: the journal's line number holding the differing value.
    """

    step: int
    epoch: int
    batch_idx: int
    values: Mapping[str, tuple[Any, Any]]
    line: int | None = None

    def __str__(self) -> str:
        diffs = "; ".join(
            f"{k}: journal {a!r} != replay {b!r}" for k, (a, b) in self.values.items()
        )
        where = f"epoch {self.epoch}, batch {self.batch_idx}"
        if self.line is not None:
            where += f"; journal line {self.line}"
        return f"step {self.step} ({where}): {diffs}"


@attrs.frozen
class ReplayReport:
    """What a replay did and found.

    Attributes:
        run_dir: the run directory.
        checkpoint: the checkpoint the replay started from.
        start_step: that checkpoint's step.
        from_step: the first step asked for.
        to_step: the last step asked for.
        steps: optimizer steps re-executed (from ``start_step + 1``).
        compared: journaled values compared: every loss (a line's ``loss`` and each of its
            ``losses``), learning rate and fingerprint of the replayed steps, and the start
            checkpoint's fingerprint. With no divergence, that is every such value the journal
            holds for those steps.
        divergence: the first difference, or ``None``. Its ``step`` is where the first differing
            value was seen.
        first_nonfinite_step: the first re-executed step with a NaN or infinite loss, in any of
            its micro-batches.
        first_nonfinite_loss: that loss.
        losses: each re-executed step's loss.
        anomaly: with ``detect_anomaly``, the error anomaly detection raised (and the forward
            traceback it printed), else ``None``.
        anomaly_step: the step that raised it.
        diverged_after: with a divergence, the last step before it at which the differing
            quantities (loss, learning rate or fingerprint) were journaled and matched, or at
            which the state's fingerprint matched (the step the replay started from, at the
            latest): the run first differed in one of the steps ``diverged_after + 1`` ..
            ``divergence.step``. It is ``divergence.step - 1`` for a loss when the journal holds
            every step's loss (losses that match do not show that the state does: a fingerprint
            that differs is placed after the last one that matched). ``None`` without a
            divergence, or for a line the replay never reached.
        first_divergent_step: the step that first differed when the journal pins it
            (``divergence.step`` when ``diverged_after`` is the step before), else ``None``.
        losses_matched: for a divergence in the fingerprint alone, how many of the steps
            ``diverged_after + 1`` .. ``divergence.step`` had a journaled loss, all of which
            matched; else ``None``.
    """

    run_dir: str
    checkpoint: str
    start_step: int
    from_step: int
    to_step: int
    steps: int
    compared: int
    divergence: Divergence | None = None
    first_nonfinite_step: int | None = None
    first_nonfinite_loss: float | None = None
    losses: Mapping[int, float] = attrs.field(factory=dict)
    anomaly: str | None = None
    anomaly_step: int | None = None
    diverged_after: int | None = None
    first_divergent_step: int | None = None
    losses_matched: int | None = None

    @property
    def identical(self) -> bool:
        """Whether every re-executed step matched the journal bitwise."""
        return self.divergence is None and self.anomaly is None

    def __str__(self) -> str:
        head = (
            f"replayed {self.steps} step{'s' * (self.steps != 1)} "
            f"({self.start_step + 1}..{self.start_step + self.steps}) from {self.checkpoint} "
            f"(step {self.start_step})"
        )
        div, after = self.divergence, self.diverged_after
        if self.anomaly is not None:
            out = f"{head}; anomaly detected at step {self.anomaly_step}:\n{self.anomaly}"
        elif div is not None and self.first_divergent_step is None:
            out = f"{head}; first difference seen at {div}"
            if after is not None and self.losses_matched is not None:
                steps = div.step - after
                if self.losses_matched == steps:
                    which = (
                        f"the journaled losses of all {steps} steps {after + 1}..{div.step} matched"
                    )
                else:
                    which = (
                        f"the losses journaled for {self.losses_matched} of the {steps} steps "
                        f"{after + 1}..{div.step} matched (the others have none journaled)"
                    )
                out += (
                    f"\n{which}; the state's fingerprint last matched at step {after}, so the "
                    f"state first differed in steps ({after}, {div.step}], in values the loss "
                    "did not show"
                )
            elif after is not None:
                names = " or ".join(sorted(div.values))
                out += (
                    f"\nthe divergence lies in steps ({after}, {div.step}]: no {names} journaled "
                    "in between to compare (a journal with every step's loss, as engine writes "
                    "now, names the step)"
                )
        elif div is not None:
            out = f"{head}; first divergence at {div}"
        else:
            out = f"{head}: bitwise identical ({self.compared} journaled values compared)"
        if self.first_nonfinite_step is not None:
            loss = self.first_nonfinite_loss
            if loss is None:
                loss = self.losses.get(self.first_nonfinite_step)
            out += f"\nfirst non-finite loss: step {self.first_nonfinite_step} (loss {loss})"
        return out


# --------------------------------------------------------------------------- replay


class _Diverged(Exception):
    def __init__(
        self, divergence: Divergence, after: int | None, losses_matched: int | None = None
    ) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence
        self.after = after
        self.losses_matched = losses_matched

    @classmethod
    def at(
        cls,
        state: TrainState,
        diffs: dict[str, tuple[Any, Any]],
        after: int | None,
        line: int | None = None,
        losses_matched: int | None = None,
    ) -> _Diverged:
        """The replay differs from the journal at ``state``'s position, in ``diffs``."""
        divergence = Divergence(state.step, state.epoch, state.batch_idx, diffs, line=line)
        return cls(divergence, after=after, losses_matched=losses_matched)


class _WrongStart(Exception):
    """The checkpoint the replay started from does not hold its journaled state."""

    def __init__(self, journaled: str, actual: str) -> None:
        super().__init__(f"fingerprint {actual}, journaled {journaled}")


def _key(step: int, epoch: int, batch_idx: int, micro_step: int) -> tuple[int, int, int, int]:
    return step, epoch, batch_idx, micro_step


def _state_key(state: TrainState) -> tuple[int, int, int, int]:
    return _key(state.step, state.epoch, state.batch_idx, state.micro_step)


def _line_key(line: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return _key(line["step"], line["epoch"], line["batch_idx"], line.get("micro_step", 0))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        # bitwise for floats as JSON carries them; NaN equals NaN here
        return bool(a == b) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _in_range(key: tuple[int, int, int, int], start: tuple[int, int, int, int], to: int) -> bool:
    """Whether a fit passes ``key`` after ``start`` and by the end of step ``to`` (positions
    of step ``to`` with a micro-batch index belong to the window of step ``to + 1``)."""
    return start < key and (key[0] < to or (key[0] == to and key[3] == 0))


_COMPARED = ("loss", "lr", "fingerprint")


class _Checker(Listener):
    """Compares the replayed run with the journal as it goes; records losses.

    Each journaled loss of a replayed step (a line's ``losses``) is compared when that step ends;
    each line of a replayed position holding a loss, learning rate or fingerprint when the replay
    passes its position, and a line whose position the replay passed without reaching it is a
    difference too, so no journaled value of the replayed steps goes unchecked.
    """

    def __init__(
        self,
        journal: _Lines,
        lines: list[dict[str, Any]],
        start_line: dict[str, Any],
        to_step: int,
        span: tuple[int, int],
        detect_anomaly: bool = False,
    ) -> None:
        self.journal = journal
        self.start_line = start_line
        start, start_step = _line_key(start_line), int(start_line["step"])
        # each replayed step's journaled losses, with their line numbers
        self.step_losses: dict[int, list[tuple[float, int]]] = {}
        # the lines to compare at their position, by position, in the order a fit passes them
        self.pending: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
        for line in lines:
            if "transition" in line:  # applied again by _Transitions, not compared
                continue
            losses = line.get("losses")
            if isinstance(losses, list):
                first = line["step"] - len(losses) + 1
                for step, value in enumerate(losses, start=first):
                    if start_step < step <= to_step:
                        self.step_losses.setdefault(step, []).append((value, journal.number(line)))
            key = _line_key(line)
            if any(k in line for k in _COMPARED) and _in_range(key, start, to_step):
                self.pending.setdefault(key, []).append(line)
        self.pending = dict(sorted(self.pending.items()))
        self.ends = {_line_key(x) for x in lines if x.get("end")}  # where fits ended
        self.span = span
        self.detect_anomaly = detect_anomaly
        self.compared = 0
        self.steps = 0
        self.current = 0  # the step being executed
        self.losses: dict[int, float] = {}
        self.positions: dict[tuple[int, int], tuple[int, int]] = {}  # (step, micro) -> (e, b)
        self.loss_steps: set[int] = set()  # steps whose journaled loss matched
        self.first_nonfinite: int | None = None
        self.first_nonfinite_loss: float | None = None
        # for each journaled quantity, the last step at which it matched (a state that matches
        # vouches for all: the replay starts from one)
        self.matched = dict.fromkeys(_COMPARED, start_step)
        self.transitions: _Transitions | None = None
        #: a follower compares nothing: it computes the fingerprints a checking rank computes,
        #: at the same points (a sharded state's fingerprint is a collective), see _Follower
        self.follows = False

    def on_train_start(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        journaled = self.start_line.get("fingerprint")
        if journaled is not None:
            actual = _fingerprint(state, journaled)
            if self.follows:
                return
            if actual != journaled:
                raise _WrongStart(journaled, actual)
            self.compared += 1

    def on_train_batch_start(self, rec: EventRecord) -> None:
        assert rec.state is not None
        self.current = rec.state.step + 1
        if not self.follows:
            self._overdue(rec.state, _state_key(rec.state))

    def in_span(self) -> bool:
        """Whether the step being executed is one anomaly detection was asked for."""
        lo, hi = self.span
        return self.detect_anomaly and lo <= self.current <= hi

    def on_train_batch_end(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        due = self._due(state)  # its collective first: nothing before it can raise
        if self.follows:
            return
        loss = rec.outputs.get("loss") if isinstance(rec.outputs, Mapping) else None
        value = float(loss) if loss is not None else None
        self.positions[(state.step, state.micro_step)] = (state.epoch, state.batch_idx)
        if (
            value is not None
            and self.first_nonfinite is None
            and state.micro_step
            and not math.isfinite(value)
        ):  # a micro-batch inside an accumulation window: its step is the one it will end
            self.first_nonfinite, self.first_nonfinite_loss = state.step + 1, value
        if state.micro_step == 0:
            self.steps += 1
            if value is not None:
                self.losses[state.step] = value
                if self.first_nonfinite is None and not math.isfinite(value):
                    self.first_nonfinite, self.first_nonfinite_loss = state.step, value
            for journaled, number in self.step_losses.pop(state.step, ()):
                self.compared += 1
                if value is None or not _same(journaled, value):
                    after = self.matched["loss"]
                    raise _Diverged.at(state, {"loss": (journaled, value)}, after, number)
                self.loss_steps.add(state.step)
                self.matched["loss"] = state.step
        self._compare_at(rec, value if state.micro_step == 0 else None, due)

    def on_train_epoch_start(self, rec: EventRecord) -> None:
        self._compare_at(rec, None)

    def on_train_epoch_end(self, rec: EventRecord) -> None:
        self._compare_at(rec, None)

    def on_train_end(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        self._compare_at(rec, None)
        if self.follows:
            return
        self._overdue(state, None)  # nothing is reached after this
        if self.transitions is not None:
            self.compared += self.transitions.compared
            left = self.transitions.unverified(self.journal, _state_key(state))
            if left is not None:
                line, why = left
                number = self.journal.number(line)
                raise ReplayError(
                    f"{self.journal.path}: line {number} (step {line['step']}) holds the "
                    f"fingerprint of a checkpoint saved after a state transition the replay did "
                    f"not reach ({why})"
                )
        for entries in self.step_losses.values():  # every replayed step ended above
            raise _Diverged.at(
                state, {"loss": (entries[0][0], None)}, self.matched["loss"], entries[0][1]
            )

    def _due(self, state: TrainState) -> tuple[list[dict[str, Any]], str | None]:
        """The lines to compare at the state's position, and the state's fingerprint if one of
        them holds one. Every rank of a sharded run computes it here together (a collective),
        a follower included, before anything in the event can raise: the ranks make the same
        collectives up to the stop they agree on."""
        lines = self.pending.pop(_state_key(state), None) or []
        journaled = next((x["fingerprint"] for x in lines if "fingerprint" in x), None)
        return lines, None if journaled is None else _fingerprint(state, journaled)

    def _compare_at(
        self,
        rec: EventRecord,
        loss: float | None,
        due: tuple[list[dict[str, Any]], str | None] | None = None,
    ) -> None:
        state = rec.state
        assert state is not None
        lines, fingerprint = self._due(state) if due is None else due
        if not lines or self.follows:
            return
        compared: set[str] = set()
        for line in lines:
            diffs: dict[str, tuple[Any, Any]] = {}
            if "loss" in line:
                self.compared += 1
                if loss is None or not _same(line["loss"], loss):
                    diffs["loss"] = (line["loss"], loss)
            if "lr" in line:
                lr = getattr(rec.run.task, "lr", None)
                value = None if lr is None else float(lr(state.step) if callable(lr) else lr)
                self.compared += 1
                if value is None or not _same(line["lr"], value):
                    diffs["lr"] = (line["lr"], value)
            if "fingerprint" in line:
                self.compared += 1
                if line["fingerprint"] != fingerprint:
                    diffs["fingerprint"] = (line["fingerprint"], fingerprint)
            if "loss" in line and "loss" not in diffs:
                self.loss_steps.add(state.step)
            if diffs:
                # each differing quantity first differed after the last step where it matched
                after = min(self.matched[k] for k in diffs)
                matched = None
                if set(diffs) == {"fingerprint"}:  # the losses up to it matched
                    matched = sum(after < s <= state.step for s in self.loss_steps) or None
                raise _Diverged.at(state, diffs, after, self.journal.number(line), matched)
            compared.update(k for k in _COMPARED if k in line)
        if "fingerprint" in compared:  # the state is the journaled one, as at a checkpoint
            compared.update(self.matched)
        for k in compared:
            self.matched[k] = state.step

    def _overdue(self, state: TrainState, now: tuple[int, int, int, int] | None) -> None:
        """A line of a position the replay has passed (all, with ``now=None``) without
        reaching it: its position differs from the replay's."""
        for key, lines in list(self.pending.items()):
            if now is not None and key >= now:
                return
            if now is not None and key in self.ends:
                # a fit's end (and what it saved there) that a later fit continued from
                # mid-epoch: the replay runs on through it (its losses are compared by step)
                del self.pending[key]
                continue
            line = lines[0]
            step, epoch, batch_idx, micro = key
            at = self.positions.get((step, micro))
            diffs: dict[str, tuple[Any, Any]] = {}
            if at is not None:
                if epoch != at[0]:
                    diffs["epoch"] = (epoch, at[0])
                if batch_idx != at[1]:
                    diffs["batch_idx"] = (batch_idx, at[1])
            if not diffs:
                diffs["position"] = ((epoch, batch_idx, micro), None)
            replayed_at = at if at is not None else (state.epoch, state.batch_idx)
            divergence = Divergence(step, *replayed_at, diffs, line=self.journal.number(line))
            raise _Diverged(divergence, after=None)


class _RankZeroChecker(_Checker):
    """The checker of a data-parallel replay (the journal is rank 0's: its losses,
    fingerprints and checkpoints). A difference found does not end the fit by raising, which
    would leave the other ranks waiting in the step's collective: it is kept, and a
    :class:`~engine.events.Stop` returned at the next event the loop agrees stops after
    (a batch's end, an epoch's start or end), so every rank stops after the same batch.

    A replicated run's checker runs on rank 0 alone. A sharded run's runs on every rank
    (``sharded=True``): rank 0 checks, the others follow (:attr:`_Checker.follows`), and so
    does rank 0 once it has found a difference, so that every rank computes each fingerprint,
    a collective, at the same points until the agreed stop."""

    def __init__(self, *args: Any, sharded: bool = False, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failure: BaseException | None = None
        self.rank_zero_only = not sharded
        self.follows = rank != 0

    def _guarded(self, method: Any, rec: EventRecord) -> None:
        if self.failure is None or self.follows:
            try:
                method(self, rec)
            except (_Diverged, _WrongStart, ReplayError) as e:
                self.failure, self.follows = e, True

    def _stop(self, method: Any, rec: EventRecord) -> Stop | None:
        self._guarded(method, rec)
        return None if self.failure is None else Stop("replay: differs from the journal")

    def on_train_start(self, rec: EventRecord) -> None:
        self._guarded(_Checker.on_train_start, rec)  # its stop: at the first agreed event

    def on_train_batch_start(self, rec: EventRecord) -> None:
        self._guarded(_Checker.on_train_batch_start, rec)  # its stop: at the batch's end

    def on_train_batch_end(self, rec: EventRecord) -> Stop | None:  # type: ignore[override]
        return self._stop(_Checker.on_train_batch_end, rec)

    def on_train_epoch_start(self, rec: EventRecord) -> Stop | None:  # type: ignore[override]
        return self._stop(_Checker.on_train_epoch_start, rec)

    def on_train_epoch_end(self, rec: EventRecord) -> Stop | None:  # type: ignore[override]
        return self._stop(_Checker.on_train_epoch_end, rec)

    def on_train_end(self, rec: EventRecord) -> None:
        self._guarded(_Checker.on_train_end, rec)  # nothing to stop: the loop has ended


def _fingerprint(state: TrainState, journaled: Any) -> str:
    """The state's fingerprint in the algorithm of a journaled one (64 hex digits: SHA-256, as
    engine wrote before checkpoint format 3)."""
    return state.fingerprint(
        "sha256" if isinstance(journaled, str) and len(journaled) == 64 else "xxh3_128"
    )


def _checkpoints(
    root: Path, journal: _Lines, from_step: int, passed: list[str], trusted: bool
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The journaled checkpoints taken before step ``from_step`` ran, newest first, each found,
    verified and holding the position (and, where its metadata records one, the fingerprint)
    of the journal line naming it. A checkpoint overwritten since (a reused name such as
    ``last``) is passed over with a warning, and said in ``passed``; the replay checks the
    fingerprint of the one it starts from and falls back to the next if it differs."""
    candidates = [x for x in journal.lines if isinstance(x.get("checkpoint"), str)]
    for line in sorted(candidates, key=_line_key, reverse=True):
        if line["step"] >= from_step:
            continue
        journaled = Path(line["checkpoint"])
        where = f"journaled at step {line['step']} (line {journal.number(line)})"
        # the run directory may have moved since: look for the checkpoint beside the journal too
        places = (journaled, root / journaled.name, root / "checkpoints" / journaled.name)
        for path in dict.fromkeys(places):
            # a path from the journal leads out of the run directory only for a trusted run
            # (its ModelCheckpoint's dirpath may be anywhere): else nothing there is opened
            if not (trusted or Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))):
                continue
            if not (path / checkpoint.META).is_file():
                continue
            try:
                meta = checkpoint.read_meta(path)
                if meta.get("weights_only"):
                    break  # the model alone: no optimizer state to continue from
                # the counters meta.json records (each, where an older format lacks one, the
                # line's own)
                held = tuple(
                    meta.get(name, own)
                    for name, own in zip(
                        ("step", "epoch", "batch_idx", "micro_step"), _line_key(line), strict=True
                    )
                )
                recorded, expected = meta.get("fingerprint"), line.get("fingerprint")
                wrong = None
                if held != _line_key(line):
                    wrong = f"it holds step {held[0]} (epoch {held[1]}, batch {held[2]})"
                elif (
                    recorded
                    and expected
                    and len(recorded) == len(expected)
                    and recorded != expected
                ):
                    wrong = f"fingerprint {recorded}, journaled {expected}"
                if wrong is not None:
                    passed.append(f"{path}, {where}: {wrong}")
                    warnings.warn(_overwritten(path, where, wrong), stacklevel=4)
                    continue
                checkpoint.verify(path)
            except checkpoint.CheckpointError as e:
                warnings.warn(
                    f"replay: checkpoint {path} fails verification ({e}); trying an older one",
                    stacklevel=4,
                )
                break
            yield path, line
            break


def _overwritten(path: Path, where: str, why: str) -> str:
    return (
        f"replay: checkpoint {path}, {where}, does not hold the journaled state ({why}): it was "
        "overwritten since (a reused name such as 'last'); trying an older one"
    )


# --------------------------------------------------------------------------- the journal, checked


class _Lines:
    """The journal's lines, each checked, with their line numbers and the run's recorded end."""

    def __init__(self, root: Path) -> None:
        self.path = root / JOURNAL
        if not self.path.is_file():
            raise ReplayError(
                f"{root} has no {JOURNAL}: not a run directory (a fit writes one unless "
                "Trainer(enable_journal=False))"
            )
        try:
            numbered = Journal.read_numbered(root)
        except JournalError as e:
            raise ReplayError(str(e)) from None
        if not numbered:
            raise ReplayError(f"{self.path} is empty: the run journaled no step; nothing to replay")
        self.lines: list[dict[str, Any]] = []
        self.numbers: dict[int, int] = {}  # id(line) -> its line number
        for number, line in numbered:
            _check_line(self.path, number, line)
            self.lines.append(line)
            self.numbers[id(line)] = number
        self._check_fits()
        self.last = max(x["step"] for x in self.lines)

    def number(self, line: Mapping[str, Any]) -> int:
        return self.numbers[id(line)]

    def _check_fits(self) -> None:
        """Each fit's lines (from its start line to the next) lie within it: not before its
        start, not past its end line, never further from the lines before them than the fit
        wrote lines (``every_n_steps``, in its start line)."""
        start: dict[str, Any] | None = None
        end: dict[str, Any] | None = None
        furthest = 0
        for line in self.lines:
            step = line["step"]
            if line.get("start"):
                start, end, furthest = line, None, step
                continue
            where = f"{self.path}: line {self.number(line)} (step {step})"
            if end is not None and step > end["step"]:
                raise ReplayError(
                    f"{where} is past the end of its fit (step {end['step']}, line "
                    f"{self.number(end)}): the journal was edited; refused"
                )
            if line.get("end") and end is not None:
                raise ReplayError(f"{where}: a second end line for one fit; refused")
            if start is not None:
                every = start.get("every_n_steps")
                if step < start["step"]:
                    raise ReplayError(
                        f"{where} is before its fit's start (step {start['step']}, line "
                        f"{self.number(start)}): the journal was edited; refused"
                    )
                if every and step > furthest + every:
                    raise ReplayError(
                        f"{where} is {step - furthest} steps after the furthest line before it "
                        f"(step {furthest}), and its fit wrote a line every {every} steps: the "
                        "journal was edited; refused"
                    )
            furthest = max(furthest, step)
            if line.get("end"):
                end = line


def _check_line(path: Path, number: int, line: Any) -> None:
    """Refuse, naming its line number, a line that is not what a journal writes."""

    def bad(what: str) -> ReplayError:
        return ReplayError(
            f"{path}: line {number} {what}; the journal is damaged or was edited, and a replay "
            "cannot vouch for values it cannot read"
        )

    if not isinstance(line, dict):
        raise bad(f"is not a JSON object (got {type(line).__name__})")

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def number_(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    for key in ("step", "epoch", "batch_idx"):
        if not integer(line.get(key)):
            raise bad(f"has {key}={line.get(key)!r}: pass an integer >= 0")
    for key in ("micro_step", "transitions", "every_n_steps", "index"):
        if key in line and not integer(line[key]):
            raise bad(f"has {key}={line[key]!r}: pass an integer >= 0")
    for key in ("loss", "lr"):
        if key in line and not number_(line[key]):
            raise bad(f"has {key}={line[key]!r}, not a number")
    if "losses" in line:
        losses = line["losses"]
        if not isinstance(losses, list) or not all(number_(v) for v in losses):
            raise bad(f"has losses={losses!r}, not a list of numbers")
        if len(losses) > line["step"]:
            raise bad(f"has {len(losses)} losses, more than the {line['step']} steps up to it")
    if "skipped" in line and not (
        isinstance(line["skipped"], list) and all(integer(v) for v in line["skipped"])
    ):
        raise bad(f"has skipped={line['skipped']!r}, not a list of steps")
    if "fingerprint" in line:
        fp = line["fingerprint"]
        if not (
            isinstance(fp, str) and len(fp) in (32, 64) and all(c in "0123456789abcdef" for c in fp)
        ):
            raise bad(f"has fingerprint={fp!r}, not 32 or 64 hex digits")
    if "checkpoint" in line and not (
        line["checkpoint"] is True or isinstance(line["checkpoint"], str)
    ):
        raise bad(f"has checkpoint={line['checkpoint']!r}, not a path")
    for key in ("start", "end"):
        if key in line and not isinstance(line[key], bool):
            raise bad(f"has {key}={line[key]!r}, not true or false")
    if "transition" in line:
        for key in ("transition", "cause"):
            if not (line.get(key) is None or isinstance(line[key], str)):
                raise bad(f"has {key}={line[key]!r}, not a name")
        if "function" in line and not isinstance(line["function"], str):
            raise bad(f"has function={line['function']!r}, not a file name")


def _run_file(root: Path, name: Any, what: str) -> Path:
    """``root / name``, refused unless it is a file of the run directory itself: a plain file
    name, not a link out of it (pickled code is read from nowhere else, even when trusted)."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and "\\" not in name
    if not plain or Path(name).name != name:
        raise ReplayError(
            f"{root / JOURNAL}: {what} names {name!r}, not a file name inside the run directory: "
            "refused (replay reads a run's code only from its own directory)"
        )
    path = root / name
    real, inside = path.resolve(), root.resolve()
    if not real.is_relative_to(inside):
        raise ReplayError(
            f"{path} leads to {real}, outside the run directory {inside}: refused, even with "
            "trust_code (replay reads a run's code only from its own directory)"
        )
    return path


def _untrusted(root: Path) -> UntrustedCodeError:
    return UntrustedCodeError(
        f"replaying {root} unpickles {TASK}, {MODEL} and {DATA} (cloudpickle): the task's "
        "functions, the model's class and the data pipeline, which runs code from those files. "
        "Pass trust_code=True (command line: --trust-code) only for a run directory you trust."
    )


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
    task, model, data, flags = _load_run(root, data)
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
                **got,
            )
        transitions = _Transitions(root, journal, start_line)
        kept = [x for x in journal.lines if id(x) not in transitions.deferred]
        checker = _Checker(journal, kept, start_line, to_step, (from_step, to_step))
        checker.transitions = transitions
        template = load_skeleton(model, task.tx)
        try:
            outcome = _run_checked(
                task, template, data, ckpt, flags, [checker, transitions], to_step, detect_anomaly
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
    task, model, data, flags = _load_run(root, data)
    transitions = _Transitions(root, journal, start_line)
    kept = [x for x in journal.lines if id(x) not in transitions.deferred]
    rank = int(os.environ.get("RANK", "0"))
    sharded = flags.get("strategy") == "fsdp"
    checker = _RankZeroChecker(
        journal, kept, start_line, to_step, (from_step, to_step), sharded=sharded, rank=rank
    )
    checker.transitions = transitions
    template = load_skeleton(model, task.tx)
    listeners = [checker, transitions]
    try:
        outcome = _run_checked(task, template, data, Path(ckpt), flags, listeners, to_step, False)
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


def _load_run(root: Path, data: Any) -> tuple[Any, bytes, Any, dict[str, Any]]:
    """Unpickle the task and the data (runs code: trusted runs only) and read the model's
    pickled structure; read the flags that decide what a step computes."""
    for name in (TASK, MODEL):
        if not (root / name).is_file():
            raise ReplayError(
                f"{root / name} is missing: the run was journaled with Journal(replayable=False) "
                "or its task could not be pickled (see the warning of that run)"
            )
    task = loads_code(_run_file(root, TASK, "the task").read_bytes())
    if task.tx is None:
        raise ReplayError(
            f"{root / TASK}: the task has a step_fn and no tx, so the optimizer state's "
            "structure cannot be rebuilt; give Task(step_fn=..., tx=...) to replay its runs"
        )
    model = _run_file(root, MODEL, "the model").read_bytes()
    load_skeleton(model, task.tx)  # fails here, before any step, if it cannot be rebuilt
    if data is None:
        if not (root / DATA).is_file():
            raise ReplayError(
                f"{root / DATA} is missing (the data source did not pickle, or was larger than "
                "Journal(max_data_bytes=...)); pass the training data as replay(..., data=...)"
            )
        data = loads_code(_run_file(root, DATA, "the data").read_bytes())
        if isinstance(data, Rebuild):  # a datamodule recorded as its class and hyperparameters
            data = data()
    config_path = root / CONFIG
    config = (
        json.loads(_run_file(root, CONFIG, "the config").read_text())
        if config_path.is_file()
        else {}
    )
    return task, model, data, _flags(config)


def _privacy(ckpt: Any) -> Any:
    """The DP-SGD transform of a run whose checkpoint holds DP-SGD's numbers
    (``extra["dpsgd"]``), built with them; ``None`` for any other run. ``chunk_size`` (how
    many examples are vectorised at once) is not recorded: replay runs each micro-batch whole."""
    from engine import checkpoint
    from engine.privacy import DPSGD, KEY

    held = (checkpoint.read_meta(ckpt).get("trees") or {}).get("extra", {}).get(KEY)
    if not isinstance(held, dict):
        return None
    names = ("max_grad_norm", "noise_multiplier", "sample_rate", "expected_batch_size")
    try:
        return DPSGD(**{k: held[k] for k in names})
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"{ckpt}: extra['dpsgd'] does not describe a DP-SGD run: {e}") from e


def _flags(config: dict[str, Any]) -> dict[str, Any]:
    """The Trainer flags of the recorded run that decide what its steps compute: those of
    ``_REPLAYED_FLAGS``, its precision and the device it ran on (the one resolved then)."""
    from engine.transforms import PRECISIONS

    flags = {k: config[k] for k in _REPLAYED_FLAGS if k in config}
    precision = config.get("precision")
    if precision is not None:  # absent or None: a run before precisions, in float32
        if precision not in PRECISIONS and precision not in (32, "32"):
            raise ReplayError(
                f"the run's precision was the plugin {precision}, which replay cannot rebuild "
                "from config.json; replay runs with precision flags such as 'bf16-mixed'"
            )
        flags["precision"] = precision
    device = config.get("device")
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        flags["accelerator"] = kind
        flags["devices"] = [int(index)] if index else 1
    world = config.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ReplayError(f"config.json: world_size={world!r} is not a number of ranks (>= 1)")
    if world > 1:  # as many ranks again, here: gloo processes on this machine's CPU
        if flags.get("accelerator", "cpu") != "cpu":
            raise ReplayError(
                f"the run had {world} data-parallel ranks on {device}; replay re-executes a "
                "data-parallel run on CPU processes only (gloo), whose arithmetic is not that "
                "of the accelerator's collectives: replay a CPU run, or a one-device run"
            )
        # the same kind of strategy: a sharded state's arithmetic (gathers, reduce-scatters)
        # is FSDP's, and its checkpoints are shards
        strategy = "fsdp" if config.get("sharded") is True else "ddp"
        flags.update(accelerator="cpu", strategy=strategy, devices=world, num_nodes=1)
    return flags


# the events a replay emits in place of those a transition was asked for in that it does not
# emit (it skips validation): the last event of the same batch, before the next step
_REPLAYED_AT = {
    "on_validation_start": "on_train_batch_end",
    "on_validation_epoch_start": "on_train_batch_end",
    "on_validation_batch_start": "on_train_batch_end",
    "on_validation_batch_end": "on_train_batch_end",
    "on_validation_epoch_end": "on_train_batch_end",
    "on_validation_end": "on_train_batch_end",
}


class _Transitions(Listener):
    """Applies the run's journaled state transitions again, at the positions they were applied.

    Those journaled before the checkpoint the replay starts from are in its state already; those
    after it at the same position (asked for later in the event the checkpoint was saved in, or
    in a later event of that batch) are applied when the replay starts.
    """

    def __init__(self, root: Path, journal: _Lines, start_line: dict[str, Any]) -> None:
        lines = journal.lines
        position = _key(
            start_line["step"],
            start_line["epoch"],
            start_line["batch_idx"],
            start_line.get("micro_step", 0),
        )
        after = next(i for i, x in enumerate(lines) if x is start_line) + 1
        self.compared = 0  # fingerprints compared (of checkpoints saved after a transition)
        self.at_start: list[Transition] = []
        self.pending: dict[tuple[str, tuple[int, int, int, int]], list[Transition]] = {}
        # checkpoints saved right after a transition at their position: their fingerprints are
        # of the state the transition made, compared once it is applied (on_state_transition)
        self.verify: dict[int, list[dict[str, Any]]] = {}  # by id of the Transition
        self.deferred: set[int] = set()  # ids of those lines, which the checker passes over
        by_index: dict[int, tuple[Transition, tuple[int, int, int, int]]] = {}
        for line in lines[after:]:
            if "transition" not in line:
                before = by_index.get(line.get("transitions", 0) - 1)
                if (
                    "checkpoint" in line
                    and "fingerprint" in line
                    and before is not None
                    and before[1] == _line_key(line)
                ):
                    self.verify.setdefault(id(before[0]), []).append(line)
                    self.deferred.add(id(line))
                continue
            if "function" not in line:
                raise ReplayError(
                    f"{root / JOURNAL}: line {journal.number(line)}: the state transition "
                    f"{line['transition']!r} at step {line['step']} was not saved (its function "
                    "did not pickle): this run cannot be replayed past it"
                )
            what = f"line {journal.number(line)}, the state transition {line['transition']!r},"
            pickled = _run_file(root, line["function"], what)
            if not pickled.is_file():
                raise ReplayError(
                    f"{pickled} is missing: the journal's state transition "
                    f"{line['transition']!r} at step {line['step']} cannot be applied again"
                )
            fn = loads_code(pickled.read_bytes())
            request = Transition(fn, name=line["transition"])
            key = _line_key(line)
            if "index" in line:
                by_index[line["index"]] = (request, key)
            if key == position:
                self.at_start.append(request)
                continue
            cause = str(line.get("cause"))
            event = _REPLAYED_AT.get(cause, cause)
            self.pending.setdefault((event, key), []).append(request)

    def on_train_start(self, rec: EventRecord) -> list[Transition]:
        out, self.at_start = self.at_start, []
        return out

    def on_state_transition(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        for line in self.verify.pop(id(rec.transition), ()):
            self.compared += 1
            actual = _fingerprint(state, line["fingerprint"])
            if actual != line["fingerprint"]:
                diffs = {"fingerprint": (line["fingerprint"], actual)}
                raise _Diverged.at(state, diffs, after=None)

    def unverified(
        self, journal: _Lines, now: tuple[int, int, int, int]
    ) -> tuple[dict[str, Any], str] | None:
        """A line of a checkpoint saved after a transition at a position the replay passed
        (by ``now``, where it ended) whose fingerprint was never compared, and why."""
        for lines in self.verify.values():
            for line in lines:
                key = _line_key(line)
                if key <= now:
                    return line, "the transition was not applied at its position"
        return None

    def _due(self, rec: EventRecord) -> list[Transition] | None:
        state = rec.state
        if state is None or not self.pending:
            return None
        key = _key(state.step, state.epoch, state.batch_idx, state.micro_step)
        return self.pending.pop((rec.event.value, key), None)

    on_train_epoch_start = _due
    on_train_batch_start = _due
    on_train_batch_end = _due
    on_train_epoch_end = _due


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
