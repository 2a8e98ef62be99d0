"""The Trainer: Lightning's fit / validate / test / predict as a thin driver over pure steps.

The driver owns loop limits and the validation schedule, calls the steps built from a
:class:`~engine.task.Task`, keeps host-side metrics, and emits :class:`~engine.events.Event` s.
It never reaches inside a step, and no listener reaches into it: a listener reads ``rec.run``
(a read-only :class:`~engine.events.RunView`) and returns requests (``Stop``, ``Save``,
``Log``), which the driver carries out once the event has reached every listener. The loop
semantics (which batches train, when the optimizer steps, when validation runs, what
``global_step`` / ``current_epoch`` read) follow Lightning 2.x; ``tests/test_lightning_parity.py``
runs the same configurations through Lightning itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from engine.driver import evaluating, fitting
from engine.driver._profiling import Profiler
from engine.driver._signals import SignalCatcher
from engine.driver._views import RunViews, missing_attribute
from engine.driver.assembly import assemble, build_callbacks, build_loggers
from engine.driver.resolve import resolve
from engine.driver.run import Run
from engine.parallel.environments import LAUNCHED_BY_VAR
from engine.plan.flags import Flags
from engine.state import TrainState
from engine.task import Task

__all__ = ["Trainer"]


class Trainer(RunViews):
    """Lightning's ``Trainer``, as a driver of pure steps. Flags keep Lightning's names,
    defaults and meanings.

    ``fit`` returns the final :class:`TrainState`; ``validate`` / ``test`` return one dict of
    floats per dataloader; ``predict`` returns the outputs (a list per dataloader when there are
    several).

    Engine-specific: ``compile`` (``True`` or ``torch.compile`` options) compiles the train and
    eval steps; ``steps_per_call`` (Keras's ``steps_per_execution``, default 1) runs that many
    optimizer steps per call of the training step, one graph under ``compile`` (see
    ``docs/guide.md``: blocks end where the loop must see the state, batch events come
    once per block, and listeners that must see every step make it 1, saying so);
    ``enable_journal`` (default ``True``, off with ``barebones`` and
    ``fast_dev_run``) adds a :class:`~engine.listeners.Journal`, so each fit leaves a run
    directory that :func:`engine.replay` can re-execute and check bitwise. The flags
    ``precision`` takes Lightning's six precisions and their aliases
    (:mod:`engine.transforms.precision`), ``accelerator`` / ``devices`` one CPU, CUDA or MPS
    device or several (:mod:`engine.transforms.devices`); ``plugins`` takes engine's precision
    transforms, placement, anomaly detection, :class:`~engine.privacy.DPSGD` and
    :class:`~engine.checkpoint.CheckpointIO`; ``strategy`` the data-parallel and fully sharded
    strategies (:mod:`engine.parallel`). Lightning 2.6's ``enable_autolog_hparams`` decides
    whether the task's ``hparams`` go to the loggers; its ``model_registry`` (an upload to
    Lightning AI's hosted registry) takes only ``None``.

    The flags are checked and resolved once, into ``trainer.config`` (a frozen
    :class:`~engine.plan.LoopConfig`: Lightning's defaults filled in, ``fast_dev_run`` and
    ``barebones`` applied); ``trainer.max_epochs`` and the other flags read it. When to validate
    and when to stop are the pure predicates of :mod:`engine.plan.schedule`, which the listeners
    ask too.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
        >>> data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(4)]
        >>> trainer = eg.Trainer(max_epochs=2, barebones=True)
        >>> state = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), train_dataloaders=data)
        >>> trainer.global_step, trainer.current_epoch
        (8, 2)
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        num_nodes: int = 1,
        precision: int | str | None = None,
        logger: Any = None,
        callbacks: Any = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        profiler: str | None = None,
        detect_anomaly: bool = False,
        barebones: bool = False,
        plugins: Any = None,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: str | os.PathLike[str] | None = None,
        compile: bool | Mapping[str, Any] = False,
        steps_per_call: int = 1,
        enable_journal: bool | None = None,
        enable_autolog_hparams: bool = True,
        model_registry: str | None = None,
    ) -> None:
        # every flag checked and resolved, once; the loop and the listeners read this record
        flags = Flags(**{name: value for name, value in locals().items() if name != "self"})
        self.config = resolve(flags)
        self._assembly = assemble(flags, self.config)
        self.loggers = build_loggers(logger, self.config)
        self.callbacks = build_callbacks(callbacks, self.config, self._assembly.strategy)
        self._profiler = Profiler(self.config.profiler)
        self._inside_launch = False  # a launcher's processes run the entry point itself
        # the current or last call's record: what the properties below read
        self._run = Run(self.config, self._assembly, self.loggers, self.callbacks, facade=self)

    # ------------------------------------------------------------------ outside a run

    def __getattr__(self, name: str) -> Any:
        # only for names not found otherwise: a Lightning attribute says what replaces it
        raise missing_attribute(type(self).__name__, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send host-side metrics to every logger and record them as logged/callback metrics.

        For the driver and for code outside events; a listener returns
        :class:`~engine.events.Log` instead.
        """
        self._run.log_metrics(metrics, step)

    def save_checkpoint(
        self,
        filepath: str | os.PathLike[str],
        *,
        metrics: Mapping[str, float] | None = None,
        asynchronous: bool = False,
        weights_only: bool = False,
    ) -> Any:
        """Save the current state, the listeners' states and the loop position to ``filepath``.

        The checkpoint determines the rest of the run: ``fit(..., ckpt_path=filepath)`` continues
        it. See :func:`engine.checkpoint.save` for the format and the guarantees. With
        ``asynchronous=True`` only a snapshot blocks and the write happens in the background
        (:func:`engine.checkpoint.save_async`); returns a future of the path instead of the path.
        A run waits for its pending saves before it ends. ``weights_only=True`` saves the model
        alone (Lightning's meaning): ``validate`` / ``test`` / ``predict`` can start from it,
        ``fit`` cannot.

        For code outside events (after ``fit``, say). A listener returns
        :class:`~engine.events.Save` instead, which the driver carries out through this method
        once the event has reached every listener.

        Raises:
            RuntimeError: before a run, or when called while an event is being dispatched (from
                a handler that holds the trainer): return ``engine.Save(path)`` there.
        """
        return self._run.save_checkpoint(
            filepath, metrics=metrics, asynchronous=asynchronous, weights_only=weights_only
        )

    def fit(
        self,
        task: Task,
        state: TrainState,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | None = None,
    ) -> TrainState:
        """Train ``state`` and return the final state.

        Args:
            task: the loss, optimizer and evaluation functions.
            state: the initial state (consumed: the steps donate its tensors).
            train_dataloaders: an iterable of batches (or a datamodule).
            val_dataloaders: one iterable or a list of them.
            datamodule: an object with ``train_dataloader()`` / ``val_dataloader()`` methods.
            ckpt_path: resume from a checkpoint: a path, ``"last"`` or ``"best"`` (of the
                ``ModelCheckpoint`` listener). ``state`` then gives only the structure (model and
                optimizer); every value comes from the checkpoint.

        With ``devices=N`` and no launcher of its own (torchrun, SLURM), the Trainer starts the
        other processes: ``strategy="ddp"`` runs the script again in each (they reach this
        call and join), ``"ddp_spawn"`` runs this call in new processes and returns rank 0's
        final state here.
        """
        return self._launching(
            "fit", task, state, train_dataloaders, val_dataloaders, datamodule, ckpt_path
        )

    def validate(
        self,
        task: Task | None = None,
        state: TrainState | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; returns one dict of metrics per dataloader.

        ``task`` and ``state`` may be left out after a fit of this Trainer, as Lightning's
        ``trainer.validate(ckpt_path=...)`` without a model: the fit's task, and its final state
        (the structure a ``ckpt_path`` is loaded into; with no ``ckpt_path`` and a
        ``ModelCheckpoint`` that ranked checkpoints, its best one, with a warning).
        """
        task, state, ckpt_path = evaluating.inputs(self._run, "validate", task, state, ckpt_path)
        return self._launching(
            "validate", "validation", task, state, dataloaders, datamodule, ckpt_path, verbose
        )

    def test(
        self,
        task: Task | None = None,
        state: TrainState | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns one dict of metrics per dataloader.

        ``task`` and ``state`` may be left out after a fit of this Trainer, as Lightning's
        ``trainer.test(ckpt_path=...)`` without a model: the fit's task, and its final state
        (the structure a ``ckpt_path`` is loaded into; with no ``ckpt_path`` and a
        ``ModelCheckpoint`` that ranked checkpoints, its best one, with a warning).
        """
        task, state, ckpt_path = evaluating.inputs(self._run, "test", task, state, ckpt_path)
        return self._launching(
            "test", "test", task, state, dataloaders, datamodule, ckpt_path, verbose
        )

    def predict(
        self,
        task: Task | None = None,
        state: TrainState | None = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
    ) -> list[Any] | None:
        """Run prediction; returns the outputs (a list per dataloader when there are several:
        under several processes, this rank's shard's). ``task`` and ``state`` may be left out
        after a fit, as in :meth:`test`."""
        task, state, ckpt_path = evaluating.inputs(self._run, "predict", task, state, ckpt_path)
        return self._launching(
            "predict", task, state, dataloaders, datamodule, return_predictions, ckpt_path
        )

    def _launching(self, stage: str, *args: Any) -> Any:
        """Run the stage on every process of the run: started by the strategy's launcher where
        it has one (then rank 0's result comes back), else here, in the process group the
        strategy joins."""
        launcher = None if self._inside_launch else self._assembly.strategy.launcher
        if launcher is None:
            return self._stage(stage, args)
        return launcher.launch(_launched, self, stage, args)

    def _launched_stage(self, stage: str, args: tuple[Any, ...]) -> Any:
        """The stage in a process a launcher started: no launching again; a spawned run's
        caller gets what the strategy says goes back (a sharded state gathered whole)."""
        self._inside_launch = True
        try:
            out = self._stage(stage, args)
            if os.environ.get(LAUNCHED_BY_VAR, "").startswith("spawn:"):
                out = self._assembly.strategy.spawned_result(out)  # every rank joins
            return out
        finally:
            self._inside_launch = False

    def _stage(self, stage: str, args: tuple[Any, ...]) -> Any:
        """The stage in this process, with a new :class:`~engine.driver.run.Run`."""
        signals = SignalCatcher()
        with signals.catching(stage == "fit"):  # from before the rendezvous
            self._assembly.strategy.setup()
            run = self._run = Run(
                self.config,
                self._assembly,
                self.loggers,
                self.callbacks,
                stage=stage,
                previous=self._run,
                signals=signals,
                facade=self,
            )
            if stage == "fit":
                return fitting.fit(run, self._profiler, *args)
            if stage == "predict":
                return evaluating.predict(run, self._profiler, *args)
            return evaluating.evaluate(run, self._profiler, *args)


def _launched(trainer: Trainer, stage: str, args: tuple[Any, ...]) -> Any:
    """A stage in a process a launcher started (or in rank 0 of the launching one): it joins
    the run's process group and runs, without launching again."""
    return trainer._launched_stage(stage, args)
