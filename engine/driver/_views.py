"""The Trainer's read-only faces: the resolved flags as attributes (:class:`FlagViews`, made
from :class:`~engine.plan.LoopConfig`'s fields), the run, the world and the listeners
(:class:`RunViews`), ``trainer.strategy`` as Lightning's users read it
(:class:`StrategyFlag`), and what replaces each Lightning attribute engine does not have
(:func:`missing_attribute`)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from engine.driver._profiling import Profiler
from engine.driver.assembly import Assembly, is_a
from engine.driver.run import Run, stepping_batches
from engine.plan.config import LoopConfig
from engine.state import TrainState
from engine.task import Task
from engine.transforms import Pipeline

__all__ = [
    "LIGHTNING_ATTRIBUTES",
    "FlagViews",
    "RunViews",
    "StrategyFlag",
    "missing_attribute",
]


def _flag(name: str) -> Any:
    def get(self: Any) -> Any:
        return getattr(self.config, name)

    return property(get, doc=f"The resolved ``{name}`` flag: ``config.{name}`` (read-only).")


class FlagViews:
    """The resolved flags as read-only attributes of the Trainer, where Lightning has them:
    ``trainer.max_epochs`` reads ``trainer.config.max_epochs`` (a frozen
    :class:`~engine.plan.LoopConfig`, resolved once when the Trainer is built). One property
    per field of the config, made from its fields (:func:`_views`): a field added there is a
    flag view here."""

    config: LoopConfig

    @property
    def strategy(self) -> str:
        """The resolved ``strategy`` flag (a str); Lightning's Strategy object's attributes
        on it say where engine keeps them (``trainer.strategy.root_device`` is
        ``trainer.root_device``)."""
        return StrategyFlag(self.config.strategy, self._strategy_object())

    def _strategy_object(self) -> Any:
        return None


def _views(cls: type) -> type:
    for field in attrs.fields(LoopConfig):
        if field.name not in cls.__dict__:
            setattr(cls, field.name, _flag(field.name))
    return cls


_views(FlagViews)


# Lightning's Trainer attributes engine has no attribute for, and what replaces each
LIGHTNING_ATTRIBUTES = {
    "lightning_module": "the model is the state: trainer.state.params / .buffers (its module, "
    "state.module, is a stateless template shared by the steps); to run it, "
    "engine.predict_step(fn)(state, batch) or engine.eval_step(fn)(state, batch), in eval mode "
    "without changing the template (in a listener: rec.state)",
    "model": "the model is the state: trainer.state.params / .buffers; run it with "
    "engine.predict_step(fn)(trainer.state, batch)",
    "optimizers": "the optimizer is trainer.task.tx (an engine.optim transformation) and its "
    "state trainer.state.opt_state; optim.get_hyperparams(state.opt_state) reads an injected lr",
    "optimizer": "the optimizer is trainer.task.tx and its state trainer.state.opt_state",
    "lr_scheduler_configs": "a schedule is a function of the step inside the optimizer "
    "(optim.adamw(optim.warmup_cosine(...))); stepped per epoch or on a metric, the listeners "
    "LearningRateSchedule and ReduceLROnPlateau",
    "lr_schedulers": "a schedule is a function of the step inside the optimizer "
    "(optim.adamw(optim.warmup_cosine(...))); the listeners LearningRateSchedule and "
    "ReduceLROnPlateau",
    "fit_loop": "the fit loop is a function, engine.loop.fit.fit; its position is "
    "trainer.global_step, trainer.current_epoch and trainer.state.batch_idx, its limits "
    "trainer.config (and trainer.estimated_stepping_batches)",
    "validate_loop": "validation runs in trainer.validate(); its counts are "
    "trainer.num_val_batches",
    "test_loop": "testing runs in trainer.test(); its counts are trainer.num_test_batches",
    "predict_loop": "prediction runs in trainer.predict(); its counts are "
    "trainer.num_predict_batches",
    "precision_plugin": "the precision is trainer.precision (the flag) and a step transform, "
    "engine.transforms.precision_transform(trainer.precision); its state (a loss scale) is "
    "trainer.state.precision",
    "scaler": "the loss scale is state: trainer.state.precision (precision='16-mixed')",
    "training": "trainer.stage == 'fit' (and not trainer.sanity_checking)",
    "validating": "trainer.stage == 'validate', or a validation event of fit (on_validation_*)",
    "testing": "trainer.stage == 'test'",
    "predicting": "trainer.stage == 'predict'",
    "is_last_batch": "in a listener, rec.batch_idx + 1 == rec.run.num_training_batches",
    "val_dataloaders": "the loaders given to fit(val_dataloaders=...) or the datamodule's "
    "val_dataloader() (trainer.datamodule)",
    "test_dataloaders": "the loaders given to test() or the datamodule's test_dataloader()",
    "predict_dataloaders": "the loaders given to predict() or the datamodule's "
    "predict_dataloader()",
    "checkpoint_connector": "checkpoints: trainer.save_checkpoint(path), "
    "fit(ckpt_path=...), engine.checkpoint.load / read_meta",
    "init_module": "build the module as usual and make the state with task.init(model, seed=...)",
    "tuner": "the tuner is engine.Tuner(trainer): tuner.lr_find(task, state, loader) and "
    "tuner.scale_batch_size(task, state, loader); or the listeners LearningRateFinder and "
    "BatchSizeFinder",
    "interrupted": "a SIGTERM/SIGINT during fit saves a checkpoint and exits; fit() raises on "
    "an interruption",
    "received_sigterm": "a SIGTERM during fit saves a checkpoint and exits (engine handles it)",
}


# Lightning's Strategy attributes, and where engine keeps each
_STRATEGY_ATTRIBUTES = {
    "root_device": "trainer.root_device",
    "world_size": "trainer.world_size",
    "global_rank": "trainer.global_rank",
    "local_rank": "trainer.local_rank",
    "is_global_zero": "trainer.is_global_zero",
    "num_processes": "trainer.num_devices",
    "precision_plugin": "trainer.precision (the flag) and its step transform",
    "checkpoint_io": "Trainer(plugins=[an engine.checkpoint.CheckpointIO])",
    "model": "trainer.state (the model's tensors)",
    "lightning_module": "trainer.state (the model's tensors)",
    "optimizers": "trainer.task.tx and trainer.state.opt_state",
    "barrier": "trainer.strategy.barrier()",
}


class StrategyFlag(str):
    """``trainer.strategy``: the flag's value, a str (``"auto"``), as Lightning's flag is
    given. The rank facts and collectives of Lightning's Strategy object read on it come from
    the run's strategy (``trainer.strategy.barrier()``, ``.world_size``, ``.broadcast(obj)``);
    any other attribute of Lightning's says where engine keeps it."""

    _DELEGATED = frozenset(
        (
            "world_size",
            "global_rank",
            "local_rank",
            "node_rank",
            "is_global_zero",
            "barrier",
            "broadcast",
        )
    )

    def __new__(cls, value: str, strategy: Any = None) -> StrategyFlag:
        out = super().__new__(cls, value)
        out.__dict__["_strategy"] = strategy
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        strategy = self.__dict__.get("_strategy")
        if strategy is not None and name in self._DELEGATED:
            return getattr(strategy, name)
        instead = _STRATEGY_ATTRIBUTES.get(name)
        where = f"Lightning's trainer.strategy.{name} is {instead}" if instead else ""
        raise AttributeError(
            f"trainer.strategy is the strategy flag's value ({str(self)!r}), not Lightning's "
            f"Strategy object, and has no attribute {name!r}" + (f": {where}" if where else "")
        )


