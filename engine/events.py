"""Events: what the Trainer announces instead of calling callbacks that can change it.

The :class:`Event` enum is named after Lightning's ``Callback`` hooks so a migration is a rename.
A listener is any object with methods named after the events it wants (``on_train_batch_end``)
or a function registered with :func:`on` and an Ignite-style filter (``every=``, ``once=``, a
predicate). Each receives one immutable :class:`EventRecord`, whose ``run`` is a read-only
:class:`RunView` of the run, and may return requests: :class:`Stop`, :class:`Save`,
:class:`Log`, :class:`Transition`, :class:`Search`. **Listeners request, the driver acts**: the
driver carries the requests out once the event has reached every listener, so no event fires
inside another and a checkpoint holds every listener's state after the event. A listener
cannot change the state, which is a frozen record anyway.

Example:
    >>> from engine.events import Event, on
    >>> seen = []
    >>> listener = on(Event.ON_TRAIN_BATCH_END, lambda rec: seen.append(rec.batch_idx), every=2)
"""

from __future__ import annotations

import difflib
import enum
import numbers
import os
from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import attrs

if TYPE_CHECKING:
    from concurrent.futures import Future
    from pathlib import Path

    from engine.plan.config import LoopConfig
    from engine.state import TrainState
    from engine.task import Task

__all__ = [
    "Event",
    "EventRecord",
    "Listener",
    "Log",
    "Request",
    "RunView",
    "Save",
    "Search",
    "Stop",
    "Transition",
    "Trials",
    "check_listener",
    "on",
]


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
    # engine's own: a listener's Transition has been applied (the Journal records it for replay)
    ON_STATE_TRANSITION = "on_state_transition"
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


_NO_METRICS: Mapping[str, float] = MappingProxyType({})


