"""Loading a checkpoint into a state (private): :func:`load`, the verified tensors assembled into
a state shaped like the template, and the checks that they fit it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from engine.checkpoint import _layouts, _opt_fit, _tree
from engine.checkpoint._files import _RANK_GRADS, _TREES, META, TENSORS
from engine.checkpoint._read import _verified_tensors, read_meta
from engine.errors import CheckpointError
from engine.optim.base import load_state_dict as load_opt_state
from engine.state import TrainState

__all__ = ["load"]


def load(path: str | os.PathLike[str], template: TrainState, *, rank: int = 0) -> TrainState:
    """Load a checkpoint into a state shaped like ``template`` (same model and optimizer).

    The template supplies the structure (the module, the optimizer state's tree); every value
    comes from the checkpoint, verified first. From a ``weights_only`` checkpoint only the
    parameters, buffers and counters come; the optimizer state and ``extra`` are the template's.

    ``rank``: the data-parallel rank the state is for. A checkpoint saved inside an
    accumulation window by ``r`` ranks holds each rank's partial gradient sum (see
    :func:`save`'s ``rank_grad_accum``); rank ``rank`` gets its own as ``grad_accum``. Every
    other value is the same on every rank.

    Raises:
        CheckpointError: if a file is missing or fails its checksum, the payload is not plain
            tensors, or the checkpoint does not fit the template (the message lists missing,
            unexpected and mis-shaped keys); or if it was saved inside an accumulation window
            and holds no partial gradient sum for ``rank``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"load(rank={rank!r}): pass the rank, an int >= 0")
    root = Path(path)
    meta = read_meta(root)
    layout = _layouts.of_meta(meta)
    if layout is not None:  # a strategy's files (a sharded checkpoint: DCP's shards)
        return _assemble(root, meta, template, layout.read(root, meta, template), 0)
    mine = "grad_accum" if rank == 0 else f"{_RANK_GRADS}{rank}"
    device_of = {k: v.device for k, v in {**template.params, **template.buffers}.items()}
    devices = {
        f"{group}/{k}": d for group in ("params", "buffers", mine) for k, d in device_of.items()
    }
    for name in _TREES:  # a tree's tensors go where the template's are (else the CPU)
        shaped: dict[str, Tensor] = {}
        _tree.to_json(getattr(template, name), name, shaped)
        devices.update((k, t.device) for k, t in shaped.items())
    tensors = _verified_tensors(root, meta, devices)
    placing = _layouts.of_state(template)
    if placing is not None:  # a full checkpoint resumed sharded, say: each rank takes its shards
        tensors = placing.placed_like(template, tensors)
    return _assemble(root, meta, template, tensors, rank)


