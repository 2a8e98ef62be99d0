"""The evaluation loops: :func:`evaluate` (validation and test), :func:`sanity_check` and
:func:`predict`, each a fold over local ``state`` and ``progress`` values.

They read top to bottom: start events → per loader: a fresh metric reduction, its batches
(move → batch start → step → batch end), the reduction computed → the results logged → end
events. Like :func:`engine.loop.fit.fit` they reach their driver only through a services
object, :class:`EvalServices`: each event is handed the current ``state`` and
:class:`~engine.plan.progress.Progress` and returns the ones the loop continues with (a
listener's :class:`~engine.events.Stop` changes the progress). Nothing here reads or writes an
attribute of the driver.

Two points are the strategy's, each in one place: the loaders arrive prepared (the Run's
``prepare_loaders``, already applied, and their batch counts taken after it), and every
evaluation epoch's metrics are computed by :meth:`EvalServices.compute` (where a cross-rank
reduction belongs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.data import batch_size, lookahead
from engine.events import Event
from engine.loop.services import LoopServices
from engine.plan.progress import Phase, Progress
from engine.state import TrainState

__all__ = ["EvalServices", "evaluate", "predict", "sanity_check"]


class EvalServices(LoopServices, Protocol):
    """What the evaluation loops ask of their driver. Each call hands over the loop's current
    values (the Trainer's Run keeps them as its record of the run, for the listeners' view) and
    returns the ones the loop continues with."""

    def step(self, state: TrainState, batch: Any) -> Any:
        """The evaluation (or prediction) step on one batch: its metrics (or outputs)."""
        ...

    def reducer(self) -> Any:
        """A fresh metric reduction for one loader's epoch (``task.reducer()``)."""
        ...

    def compute(self, reducer: Any) -> dict[str, float]:
        """One loader's epoch metrics from its reduction: every evaluation epoch's metrics are
        computed here (the single place where they would be reduced across processes)."""
        ...

    def log(self, state: TrainState, progress: Progress, metrics: dict[str, float]) -> None:
        """An evaluation's results to the loggers and the progress bar."""
        ...

    def log_step(self, kind: str, dataloader_idx: int, metrics: dict[str, float]) -> None:
        """One evaluation batch's step values (``LogOptions(on_step=True)``) to the loggers."""
        ...

    def batch_indices(self, dataloader_idx: int) -> Any:
        """The dataset indices of the prediction batch just received from that loader (or
        ``None``); called once per batch, in order."""
        ...


_EVENTS = {
    kind: {
        "start": Event[f"ON_{name}_START"],
        "epoch_start": Event[f"ON_{name}_EPOCH_START"],
        "batch_start": Event[f"ON_{name}_BATCH_START"],
        "batch_end": Event[f"ON_{name}_BATCH_END"],
        "epoch_end": Event[f"ON_{name}_EPOCH_END"],
        "end": Event[f"ON_{name}_END"],
    }
    for kind, name in (("validation", "VALIDATION"), ("test", "TEST"))
}


def evaluate(
    kind: str,
    run: EvalServices,
    state: TrainState,
    progress: Progress,
    loaders: Sequence[Any],
    limits: Sequence[float],
    *,
    log: bool,
) -> tuple[TrainState, Progress, list[dict[str, float]]]:
    """One validation or test epoch (``kind``: ``"validation"`` / ``"test"``) over ``loaders``,
    each up to its entry of ``limits`` batches; returns the state and progress the listeners
    left and one dict of metrics per loader.

    The metrics are named ``val/<name>`` (``test/<name>``, see
    :func:`engine.metrics.metric_name`), with ``/dataloader_idx_<k>`` appended when there are
    several loaders; ``log`` sends them, all loaders' in one row, to the loggers and the
    progress bar. A fit's validation arrives in phase ``VALIDATION``: once its results exist
    the phase is ``VALIDATED`` (a checkpoint saved from then on keeps them on resume), and once
    its epoch end has been dispatched, ``VALIDATION_END``.

    Example:
        >>> import torch
        >>> from engine.metrics import MetricReducer
        >>> class Services:  # the smallest services: no listeners, metrics on the host
        ...     def emit(self, event, state, progress, **fields): return state, progress
        ...     emit_batch = emit
        ...     def move(self, batch): return batch
        ...     def step(self, state, batch): return {"loss": batch.mean()}
        ...     def reducer(self): return MetricReducer()
        ...     def compute(self, reducer): return reducer.compute()
        ...     def log(self, state, progress, metrics): pass
        ...     def log_step(self, kind, dataloader_idx, metrics): pass
        >>> loaders = [[torch.ones(2), torch.zeros(2)]]
        >>> _, _, results = evaluate(
        ...     "validation", Services(), None, Progress(), loaders, [2], log=False)
        >>> results
        [{'val/loss': 0.5}]
    """
    events = _EVENTS[kind]
    prefix = "val" if kind == "validation" else kind
    state, progress = run.emit(events["start"], state, progress)
    state, progress = run.emit(events["epoch_start"], state, progress)
    results: list[dict[str, float]] = []
    for dl_idx, (loader, limit) in enumerate(zip(loaders, limits, strict=True)):
        reducer = run.reducer()
        suffix = f"/dataloader_idx_{dl_idx}" if len(loaders) > 1 else ""
        for batch_idx, batch, _, _ in lookahead(loader, limit):
            batch = run.move(batch)
            state, progress = run.emit_batch(
                events["batch_start"],
                state,
                progress,
                batch=batch,
                batch_idx=batch_idx,
                dataloader_idx=dl_idx,
            )
            metrics = run.step(state, batch)
            reducer.update(metrics, batch_size(batch))
            if log and (row := reducer.eval_step_logged(prefix, metrics)):
                run.log_step(kind, dl_idx, {f"{k}{suffix}": v for k, v in row.items()})
            state, progress = run.emit_batch(
                events["batch_end"],
                state,
                progress,
                outputs=metrics,
                batch=batch,
                batch_idx=batch_idx,
                dataloader_idx=dl_idx,
            )
        computed = run.compute(reducer)
        named = ((reducer.eval_epoch_name(prefix, k), v) for k, v in computed.items())
        results.append({f"{name}{suffix}": v for name, v in named if name is not None})
    if log:
        run.log(state, progress, {k: v for r in results for k, v in r.items()})
    if progress.phase is Phase.VALIDATION:
        # fit's validation has its results: a resume keeps them
        progress = progress._replace(phase=Phase.VALIDATED)
    state, progress = run.emit(events["epoch_end"], state, progress)
    if progress.phase is Phase.VALIDATED:  # ... and its epoch end has been dispatched
        progress = progress._replace(phase=Phase.VALIDATION_END)
    state, progress = run.emit(events["end"], state, progress)
    return state, progress, results


