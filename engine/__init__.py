"""engine: a functional training engine for PyTorch.

Pure step functions over a frozen :class:`TrainState`, functional optimizers in
:mod:`engine.optim`, and a thin :class:`Trainer` driver with Lightning's flags, loop semantics
and hook names, whose listeners (:mod:`engine.listeners`) and loggers (:mod:`engine.loggers`)
react to events but cannot change the state: a listener reads a read-only view of the run and
returns requests (:class:`Stop`, :class:`Save`, :class:`Log`) that the driver carries out.
Checkpoints (:mod:`engine.checkpoint`) resume a run exactly, and :func:`replay` re-executes a
journaled run and checks it bitwise. :class:`Tuner` searches a learning rate and a batch size
as Lightning's tuner does, on copies of the state. Research pieces: :mod:`engine.ensemble`
trains E models (an ensemble, or a hyperparameter sweep) in one vmapped step;
:func:`per_example_grads` and :mod:`engine.privacy` (DP-SGD as a step transform);
:mod:`engine.meta` (MAML through the optimizers' differentiable form).
"""

# _torch_check first: on a torch older than engine supports, importing engine stops there with
# a message that names the versions, before any module fails on a missing torch API
from engine import _torch_check  # noqa: F401  # isort: skip
from engine import (
    checkpoint,
    data,
    ensemble,
    listeners,
    loggers,
    meta,
    optim,
    privacy,
    rng,
    transforms,
    tuner,
)
from engine._version import __version__
from engine.events import (
    Event,
    EventRecord,
    Listener,
    Log,
    RunView,
    Save,
    Search,
    Stop,
    Transition,
    on,
)
from engine.listeners import (
    BatchSizeFinder,
    EarlyStopping,
    Journal,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from engine.loggers import CSVLogger, TensorBoardLogger
from engine.metrics import LogOptions
from engine.per_example import per_example_grads
from engine.replaying import Divergence, ReplayError, ReplayReport, UntrustedCodeError, replay
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
from engine.tuner import Tuner

__all__ = [
    "CSVLogger",
    "ConsumedStateError",
    "Divergence",
    "EarlyStopping",
    "BatchSizeFinder",
    "Journal",
    "LearningRateFinder",
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
    "Search",
    "Stop",
    "Task",
    "Trainer",
    "Tuner",
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
    "ensemble",
    "eval_step",
    "listeners",
    "loggers",
    "meta",
    "optim",
    "per_example_grads",
    "predict_step",
    "privacy",
    "replay",
    "rng",
    "transforms",
    "train_step",
    "tuner",
    "LogOptions",
]
