"""What a Trainer's flags and plugins assemble, once, when it is built: the step transforms
of each slot, the strategy, the checkpoint IO (an :class:`Assembly`), and the default
listeners and loggers. A run composes its pipeline from it (:func:`pipeline`).

Plugins are sorted by the kind each declares (``plugin_kind``: see
:func:`engine.driver._checks.plugin_kind`), never by elimination; the flags were checked by
:func:`engine.driver.resolve.resolve` before anything here runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import attrs

from engine import listeners as made
from engine import transforms
from engine.driver._checks import plugins_by_kind
from engine.optim import clip_by_global_norm, clip_by_value
from engine.parallel.select import select_strategy
from engine.plan.config import LoopConfig
from engine.plan.flags import Flags
from engine.transforms.devices import resolve_devices

__all__ = ["Assembly", "assemble", "build_callbacks", "build_loggers", "pipeline"]


@attrs.frozen
class Assembly:
    """The parts a Trainer's flags and plugins chose (``trainer.assembly``, read-only): the
    transform of each slot of :func:`engine.transforms.compose` that does not change per run,
    the strategy and the checkpoint IO."""

    #: the placement: the plugged one, else the ``accelerator`` / ``devices`` flags' device
    placement: transforms.SingleDevice
    #: whether the placement was plugged in (then a strategy's per-rank device does not replace it)
    placement_plugged: bool
    #: the precision transform (plugged, or the ``precision`` flag's)
    precision: transforms.Transform
    #: anomaly detection (plugged, or ``detect_anomaly=True``'s), or ``None``
    anomaly: transforms.DetectAnomaly | None
    #: DP-SGD (:class:`engine.privacy.DPSGD`), or ``None``
    privacy: Any
    #: the plugged :class:`engine.checkpoint.CheckpointIO`, or ``None`` (the default one)
    checkpoint_io: Any
    #: how the work is spread over processes (:mod:`engine.parallel`)
    strategy: transforms.Strategy
    #: the processes on each node (``trainer.num_devices``)
    processes: int

    def placement_now(self) -> transforms.SingleDevice:
        """The placement: the plugged one, else this rank's device (the strategy's: a spawned
        process learns its local rank only once it runs), else the flags'."""
        placed = None if self.placement_plugged else self.strategy.root_device
        if placed is None or placed == self.placement.device:
            return self.placement
        return transforms.SingleDevice(placed, transfer=self.placement.transfer)


def assemble(flags: Flags, config: LoopConfig) -> Assembly:
    """The :class:`Assembly` of ``flags`` (resolved into ``config``)."""
    plugged = plugins_by_kind(flags.plugins)
    here = resolve_devices(flags.accelerator, flags.devices)
    placement = plugged.get("placement")
    anomaly = plugged.get("anomaly detection")
    precision = plugged.get("precision") or transforms.precision_transform(config.precision)
    return Assembly(
        placement=placement or transforms.SingleDevice(config.device),
        placement_plugged=placement is not None,
        precision=precision,
        anomaly=anomaly or (transforms.DetectAnomaly() if config.detect_anomaly else None),
        privacy=plugged.get("privacy"),
        checkpoint_io=plugged.get("checkpoint IO"),
        strategy=select_strategy(
            flags.strategy,
            processes=len(here),
            num_nodes=flags.num_nodes,
            devices=here,
            plugins=tuple(plugged.values()),
            sync_batchnorm=flags.sync_batchnorm,
        ),
        processes=len(here),
    )


def pipeline(
    assembly: Assembly,
    config: LoopConfig,
    task: Any,
    observe: transforms.Observe | None = None,
) -> transforms.Pipeline:
    """The step transforms the flags describe (``engine.transforms.compose``), for ``task``: a
    custom loop that composes the same gets the Trainer's results bitwise."""
    clip = None
    if config.gradient_clip_val:
        by = clip_by_global_norm if config.gradient_clip_algorithm == "norm" else clip_by_value
        clip = by(float(config.gradient_clip_val))
    placement = assembly.placement_now()
    if task is not None and task.transfer_batch_to_device is not None:
        placement = transforms.SingleDevice(
            placement.device, transfer=task.transfer_batch_to_device
        )
    return transforms.compose(
        placement=placement,
        precision=assembly.precision,
        observe=observe,
        strategy=assembly.strategy,
        privacy=assembly.privacy,
        clip=clip,
        accumulate=config.accumulate_grad_batches,
        compile=config.compile,
        detect_anomaly=assembly.anomaly or False,
    )


def build_loggers(logger: Any, config: LoopConfig) -> list[Any]:
    """The run's loggers: none with ``logger=False`` (and under ``fast_dev_run`` or
    ``barebones``), a :class:`~engine.loggers.TensorBoardLogger` by default."""
    if config.fast_dev_run or config.barebones or logger is False:
        return []
    if logger is None or logger is True:
        from engine.loggers import TensorBoardLogger

        return [TensorBoardLogger(config.default_root_dir)]
    # checked at construction (_checks.check_loggers)
    return list(logger) if isinstance(logger, (list, tuple)) else [logger]


def is_a(obj: Any, cls_name: str) -> bool:
    """Whether ``obj``'s class, or a base of it, is named ``cls_name`` (the listeners'
    classes, without importing them)."""
    return any(c.__name__ == cls_name for c in type(obj).__mro__)


def build_callbacks(callbacks: Any, config: LoopConfig, strategy: Any) -> list[Any]:
    """The run's listeners: the given ones, then those the flags turn on (the bar, the summary,
    ``ModelCheckpoint``, the journal, the ``max_time`` Timer), the checkpoint savers last."""
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        callbacks = [callbacks]  # one listener, as Lightning takes one Callback
    listeners = list(callbacks or [])

    def add(name: str, make: Callable[[], Any], first: bool = False) -> None:
        if not any(is_a(x, name) for x in listeners):
            listeners.insert(0, make()) if first else listeners.append(make())

    if config.enable_progress_bar:
        add("ProgressBar", made.ProgressBar)
    if config.enable_model_summary:
        add("ModelSummary", made.ModelSummary, first=True)
    savers = [x for x in listeners if is_a(x, "ModelCheckpoint")]
    if savers and not config.enable_checkpointing:
        raise ValueError(
            "Trainer(enable_checkpointing=False) was given a ModelCheckpoint in callbacks; "
            "drop one or the other"
        )
    if config.enable_checkpointing:
        add("ModelCheckpoint", made.ModelCheckpoint)  # as Lightning: the latest, every epoch
    unjournaled = strategy.not_journaled
    if unjournaled and any(is_a(x, "Journal") for x in listeners):
        raise ValueError(
            f"Trainer(callbacks=[Journal(...)]) with strategy {strategy!r}: "
            f"{unjournaled}; drop the Journal"
        )
    if config.enable_journal and unjournaled:
        warnings.warn(
            f"Trainer: no journal for this run (strategy {strategy!r}: "
            f"{unjournaled}); pass enable_journal=False to say so",
            stacklevel=3,
        )
    elif config.enable_journal:
        add("Journal", made.Journal)  # the run directory's record, for replay
    if config.max_time is not None:
        max_time = config.max_time
        add("Timer", lambda: made.Timer(max_time, interval="step", verbose=False))
    # as Lightning's _reorder_callbacks: checkpoints are written last in each event, so they
    # hold the other listeners' state after this event (EarlyStopping's check included)
    return [x for x in listeners if not is_a(x, "ModelCheckpoint")] + [
        x for x in listeners if is_a(x, "ModelCheckpoint")
    ]
