"""Where a data-parallel fit resumes: a checkpoint's position carried across world sizes
(:func:`check_world`, :func:`carry_position`, in the unit :func:`position_unit` measures) and
the ranks' partial gradient sums gathered into rank 0's checkpoint
(:func:`gather_to_rank_zero`). The driver's restore asks these; they know the ranks and the
dealing of :func:`engine.data.shard_loader`, nothing of the Trainer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine import checkpoint
from engine.parallel import _watchdog
from engine.state import TrainState

__all__ = ["carry_position", "check_world", "gather_to_rank_zero", "position_unit"]


def gather_to_rank_zero(sums: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The partial gradient sums ``sums`` of every rank, on rank 0: those of ranks 1, 2, ...
    in order (rank 0's are ``sums``); ``[]`` on the other ranks, and in a process with no
    process group. A collective: every rank of the group must call it. One ``gather`` per
    dtype and device, of the tensors flattened (bitwise copies)."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return []
    world, rank = dist.get_world_size(), dist.get_rank()
    kinds: dict[tuple[Any, Any], list[str]] = {}
    for name, t in sums.items():
        kinds.setdefault((t.dtype, t.device), []).append(name)
    out: list[dict[str, Any]] = [{} for _ in range(world - 1)]
    with torch.no_grad():
        for names in kinds.values():
            tensors = [sums[n].detach() for n in names]
            flat = _flatten_dense_tensors(tensors)
            bins = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
            with _watchdog.guard("the gathering of every rank's partial gradient sums"):
                dist.gather(flat, bins, dst=0)
            if bins is None:
                continue
            for r in range(1, world):
                for n, t in zip(names, _unflatten_dense_tensors(bins[r], tensors), strict=True):
                    out[r - 1][n] = t
    if rank:
        return []
    return [{n: got[n] for n in sums} for got in out]  # the state's order


def position_unit(loader: Any) -> int | None:
    """What one of a rank's batches of ``loader`` advances the epoch's global position by,
    divided by the world size: its ``batch_size`` for a ``DataLoader`` with torch's
    ``BatchSampler`` (positions count samples), 1 for one with a batch sampler of its own
    (positions count whole batches, as :func:`engine.data.shard_loader` deals them), ``None``
    for anything else (an iterable: no position to carry to another world size)."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader

    from engine.data import _wrappers as data

    if not isinstance(loader, DataLoader) or isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    ):
        return None
    bs = data._user_batch_sampler(loader)
    if bs is None:
        return None
    if type(bs) is BatchSampler:
        return int(bs.batch_size)
    return 1


def check_world(
    path: Path, meta: Mapping[str, Any], *, world_size: int, accumulate: int | None
) -> None:
    """Refuse a fit resumed from the checkpoint at ``path`` (its ``meta``) on ``world_size``
    ranks when the checkpoint was saved inside an accumulation window and does not hold a
    partial gradient sum for each of those ranks: on another world size (each rank's sum is of
    its own shard of the window, which no other dealing reproduces), or saved for a listener
    that runs on rank 0 alone (it holds rank 0's only).

    Raises:
        CheckpointError: naming both world sizes and what to resume from instead.
    """
    micro = meta.get("micro_step", 0)
    if not micro or not meta.get("has_grad_accum"):
        return
    saved = meta.get("extra", {}).get("trainer", {}).get("world_size", 1)
    held = meta.get("grad_accum_ranks", 1)
    where = (
        f"inside an accumulation window ({micro} of accumulate_grad_batches={accumulate} "
        f"micro-batches after step {meta.get('step')}, batch {meta.get('batch_idx')} of epoch "
        f"{meta.get('epoch')})"
    )
    if saved != world_size:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved {where} on world size "
            f"{saved}, and this run has world size {world_size}: each of the {saved} ranks "
            f"holds a partial gradient sum of its own shard of the window, which cannot be "
            f"dealt to {world_size} ranks. Resume on world size {saved} (devices x num_nodes), "
            "or from a checkpoint saved at an optimizer step (a window boundary), which "
            "resumes on any world size"
        )
    if held < world_size:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved {where} on world size "
            f"{saved} but holds the partial gradient sums of {held} rank(s) only (saved for a "
            "listener that runs on rank 0 alone, or by an engine that did not gather them): "
            f"the other ranks' windows cannot continue. Resume from a checkpoint saved at an "
            "optimizer step, or by a save every rank takes part in (ModelCheckpoint, a signal, "
            "trainer.save_checkpoint on every rank)"
        )


