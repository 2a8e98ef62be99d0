"""The Trainer's checkpoint IO (private): :class:`CheckpointIO`, Lightning's plugin, whose
methods call the package's functions."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

# the package's functions, looked up at each call: one replaced on the package (a test's
# monkeypatch of engine.checkpoint.save_async, say) is the one a Trainer's IO calls
from engine import checkpoint
from engine.state import TrainState

__all__ = ["CheckpointIO"]


class CheckpointIO:
    """How a Trainer writes, reads and deletes its checkpoints (Lightning's ``CheckpointIO``
    plugin): ``Trainer(plugins=[MyIO()])``. Each method does what the module function of its
    name does; override one to add to it (copy a saved checkpoint to other storage, say), and
    call the base method to keep the format's guarantees (atomic, verified).

    Example:
        >>> import shutil
        >>> class Mirrored(CheckpointIO):  # keeps a second copy of every synchronous save
        ...     def __init__(self, mirror):
        ...         self.mirror = mirror
        ...     def save(self, state, path, **kwargs):
        ...         out = super().save(state, path, **kwargs)
        ...         shutil.copytree(out, f"{self.mirror}/{out.name}", dirs_exist_ok=True)
        ...         return out
    """

    plugin_kind = "checkpoint IO"  # its kind among Trainer(plugins=[...])

    def save(self, state: TrainState, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """:func:`save` (``metrics``, ``extra``, ``fingerprint``, ``weights_only``,
        ``rank_grad_accum``)."""
        return checkpoint.save(state, path, **kwargs)

    def save_async(
        self, state: TrainState, path: str | os.PathLike[str], **kwargs: Any
    ) -> Future[Path]:
        """:func:`save_async`."""
        return checkpoint.save_async(state, path, **kwargs)

    def load(self, path: str | os.PathLike[str], template: TrainState, **kwargs: Any) -> TrainState:
        """:func:`load` (``rank``: passed by a Trainer only on a data-parallel rank > 0)."""
        return checkpoint.load(path, template, **kwargs)

    def remove(self, path: str | os.PathLike[str]) -> None:
        """:func:`remove`."""
        checkpoint.remove(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
