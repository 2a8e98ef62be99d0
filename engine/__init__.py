"""engine: a functional training engine for PyTorch.

Pure step functions over a frozen :class:`TrainState`, functional optimizers in
:mod:`engine.optim`, and a thin :class:`Trainer` driver with Lightning's flags, loop semantics
and hook names, whose listeners (:mod:`engine.listeners`) and loggers (:mod:`engine.loggers`)
react to events but cannot change the state: a listener reads a read-only view of the run and
returns requests (:class:`Stop`, :class:`Save`, :class:`Log`) that the driver carries out.
Checkpoints (:mod:`engine.checkpoint`) resume a run exactly, and :func:`replay` re-executes a
journaled run and checks it bitwise.
"""

from engine import checkpoint, data, listeners, loggers, meta, optim, rng, transforms
from engine._replay import Divergence, ReplayError, ReplayReport, UntrustedCodeError, replay
from engine._version import __version__
from engine.events import (
    Event,
    EventRecord,
    Listener,
    Log,
    RunView,
    Save,
    Stop,
    Transition,
    on,
)
from engine.listeners import (
    EarlyStopping,
    Journal,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from engine.loggers import CSVLogger, TensorBoardLogger
from engine.metrics import LogOptions
from engine.state import ConsumedStateError, TrainState
from engine.step import (
    EvalStep,
    ModelView,
    PredictStep,
    TrainStep,
    eval_step,
    predict_step,
    train_step,
)
from engine.task import Task
from engine.trainer import Trainer

__all__ = [
    "CSVLogger",
    "ConsumedStateError",
    "Divergence",
    "EarlyStopping",
    "Journal",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "ReplayError",
    "ReplayReport",
    "TensorBoardLogger",
    "Timer",
    "Event",
    "EventRecord",
    "Listener",
    "Log",
    "RunView",
    "Save",
    "Stop",
    "Task",
    "Trainer",
    "UntrustedCodeError",
    "on",
    "EvalStep",
    "ModelView",
    "PredictStep",
    "TrainState",
    "TrainStep",
    "Transition",
    "__version__",
    "checkpoint",
    "data",
    "eval_step",
    "listeners",
    "loggers",
    "meta",
    "optim",
    "predict_step",
    "replay",
    "rng",
    "transforms",
    "train_step",
    "LogOptions",
]