def carry_position(
    path: Path,
    state: TrainState,
    total_batch_idx: int,
    saved: Mapping[str, Any],
    *,
    world_size: int,
    unit: int | None,
) -> tuple[TrainState, int]:
    """The state and the loop's ``total_batch_idx`` of a fit resumed from the checkpoint at
    ``path`` (``saved``: its ``extra.trainer``) on ``world_size`` ranks, each batch ``unit``
    positions (see :func:`position_unit`): the rank-local ``state.batch_idx`` converted so every new
    shard starts at the epoch's global position ``N = batch_idx * unit_then * world_then`` where the
    checkpoint's ranks stopped, ``N / (unit * world_size)`` batches into each new shard. The epoch's
    earlier batches in ``total_batch_idx`` are this world size's; the earlier epochs' stay counted
    as they ran. Unchanged at an epoch's start or on the same world size.

    Raises:
        CheckpointError: if ``N`` is not a whole number of this world size's global batches,
            or the loader's position cannot be told (naming ``N``, the batch sizes and the
            world sizes, and what to do).

    Example:
        >>> import torch, engine as eg
        >>> from engine import optim
        >>> s = eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1)).replace(batch_idx=4)
        >>> saved = {"world_size": 2, "position_unit": 8}
        >>> s, total = carry_position(Path("c"), s, 4, saved, world_size=1, unit=8)
        >>> s.batch_idx, total  # 4 batches of 8 on each of 2 ranks: 64 samples
        (8, 8)
    """
    was = saved.get("world_size", 1)
    k = state.batch_idx
    if was == world_size or k == 0:
        return state, total_batch_idx
    if saved.get("data_state") is not None:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved {k} batches into epoch "
            f"{state.epoch} on world size {was}, with the position of a stateful loader (its "
            f"state_dict(), rank 0's), and this run has world size {world_size}: a loader's "
            "own state cannot be dealt to other ranks. Resume on world size "
            f"{was}, or from a checkpoint saved at an epoch's end"
        )
    was_unit = saved.get("position_unit", unit)
    if was_unit is None or unit is None:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved {k} batches into epoch "
            f"{state.epoch} on world size {was}, and this run has world size {world_size}, but "
            "the training loader's position cannot be carried over (not a DataLoader over a "
            "map-style dataset with a batch_size or batch sampler). Resume on world size "
            f"{was}, or from a checkpoint saved at an epoch's end"
        )
    n = k * was_unit * was
    per = unit * world_size
    what = "samples" if unit != 1 or was_unit != 1 else "batches"
    if n % per:
        raise checkpoint.CheckpointError(
            f"fit(ckpt_path={str(path)!r}): the checkpoint was saved at global position "
            f"N={n} ({what}) of epoch {state.epoch}: {k} batches of {was_unit} on each of "
            f"{was} ranks; on world size {world_size} with batches of {unit}, a global batch "
            f"is {per}, and N is no whole number of them, so the new shards cannot start where "
            f"the old ones stopped. Resume on world size {was}, with a batch size b such that "
            f"b * {world_size} divides {n}, or from a checkpoint saved where N is a multiple "
            f"of {per} (or at an epoch's end)"
        )
    new = n // per
    return state.replace(batch_idx=new), max(total_batch_idx - k + new, 0)
