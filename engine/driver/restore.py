"""A run continued from a checkpoint: ``ckpt_path`` resolved (``"last"``, ``"best"``, a path:
rank 0's on every rank), the datamodule's state given back before its loaders are asked for,
and the state, the loop's position and the metrics restored into the
:class:`~engine.driver.run.Run`, after the checks that a fit continues exactly (the same
precision, accumulation and DP-SGD; a world size the position converts to).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from engine import checkpoint, privacy, transforms
from engine.driver.run import Run
from engine.events import Event
from engine.parallel import positions
from engine.state import TrainState

__all__ = ["datamodule_first", "restore"]


def resolve(run: Run, ckpt_path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``ckpt_path`` names, rank 0's on every rank: ``"best"`` / ``"last"`` are
    resolved by rank 0's listeners, whose ranking is the one its files follow, and an error
    resolving it is raised on every rank."""
    if run.world_size == 1:
        return run.checkpointer.resolve(ckpt_path)
    found: tuple[Path | None, BaseException | None] = (None, None)
    if run.is_global_zero:
        try:
            found = (run.checkpointer.resolve(ckpt_path), None)
        except (checkpoint.CheckpointError, ValueError, OSError) as e:
            found = (None, e)
    path, error = run.broadcast(found)
    if error is not None:
        raise error
    return path


def datamodule_first(run: Run, ckpt_path: Any, datamodule: Any) -> None:
    """Lightning restores a datamodule's state before asking it for loaders: resolve the
    checkpoint now (once; the run's restore uses it) and give the datamodule its state."""
    run.resolved_early(None)
    if ckpt_path is None or datamodule is None:
        return
    path = resolve(run, ckpt_path)
    run.resolved_early((ckpt_path, path))
    if path is not None:
        _restore_datamodule(path, datamodule)


def _restore_datamodule(path: Path, datamodule: Any) -> None:
    load = getattr(datamodule, "load_state_dict", None)
    if not callable(load) or not (path / checkpoint.META).is_file():
        return
    saved = checkpoint.read_meta(path).get("extra", {}).get("datamodule")
    if saved is not None:  # Lightning's restore_datamodule
        load(saved)


def restore(run: Run, ckpt_path: str | os.PathLike[str], template: TrainState) -> None:
    """Continue ``run`` from the checkpoint ``ckpt_path`` names: its state, its listeners'
    states and, for a fit, the loop's position and the metrics."""
    saver = run.checkpointer
    early = run.resolved_early(None)
    path = early[1] if early is not None and early[0] is ckpt_path else resolve(run, ckpt_path)
    if path is None:
        return
    fit = run.stage == "fit" and (path / checkpoint.META).is_file()  # else load says why
    if fit:
        _check_precision(run, path)
        _check_threads(run, path)
        meta = checkpoint.read_meta(path)
        accumulate = (meta.get("extra", {}).get("config") or {}).get("accumulate_grad_batches")
        positions.check_world(path, meta, world_size=run.world_size, accumulate=accumulate)
    state = saver.load(path, template, stage=run.stage, asked=ckpt_path)
    run.hand_over(state)
    if fit:
        _check_accumulation(run, path, state)
        _check_privacy(run, path, state)
    new_reducer = None if run.task is None else run.task.reducer
    restored = saver.restore_run(
        path, stage=run.stage, progress=run.progress, new_reducer=new_reducer
    )
    if restored is None:
        run.resumed(str(path), state)  # ModelCheckpoint never deletes the one resumed from
    else:  # a fit continues: what its listeners had seen, they see
        # the epoch's position in this world size's batches (another's: converted)
        saved = checkpoint.read_meta(path).get("extra", {}).get("trainer", {})
        # the interrupted fit's training order (one saved before it was recorded: the loader's)
        run.use_train_order(saved.get("train_order") or "loader")
        unit = positions.position_unit(run.train_dataloader)
        state, total = positions.carry_position(
            path,
            state,
            restored.progress.total_batch_idx,
            saved,
            world_size=run.world_size,
            unit=unit,
        )
        progress = restored.progress._replace(total_batch_idx=total)
        run.resumed(str(path), state, progress, restored.metrics)
    if early is None and run.datamodule is not None:
        _restore_datamodule(path, run.datamodule)
    run.announce(Event.ON_LOAD_CHECKPOINT, checkpoint_path=str(path))


