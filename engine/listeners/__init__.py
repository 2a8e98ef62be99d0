"""Listeners: the Trainer's Lightning-style callbacks, as objects that react to events.

Each listener has methods named after :class:`~engine.events.Event` values; it reads the
immutable :class:`~engine.events.EventRecord` (state, metrics, and ``rec.run``, the run's
read-only :class:`~engine.events.RunView`) and may return requests, which the driver carries out
once the event has reached every listener: :class:`~engine.events.Stop` (stop fitting),
:class:`~engine.events.Save` (write a checkpoint), :class:`~engine.events.Log` (log metrics).
No listener holds the Trainer.
Those with state worth checkpointing (``EarlyStopping``, ``Timer``) implement ``state_dict`` /
``load_state_dict``.

========================  ======================================================
:class:`ProgressBar`      tqdm bars for the training, validation, test and predict loops
:class:`ModelSummary`     a table of layers and parameter counts when fitting starts
:class:`EarlyStopping`    stop when a monitored metric stops improving
:class:`ModelCheckpoint`  save checkpoints while fitting; keep the best k by a metric
:class:`LearningRateMonitor`  log the learning rate (metric ``"lr"``) with the loggers
:class:`Timer`            time each loop; stop when a time budget is spent
:class:`ReduceLROnPlateau`  cut the learning rate when a monitored metric plateaus
:class:`LearningRateSchedule`  a schedule stepped per epoch (Lightning's ``interval``)
:class:`EMAWeightAveraging`  evaluate and finish with the weights' moving average
:class:`StochasticWeightAveraging`  Lightning's SWA: average per epoch, SWALR, BatchNorm
:class:`Finetuning`       freeze and unfreeze parameter groups by epoch
:class:`BackboneFinetuning`  Lightning's backbone schedule
:class:`LearningRateFinder`  a learning-rate range test when the fit starts (Lightning's)
:class:`BatchSizeFinder`  the largest batch size that fits in memory, when the fit starts
========================  ======================================================

Example:
    >>> from engine.listeners import EarlyStopping, LearningRateMonitor, Timer
    >>> listeners = [EarlyStopping("val/loss", patience=5), LearningRateMonitor("step"),
    ...              Timer(duration="00:01:00:00")]
"""

from engine.listeners.averaging import EMAWeightAveraging, StochasticWeightAveraging, swalr
from engine.listeners.batch_size_finder import BatchSizeFinder, is_oom_error
from engine.listeners.checkpoint import ModelCheckpoint
from engine.listeners.early_stopping import EarlyStopping, EarlyStoppingReason
from engine.listeners.finetuning import (
    BackboneFinetuning,
    Finetuning,
    FinetuningTransition,
    multiplicative,
)
from engine.listeners.journal import Journal
from engine.listeners.lr_finder import LearningRateFinder, LRFinderResult, lr_grid
from engine.listeners.lr_monitor import LearningRateMonitor
from engine.listeners.lr_schedule import LearningRateSchedule, ReduceLROnPlateau
from engine.listeners.prediction_writer import BasePredictionWriter
from engine.listeners.progress import ProgressBar
from engine.listeners.summary import ModelSummary, summarize
from engine.listeners.timer import Timer, parse_duration

__all__ = [
    "BackboneFinetuning",
    "BasePredictionWriter",
    "BatchSizeFinder",
    "EMAWeightAveraging",
    "EarlyStopping",
    "EarlyStoppingReason",
    "Finetuning",
    "FinetuningTransition",
    "Journal",
    "LRFinderResult",
    "LearningRateFinder",
    "LearningRateMonitor",
    "LearningRateSchedule",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "ReduceLROnPlateau",
    "StochasticWeightAveraging",
    "Timer",
    "is_oom_error",
    "lr_grid",
    "multiplicative",
    "parse_duration",
    "summarize",
    "swalr",
]
