"""engine: a functional training engine for PyTorch.

Pure step functions over a frozen :class:`TrainState`, functional optimizers in
:mod:`engine.optim`, and (in later releases) a thin ``Trainer`` driver with Lightning's loop
semantics and bitwise-exact resume.
"""

from engine import optim, rng
from engine.events import Event, EventRecord, Listener, Stop, on
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

__version__ = "0.1.0"

__all__ = [
    "ConsumedStateError",
    "Event",
    "EventRecord",
    "Listener",
    "Stop",
    "Task",
    "Trainer",
    "on",
    "EvalStep",
    "ModelView",
    "PredictStep",
    "TrainState",
    "TrainStep",
    "__version__",
    "eval_step",
    "optim",
    "predict_step",
    "rng",
    "train_step",
]
