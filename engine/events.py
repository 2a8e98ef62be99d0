"""Events: what the Trainer announces instead of calling callbacks that can change it.

The :class:`Event` enum is named after Lightning's ``Callback`` hooks so a migration is a rename.
A listener is any object with methods named after the events it wants (``on_train_batch_end``)
or a function registered with :func:`on` and an Ignite-style filter (``every=``, ``once=``, a
predicate). Each receives one immutable :class:`EventRecord` and may return a request
(:class:`Stop`); it cannot change the state, which is a frozen record anyway.

Example:
    >>> from engine.events import Event, on
    >>> seen = []
    >>> listener = on(Event.ON_TRAIN_BATCH_END, lambda rec: seen.append(rec.batch_idx), every=2)
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from concurrent.futures import Future
    from pathlib import Path

    from engine.state import TrainState
    from engine.trainer import Trainer

__all__ = ["Event", "EventRecord", "Listener", "Stop", "check_listener", "on"]


class Event(str, enum.Enum):
    """The Trainer's events, named (and ordered) like Lightning 2.x's Callback hooks."""

    SETUP = "setup"
    ON_FIT_START = "on_fit_start"
    ON_SANITY_CHECK_START = "on_sanity_check_start"
    ON_SANITY_CHECK_END = "on_sanity_check_end"
    ON_TRAIN_START = "on_train_start"
    ON_TRAIN_EPOCH_START = "on_train_epoch_start"
    ON_TRAIN_BATCH_START = "on_train_batch_start"
    ON_BEFORE_BACKWARD = "on_before_backward"
    ON_AFTER_BACKWARD = "on_after_backward"
    ON_BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    ON_TRAIN_BATCH_END = "on_train_batch_end"
    ON_VALIDATION_START = "on_validation_start"
    ON_VALIDATION_EPOCH_START = "on_validation_epoch_start"
    ON_VALIDATION_BATCH_START = "on_validation_batch_start"
    ON_VALIDATION_BATCH_END = "on_validation_batch_end"
    ON_VALIDATION_EPOCH_END = "on_validation_epoch_end"
    ON_VALIDATION_END = "on_validation_end"
    ON_TRAIN_EPOCH_END = "on_train_epoch_end"
    ON_TRAIN_END = "on_train_end"
    ON_FIT_END = "on_fit_end"
    ON_TEST_START = "on_test_start"
    ON_TEST_EPOCH_START = "on_test_epoch_start"
    ON_TEST_BATCH_START = "on_test_batch_start"
    ON_TEST_BATCH_END = "on_test_batch_end"
    ON_TEST_EPOCH_END = "on_test_epoch_end"
    ON_TEST_END = "on_test_end"
    ON_PREDICT_START = "on_predict_start"
    ON_PREDICT_EPOCH_START = "on_predict_epoch_start"
    ON_PREDICT_BATCH_START = "on_predict_batch_start"
    ON_PREDICT_BATCH_END = "on_predict_batch_end"
    ON_PREDICT_EPOCH_END = "on_predict_epoch_end"
    ON_PREDICT_END = "on_predict_end"
    ON_EXCEPTION = "on_exception"
    ON_SAVE_CHECKPOINT = "on_save_checkpoint"
    ON_LOAD_CHECKPOINT = "on_load_checkpoint"
    TEARDOWN = "teardown"

    def __call__(
        self,
        *,
        every: int | None = None,
        once: int | None = None,
        filter: Callable[[EventRecord], bool] | None = None,
    ) -> EventFilter:
        """This event with an Ignite-style filter: ``Event.ON_TRAIN_BATCH_END(every=10)``."""
        return EventFilter(self, every=every, once=once, predicate=filter)


@attrs.frozen
class EventRecord:
    """What a listener receives: immutable, with everything known at that point.

    Attributes:
        event: which event this is.
        stage: ``"fit"``, ``"sanity_check"``, ``"validate"``, ``"test"`` or ``"predict"``
            (validation inside ``fit`` has stage ``"fit"``).
        state: the current :class:`TrainState` (read it; it cannot be changed).
        metrics: the latest host-side metrics (``trainer.callback_metrics``) as floats.
        batch_idx: the batch index within the epoch / dataloader, for batch events.
        dataloader_idx: which evaluation or prediction dataloader, for those events.
        outputs: the step's metrics (tensors) for ``*_batch_end``; predictions for predict.
        batch: the batch, for batch events.
        exception: the exception, for ``on_exception``.
        loss: for ``on_before_backward``, the micro-batch's loss (a tensor, before any loss
            scale or accumulation divisor).
        grads: read-only ``{name: tensor}``: for ``on_after_backward`` this micro-batch's
            gradients (of ``loss / accumulate_grad_batches``), for ``on_before_optimizer_step``
            the accumulation window's summed gradients before clipping. Read them; changing
            them in place changes the step.
        checkpoint_path: the checkpoint being written or read, for ``on_save_checkpoint`` /
            ``on_load_checkpoint``.
        checkpoint_future: for ``on_save_checkpoint`` of an asynchronous save, a future of the
            checkpoint's path that completes once it is on disk (or fails as the write did);
            None for a synchronous save, which is on disk when the event's caller returns. The
            write starts after every listener has had the event (their states go into the
            checkpoint), so wait on it later, never inside the handler.
        trainer: the Trainer, for its read-only properties (``global_step``,
            ``num_training_batches``, ``logged_metrics``, ...).
    """

    event: Event
    stage: str
    state: TrainState | None
    metrics: Mapping[str, float]
    trainer: Trainer
    batch_idx: int | None = None
    dataloader_idx: int = 0
    outputs: Any = None
    batch: Any = None
    exception: BaseException | None = None
    loss: Any = None
    grads: Mapping[str, Any] | None = None
    checkpoint_path: str | None = None
    checkpoint_future: Future[Path] | None = None


@attrs.frozen
class Stop:
    """A listener's request to stop fitting (Lightning's ``trainer.should_stop = True``).

    As in Lightning, fitting stops once ``min_epochs`` / ``min_steps`` are met.
    """

    reason: str = ""


@attrs.define
class EventFilter:
    """An event plus a filter on its occurrences (counted from 1, per filter)."""

    event: Event
    every: int | None = None
    once: int | None = None
    predicate: Callable[[EventRecord], bool] | None = None
    count: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("every", "once"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive int (got {value!r})")
        if self.every is not None and self.once is not None:
            raise ValueError("pass either every= or once=, not both")

    def fires(self, record: EventRecord) -> bool:
        self.count += 1
        if self.every is not None and self.count % self.every:
            return False
        if self.once is not None and self.count != self.once:
            return False
        return self.predicate is None or bool(self.predicate(record))


class Listener:
    """Base class for listeners: override the methods named after the events you need.

    Subclassing is optional; the Trainer looks for methods named after :class:`Event` values on
    any object passed in ``callbacks``. ``state_dict`` / ``load_state_dict`` let a listener's
    own state (EarlyStopping's best score, say) travel in checkpoints.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


class _FunctionListener(Listener):
    def __init__(self, flt: EventFilter, fn: Callable[[EventRecord], Any]) -> None:
        self.filter = flt
        self.fn = fn
        setattr(self, flt.event.value, self._handle)

    def _handle(self, record: EventRecord) -> Any:
        if self.filter.fires(record):
            return self.fn(record)
        return None

    def __repr__(self) -> str:
        return f"on({self.filter.event.value}, {getattr(self.fn, '__name__', self.fn)!r})"


def on(
    event: Event | EventFilter,
    fn: Callable[[EventRecord], Any],
    *,
    every: int | None = None,
    once: int | None = None,
    filter: Callable[[EventRecord], bool] | None = None,
) -> Listener:
    """A listener that calls ``fn(record)`` on ``event`` (filtered), for ``callbacks=[...]``.

    Example:
        >>> from engine.events import Event, on
        >>> listener = on(Event.ON_VALIDATION_END, print, once=1)
        >>> listener = on(Event.ON_TRAIN_BATCH_END(every=50), print)
    """
    if isinstance(event, EventFilter):
        if every is not None or once is not None or filter is not None:
            raise ValueError("give the filter either on the event or to on(), not both")
        flt = EventFilter(
            event.event, every=event.every, once=event.once, predicate=event.predicate
        )
    elif isinstance(event, Event):
        flt = EventFilter(event, every=every, once=once, predicate=filter)
    else:
        raise TypeError(f"event must be an engine.Event (got {event!r})")
    return _FunctionListener(flt, fn)


# Lightning Callback hooks engine has no event for, and why
_NOT_EVENTS = {
    "on_before_zero_grad": "a pure step has no .grad buffers to zero",
    "on_validation_model_eval": "the eval step runs the module in eval mode itself",
    "on_validation_model_train": "the train step runs the module in train mode itself",
    "on_test_model_eval": "the eval step runs the module in eval mode itself",
    "on_predict_model_eval": "the predict step runs the module in eval mode itself",
}


def check_listener(listener: Any) -> None:
    """Refuse a listener with a handler named after no event (a typo, or a Lightning hook that
    engine does not have), which would otherwise never be called.

    A handler is a public callable attribute named ``on_*``, ``setup`` or ``teardown``.

    Example:
        >>> class Typo(Listener):
        ...     def on_train_batch_edn(self, rec): ...
        >>> check_listener(Typo())
        Traceback (most recent call last):
        ...
        ValueError: Typo.on_train_batch_edn is not an engine event, ...on_train_batch_end? ...
    """
    names = {e.value for e in Event}
    for attr in dir(listener):
        if not attr.startswith("on_") or attr in names:
            continue
        if not callable(getattr(listener, attr, None)):
            continue
        owner = type(listener).__name__
        why = _NOT_EVENTS.get(attr)
        if why is not None:
            hint = f"Lightning's {attr} has no engine event: {why}"
        else:
            close = difflib.get_close_matches(attr, sorted(names), n=1)
            hint = f"did you mean {close[0]}?" if close else "see engine.Event for the events"
        raise ValueError(
            f"{owner}.{attr} is not an engine event, so it would never be called; {hint} "
            "(rename it, or make it private with a leading underscore)"
        )


class Emitter:
    """Dispatches events to listeners; the handler table is built once, so an event nobody
    listens to costs one dict lookup."""

    def __init__(self, listeners: Iterable[Any]) -> None:
        self.listeners = list(listeners)
        for listener in self.listeners:
            check_listener(listener)
        # the event being dispatched and the index of the handler being called (a checkpoint
        # saved by a handler records who is yet to have the event: a resume calls them)
        self._event: Event | None = None
        self._index = 0
        self.table: dict[Event, list[Callable[[EventRecord], Any]]] = {}
        for event in Event:
            handlers = [
                getattr(x, event.value)
                for x in self.listeners
                if callable(getattr(x, event.value, None))
            ]
            if handlers:
                self.table[event] = handlers

    def wants(self, event: Event) -> bool:
        return event in self.table

    def emit(
        self,
        event: Event,
        make_record: Callable[[], EventRecord],
        on_request: Callable[[Any], None],
        only: Collection[int] | None = None,
    ) -> None:
        """Call the handlers of ``event`` (only those of the listeners whose ``id`` is in
        ``only``, when given), passing each non-None return value to ``on_request`` before the
        next handler runs."""
        handlers = self.table.get(event)
        if not handlers:
            return
        record = make_record()
        outer_event, outer_index = self._event, self._index  # emits nest (a save in a handler)
        self._event = event
        try:
            for i, handle in enumerate(handlers):
                if only is not None and id(getattr(handle, "__self__", None)) not in only:
                    continue
                self._index = i
                out = handle(record)
                if out is not None:
                    on_request(out)
        finally:
            self._event, self._index = outer_event, outer_index

    def pending(self) -> tuple[Event, list[Any]] | None:
        """The event being dispatched and the listeners that have not had it yet."""
        if self._event is None:
            return None
        later = self.table[self._event][self._index + 1 :]
        return self._event, [getattr(h, "__self__", None) for h in later]
