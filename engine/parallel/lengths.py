"""Every rank's loaders agreed before the first step: the lengths a data-parallel strategy
compares (:meth:`engine.parallel.DDP.agree_loaders`).

A data-parallel strategy gives each rank its shard of one dataset, so every rank must build
the same one: the same number of samples, the same number of batches. Ranks that built
different data (one read a file another had not finished writing, a filter that depends on the
rank) would otherwise take different numbers of steps, and the first all-reduce one rank makes
alone dies in the backend (gloo's ``Received data size doesn't match``, a SIGABRT) or waits
for the timeout, with no word of the cause. The strategy measures each loader as it shards it
(:func:`measure`, before sharding: the whole dataset's lengths), gathers every rank's
measures in one collective when a stage's loaders are ready, and :func:`disagreement` says
which loader differs on which rank.

What is measured, per loader of each stage (``"train"``, ``"val"``, ``"test"``,
``"predict"``, and the loaders ``reload_dataloaders_every_n_epochs`` fetches again):

* a ``DataLoader`` over a map-style dataset: its samples (``len(dataset)``) and batches
  (``len(loader)``, unsharded);
* any other loader with a length (a list of batches, which every rank reads whole): its
  batches;
* a loader without one (an ``IterableDataset``, a generator): nothing; every rank reads it
  whole, and its lengths are the user's to keep equal (the strategy cannot count them without
  reading them).

The number of loaders of each stage is compared too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Length", "disagreement", "measure", "repeated"]


class Length(NamedTuple):
    """One loader's lengths as a rank measured them (``None``: not known)."""

    stage: str
    idx: int
    samples: int | None
    batches: int | None
    #: what an evaluation shard's padding repeats of its order ("1 sample", "3 batches": a
    #: strategy whose forward is a collective pads evaluation shards; "": nothing)
    repeated: str = ""

    def describe(self) -> str:
        if self.samples is None and self.batches is None:
            return "no length (an iterable: not compared)"
        parts = []
        if self.samples is not None:
            parts.append(f"{self.samples} samples")
        if self.batches is not None:
            parts.append(f"{self.batches} batches")
        return " in ".join(parts)


def measure(loader: Any, stage: str, index: int) -> Length:
    """``loader``'s lengths before the strategy shards it: samples of a map-style dataset,
    batches of a sized loader; ``None`` for what it does not have (an iterable dataset)."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(loader, torch.utils.data.DataLoader) and isinstance(
        dataset, torch.utils.data.IterableDataset
    ):
        return Length(stage, index, None, None)  # a length it declares is only a guess
    samples: int | None = None
    if isinstance(loader, torch.utils.data.DataLoader):
        try:
            samples = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            samples = None
    try:
        batches: int | None = len(loader)
    except TypeError:
        batches = None
    return Length(stage, index, samples, batches)


def _name(stage: str, index: int, count: int) -> str:
    kind = {"val": "validation", "train": "training"}.get(stage, stage)
    return f"the {kind} dataloader" + (f" {index} (dataloader_idx={index})" if count > 1 else "")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_WHAT_TO_DO = (
    "Every rank must build the same dataset (the same samples, the same batch_size): the "
    "strategy gives each rank its shard of it (use_distributed_sampler=True), so build it from "
    "the same files and seed on every rank, not from a part of each rank's own. Data each rank "
    "has already split by rank goes with use_distributed_sampler=False, each rank's training "
    "loader of the same number of batches"
)


def disagreement(gathered: Sequence[Sequence[Length]]) -> str | None:
    """``None`` when every rank measured the same loaders alike, else a message that names
    each loader that differs, with every rank's lengths, and what to do."""
    lines: list[str] = []
    world = len(gathered)
    stages: list[str] = []
    for lengths in gathered:
        for length in lengths:
            if length.stage not in stages:
                stages.append(length.stage)
    for stage in stages:
        per_rank = [[x for x in lengths if x.stage == stage] for lengths in gathered]
        counts = [len(x) for x in per_rank]
        if len(set(counts)) > 1:
            by = {c: [r for r in range(world) if counts[r] == c] for c in counts}
            kind = {"val": "validation", "train": "training"}.get(stage, stage)
            lines.append(
                f"the {kind} dataloaders: "
                + "; ".join(f"{c} on {_ranks(rs)}" for c, rs in by.items())
            )
            continue
        for index in range(counts[0]):
            seen = [per_rank[r][index] for r in range(world)]
            values = [(x.samples, x.batches) for x in seen]
            if len(set(values)) == 1:
                continue
            groups: dict[tuple[int | None, int | None], list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            lines.append(
                f"{_name(stage, index, counts[0])}: "
                + "; ".join(f"{seen[rs[0]].describe()} on {_ranks(rs)}" for v, rs in groups.items())
            )
    if not lines:
        return None
    return (
        "the ranks built different data, so they would take different numbers of steps (the "
        "first collective a rank makes alone fails or hangs): "
        + "; ".join(lines)
        + ". "
        + _WHAT_TO_DO
    )


def repeated(gathered: Sequence[Sequence[Length]], world: int) -> str | None:
    """``None`` when no evaluation loader's shards repeat a position of its order, else a
    message naming each one whose padding does (every rank measured the same: rank 0's
    measures are read)."""
    lines = []
    for x in gathered[0]:
        if x.stage == "train" or not x.repeated:
            continue
        count = sum(1 for y in gathered[0] if y.stage == x.stage)
        lines.append(
            f"{_name(x.stage, x.idx, count)} ({x.describe()}) repeats {x.repeated} of its "
            "order to deal every rank as many"
        )
    if not lines:
        return None
    return (
        "evaluation shards are padded as Lightning's DistributedSampler pads them (every rank "
        "runs as many batches), and "
        + "; ".join(lines)
        + f": their metrics count those twice, as Lightning's do. For every sample once, give "
        f"the loader a multiple of {world} samples, or a sampler of your own, "
        "DistributedSampler(..., drop_last=True) (kept as it is)"
    )
