"""What a replay found: its report, the first divergence, and the errors it raises.

:class:`ReplayReport` and :class:`Divergence` are what :func:`engine.replay` returns;
:class:`ReplayError` and :class:`UntrustedCodeError` what it raises. ``_Diverged`` and
``_WrongStart`` are the replay's own signals, raised by the checker while a fit runs and turned
into the report (or into trying an older checkpoint) by :mod:`engine.replaying._rerun`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from engine.state import TrainState


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
        data_rebuilt: the calls that made the training data again, where ``data.pkl``
            records it by reference (``module.Class(name=value, ...)``); empty where it was
            pickled whole or passed as ``data=``. A divergence of such a run may come from data
            that these calls do not make the same again.
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
    data_rebuilt: tuple[str, ...] = ()

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
        if div is not None and self.data_rebuilt:
            out += (
                f"\nthe training data was made again from data.pkl's reference: "
                f"{'; '.join(self.data_rebuilt)}; data that such a call does not make the "
                "same again (drawn from the global random generator as it is made, or "
                "depending on more than these arguments) diverges from the first step it "
                "reads: pass the run's data as replay(..., data=...) to tell"
            )
        if self.first_nonfinite_step is not None:
            loss = self.first_nonfinite_loss
            if loss is None:
                loss = self.losses.get(self.first_nonfinite_step)
            out += f"\nfirst non-finite loss: step {self.first_nonfinite_step} (loss {loss})"
        return out


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