def _counts(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(value)


def _objects(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


def _read_only(metrics: Mapping[str, float]) -> Mapping[str, float]:
    """A read-only mapping: the driver's snapshots (and other read-only mappings) as they are,
    a mutable one (a dict) copied."""
    if isinstance(metrics, MappingProxyType) or not isinstance(metrics, MutableMapping):
        return metrics
    return MappingProxyType(dict(metrics))


@attrs.frozen(slots=False)  # an instance dict: the driver copies it to move the counters on
class RunView:
    """What a listener may know about the run: a read-only snapshot, ``rec.run``.

    It stands where Lightning passes the ``trainer``, with the names of the trainer's
    properties, so a migration is a rename: ``trainer.global_step`` is
    ``rec.run.global_step``, ``trainer.callback_metrics`` is ``rec.run.callback_metrics``,
    ``trainer.max_epochs`` is ``rec.run.config.max_epochs``. The driver builds a new one when
    something in it changes (the counters with each batch, the metrics on logging steps, the
    rest between loops), so a listener may keep one: it never changes under it. Nothing here
    acts on the run; a listener returns requests instead (:class:`Stop`, :class:`Save`,
    :class:`Log`), which the driver carries out after the event, so a request made in this
    event shows in the views of later events (``should_stop``, the metrics of a ``Log``).

    Attributes:
        stage: the Trainer's stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``
            (``""`` outside a run); the sanity check is part of ``"fit"``.
        sanity_checking: whether the sanity check is running.
        global_step: optimizer steps taken.
        current_epoch: completed epochs (incremented after ``on_train_epoch_end``).
        num_training_batches: training batches per epoch after ``limit_train_batches``
            (``inf`` for a loader without a length).
        num_val_batches: validation batches per dataloader, after ``limit_val_batches``.
        num_test_batches: test batches per dataloader.
        num_predict_batches: prediction batches per dataloader.
        should_stop: whether a listener has asked to stop (:class:`Stop`) in an earlier event.
        config: the Trainer's flags as resolved (:class:`~engine.plan.LoopConfig`):
            ``config.max_epochs``, ``config.log_every_n_steps``, ``config.fast_dev_run``, ...
            (``None`` only in a view built by hand, for a test).
        callback_metrics: the latest host-side metrics, by name (what ``rec.metrics`` holds).
        logged_metrics: the metrics last sent to the loggers, by name.
        progress_bar_metrics: the metrics the progress bar shows.
        default_root_dir: the Trainer's ``default_root_dir``.
        log_dir: the first logger's directory, else ``default_root_dir``.
        run_dir: the run directory the :class:`~engine.listeners.Journal` writes, once known.
        task: the :class:`~engine.task.Task` being run (its ``lr``, ``prog_bar``, functions).
        ckpt_path: the checkpoint the run resumed from, or ``None``.
        loggers: the Trainer's loggers, to read (their ``version``, ``log_dir``); to log,
            return :class:`Log`.
        train_dataloader: the training dataloader ``fit`` was given (or got from the
            datamodule).
        datamodule: the datamodule ``fit`` was given, or ``None``.
        world_size: the processes of the run (1 unless a multi-process strategy runs it).
        global_rank: this process's rank among them (0 to ``world_size - 1``).
        local_rank: its rank on its node; ``node_rank``: its node's.
        is_global_zero: whether this is rank 0, the one that writes logs, the progress bar and
            checkpoints (a listener with side effects of its own checks it, as Lightning's
            ``rank_zero_only`` does).

    Example:
        >>> from engine.events import RunView
        >>> run = RunView(stage="fit", global_step=40, callback_metrics={"val/loss": 0.25})
        >>> run.global_step, run.callback_metrics["val/loss"], run.should_stop
        (40, 0.25, False)
    """

    stage: str = ""
    sanity_checking: bool = False
    global_step: int = 0
    current_epoch: int = 0
    num_training_batches: float = 0
    num_val_batches: tuple[float, ...] = attrs.field(default=(), converter=_counts)
    num_test_batches: tuple[float, ...] = attrs.field(default=(), converter=_counts)
    num_predict_batches: tuple[float, ...] = attrs.field(default=(), converter=_counts)
    should_stop: bool = False
    # the objects of the run are left out of the repr (a dataset in a list would fill it)
    config: LoopConfig | None = attrs.field(default=None, repr=False)
    callback_metrics: Mapping[str, float] = attrs.field(default=_NO_METRICS, converter=_read_only)
    logged_metrics: Mapping[str, float] = attrs.field(default=_NO_METRICS, converter=_read_only)
    progress_bar_metrics: Mapping[str, float] = attrs.field(
        default=_NO_METRICS, converter=_read_only
    )
    default_root_dir: str = ""
    log_dir: str | None = None
    run_dir: str | None = None
    task: Task | None = attrs.field(default=None, repr=False)
    ckpt_path: str | None = None
    loggers: tuple[Any, ...] = attrs.field(default=(), repr=False, converter=_objects)
    train_dataloader: Any = attrs.field(default=None, repr=False)
    datamodule: Any = attrs.field(default=None, repr=False)
    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0."""
        return self.global_rank == 0


def _moved(view: RunView, global_step: int, current_epoch: int) -> RunView:
    """``view`` at other counters, as the driver makes one a batch: a copy of its fields with
    the two replaced (a sixth of the cost of building the record anew)."""
    fields = view.__dict__.copy()
    fields["global_step"] = global_step
    fields["current_epoch"] = current_epoch
    out = object.__new__(RunView)
    object.__setattr__(out, "__dict__", fields)  # past the frozen __setattr__, as attrs does
    return out


_EMPTY_RUN = RunView()

_NO_TRAINER = (
    "an EventRecord has no trainer: listeners read the run through rec.run, a read-only view "
    "with the trainer's names (rec.run.global_step, rec.run.current_epoch, "
    "rec.run.callback_metrics, rec.run.config.max_epochs, ...), and ask the driver to act by "
    "returning requests: `return eg.Save(path)` instead of trainer.save_checkpoint(path), "
    "`return eg.Log({...})` instead of trainer.log_metrics(...), `return eg.Stop()` instead of "
    "trainer.should_stop = True (see engine.events)"
)


@attrs.frozen
class EventRecord:
    """What a listener receives: immutable, with everything known at that point.

    Attributes:
        event: which event this is.
        stage: ``"fit"``, ``"sanity_check"``, ``"validate"``, ``"test"`` or ``"predict"``
            (validation inside ``fit`` has stage ``"fit"``).
        state: the current :class:`TrainState` (read it; it cannot be changed).
        metrics: the latest host-side metrics (``rec.run.callback_metrics``) as floats.
        run: the read-only :class:`RunView` of the run (Lightning's ``trainer`` argument:
            ``rec.run.global_step``, ``rec.run.num_training_batches``, ...).
        batch_idx: the batch index within the epoch / dataloader, for batch events.
        dataloader_idx: which evaluation or prediction dataloader, for those events.
        outputs: the step's metrics (tensors) for ``*_batch_end``; predictions for predict.
        batch: the batch, for batch events.
        batch_indices: for prediction batch events, the dataset indices of the batch's samples
            (this rank's, under several processes), as Lightning's ``batch_indices``; ``None``
            where the loader has none (not a ``DataLoader`` with a batch sampler).
        exception: the exception, for ``on_exception``.
        loss: for ``on_before_backward``, the micro-batch's loss (a tensor, before any loss
            scale or accumulation divisor).
        grads: read-only ``{name: tensor}``: for ``on_after_backward`` this micro-batch's
            gradients (of ``loss / accumulate_grad_batches``), for ``on_before_optimizer_step``
            the accumulation window's summed gradients before clipping. Read them; changing
            them in place changes the step.
        checkpoint_path: the checkpoint being written or read, for ``on_save_checkpoint`` /
            ``on_load_checkpoint``.
        block: for ``on_train_batch_end`` after a block of ``steps_per_call`` optimizer steps
            (one event for the block, its last batch's), every micro-batch's metrics, each
            stacked along a first dimension (per optimizer step for what only a step reports,
            such as ``grad_norm``); ``None`` after a single batch.
        checkpoint_future: for ``on_save_checkpoint`` of an asynchronous save, a future of the
            checkpoint's path that completes once it is on disk (or fails as the write did);
            None for a synchronous save, which is on disk before the next event. The write
            starts after every listener has had the event (their states go into the
            checkpoint), so wait on it later, never inside the handler.

    There is no ``trainer``: reading ``rec.trainer`` raises an ``AttributeError`` that says
    what replaces it (``rec.run`` to read, requests to act).
    """

    event: Event
    stage: str
    state: TrainState | None
    metrics: Mapping[str, float]
    run: RunView = _EMPTY_RUN
    batch_idx: int | None = None
    dataloader_idx: int = 0
    outputs: Any = None
    batch: Any = None
    batch_indices: Sequence[int] | None = None
    exception: BaseException | None = None
    loss: Any = None
    grads: Mapping[str, Any] | None = None
    checkpoint_path: str | None = None
    checkpoint_future: Future[Path] | None = None
    block: Mapping[str, Any] | None = None
    transition: Transition | None = None
    cause: Event | None = None

    @property
    def trainer(self) -> NoReturn:
        """Not here: read ``rec.run``, return requests (raises ``AttributeError`` saying so)."""
        raise AttributeError(_NO_TRAINER)


# ---------------------------------------------------------------------------- requests


def _text(request: str) -> Callable[[Any, Any, Any], None]:
    """A validator refusing a field that is not a str, naming the request and the field."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{request}({attribute.name}={value!r}): pass a str")

    return check


@attrs.frozen
class Stop:
    """A listener's request to stop fitting (Lightning's ``trainer.should_stop = True``).

    As in Lightning, fitting stops once ``min_epochs`` / ``min_steps`` are met. The driver sets
    ``should_stop`` after the event has reached every listener (later events see it in
    ``rec.run.should_stop``), before it writes any checkpoint asked for in the same event.
    """

    reason: str = attrs.field(default="", validator=_text("Stop"))


def _path(value: Any) -> str:
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            return path
    raise TypeError(f"a checkpoint path must be a non-empty str or os.PathLike (got {value!r})")


def _paths(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, os.PathLike)):
        return (_path(value),)  # one path, not its characters
    if not isinstance(value, Iterable):
        raise TypeError(f"replaces must be a path or an iterable of paths (got {value!r})")
    return tuple(_path(v) for v in value)


def _flag(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"Save({name}={value!r}): pass True or False")

    return check


@attrs.frozen
class Save:
    """A listener's request to save a checkpoint of the run (``trainer.save_checkpoint``).

    The driver writes it once the event has reached every listener (so it holds each
    listener's state after the event, and the effect of the event's :class:`Stop` and
    :class:`Log` requests), firing ``on_save_checkpoint`` first. Once the checkpoint is on disk
    it deletes the checkpoints in ``replaces`` (:func:`engine.checkpoint.remove`), the way
    :class:`~engine.listeners.ModelCheckpoint` drops one that left the top k; a write that
    fails deletes nothing.

    Args:
        path: where to write the checkpoint (a directory; see :mod:`engine.checkpoint`).
        asynchronous: write in the background: the loop waits only for a snapshot of the state
            (:func:`engine.checkpoint.save_async`); the checkpoints in ``replaces`` are deleted
            once it has landed, and the run waits for it before it ends.
        weights_only: save the model alone (Lightning's meaning): ``validate`` / ``test`` /
            ``predict`` can start from it, ``fit`` cannot.
        replaces: checkpoints to delete once this one is on disk (a path or several).

    Raises:
        TypeError: for a path that is not a non-empty str or ``os.PathLike``, or a flag that
            is not a bool.

    Example:
        >>> import engine as eg
        >>> class SaveEvery100(eg.Listener):
        ...     def on_train_batch_end(self, rec):
        ...         if rec.run.global_step % 100 == 0:
        ...             return eg.Save(f"ckpts/step={rec.run.global_step}")
        >>> eg.Save("ckpts/step=200", replaces="ckpts/step=100").replaces
        ('ckpts/step=100',)
    """

    path: str = attrs.field(converter=_path)
    asynchronous: bool = attrs.field(default=False, kw_only=True, validator=_flag("asynchronous"))
    weights_only: bool = attrs.field(default=False, kw_only=True, validator=_flag("weights_only"))
    replaces: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=_paths)


