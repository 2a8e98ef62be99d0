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
(:attr:`ReplayReport.diverged_after`).

The typical use is a loss that turned NaN: the journal shows roughly where, a replay of that
stretch names the first step with a non-finite loss, and replaying exactly that step with
``detect_anomaly=True`` reports the backward function that produced the NaN and the forward line
that called it (see docs/checkpoints.md).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from engine import checkpoint
from engine._pickling import load_skeleton, loads_code
from engine.events import EventRecord, Listener, Transition
from engine.listeners.journal import CONFIG, DATA, JOURNAL, MODEL, TASK, Journal
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
        epoch: the epoch at that point.
        batch_idx: batches consumed in that epoch.
        values: for each differing quantity (``"loss"``, ``"lr"``, ``"fingerprint"``), the pair
            ``(journal, replay)``.
    """

    step: int
    epoch: int
    batch_idx: int
    values: Mapping[str, tuple[Any, Any]]

    def __str__(self) -> str:
        diffs = "; ".join(
            f"{k}: journal {a!r} != replay {b!r}" for k, (a, b) in self.values.items()
        )
        return f"step {self.step} (epoch {self.epoch}, batch {self.batch_idx}): {diffs}"


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
        compared: journaled values compared (losses, learning rates, fingerprints).
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
            ``divergence.step``, and the steps in between journaled none of those quantities.
            It is ``divergence.step - 1`` for a loss when the journal holds every step's loss
            (losses that match do not show that the state does: a fingerprint that differs is
            placed after the last one that matched). ``None`` without a divergence, or when the
            checkpoint the replay starts from differs from its journaled fingerprint.
        first_divergent_step: the step that first differed when the journal pins it
            (``divergence.step`` when ``diverged_after`` is the step before), else ``None``.
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
        if self.anomaly is not None:
            out = f"{head}; anomaly detected at step {self.anomaly_step}:\n{self.anomaly}"
        elif self.divergence is not None and self.first_divergent_step is None:
            out = f"{head}; first difference seen at {self.divergence}"
            if self.diverged_after is not None:
                out += (
                    f"\nthe divergence lies in steps ({self.diverged_after}, "
                    f"{self.divergence.step}]: no value journaled in between to compare (a "
                    "journal with every step's loss, as engine writes now, names the step)"
                )
        elif self.divergence is not None:
            out = f"{head}; first divergence at {self.divergence}"
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
    def __init__(self, divergence: Divergence, after: int | None) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence
        self.after = after

    @classmethod
    def at(
        cls, state: TrainState, diffs: dict[str, tuple[Any, Any]], after: int | None
    ) -> _Diverged:
        """The replay differs from the journal at ``state``'s position, in ``diffs``."""
        return cls(Divergence(state.step, state.epoch, state.batch_idx, diffs), after=after)


def _check_fingerprint(state: TrainState, journaled: str) -> None:
    """Raise :class:`_Diverged` unless ``state`` has the ``journaled`` fingerprint (a state
    that matches vouches for itself: no step before it is to blame)."""
    actual = _fingerprint(state, journaled)
    if actual != journaled:
        raise _Diverged.at(state, {"fingerprint": (journaled, actual)}, after=None)


def _key(step: int, epoch: int, batch_idx: int, micro_step: int) -> tuple[int, int, int, int]:
    return step, epoch, batch_idx, micro_step


