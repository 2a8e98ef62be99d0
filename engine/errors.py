"""The exceptions that more than one layer raises, defined below all of them.

A module raises these without importing the layer that usually does (the checksum threads raise
:class:`CheckpointError` without importing :mod:`engine.checkpoint`).
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CollectiveError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, of another format, or does not fit the state."""


class CollectiveError(RuntimeError):
    """One of engine's collectives failed: a rank did not join it within the strategy's timeout,
    or left (died); the message names the collective and the ranks."""