def _floats(value: Any) -> Mapping[str, float]:
    if not isinstance(value, Mapping):
        raise TypeError(f"Log(metrics={value!r}): pass a mapping of names to floats")
    out: dict[str, float] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise TypeError(f"Log(metrics=...): the names must be str (got {k!r})")
        if not isinstance(v, numbers.Real):
            raise TypeError(
                f"Log(metrics=...): {k!r} is a {type(v).__name__}, not a number; log host-side "
                "floats (a tensor's .item() reads it, one host-device sync)"
            )
        out[k] = float(v)
    return MappingProxyType(out)


def _step(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"Log(step={value!r}): pass an int >= 0, or None for the global step")


@attrs.frozen
class Log:
    """A listener's request to log metrics (``trainer.log_metrics``): host-side numbers, sent
    to every logger at ``step`` (default: the global step) and recorded in
    ``logged_metrics`` and ``callback_metrics``, once the event has reached every listener.

    Args:
        metrics: ``{name: number}``; stored as floats.
        step: the step to log at, or ``None`` for the global step.

    Raises:
        TypeError: for metrics that are not a mapping of str to numbers (a tensor included:
            read it with ``.item()``).
        ValueError: for a step that is not an int >= 0.

    Example:
        >>> import engine as eg
        >>> eg.Log({"lr": 0.1}, step=3)
        Log(metrics={'lr': 0.1}, step=3)
    """

    metrics: Mapping[str, float] = attrs.field(converter=_floats, repr=lambda m: repr(dict(m)))
    step: int | None = attrs.field(default=None, validator=_step)


