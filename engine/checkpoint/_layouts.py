"""The checkpoint layouts that strategies bring (private): the seam between the checkpoint code
and a strategy whose state is not whole on each process.

The checkpoint code writes and reads one layout of its own, the full one (``tensors.pt``: every
tensor whole, on one process). Any other is a :class:`Layout`, registered under the name that
both a state and a checkpoint say: a state whose tensors are DTensors (``state.sharded``) is
saved by the layout ``"sharded"``, and a checkpoint whose ``meta.json`` says
``"layout": "sharded"`` is read by it. ``engine.parallel`` registers that one
(``torch.distributed.checkpoint``'s IO, ``engine/parallel/_dcp_layout.py``) when it is
imported, which ``import engine`` always does, so every call below finds it; a lookup that finds
nothing registered is a :class:`~engine.errors.CheckpointError` that says so. Nothing here
imports a strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from engine.checkpoint._meta import SHARDED
from engine.errors import CheckpointError
from engine.state import TrainState

__all__ = ["Layout", "of_meta", "of_state", "register"]


class Layout(Protocol):
    """What the checkpoint functions ask of a layout other than the full one. ``save`` and
    ``save_async`` take :func:`engine.checkpoint.save`'s keywords (``metrics``, ``extra``,
    ``fingerprint``, ``weights_only``, ``rank_grad_accum``); every method raises
    :class:`~engine.errors.CheckpointError` for what it refuses."""

    def save(self, state: TrainState, target: Path, **kwargs: Any) -> Path:
        """Write ``state`` to ``target`` (:func:`engine.checkpoint.save`)."""
        ...

    def save_async(self, state: TrainState, target: Path, **kwargs: Any) -> Future[Path]:
        """Write ``state`` to ``target`` in the background
        (:func:`engine.checkpoint.save_async`)."""
        ...

    def verify(self, root: Path, meta: Mapping[str, Any]) -> Any:
        """Check every file of the checkpoint at ``root``; what the loaders need of the check
        (an index, say) is returned."""
        ...

    def read(self, root: Path, meta: Mapping[str, Any], template: TrainState) -> dict[str, Tensor]:
        """The checkpoint's tensors by checkpoint key (``params/<name>``, ``opt_state/<path>``,
        ...), verified, each like the template's (:func:`engine.checkpoint.load`)."""
        ...

    def read_weights(
        self, root: Path, meta: Mapping[str, Any], devices: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        """The checkpoint's parameters and buffers by name, whole, verified; ``devices`` by
        checkpoint key (:func:`engine.checkpoint.load_weights`, :func:`~engine.checkpoint.export`).
        """
        ...

    def placed_like(self, template: TrainState, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` (whole, by checkpoint key, read from a full checkpoint) placed as the
        ``template`` of this layout holds its own: a full checkpoint resumed in this layout."""
        ...

    def inspected(self, root: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
        """The file-level part of :func:`engine.checkpoint.inspect`'s summary (the keys of
        ``engine/checkpoint/_report.py``'s ``inspected``)."""
        ...


_LAYOUTS: dict[str, Layout] = {}


def register(name: str, layout: Layout) -> None:
    """Make ``layout`` the one of states and checkpoints that say ``name`` (again: replaced)."""
    _LAYOUTS[name] = layout


def _registered(name: str, what: str) -> Layout:
    layout = _LAYOUTS.get(name)
    if layout is None:
        raise CheckpointError(
            f"{what} is in the checkpoint layout {name!r}, and no such layout is registered "
            f"(registered: {sorted(_LAYOUTS) or 'none'}). A strategy registers its layout when "
            "its package is imported: engine.parallel registers 'sharded' "
            "(torch.distributed.checkpoint), and `import engine` imports it"
        )
    return layout


def of_state(state: TrainState) -> Layout | None:
    """The layout that saves ``state``, and places a full checkpoint's tensors like it; ``None``
    for the full layout (every tensor whole)."""
    return _registered(SHARDED, "the state (its tensors are DTensors)") if state.sharded else None


def of_meta(meta: Mapping[str, Any]) -> Layout | None:
    """The layout that reads the checkpoint whose ``meta.json`` is ``meta``; ``None`` for the
    full layout (``tensors.pt``)."""
    name = meta.get("layout")
    return None if name is None else _registered(name, "the checkpoint (its meta.json says so)")