def sanity_check(
    run: EvalServices,
    state: TrainState,
    progress: Progress,
    loaders: Sequence[Any],
    limits: Sequence[float],
) -> tuple[TrainState, Progress]:
    """Lightning's sanity check before a fit trains: a validation of ``limits`` batches per
    loader (``num_sanity_val_steps``, each capped by its loader's count) between
    ``on_sanity_check_start`` and ``on_sanity_check_end``, its results neither logged nor
    returned. The caller marks the run as sanity checking around it (the listeners' view)."""
    state, progress = run.emit(Event.ON_SANITY_CHECK_START, state, progress)
    state, progress, _ = evaluate("validation", run, state, progress, loaders, limits, log=False)
    return run.emit(Event.ON_SANITY_CHECK_END, state, progress)


def predict(
    run: EvalServices,
    state: TrainState,
    progress: Progress,
    loaders: Sequence[Any],
    limits: Sequence[float],
    *,
    keep: bool,
) -> tuple[TrainState, Progress, list[list[Any]]]:
    """Prediction over ``loaders``, each up to its entry of ``limits`` batches; returns the
    state and progress the listeners left and, per loader, the step's outputs in batch order
    (empty lists unless ``keep``: Lightning's ``return_predictions=False``).

    Example:
        >>> import torch
        >>> class Services:
        ...     def emit(self, event, state, progress, **fields): return state, progress
        ...     emit_batch = emit
        ...     def move(self, batch): return batch
        ...     def step(self, state, batch): return batch * 2
        ...     def batch_indices(self, dataloader_idx): return None
        >>> loaders = [[torch.ones(1), torch.zeros(1)]]
        >>> _, _, outputs = predict(Services(), None, Progress(), loaders, [2], keep=True)
        >>> outputs
        [[tensor([2.]), tensor([0.])]]
    """
    state, progress = run.emit(Event.ON_PREDICT_START, state, progress)
    state, progress = run.emit(Event.ON_PREDICT_EPOCH_START, state, progress)
    outputs: list[list[Any]] = []
    for dl_idx, (loader, limit) in enumerate(zip(loaders, limits, strict=True)):
        outs: list[Any] = []
        for batch_idx, batch, _, _ in lookahead(loader, limit):
            indices = run.batch_indices(dl_idx)
            batch = run.move(batch)
            state, progress = run.emit_batch(
                Event.ON_PREDICT_BATCH_START,
                state,
                progress,
                batch=batch,
                batch_idx=batch_idx,
                dataloader_idx=dl_idx,
                batch_indices=indices,
            )
            out = run.step(state, batch)
            if keep:
                outs.append(out)
            state, progress = run.emit_batch(
                Event.ON_PREDICT_BATCH_END,
                state,
                progress,
                outputs=out,
                batch=batch,
                batch_idx=batch_idx,
                dataloader_idx=dl_idx,
                batch_indices=indices,
            )
        outputs.append(outs)
    state, progress = run.emit(Event.ON_PREDICT_EPOCH_END, state, progress)
    state, progress = run.emit(Event.ON_PREDICT_END, state, progress)
    return state, progress, outputs