def _callable(instance: Any, attribute: Any, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"Transition(fn={value!r}): pass a function state -> state")


@attrs.frozen
class Transition:
    """A listener's request to change the training state: ``state = fn(state)``, a pure
    function (plateau learning rates, unfreezing, EMA weights kept in ``state.extra``).

    The driver applies it during ``fit`` once the event has reached every listener (after the
    event's :class:`Stop` and :class:`Log` requests, before its :class:`Save` s, so a checkpoint
    asked for in the same event holds the new state), then fires ``on_state_transition``. The
    :class:`~engine.listeners.Journal` records each one (its position, the event that asked and
    ``fn`` pickled), and :func:`engine.replay` applies them again at the same points, so resume
    and replay stay bitwise. ``fn`` returns a new :class:`~engine.state.TrainState` of the same
    structure and counters (a step, epoch or seed of its own is refused); it may build it with
    ``state.replace(...)``. The state passed in is consumed.

    Args:
        fn: ``fn(state) -> state``; it must pickle (with cloudpickle) for replay.
        name: what the journal calls it.

    Example:
        >>> import engine as eg
        >>> class HalveOnce(eg.Listener):
        ...     def on_train_epoch_end(self, rec):
        ...         if rec.run.current_epoch == 0:
        ...             return eg.Transition(
        ...                 lambda s: s.replace(params={k: v * 0.5 for k, v in s.params.items()}),
        ...                 name="halve")
    """

    fn: Callable[[TrainState], TrainState] = attrs.field(validator=_callable)
    name: str = attrs.field(default="", validator=_text("Transition"))