def _assemble(
    root: Path,
    meta: Mapping[str, Any],
    template: TrainState,
    tensors: Mapping[str, Tensor],
    rank: int,
) -> TrainState:
    """The state that ``tensors`` (by checkpoint key, verified) and ``meta`` describe, shaped
    like ``template``; ``rank``'s partial gradient sum as its ``grad_accum``."""
    mine = "grad_accum" if rank == 0 else f"{_RANK_GRADS}{rank}"
    device_of = {k: v.device for k, v in {**template.params, **template.buffers}.items()}
    devices: dict[str, Any] = {}
    for name in _TREES:
        shaped: dict[str, Tensor] = {}
        _tree.to_json(getattr(template, name), name, shaped)
        devices.update((k, t.device) for k, t in shaped.items())
    groups: dict[str, dict[str, Tensor]] = {"params": {}, "buffers": {}, "grad_accum": {}}
    opt: dict[str, Any] = dict(meta.get("opt_state_scalars", {}))
    in_trees: dict[str, Tensor] = {}
    for key, t in tensors.items():
        group, _, name = key.partition("/")
        if group == mine:  # this rank's partial gradient sum
            groups["grad_accum"][name] = t
        elif group == "opt_state":
            opt[name] = t
        elif group.startswith(_RANK_GRADS) or group == "grad_accum":  # another rank's
            continue
        elif group in groups:
            groups[group][name] = t
        elif group in _TREES:
            in_trees[key] = t.to(devices.get(key, "cpu"))
        else:
            raise CheckpointError(f"{root / TENSORS}: unknown entry {key!r}")
    trees = meta.get("trees", {})  # absent before format 2: the template's then
    try:
        restored = {
            name: _tree.from_json(trees[name], in_trees) for name in _TREES if name in trees
        }
    except (KeyError, ValueError, TypeError, RuntimeError) as e:  # a damaged tree
        raise CheckpointError(
            f"{root / META}: 'trees' (the state's extra and precision) cannot be rebuilt: {e}"
        ) from e
    if (  # a template without a precision state takes the checkpoint's, as it takes extra
        "precision" in restored
        and template.precision is not None
        and _shape_of(restored["precision"]) != _shape_of(template.precision)
    ):
        raise CheckpointError(
            f"{root}: the checkpoint's precision state ({_shape_of(restored['precision'])}) "
            f"does not fit the template's ({_shape_of(template.precision)}): it was saved under "
            "another precision (a loss scale comes with '16-mixed'). Resume with the precision "
            "it was saved with (its config records it), or load its weights alone"
        )
    _check_fit(root, "params", template.params, groups["params"])
    _check_fit(root, "buffers", template.buffers, groups["buffers"])
    params = {
        k: groups["params"][k].to(device_of[k]).requires_grad_(v.requires_grad)
        for k, v in template.params.items()
    }
    buffers = {k: groups["buffers"][k].to(device_of[k]) for k in template.buffers}
    if meta.get("has_grad_accum") and not groups["grad_accum"]:
        held = meta.get("grad_accum_ranks", 1)
        raise CheckpointError(
            f"{root}: saved inside an accumulation window (micro_step {meta['micro_step']}) "
            f"with the partial gradient sums of {held} rank{'s' * (held != 1)}, none of them "
            f"rank {rank}'s: a data-parallel rank continues only its own window. Resume on the "
            "world size it was saved on, or from a checkpoint saved at an optimizer step"
        )
    grad_accum = (
        {k: groups["grad_accum"][k].to(device_of[k]) for k in template.params}
        if meta.get("has_grad_accum")
        else None
    )
    try:
        opt_state = (
            template.opt_state
            if meta.get("weights_only")
            else load_opt_state(template.opt_state, opt)
        )
    except (KeyError, ValueError) as e:  # another optimizer's state: say whose, and what to do
        raise _opt_fit.refuse(root, meta, template.opt_state, opt, e) from e
    return template.replace(
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        grad_accum=grad_accum,
        step=meta["step"],
        epoch=meta["epoch"],
        batch_idx=meta["batch_idx"],
        micro_step=meta["micro_step"],
        seed=meta["seed"],
        _ownership=type(template._ownership)(),
        **restored,
    )


def _check_fit(
    root: Path, group: str, expected: Mapping[str, Tensor], got: Mapping[str, Tensor]
) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(got[k].shape)} {got[k].dtype}, model {tuple(v.shape)} {v.dtype}"
        for k, v in expected.items()
        if k in got and (got[k].shape != v.shape or got[k].dtype != v.dtype)
    )
    if (
        shapes
        and not missing
        and not unexpected
        and all(got[k].shape == v.shape for k, v in expected.items())
    ):
        dtypes = sorted(
            {
                f"{got[k].dtype} in the checkpoint, {v.dtype} in the template"
                for k, v in expected.items()
                if got[k].dtype != v.dtype
            }
        )
        raise CheckpointError(
            f"{root}: the checkpoint's {group} have other dtypes than the template's "
            f"({'; '.join(dtypes)}): it was saved under another precision. Resume with the "
            "precision it was saved with (its config records it), e.g. Trainer(precision="
            "'bf16-true') for bfloat16 parameters"
        )
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{root}: the checkpoint's {group} do not fit the model (missing: {missing}; "
            f"unexpected: {unexpected}; mis-shaped: {shapes}); was it saved from another model?"
        )


def _shape_of(tree: Any) -> Any:
    """A tree's structure, for comparing precision states: dict keys sorted (a checkpoint's
    JSON does not keep their order), tensors by dtype."""
    if isinstance(tree, Mapping):
        return {k: _shape_of(tree[k]) for k in sorted(tree)}
    if isinstance(tree, (list, tuple)):
        return [_shape_of(x) for x in tree]
    if isinstance(tree, Tensor):
        return str(tree.dtype).removeprefix("torch.")
    return type(tree).__name__
