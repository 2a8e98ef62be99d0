"""Dataloader plumbing for the Trainer: resolving sources, counting batches, limits, lookahead;
seeded order and randomness; resume positions; sharding across ranks.

Any iterable of batches works (a ``torch.utils.data.DataLoader``, a list, a generator
factory); a *datamodule* is any object with ``train_dataloader()`` / ``val_dataloader()`` /
``test_dataloader()`` / ``predict_dataloader()`` methods.

The package, bottom up (each module imports only those above it in this list):

* ``_checks``: argument checks (seeds, epochs, counts) with messages that name the call;
* ``_wrappers``: the loader-wrapper protocol, what a fit puts around a loader's samplers;
* ``_sources``: loaders and datamodules resolved, batches counted and limited, lookahead,
  stateful loaders and their JSON state, ``batch_size``;
* ``_seeding``: :class:`SeededDataset`, :class:`ShuffleSampler`, :func:`seed_shuffle`,
  :func:`order_outside_the_state`;
* ``_sharding``: :func:`shard_loader`, :func:`shard_start` and their samplers;
* ``_batch_keys``: per-batch randomness, :func:`seed_batches` and its dataset and worker hooks,
  :func:`randomness_outside_the_state`;
* ``_position``: :func:`position_loader` (the skip of a resumed epoch's first batches) and
  :func:`restore_loader`;
* ``_indices``: :func:`record_batch_indices` (each batch's dataset indices, for prediction
  writers) and :func:`stop_recording`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.data._batch_keys import randomness_outside_the_state, seed_batches
from engine.data._indices import record_batch_indices, stop_recording
from engine.data._position import position_loader, restore_loader
from engine.data._seeding import (
    SampleKey,
    SeededDataset,
    ShuffleSampler,
    order_outside_the_state,
    seed_shuffle,
)
from engine.data._sharding import shard_loader, shard_start
from engine.data._sources import (
    count_batches,
    datamodule_loaders,
    is_datamodule,
    limit_batches,
    lookahead,
    resolve_loaders,
    setup_datamodule,
    state_from_json,
    state_to_json,
    stateful,
    teardown_datamodule,
)

# What a loader pickled by an engine before this package (a run directory's data.pkl) may
# reference by its old name, engine.data.<name>: the wrappers a fit puts in a loader and the
# hooks it gives its dataset and workers.
# isort: split
from engine.data._batch_keys import _BatchFetch as _BatchFetch
from engine.data._batch_keys import _BatchKey as _BatchKey
from engine.data._batch_keys import _BatchKeys as _BatchKeys
from engine.data._batch_keys import _HookWorkers as _HookWorkers
from engine.data._position import _SkipFirst as _SkipFirst
from engine.data._sharding import _Shard as _Shard
from engine.data._sharding import _ShardBatches as _ShardBatches

__all__ = [
    "record_batch_indices",
    "stop_recording",
    "SampleKey",
    "SeededDataset",
    "ShuffleSampler",
    "count_batches",
    "datamodule_loaders",
    "is_datamodule",
    "limit_batches",
    "lookahead",
    "order_outside_the_state",
    "position_loader",
    "randomness_outside_the_state",
    "resolve_loaders",
    "restore_loader",
    "seed_batches",
    "seed_shuffle",
    "setup_datamodule",
    "shard_loader",
    "shard_start",
    "state_from_json",
    "state_to_json",
    "stateful",
    "teardown_datamodule",
]


# not in __all__ (the loops' batch size, as Lightning counts it); defined here, so the API page
# keeps documenting it
def batch_size(batch: Any) -> int:
    """The size of a batch: the first dimension of its first tensor (Lightning's rule), else 1."""
    stack: list[Any] = [batch]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            return int(x.shape[0]) if x.ndim else 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, Sequence) and not isinstance(x, str):
            stack.extend(x)
    return 1