class Trials(Protocol):
    """What a :class:`Search` is given: trial fits on the run's flags (its precision, devices,
    accumulation, clipping, limits), each in a run of its own with no loggers, no checkpoints
    and no listeners but those it is given; the run asking is not touched."""

    def fit(
        self,
        task: Task,
        state: TrainState,
        train_dataloader: Any,
        *,
        steps: int,
        listeners: Sequence[Any] = (),
    ) -> TrainState:
        """Train ``state`` (consumed: give a copy) for at most ``steps`` optimizer steps on
        ``train_dataloader``, without validation; returns the state it ends with. The
        ``listeners`` hear the trial's events and may :class:`Stop` it."""
        ...


def _search_fn(instance: Any, attribute: Any, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"Search(fn={value!r}): pass a function trials -> requests or None")


@attrs.frozen
class Search:
    """A listener's request to run trial fits on copies of the state before the run goes on:
    what Lightning's tuner callbacks (``LearningRateFinder``, ``BatchSizeFinder``) do inside
    ``on_fit_start``.

    The driver calls ``fn(trials)`` during ``fit``, once the event has reached every listener
    and before its other requests are carried out; ``trials.fit(task, state, loader,
    steps=...)`` runs one trial (:class:`Trials`). ``fn`` returns requests of its own (a
    :class:`Transition` setting what it found, say), or None; they are carried out with the
    event's. A search in ``on_fit_start`` is followed by the fit fetching its loaders from
    the datamodule again (as Lightning's tuners reset them), so a datamodule's ``batch_size``
    set by the search is the one the fit trains with.

    Args:
        fn: ``fn(trials) -> requests``.
        name: what it is, for errors.

    Example:
        >>> import engine as eg
        >>> class TryFirst(eg.Listener):            # a trial of 2 steps before fitting
        ...     def on_fit_start(self, rec):
        ...         def trial(trials):
        ...             end = trials.fit(rec.run.task, rec.state.copy(),
        ...                              rec.run.train_dataloader, steps=2)
        ...             self.tried = end.step - rec.state.step
        ...         return eg.Search(trial, name="try first")
    """

    fn: Callable[[Trials], Any] = attrs.field(validator=_search_fn)
    name: str = ""


