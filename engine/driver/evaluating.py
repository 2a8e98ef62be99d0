"""The validate, test and predict stages, top to bottom: the datamodule set up and asked for
its loaders, the loaders prepared and counted, then, in the run's context, the step built and
the evaluation loop (:mod:`engine.loop.evaluate`) over the :class:`~engine.driver.run.Run`."""

from __future__ import annotations

from typing import Any

from engine import data
from engine.data import is_datamodule, resolve_loaders, setup_datamodule
from engine.driver.context import running
from engine.driver.restore import datamodule_first
from engine.driver.run import Run
from engine.driver.services import EvalServices
from engine.events import Event
from engine.loop import evaluate as eval_loops
from engine.state import TrainState
from engine.task import Task

__all__ = ["evaluate", "inputs", "predict"]


def inputs(
    previous: Run, stage: str, task: Task | None, state: TrainState | None, ckpt_path: Any
) -> tuple[Task, TrainState, Any]:
    """The task, state and checkpoint a ``validate`` / ``test`` / ``predict`` call runs with,
    where it left them out, as Lightning's ``trainer.test(ckpt_path=...)`` without a model:
    the task and state of this Trainer's last fit (the state, when a checkpoint is named,
    gives only the structure); with neither a state nor a checkpoint after a fit with a
    ``ModelCheckpoint`` that ranked one, its best checkpoint, with a warning, as Lightning.

    Raises:
        ValueError: nothing to run with: no task or state given and no fit in this Trainer.
    """
    fitted = previous.fitted
    if task is None:
        if fitted is None:
            raise ValueError(
                f"Trainer.{stage}() needs the task (its evaluation functions): pass "
                f"trainer.{stage}(task, state, ...); only after a fit does this Trainer know one"
            )
        task = fitted[0]
    if state is None:
        if fitted is None:
            raise ValueError(
                f"Trainer.{stage}(task, state=None, ckpt_path={ckpt_path!r}): a checkpoint holds "
                "values, not the model's structure; pass a state to load it into "
                f"(task.init(model)), as Lightning's trainer.{stage}(model, ckpt_path=...) "
                "takes the model, or call it after a fit of this Trainer"
            )
        state = fitted[1]
        if ckpt_path is None:
            best = next(
                (
                    x.best_model_path
                    for x in previous.callbacks
                    if getattr(x, "best_model_path", None) and getattr(x, "monitor", None)
                ),
                None,
            )
            if best:
                import warnings

                warnings.warn(
                    f"Trainer.{stage}() without a state or a ckpt_path after a fit: the best "
                    f"checkpoint of that fit is used ({best}), as Lightning does; pass "
                    "ckpt_path='best', 'last' or a path to choose (and silence this)",
                    UserWarning,
                    stacklevel=4,
                )
                ckpt_path = "best"
    return task, state, ckpt_path


def _loaders(
    run: Run, stage: str, kind: str, method: str, dataloaders: Any, datamodule: Any, ckpt: Any
) -> tuple[list[Any], Any]:
    """The stage's loaders (the datamodule's, set up first and given its checkpointed state),
    prepared for this rank and agreed on by every rank."""
    if datamodule is None and is_datamodule(dataloaders):
        datamodule, dataloaders = dataloaders, None
    if datamodule is not None:
        setup_datamodule(datamodule, stage, run.facade)
    run.evaluating(datamodule)
    datamodule_first(run, ckpt, datamodule)
    loaders = run.prepare_loaders(kind, resolve_loaders(stage, dataloaders, datamodule, method))
    run.strategy.agree_loaders()
    if not loaders:
        raise ValueError(f"Trainer.{stage}() needs dataloaders= or a datamodule with {method}()")
    return loaders, datamodule


def evaluate(
    run: Run,
    profiler: Any,
    kind: str,
    task: Task,
    state: TrainState,
    dataloaders: Any,
    datamodule: Any,
    ckpt_path: str | None,
    verbose: bool,
) -> list[dict[str, float]]:
    """``Trainer.validate`` (``kind="validation"``) or ``Trainer.test`` (``"test"``) in this
    process (see there)."""
    stage = run.stage
    assert stage is not None
    method = "val_dataloader" if kind == "validation" else "test_dataloader"
    short = "val" if kind == "validation" else "test"
    loaders, datamodule = _loaders(run, stage, short, method, dataloaders, datamodule, ckpt_path)
    limits = run.count_batches(kind, loaders)
    with running(run, profiler, task, state, ckpt_path, datamodule):
        make = task.eval_step if kind == "validation" else task.test_step
        step = profiler.timed(
            f"{kind}_step",
            make(transforms=run.pipeline, inference_mode=run.config.inference_mode),
        )
        assert run.state is not None  # placed by running
        state, progress, results = eval_loops.evaluate(
            kind, EvalServices(run, step), run.state, run.progress, loaders, limits, log=True
        )
        run.hand_over(state, progress)
    if verbose and not run.config.barebones and run.is_global_zero:  # one table, not one a rank
        _print_results(stage, results)
    return results


def predict(
    run: Run,
    profiler: Any,
    task: Task,
    state: TrainState,
    dataloaders: Any,
    datamodule: Any,
    return_predictions: bool | None,
    ckpt_path: str | None,
) -> list[Any] | None:
    """``Trainer.predict`` in this process (see there)."""
    method = "predict_dataloader"
    loaders, datamodule = _loaders(
        run, "predict", "predict", method, dataloaders, datamodule, ckpt_path
    )
    limits = run.count_batches("predict", loaders)
    keep = return_predictions is not False
    with running(run, profiler, task, state, ckpt_path, datamodule):
        step = profiler.timed(
            "predict_step",
            task.predict_step(transforms=run.pipeline, inference_mode=run.config.inference_mode),
        )
        assert run.state is not None  # placed by running
        # each batch's dataset indices, for the listeners of its events (prediction writers):
        # recorded only when one listens, so a prediction nobody watches pays nothing
        listened = any(
            run.emitter.wants(e) for e in (Event.ON_PREDICT_BATCH_START, Event.ON_PREDICT_BATCH_END)
        )
        indices = [data.record_batch_indices(dl) for dl in loaders] if listened else []
        try:
            services = EvalServices(run, step, indices)
            state, progress, outputs = eval_loops.predict(
                services, run.state, run.progress, loaders, limits, keep=keep
            )
        finally:
            for dl in loaders:
                data.stop_recording(dl)
        run.hand_over(state, progress)
    if not keep:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    for i, r in enumerate(results):
        head = f"{stage} results" + (f" (dataloader {i})" if len(results) > 1 else "")
        print(head)
        for k, v in r.items():
            print(f"  {k:32s} {v:.6g}")