def _line_key(line: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return _key(line["step"], line["epoch"], line["batch_idx"], line.get("micro_step", 0))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        # bitwise for floats as JSON carries them; NaN equals NaN here
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


class _Checker(Listener):
    """Compares the replayed run with the journal as it goes; records losses."""

    def __init__(
        self,
        expected: dict[tuple[int, int, int, int], list[dict[str, Any]]],
        start_line: dict[str, Any],
        span: tuple[int, int],
        detect_anomaly: bool = False,
    ) -> None:
        self.expected = expected
        self.step_losses = _step_losses(expected, start_line["step"])
        self.start_line = start_line
        self.span = span
        self.detect_anomaly = detect_anomaly
        self.compared = 0
        self.steps = 0
        self.current = 0  # the step being executed
        self.losses: dict[int, float] = {}
        self.first_nonfinite: int | None = None
        self.first_nonfinite_loss: float | None = None
        # for each journaled quantity, the last step at which it matched (a state that matches
        # vouches for all: the replay starts from one)
        self.matched = dict.fromkeys(("loss", "lr", "fingerprint"), int(start_line["step"]))

    def on_train_start(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        journaled = self.start_line.get("fingerprint")
        if journaled is not None:
            self.compared += 1
            _check_fingerprint(state, journaled)

    def on_train_batch_start(self, rec: EventRecord) -> None:
        assert rec.state is not None
        self.current = rec.state.step + 1

    def in_span(self) -> bool:
        """Whether the step being executed is one anomaly detection was asked for."""
        lo, hi = self.span
        return self.detect_anomaly and lo <= self.current <= hi

    def on_train_batch_end(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        loss = rec.outputs.get("loss") if isinstance(rec.outputs, Mapping) else None
        compared: set[str] = set()
        if loss is not None and self.first_nonfinite is None and state.micro_step:
            # a micro-batch inside an accumulation window: its step is the one it will end
            value = float(loss)
            if not math.isfinite(value):
                self.first_nonfinite, self.first_nonfinite_loss = state.step + 1, value
        if state.micro_step == 0:
            self.steps += 1
            if loss is not None:
                value = float(loss)
                self.losses[state.step] = value
                if self.first_nonfinite is None and not math.isfinite(value):
                    self.first_nonfinite, self.first_nonfinite_loss = state.step, value
                for journaled in self.step_losses.get(state.step, ()):
                    self.compared += 1
                    if not _same(journaled, value):
                        raise _Diverged.at(
                            state, {"loss": (journaled, value)}, after=self.matched["loss"]
                        )
                    compared.add("loss")
        lines = self.expected.get(_key(state.step, state.epoch, state.batch_idx, state.micro_step))
        fingerprint = None
        for line in lines or ():
            diffs: dict[str, tuple[Any, Any]] = {}
            if "loss" in line and loss is not None:
                self.compared += 1
                if not _same(line["loss"], float(loss)):
                    diffs["loss"] = (line["loss"], float(loss))
            if "lr" in line:
                lr = getattr(rec.run.task, "lr", None)
                value = float(lr(state.step) if callable(lr) else lr)  # type: ignore[arg-type]
                self.compared += 1
                if not _same(line["lr"], value):
                    diffs["lr"] = (line["lr"], value)
            if "fingerprint" in line:
                fingerprint = fingerprint or _fingerprint(state, line["fingerprint"])
                self.compared += 1
                if line["fingerprint"] != fingerprint:
                    diffs["fingerprint"] = (line["fingerprint"], fingerprint)
            if diffs:
                # each differing quantity first differed after the last step where it matched
                after = min(self.matched[k] for k in diffs)
                raise _Diverged.at(state, diffs, after=after)
            compared.update(k for k in ("lr", "fingerprint") if k in line)
            if "loss" in line and loss is not None:
                compared.add("loss")
        if "fingerprint" in compared:  # the state is the journaled one, as at a checkpoint
            compared.update(self.matched)
        for k in compared:
            self.matched[k] = state.step


def _step_losses(
    expected: dict[tuple[int, int, int, int], list[dict[str, Any]]], start_step: int
) -> dict[int, list[float]]:
    """Each step's journaled losses (a line's ``losses``: the steps up to the line's), of the
    steps after ``start_step`` (the checkpoint's)."""
    out: dict[int, list[float]] = {}
    for lines in expected.values():
        for line in lines:
            losses = line.get("losses")
            if not isinstance(losses, list):
                continue  # a line of an engine before per-step losses
            first = line["step"] - len(losses) + 1
            for step, value in enumerate(losses, start=first):
                if step <= start_step:
                    continue
                seen = out.setdefault(step, [])
                if not any(_same(value, v) for v in seen):  # a resumed fit journals it again
                    seen.append(value)
    return out


def _fingerprint(state: TrainState, journaled: Any) -> str:
    """The state's fingerprint in the algorithm of a journaled one (64 hex digits: SHA-256, as
    engine wrote before checkpoint format 3)."""
    return state.fingerprint(
        "sha256" if isinstance(journaled, str) and len(journaled) == 64 else "xxh3_128"
    )


def _find_checkpoint(root: Path, lines: list[dict[str, Any]], from_step: int) -> tuple[Path, dict]:
    """The newest verified checkpoint journaled before step ``from_step`` ran."""
    candidates = [
        x for x in lines if isinstance(x.get("checkpoint"), str) and x["step"] < from_step
    ]
    candidates.sort(key=lambda x: (x["step"], x.get("micro_step", 0)), reverse=True)
    for line in candidates:
        journaled = Path(line["checkpoint"])
        # the run directory may have moved since: look for the checkpoint beside the journal too
        for path in (journaled, root / journaled.name, root / "checkpoints" / journaled.name):
            if (path / checkpoint.META).is_file():
                try:
                    if checkpoint.read_meta(path).get("weights_only"):
                        break  # the model alone: no optimizer state to continue from
                    checkpoint.verify(path)
                except checkpoint.CheckpointError as e:
                    warnings.warn(
                        f"replay: checkpoint {path} fails verification ({e}); trying an older one",
                        stacklevel=3,
                    )
                    break
                return path, line
    listed = sorted({x["step"] for x in candidates})
    raise ReplayError(
        f"{root}: no loadable checkpoint taken before step {from_step} (journaled checkpoint "
        f"steps before it: {listed or 'none'}); replay from a later step, or keep more "
        "checkpoints (ModelCheckpoint(save_top_k=-1, every_n_train_steps=...))"
    )


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
            and re-executes (and checks) the steps in between too.
        to_step: the last step to re-execute (default: the last journaled step).
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
        ReplayError: if the directory is not a replayable run or the steps are out of range.
        engine.checkpoint.CheckpointError: if the checkpoint does not fit the model.
    """
    root = Path(run_dir)
    lines = _journal(root)
    from_step, to_step = _span(lines, from_step, to_step)
    ckpt, start_line = _find_checkpoint(root, lines, from_step)
    if not trust_code:
        raise _untrusted(root)
    task, template, data, flags = _load_run(root, data)
    transitions = _Transitions(root, lines, start_line)
    kept = [x for x in lines if id(x) not in transitions.deferred]
    checker = _Checker(_expected(kept, start_line, to_step), start_line, (from_step, to_step))
    outcome = _run_checked(
        task, template, data, ckpt, flags, [checker, transitions], to_step, detect_anomaly
    )
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


def _journal(root: Path) -> list[dict[str, Any]]:
    if not (root / JOURNAL).is_file():
        raise ReplayError(
            f"{root} has no {JOURNAL}: not a run directory (a fit writes one unless "
            "Trainer(enable_journal=False))"
        )
    return Journal.read(root)


def _span(
    lines: list[dict[str, Any]], from_step: int | None, to_step: int | None
) -> tuple[int, int]:
    """The steps to re-execute: checked, with the defaults filled in."""
    last = max(x["step"] for x in lines)
    checkpointed = [x["step"] for x in lines if isinstance(x.get("checkpoint"), str)]
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
            f"to_step={to_step} is past the journal's last step ({last}); nothing to compare"
        )
    return from_step, to_step


def _load_run(root: Path, data: Any) -> tuple[Any, TrainState, Any, dict[str, Any]]:
    """Unpickle the task, the model's structure and the data (runs code: trusted runs only);
    read the flags that decide what a step computes."""
    for name in (TASK, MODEL):
        if not (root / name).is_file():
            raise ReplayError(
                f"{root / name} is missing: the run was journaled with Journal(replayable=False) "
                "or its task could not be pickled (see the warning of that run)"
            )
    task = loads_code((root / TASK).read_bytes())
    if task.tx is None:
        raise ReplayError(
            f"{root / TASK}: the task has a step_fn and no tx, so the optimizer state's "
            "structure cannot be rebuilt; give Task(step_fn=..., tx=...) to replay its runs"
        )
    template = load_skeleton((root / MODEL).read_bytes(), task.tx)
    if data is None:
        if not (root / DATA).is_file():
            raise ReplayError(
                f"{root / DATA} is missing (the data source did not pickle, or was larger than "
                "Journal(max_data_bytes=...)); pass the training data as replay(..., data=...)"
            )
        data = loads_code((root / DATA).read_bytes())
    config = json.loads((root / CONFIG).read_text()) if (root / CONFIG).is_file() else {}
    return task, template, data, _flags(config)


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
    return flags


def _expected(
    lines: list[dict[str, Any]], start_line: dict[str, Any], to_step: int
) -> dict[tuple[int, int, int, int], list[dict[str, Any]]]:
    """The values to compare: every journal line of a step the replay executes, by position."""
    expected: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
    start_key = (start_line["step"], start_line.get("micro_step", 0))
    for line in lines:
        if (line["step"], line.get("micro_step", 0)) <= start_key or line["step"] > to_step:
            continue
        if "transition" in line:  # applied again by _Transitions, not compared
            continue
        key = _key(line["step"], line["epoch"], line["batch_idx"], line.get("micro_step", 0))
        expected.setdefault(key, []).append(line)
    return expected


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

    def __init__(self, root: Path, lines: list[dict[str, Any]], start_line: dict[str, Any]) -> None:
        position = _key(
            start_line["step"],
            start_line["epoch"],
            start_line["batch_idx"],
            start_line.get("micro_step", 0),
        )
        after = lines.index(start_line) + 1
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
                    f"{root / JOURNAL}: the state transition {line['transition']!r} at step "
                    f"{line['step']} was not saved (its function did not pickle): this run "
                    "cannot be replayed past it"
                )
            pickled = root / line["function"]
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
            event = _REPLAYED_AT.get(line["cause"], line["cause"])
            self.pending.setdefault((event, key), []).append(request)

    def on_train_start(self, rec: EventRecord) -> list[Transition]:
        out, self.at_start = self.at_start, []
        return out

    def on_state_transition(self, rec: EventRecord) -> None:
        state = rec.state
        assert state is not None
        for line in self.verify.pop(id(rec.transition), ()):
            _check_fingerprint(state, line["fingerprint"])

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
    plugins = [DetectAnomaly(active=checker.in_span)] if detect_anomaly else None
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
            plugins=plugins,
            **flags,
        )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(task, template, data, ckpt_path=str(ckpt))
        except _Diverged as e:
            outcome["divergence"] = e.divergence
            outcome["diverged_after"] = e.after
            if e.after is not None and e.after == e.divergence.step - 1:
                outcome["first_divergent_step"] = e.divergence.step
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