Request = Stop | Save | Log | Transition | Search
"""What a handler may return (or a list / tuple of them, or None)."""

_REQUESTS = (Stop, Save, Log, Transition, Search)


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

    ``rank_zero_only = True`` marks a listener whose work is a side effect of one process (a
    progress bar, a printed summary, a file it writes): in a multi-process run it hears events
    on rank 0 only. A listener that decides (stops, saves) runs on every rank, so every rank
    decides alike; the driver carries out its saves on rank 0.
    """

    rank_zero_only: bool = False

    #: ``False`` promises this listener never returns :class:`Stop`. When every listener of a
    #: data-parallel fit promises it, the ranks need not agree on a stop after each batch, and
    #: agree on signals every few batches instead: one collective less a batch.
    may_stop: bool = True

    #: Under ``Trainer(steps_per_call=K)``: ``True`` lets this listener's training batch events
    #: come once per block of up to K optimizer steps (the record is the block's last batch,
    #: ``rec.block`` every micro-batch's metrics), ending blocks at the multiples of
    #: :meth:`block_ends`. ``False`` (the default): it must see every batch, and the Trainer
    #: runs one step per call, saying so. Only listeners with training batch events are asked.
    handles_blocks: bool = False

    def block_ends(self) -> tuple[int, ...]:
        """With ``handles_blocks``: global-step intervals whose multiples must end a block
        (the steps at which this listener reads the state). Default: none."""
        return ()

    def block_starts(self) -> Collection[int] | None:
        """The global steps at which blocks must start, every other step running alone, in
        place of the Trainer's own rule (a replay's: the blocks its journal recorded, so that a
        compiled run makes the same calls again). Default ``None``: the Trainer's rule."""
        return None

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
    """Dispatches events to listeners and collects their requests; the handler table is built
    once, so an event nobody listens to costs one dict lookup."""

    def __init__(self, listeners: Iterable[Any]) -> None:
        self.listeners = list(listeners)
        for listener in self.listeners:
            check_listener(listener)
        self.dispatching: Event | None = None  # the event whose handlers are running
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

    def emit(self, event: Event, record: EventRecord) -> list[tuple[Any, Request]]:
        """Call the handlers of ``event`` with ``record``, in listener order; returns the
        requests they made, in that order, each with the listener that made it (empty when
        none). Carrying them out is the caller's: after this returns, so that every listener
        has had the event first.

        Raises:
            TypeError: when a handler returns something other than None, a request or a
                list / tuple of requests.
        """
        handlers = self.table.get(event)
        if not handlers:
            return []
        made: list[tuple[Any, Request]] = []
        outer, self.dispatching = self.dispatching, event
        try:
            for handle in handlers:
                out = handle(record)
                if out is not None:
                    _collect(made, handle, event, out)
        finally:
            self.dispatching = outer
        return made


def _collect(made: list[tuple[Any, Request]], handle: Any, event: Event, out: Any) -> None:
    listener = getattr(handle, "__self__", None)
    if isinstance(out, _REQUESTS):
        made.append((listener, out))
        return
    if isinstance(out, (list, tuple)) and all(isinstance(r, _REQUESTS) for r in out):
        made.extend((listener, r) for r in out)
        return
    who = type(listener).__name__ if listener is not None else repr(handle)
    if isinstance(listener, _FunctionListener):
        who = repr(listener)
    raise TypeError(
        f"{who}.{event.value} returned {out!r}; a handler returns None, a request "
        "(engine.Stop, engine.Save, engine.Log, engine.Transition, engine.Search) or a list or "
        "tuple of them"
    )
