"""The run's journaled state transitions, applied again by a replay at the positions they
were applied (:class:`_Transitions`), with the fingerprints of checkpoints saved right after
one compared once it is applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.checkpoint._pickling import loads_code
from engine.events import EventRecord, Listener, Transition
from engine.listeners.journal import JOURNAL
from engine.replaying._journal import _fingerprint, _key, _line_key, _Lines, _run_file
from engine.replaying._report import ReplayError, _Diverged

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

    A replay of blocks (:meth:`_Checker.block_starts`) runs the recorded run's blocks, whose
    events came at the same positions: each transition is due where it was applied.
    """

    handles_blocks = True

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