def _saved_config(path: Path) -> dict[str, Any]:
    return checkpoint.read_meta(path).get("extra", {}).get("config") or {}


def _check_precision(run: Run, path: Path) -> None:
    """A fit continues exactly only under the precision its checkpoint was saved with (the
    loss scale, the autocast dtype and the parameters' dtype are part of the run)."""
    saved = _saved_config(path).get("precision")
    with contextlib.suppress(ValueError):  # else a plugin of the user's own: its repr
        saved = transforms.canonical_precision(saved)
    now = run.config.precision
    if saved != now:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved under precision "
            f"{saved!r} and this Trainer runs {now!r}; a resumed fit continues "
            f"exactly only under the same one: Trainer(precision={saved!r}). To go on under "
            "another, start a new fit from its weights (checkpoint.load_weights(path, "
            "model), then task.init(model))"
        )


def _check_threads(run: Run, path: Path) -> None:
    """Warn when a CPU fit resumes on another thread count than it was saved on: a CPU
    reduction (a loss's mean over many elements) sums per-thread parts, so the continued run
    is not bitwise the uninterrupted one (a replay sets the recorded count itself)."""
    saved = _saved_config(path).get("threads")
    now = torch.get_num_threads()
    if type(saved) is int and saved != now and run.config.device.startswith("cpu"):
        warnings.warn(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved by a fit on {saved} "
            f"thread(s) and this process computes on {now}; CPU reductions sum per-thread "
            f"parts, so the resumed fit will not be bitwise the uninterrupted one. For an "
            f"exact continuation call torch.set_num_threads({saved}) first (or set "
            f"OMP_NUM_THREADS={saved})",
            stacklevel=4,
        )


def _check_privacy(run: Run, path: Path, state: TrainState) -> None:
    """A DP-SGD fit continues only under DP-SGD, and DP-SGD continues only a fit that ran
    it: the checkpoint's ``extra["dpsgd"]`` (the noise multiplier, the sample rate and
    their history, which the accountant reads) says which it was."""
    held = privacy.KEY in state.extra
    plugged = run.assembly.privacy
    if held and plugged is None:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved by a DP-SGD fit (its "
            "state holds extra['dpsgd']) and this Trainer has no DPSGD plugin; resume it "
            "with Trainer(plugins=[engine.privacy.DPSGD(...)]) (the checkpoint's numbers "
            "are kept)"
        )
    if not held and plugged is not None:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved by a fit without "
            f"DP-SGD and this Trainer has {plugged!r}; a resumed fit continues the "
            "run it resumes. To train it privately, start a new fit from its weights "
            "(checkpoint.load_weights(path, model), then task.init(model))"
        )


def _check_accumulation(run: Run, path: Path, state: TrainState) -> None:
    """A fit resumed inside an accumulation window continues that window: only under the
    ``accumulate_grad_batches`` it was saved with (its summed gradient holds
    ``micro_step`` micro-batches, each divided by that value). At a window boundary another
    value is allowed, as in Lightning: the next step comes where the new windows end."""
    saved = _saved_config(path).get("accumulate_grad_batches")
    now = run.config.accumulate_grad_batches
    if not state.micro_step or saved is None or saved == now:
        return
    raise checkpoint.CheckpointError(
        f"fit(ckpt_path={str(path)!r}): the checkpoint was saved inside an accumulation "
        f"window, {state.micro_step} of accumulate_grad_batches={saved} micro-batches "
        f"after step {state.step} (batch {state.batch_idx} of epoch {state.epoch}), and "
        f"this Trainer accumulates {now}: the window's gradient, summed over micro-batches "
        f"each divided by {saved}, would be wrong. Resume with "
        f"Trainer(accumulate_grad_batches={saved}), or from a checkpoint saved at an "
        "optimizer step (a window boundary), where the value may change"
    )
