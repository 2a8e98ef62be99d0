"""Where the fit loop is: the :class:`Phase` a checkpoint records so a resume completes its batch.

The values are the strings checkpoints hold as ``extra.trainer.phase``; older checkpoints carry
the same strings, so they load as before (``validation_end`` is new: an older engine told it
from ``validated`` by the event it recorded beside the phase).
"""

from __future__ import annotations

import enum

__all__ = ["Phase"]


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
        >>> from engine.loop import Phase
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
            >>> from engine.loop import Phase
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
