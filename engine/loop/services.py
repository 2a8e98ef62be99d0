"""What every loop asks of the driver: :class:`LoopServices`, the base of the fit loop's
:class:`~engine.loop.fit.FitServices` and the evaluation loops'
:class:`~engine.loop.evaluate.EvalServices`."""

from __future__ import annotations

from typing import Any, Protocol

from engine.events import Event
from engine.plan.progress import Progress
from engine.state import TrainState

__all__ = ["LoopServices"]


class LoopServices(Protocol):
    """The events and the batches' placement. Each call hands over the loop's current values
    (the driver keeps them as its record of the run, for the listeners' view) and returns the
    ones the loop continues with."""

    def emit(
        self, event: Event, state: TrainState, progress: Progress, **fields: Any
    ) -> tuple[TrainState, Progress]:
        """``event`` between batches, with the listeners' requests carried out."""
        ...

    def emit_batch(
        self, event: Event, state: TrainState, progress: Progress, **fields: Any
    ) -> tuple[TrainState, Progress]:
        """A batch event (the hot path)."""
        ...

    def move(self, batch: Any) -> Any:
        """The batch on the step's device, as the listeners see it too."""
        ...