def missing_attribute(owner: str, name: str) -> AttributeError:
    """The error for ``owner.name`` where ``name`` is a Lightning attribute engine replaces."""
    instead = LIGHTNING_ATTRIBUTES.get(name)
    if instead is None:
        return AttributeError(f"'{owner}' object has no attribute '{name}'")
    return AttributeError(
        f"'{owner}' object has no attribute '{name}' (Lightning's trainer.{name}): {instead}"
    )


class RunViews(FlagViews):
    """The Trainer's read-only attributes besides the flags, where Lightning has them: the
    current or last call's record (its :class:`~engine.driver.run.Run`), the world's facts (the
    strategy's), the listeners and loggers by kind, and what the flags assembled."""

    _run: Run
    _assembly: Assembly
    _profiler: Profiler
    loggers: list[Any]
    callbacks: list[Any]

    def _strategy_object(self) -> Any:
        return self._assembly.strategy

    @property
    def assembly(self) -> Assembly:
        """What the flags and plugins chose: the strategy, the precision transform, the
        placement, anomaly detection, DP-SGD and the checkpoint IO (read-only)."""
        return self._assembly

    @property
    def pipeline(self) -> Pipeline:
        """The current or last run's step transforms (``engine.transforms.compose``): a
        custom loop that applies the same gets this Trainer's results bitwise."""
        return self._run.pipeline

    @property
    def state(self) -> TrainState | None:
        """The latest state of the current or last run."""
        return self._run.state

    @property
    def task(self) -> Task | None:
        """The task of the current or last run (a fit's with ``total_steps="auto"`` resolved)."""
        return self._run.task

    @property
    def stage(self) -> str | None:
        """``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``: the current or last call."""
        return self._run.stage

    @property
    def sanity_checking(self) -> bool:
        """Whether the fit's sanity check is running."""
        return self._run.sanity_checking

    @property
    def should_stop(self) -> bool:
        """Whether a listener asked the current or last fit to stop (``engine.Stop``)."""
        return self._run.progress.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        raise AttributeError(
            f"trainer.should_stop = {value!r}: the loop's progress is not set from outside; a "
            "listener returns engine.Stop('why') from an event (Lightning's "
            "trainer.should_stop = True), which the driver carries out after the event"
        )

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest value of every metric logged (Lightning's ``trainer.callback_metrics``)."""
        return self._run.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The latest value of every metric sent to the loggers."""
        return self._run.logged_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The metrics the progress bar shows."""
        return self._run.progress_bar_metrics

    @property
    def num_training_batches(self) -> float:
        """Training batches per epoch after ``limit_train_batches`` (the current epoch's)."""
        return self._run.progress.num_training_batches

    @property
    def num_val_batches(self) -> list[float]:
        """Batches of each validation loader after ``limit_val_batches``."""
        return self._run.num_val_batches

    @property
    def num_test_batches(self) -> list[float]:
        """Batches of each test loader after ``limit_test_batches``."""
        return self._run.num_test_batches

    @property
    def num_predict_batches(self) -> list[float]:
        """Batches of each prediction loader after ``limit_predict_batches``."""
        return self._run.num_predict_batches

    @property
    def train_dataloader(self) -> Any:
        """What the current or last fit trains on (Lightning's attribute)."""
        return self._run.train_dataloader

    @property
    def datamodule(self) -> Any:
        """The datamodule the current or last call was given."""
        return self._run.datamodule

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint the current or last call resumed from."""
        return self._run.ckpt_path

    @property
    def profile(self) -> dict[str, list[float]]:
        """The simple profiler's timings of the last run, by action (``profiler="simple"``)."""
        return self._profiler.profile

    @property
    def root_device(self) -> torch.device:
        """The device the run lives on (Lightning's ``trainer.strategy.root_device``)."""
        return self._assembly.placement_now().device

    @property
    def num_devices(self) -> int:
        """The devices (processes) the run uses on each node (Lightning's
        ``trainer.num_devices``)."""
        return self._assembly.processes

    @property
    def world_size(self) -> int:
        """The processes of the run, on every node (the strategy's)."""
        return self._assembly.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among them."""
        return self._assembly.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self._assembly.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """This process's node."""
        return self._assembly.strategy.node_rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0, the process that writes logs and checkpoints."""
        return self._assembly.strategy.is_global_zero

    @property
    def device_ids(self) -> list[int]:
        """The indices of the devices the run uses (Lightning's ``trainer.device_ids``)."""
        return [self.root_device.index or 0]

    @property
    def logger(self) -> Any:
        """The first logger, or ``None`` without one (Lightning's ``trainer.logger``)."""
        return self.loggers[0] if self.loggers else None

    def _listeners(self, name: str) -> list[Any]:
        return [x for x in self.callbacks if is_a(x, name)]

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        """The :class:`~engine.listeners.ModelCheckpoint` listeners, in order."""
        return self._listeners("ModelCheckpoint")

    @property
    def checkpoint_callback(self) -> Any:
        """The first :class:`~engine.listeners.ModelCheckpoint`, or ``None`` (Lightning's
        ``trainer.checkpoint_callback``: its ``best_model_path``, ``last_model_path``...)."""
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def early_stopping_callbacks(self) -> list[Any]:
        """The :class:`~engine.listeners.EarlyStopping` listeners, in order."""
        return self._listeners("EarlyStopping")

    @property
    def early_stopping_callback(self) -> Any:
        """The first :class:`~engine.listeners.EarlyStopping`, or ``None`` (Lightning's
        ``trainer.early_stopping_callback``)."""
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def progress_bar_callback(self) -> Any:
        """The :class:`~engine.listeners.ProgressBar`, or ``None``."""
        return next(iter(self._listeners("ProgressBar")), None)

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps the fit takes, as Lightning estimates them: ``max_steps`` when
        epochs are unlimited (``inf`` when both are); else ``ceil(num_training_batches /
        accumulate_grad_batches) * max(max_epochs, 1)``, capped by ``max_steps`` when it is set
        (an unsized training loader: ``max_steps``). It counts the whole run from step 0 under
        this Trainer's flags, so a resume that raised ``max_epochs`` reads the longer run.

        A schedule gets it without computing it: ``total_steps="auto"``
        (:class:`engine.optim.AutoLength`), resolved when the fit starts.

        Raises:
            RuntimeError: when epochs count and no fit has been given its training data yet
                (Lightning asks the module for its loader; engine's come with ``fit``).
        """
        return stepping_batches(self.config, self._run.train_dataloader)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (Lightning's ``trainer.global_step``)."""
        return self._run.global_step

    @property
    def current_epoch(self) -> int:
        """Completed epochs; incremented after ``on_train_epoch_end`` (as in Lightning)."""
        return self._run.current_epoch

    @property
    def log_dir(self) -> str | None:
        """The first logger's directory, else ``default_root_dir``."""
        return self._run.log_dir

    @property
    def run_dir(self) -> str | None:
        """The run directory the journal writes (see :func:`engine.replay`): the first logger's
        ``log_dir``, or ``<default_root_dir>/lightning_logs/version_N`` without one;
        ``None`` before a fit or without a journal."""
        return self._run.run_dir
