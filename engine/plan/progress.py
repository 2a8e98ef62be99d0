"""Where the fit loop is: the :class:`Phase` a checkpoint records so a resume completes its batch,
and the :class:`Progress` record the loop threads through beside the state.

The values are the strings checkpoints hold as ``extra.trainer.phase``; older checkpoints carry
the same strings, so they load as before (``validation_end`` is new: an older engine told it
from ``validated`` by the event it recorded beside the phase).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["Phase", "Progress"]


class Phase(enum.Enum):
    """Where the fit loop is when a checkpoint is saved.

    A listener's :class:`~engine.events.Save` is carried out right after the event it was
    asked for in, in that event's phase, once every listener has had the event:

    * ``BETWEEN``: between batches (or outside fit): nothing of a batch is left to do.
    * ``BATCH_END``: the batch has stepped and ``on_train_batch_end`` is being dispatched; its
      validation check is still to come.
    * ``VALIDATION``: the batch's validation is running and has not logged its results.
    * ``VALIDATED``: that validation has its results; ``on_validation_epoch_end`` is being
      dispatched, ``on_validation_end`` is still to come.
    * ``VALIDATION_END``: ``on_validation_end`` is being dispatched; only counting the batch is
      left.
    * ``EPOCH_END``: ``on_train_epoch_end`` is being dispatched; the epoch count is not yet
      incremented.

    Example:
        >>> from engine.plan import Phase
        >>> Phase("batch_end"), Phase.EPOCH_END.value
        (<Phase.BATCH_END: 'batch_end'>, 'epoch_end')
        >>> Phase.BETWEEN.mid_batch, Phase.VALIDATED.mid_batch
        (False, True)
    """

    BETWEEN = "between"
    BATCH_END = "batch_end"
    VALIDATION = "validation"
    VALIDATED = "validated"
    VALIDATION_END = "validation_end"
    EPOCH_END = "epoch_end"

    @property
    def mid_batch(self) -> bool:
        """Whether a checkpoint saved in this phase leaves part of its batch to complete."""
        return self in (Phase.BATCH_END, Phase.VALIDATION, Phase.VALIDATED, Phase.VALIDATION_END)

    @classmethod
    def parse(cls, value: object) -> Phase:
        """The phase a checkpoint recorded (``None``, from an older engine: ``BETWEEN``).

        Raises:
            ValueError: if ``value`` names no phase.

        Example:
            >>> from engine.plan import Phase
            >>> Phase.parse(None), Phase.parse("validated")
            (<Phase.BETWEEN: 'between'>, <Phase.VALIDATED: 'validated'>)
            >>> Phase.parse("somewhere")
            Traceback (most recent call last):
            ...
            ValueError: trainer.phase 'somewhere' is none of the loop's phases
        """
        if value is None:
            return cls.BETWEEN
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise ValueError(f"trainer.phase {value!r} is none of the loop's phases") from None


class Progress(NamedTuple):
    """The fit loop's position beyond the :class:`~engine.state.TrainState` (whose counters,
    ``step`` / ``epoch`` / ``batch_idx``, are the truth): a value the loop threads through as a
    local and hands to the Trainer's services, which return the next one.

    * ``total_batch_idx``: training batches counted across epochs (``val_check_interval``'s
      count).
    * ``phase``: where the loop is in its batch (:class:`Phase`); ``resume_phase``: the phase a
      restored checkpoint was saved in, while its batch is still to complete (else ``None``).
    * ``should_stop``: whether a listener asked to stop (:class:`~engine.events.Stop`).
    * ``num_training_batches`` / ``val_check_batch``: the current epoch's batches after the
      limits, and every how many of them validation runs (:func:`schedule.val_check_batch`).
    * ``data_position``: a stateful loader's state after the current batch;
      ``resume_data_state``: that state as a restored checkpoint recorded it, until the loader is
      positioned.
    * ``reducer``: the epoch's training metric reduction (a mutable accumulator carried by
      reference; a checkpoint records it as ``extra.train_metrics``).

    Checkpoints record it as ``extra.trainer`` (:meth:`to_json`, :meth:`from_checkpoint`).
    It is a named tuple: ``progress._replace(phase=...)`` makes the next one in half a
    microsecond (``attrs.evolve`` of a frozen record took three times that, several times a
    batch).

    Example:
        >>> from engine.plan.progress import Phase, Progress
        >>> p = Progress(total_batch_idx=3, phase=Phase.BATCH_END)
        >>> saved = p.to_json()
        >>> saved["phase"], saved["total_batch_idx"], saved["should_stop"]
        ('batch_end', 3, False)
        >>> Progress.from_checkpoint(saved).resume_phase
        <Phase.BATCH_END: 'batch_end'>
    """

    total_batch_idx: int = 0
    phase: Phase = Phase.BETWEEN
    resume_phase: Phase | None = None
    should_stop: bool = False
    num_training_batches: float = 0
    val_check_batch: float = math.inf
    data_position: Any = None
    resume_data_state: Any = None
    reducer: Any = None

    def to_json(self) -> dict[str, Any]:
        """The loop's part of a checkpoint's ``extra.trainer`` (the keys checkpoints carry)."""
        from engine import data

        return {
            "total_batch_idx": self.total_batch_idx,
            # where in the loop the save happened, so a resume completes that batch (a
            # listener's save comes after its event has reached every listener)
            "phase": self.phase.value,
            "should_stop": self.should_stop,
            # a stateful loader's position after the last batch consumed
            "data_state": None
            if self.data_position is None
            else data.state_to_json(self.data_position),
        }

    @classmethod
    def from_checkpoint(cls, saved: Mapping[str, Any]) -> Progress:
        """The progress a checkpoint's ``extra.trainer`` records, to resume from: its phase
        becomes ``resume_phase`` (``None`` between batches), its data state
        ``resume_data_state``; the epoch's counts are the loop's to compute again.

        Raises:
            TypeError, ValueError: if a value is not what an engine writes.
        """
        from engine import data

        total = saved.get("total_batch_idx", 0)
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise TypeError(f"trainer.total_batch_idx must be an int >= 0, got {total!r}")
        data_state = saved.get("data_state")
        phase = Phase.parse(saved.get("phase"))
        if "event" in saved:  # written by an engine before requests: see _older_phase
            phase = _older_phase(phase, saved["event"])
        return cls(
            total_batch_idx=total,
            # a listener's Stop is not carried over (Lightning's neither): a fit resumed with
            # raised limits trains on; the listeners' own states (EarlyStopping's wait count)
            # are what carries, and decide again
            should_stop=False,
            resume_phase=None if phase is Phase.BETWEEN else phase,
            resume_data_state=None if data_state is None else data.state_from_json(data_state),
        )


def _older_phase(phase: Phase, event: Any) -> Phase:
    """The phase of a checkpoint from an engine before requests, which recorded beside it the
    event a listener saved in (``[event, [keys of the listeners yet to have it]]``, or null).

    Those listeners are not called on resume (a save now comes after every listener had the
    event); the event tells the two ends of a validation apart, which the phase now does:
    saved in ``on_validation_epoch_end``, ``on_validation_end`` is still to come.
    """
    if event is None:
        return Phase.VALIDATION_END if phase is Phase.VALIDATED else phase
    if (
        not isinstance(event, list)
        or len(event) != 2
        or not isinstance(event[0], str)
        or not isinstance(event[1], list)
    ):
        raise TypeError(f"trainer.event must be null or [event, [listener keys]], got {event!r}")
    from engine.events import Event

    saved_in = Event(event[0])
    if phase is Phase.VALIDATED and saved_in is not Event.ON_VALIDATION_EPOCH_END:
        return Phase.VALIDATION_END
    return phase
