"""The run directory as replay reads it: the journal's lines, each checked (:class:`_Lines`,
:func:`_check_line`), their positions (the ``_key`` helpers), the journaled checkpoints a replay
may start from (:func:`_checkpoints`), and the run's own files (:func:`_run_file`: pickled code
is read from nowhere else).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from engine import checkpoint
from engine.listeners.journal import DATA, JOURNAL, MODEL, TASK, Journal, JournalError
from engine.replaying._report import ReplayError, UntrustedCodeError
from engine.state import TrainState


def _key(step: int, epoch: int, batch_idx: int, micro_step: int) -> tuple[int, int, int, int]:
    return step, epoch, batch_idx, micro_step


def _state_key(state: TrainState) -> tuple[int, int, int, int]:
    return _key(state.step, state.epoch, state.batch_idx, state.micro_step)


def _line_key(line: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return _key(line["step"], line["epoch"], line["batch_idx"], line.get("micro_step", 0))


def _fingerprint(state: TrainState, journaled: Any) -> str:
    """The state's fingerprint in the algorithm of a journaled one (64 hex digits: SHA-256, as
    engine wrote before checkpoint format 3)."""
    return state.fingerprint(
        "sha256" if isinstance(journaled, str) and len(journaled) == 64 else "xxh3_128"
    )


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
