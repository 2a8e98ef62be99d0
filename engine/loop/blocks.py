"""Blocks of optimizer steps in the fit loop (``Trainer(steps_per_call=K)``): where a block of
K accumulation windows may run as one call of the training step, as a pure function of the
loop's position.

A block runs only where the loop would not look at the state inside it: from a state between
windows, with K windows of batches left in the epoch, and no batch inside it (only its last)
after which validation runs, the fit stops (``max_steps``), metrics are logged
(``log_every_n_steps``) or a listener reads the state (:meth:`engine.events.Listener.block_ends`).
Elsewhere the loop runs single batches. Because that decision depends on the position alone,
every block of a run starts and ends at the same batches in a run resumed from any of its
checkpoints (which are saved between blocks), so the resume is bitwise.

A plan with ``starts`` (a replay's: the blocks its journal recorded) runs a block exactly at
those steps, whatever validation, logging and the listeners would say (a replay does none of
them), and single batches everywhere else: the calls the recorded run made, made again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from engine.plan import schedule
from engine.plan.config import LoopConfig
from engine.plan.progress import Progress
from engine.state import TrainState

__all__ = ["BlockPlan", "fits", "gather"]


class BlockPlan(NamedTuple):
    """What the fit loop's blocks are made of.

    Attributes:
        windows: optimizer steps per block (``steps_per_call``).
        accumulate: micro-batches per optimizer step.
        ends: global-step intervals whose multiples end a block (the listeners' and the
            logging's).
        starts: the global steps at which blocks start, single steps everywhere else (see
            the module's docstring); ``None``: wherever the rule above lets them.
    """

    windows: int
    accumulate: int
    ends: tuple[int, ...] = ()
    starts: frozenset[int] | None = None

    @property
    def batches(self) -> int:
        return self.windows * self.accumulate


def fits(
    config: LoopConfig,
    plan: BlockPlan,
    state: TrainState,
    progress: Progress,
    *,
    batch_idx: int,
    validates: bool,
) -> bool:
    """Whether the block's batches from ``batch_idx`` (this epoch's) may run as one block: see
    the module's docstring. ``validates``: this epoch validates."""
    n = plan.batches
    if state.micro_step or state.grad_accum is not None:
        return False
    if progress.num_training_batches - batch_idx < n:  # the epoch's end inside (or unknown)
        return False
    if plan.starts is not None:  # recorded: where it started, unless the fit ends inside
        return state.step in plan.starts and not any(
            schedule.epoch_done(
                config,
                global_step=state.step + w,
                should_stop=progress.should_stop,
                epoch=state.epoch,
            )
            for w in range(1, plan.windows)
        )
    for j in range(n - 1):  # after every batch but the block's last
        step = state.step + (j + 1) // plan.accumulate
        if validates and schedule.should_validate(
            config,
            val_check_batch=progress.val_check_batch,
            batch_idx=batch_idx + j,
            total_batch_idx=progress.total_batch_idx + j,
            is_last=False,
            should_stop=progress.should_stop,
            epoch=state.epoch,
            global_step=step,
        ):
            return False
        if (j + 1) % plan.accumulate:
            continue  # mid-window: nothing else looks at the state there
        if any(step % every == 0 for every in plan.ends) or schedule.epoch_done(
            config, global_step=step, should_stop=progress.should_stop, epoch=state.epoch
        ):
            return False
    return True


def gather(first: Any, rest: Iterator[Any], n: int) -> list[Any]:
    """``first`` and up to ``n - 1`` more items of ``rest`` (fewer where it ends: the loop then
    runs what it gathered as single batches)."""
    items = [first]
    for _ in range(n - 1):
        item = next(rest, None)
        if item is None:
            break
        items.append(item)
    return items
