"""Checkpoints: a versioned, verifiable on-disk form of a TrainState, written atomically.

A checkpoint is a directory::

    step=000120/
        meta.json      format version, engine/torch versions, counters, seed, metrics,
                       the optimizer state's scalar leaves, and a checksum per file
        tensors.pt     every tensor (params, buffers, accumulated grads, optimizer state)
                       as one flat ``{key: tensor}`` dict, loaded with weights_only=True

Writes go to a hidden temporary directory beside the target, every file is fsynced, then the
directory is renamed into place and its parent fsynced: a crash at any instant leaves earlier
checkpoints intact, and :func:`clean_leftovers` removes a half-written one. Loading verifies every
checksum before it returns anything and never executes code (``torch.load(weights_only=True)``;
a payload that needs more is refused).

The checksum is XXH3-128 over 8 MiB chunks (the XXH3-128 of the chunks' digests), so that the
chunks are hashed in parallel: while a save writes, and while a load reads. Checkpoints of format
versions 1 (one SHA-256 of the whole file) and 2 (SHA-256 over the same chunks) still load.

The package, by idea (each module private; the names below are re-exported here):

* ``_save``: :func:`save` (atomic, durable), :func:`save_async`, :func:`wait`,
  :func:`release_buffers`
* ``_cleanup``: :func:`remove` and :func:`clean_leftovers` (what a crash left behind)
* ``_lock``: the run lock, one live run's claim on its checkpoint directory
* ``_read``: :func:`read_meta` and :func:`verify`, the verified reads of a checkpoint's files
* ``_load``: :func:`load`, the verified tensors assembled into a state shaped like a template
* ``_report``: :func:`inspect`, what a checkpoint holds and what checking it found
* ``_weights``: :func:`load_weights` and :func:`export`, the weights without an optimizer
* ``_hparams``: :func:`read_hparams`, the run's hyperparameters as ``meta.json`` records them
* ``_lightning``: :func:`from_lightning`, the weights of a Lightning ``.ckpt``
* ``_io``: :class:`CheckpointIO`, the Trainer's plugin over the functions above
* ``_layouts``: the seam a strategy's layout plugs into (a sharded state's and checkpoint's:
  registered by ``engine.parallel``); the checkpoint code imports no strategy
* ``_files``, ``_meta``, ``_checksum``, ``_snapshot``, ``_tree``, ``_opt_fit``: the format (a
  directory's files, ``meta.json``'s schema, chunked checksums, host snapshots, trees as JSON,
  whose optimizer state a checkpoint holds)
* ``_writable``, ``_pickling``, ``_data``: whole-file writes of a run's directory, its code
  pickles, and what its ``data.pkl`` records (by reference, or pickled)
"""

from __future__ import annotations

from engine.checkpoint._cleanup import clean_leftovers, remove

# names other layers reach through the package beyond __all__: a checkpoint's file names, the
# Trainer's check of what Task(hparams=...) holds, and ModelCheckpoint's claim on its directory
from engine.checkpoint._files import META as META
from engine.checkpoint._files import TENSORS as TENSORS
from engine.checkpoint._hparams import _hparams_doc as _hparams_doc
from engine.checkpoint._hparams import read_hparams
from engine.checkpoint._io import CheckpointIO
from engine.checkpoint._lightning import from_lightning
from engine.checkpoint._load import load
from engine.checkpoint._lock import RUN_LOCK as RUN_LOCK
from engine.checkpoint._lock import _RunLock as _RunLock
from engine.checkpoint._meta import FORMAT_VERSION
from engine.checkpoint._read import read_meta, verify
from engine.checkpoint._report import inspect
from engine.checkpoint._save import release_buffers, save, save_async, wait
from engine.checkpoint._weights import IncompatibleKeys, export, load_weights
from engine.errors import CheckpointError

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointIO",
    "IncompatibleKeys",
    "clean_leftovers",
    "export",
    "from_lightning",
    "inspect",
    "load",
    "load_weights",
    "read_hparams",
    "read_meta",
    "release_buffers",
    "remove",
    "save",
    "save_async",
    "verify",
    "wait",
]
