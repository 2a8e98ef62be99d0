"""K optimizer steps in one call (private): the block core :class:`TrainStep` compiles as one
graph, and the helpers that split a block's batches and stack its metrics.

A block is ``steps_per_call`` whole accumulation windows taken from a state between windows.
Compiled, the block is one unrolled graph: one Python call, one set of guards and one seeding
for its optimizer steps (Keras's ``steps_per_execution``). Eager, it is the same single steps a
loop would make, so it is bitwise the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = [
    "STORE_EACH_STEP",
    "block_core",
    "micro_batches",
    "split_metrics",
    "stack_metrics",
]


# The Inductor options every training core compiles with (``inductor_options``, read by
# ``_Compiled``). Unrolled, a step's new optimizer state is read twice (by that step's update and
# by the next step's), and Inductor recomputes a value in each of its readers until it has more
# than four (``realize_reads_threshold``): a later step's kernels then rebuilt the moments from
# every gradient since the last stored version, and those gradients stayed alive (58 MB a K=8
# call of the medium benchmark MLP). Stored wherever a value has a second reader, each step's
# state is written once, where it is computed. That replaced a ``cat`` of the state into one
# buffer between steps (a buffer Inductor computes its inputs straight into), which wrote 14 MB
# more a step on that MLP: its K=8 block went from 1.09 to 1.01 of the compiled single step,
# the tiny one from 0.51 to 0.50 (one process, interleaved). The single-step cores take the same
# policy, so that a block computes the floats K single steps do, bit for bit: a run resumed
# between blocks continues as the whole run did, whichever steps ran as blocks.
STORE_EACH_STEP = {"realize_reads_threshold": 1}


def micro_batches(batches: Any, *, stacked: bool) -> tuple[Any, int]:
    """``(batches, n)``: the block's micro-batches as given and how many there are.

    ``stacked``: ``batches`` is one batch whose tensors have the micro-batches along their first
    dimension (kept whole: the compiled block indexes it inside its graph); otherwise it is a
    list or tuple of batches.

    Raises:
        TypeError: a sequence that is not a list or tuple, or a stacked batch with a leaf that
            is not a tensor.
        ValueError: no micro-batches, or stacked tensors whose first dimensions differ.
    """
    if not stacked:
        if not isinstance(batches, (list, tuple)):
            raise TypeError(
                f"a step with steps_per_call > 1 takes a list or tuple of batches, one per "
                f"micro-batch (got {type(batches).__name__}); pass stacked=True for one batch "
                "whose tensors stack the micro-batches along their first dimension"
            )
        if not batches:
            raise ValueError("the list of batches is empty: pass at least one batch")
        return tuple(batches), len(batches)
    leaves = pytree.tree_leaves(batches)
    if not leaves or not all(isinstance(x, Tensor) and x.dim() > 0 for x in leaves):
        kinds = sorted({type(x).__name__ for x in leaves if not isinstance(x, Tensor)})
        raise TypeError(
            "stacked=True takes a batch of tensors stacked along their first dimension "
            f"(found {', '.join(kinds) or 'no tensors, or 0-d tensors'}); pass a list of "
            "batches instead"
        )
    sizes = {x.shape[0] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(
            f"stacked=True: the tensors' first dimensions differ ({sorted(sizes)}); each must "
            "count the micro-batches"
        )
    n = sizes.pop()
    if n == 0:
        raise ValueError("stacked=True: the tensors stack no micro-batch (first dimension 0)")
    return batches, n


def pick(batches: Any, i: int, *, stacked: bool) -> Any:
    """Micro-batch ``i`` of a block's batches (:func:`micro_batches`)."""
    if not stacked:
        return batches[i]
    return pytree.tree_map(lambda x: x[i], batches)


def stack_metrics(records: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Each metric stacked over the calls that reported it, in order: per micro-batch for the
    loss and the loss function's metrics, per optimizer step for what only a step reports
    (``grad_norm``, a loss scale's)."""
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record))
    return {k: torch.stack([r[k] for r in records if k in r]) for k in names}


def split_metrics(
    metrics: Mapping[str, Tensor], n: int, accumulate: int
) -> list[dict[str, Tensor]]:
    """A block's stacked metrics (:func:`stack_metrics`) back to each of its ``n`` micro-batches'
    (what only a step reports, with the last micro-batch of each window of ``accumulate``)."""
    out: list[dict[str, Tensor]] = [{} for _ in range(n)]
    for name, values in metrics.items():
        if len(values) == n:
            for i in range(n):
                out[i][name] = values[i]
        else:  # one per optimizer step
            for w in range(len(values)):
                out[(w + 1) * accumulate - 1][name] = values[w]
    return out


def block_core(step: Any) -> Any:
    """The pure core of one block of ``step`` (a :class:`~engine.step._train.TrainStep`):
    ``(module, params, buffers, opt_state, precision, first_step, batches, windows, stacked,
    frozen, extra) -> (opt_state, precision, metrics)``, ``windows`` whole windows of
    ``step.accumulate`` micro-batches, the optimizer stepping at the end of each (parameters in
    place), metrics stacked (:func:`stack_metrics`). Unrolled: no Python branch on a value."""
    accumulate = step.accumulate

    def core(
        module,
        params,
        buffers,
        opt_state,
        precision,
        first,
        batches,
        windows,
        stacked,
        frozen,
        extra,
    ):
        records = []
        for w in range(windows):
            grad_accum = None
            for j in range(accumulate - 1):
                batch = pick(batches, w * accumulate + j, stacked=stacked)
                grad_accum, metrics = step._accumulate_core(
                    module, params, buffers, precision, grad_accum, batch, frozen, extra
                )
                records.append(metrics)
            batch = pick(batches, w * accumulate + accumulate - 1, stacked=stacked)
            opt_state, precision, metrics = step._update_core(
                module,
                params,
                buffers,
                opt_state,
                precision,
                grad_accum,
                first + w,
                batch,
                frozen,
                extra,
            )
            records.append(metrics)
        return opt_state, precision, stack_metrics(records)

    core.step_arg = 4  # type: ignore[attr-defined]  # first (after the module): see _Compiled
    core.inductor_options = STORE_EACH_STEP  # type: ignore[attr-defined]  # see _Compiled
    return core
