"""The checker: a listener that compares a replayed fit with the journal as it goes
(:class:`_Checker`), and its data-parallel form, which stops every rank after the same batch
(:class:`_RankZeroChecker`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from engine.events import EventRecord, Listener, Stop
from engine.replaying._journal import _fingerprint, _line_key, _Lines, _state_key
from engine.replaying._report import Divergence, ReplayError, _Diverged, _WrongStart
from engine.replaying._transitions import _Transitions
from engine.state import TrainState


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

    A run compiled with ``steps_per_call`` ran some of its steps in blocks, one graph each,
    which single steps match only within compile's tolerance: the journal names them
    (``blocks``), and :meth:`block_starts` makes the replay run the same blocks (its checks see
    each block's steps at its end).
    """

    handles_blocks = True

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
        #: the journaled blocks (first step -> steps) the replay runs again as blocks
        self.blocks: dict[int, int] | None = None
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

    def block_starts(self) -> frozenset[int] | None:
        return None if self.blocks is None else frozenset(self.blocks)

    def on_train_batch_end(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        due = self._due(state)  # its collective first: nothing before it can raise
        if self.follows:
            return
        if rec.block is not None:  # its micro-batches before the last, as if each had ended
            stacked = rec.block.get("loss")
            values = [] if stacked is None else torch.as_tensor(stacked).tolist()  # one sync
            n = len(values)
            config = rec.run.config
            accumulate = config.accumulate_grad_batches if config is not None else 1
            first = state.step - n // accumulate
            for j in range(n - 1):
                micro = (j + 1) % accumulate
                step = first + (j + 1) // accumulate
                at = (state.epoch, state.batch_idx - (n - 1 - j))
                self._batch_ended(step, micro, at, float(values[j]))
        loss = rec.outputs.get("loss") if isinstance(rec.outputs, Mapping) else None
        value = float(loss) if loss is not None else None
        at = (state.epoch, state.batch_idx)
        self._batch_ended(state.step, state.micro_step, at, value)
        self._compare_at(rec, value if state.micro_step == 0 else None, due)

    def _batch_ended(self, step: int, micro: int, at: tuple[int, int], value: float | None) -> None:
        """Account for a micro-batch that ended at optimizer step ``step`` (``micro`` into the
        next window), at ``at`` (epoch, batch index), with loss ``value``: a step's loss is
        compared with the journal's."""
        self.positions[(step, micro)] = at
        if (
            value is not None
            and self.first_nonfinite is None
            and micro
            and not math.isfinite(value)
        ):
            # a micro-batch inside an accumulation window: its step is the one it will end
            self.first_nonfinite, self.first_nonfinite_loss = step + 1, value
        if micro:
            return
        self.steps += 1
        if value is not None:
            self.losses[step] = value
            if self.first_nonfinite is None and not math.isfinite(value):
                self.first_nonfinite, self.first_nonfinite_loss = step, value
        for journaled, number in self.step_losses.pop(step, ()):
            self.compared += 1
            if value is None or not _same(journaled, value):
                diffs = {"loss": (journaled, value)}
                divergence = Divergence(step, *at, diffs, line=number)
                raise _Diverged(divergence, after=self.matched["loss"])
            self.loss_steps.add(step)
            self.matched["loss"] = step

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
