"""The optimizer's kernels under ``torch.func.vmap``, run on the members' stacked tensors.

An ensemble step (:mod:`engine.ensemble`) maps one member's step over a leading member axis
with ``torch.func.vmap``. The optimizers of :mod:`engine.optim` are written with
``torch._foreach_*`` ops and fused kernels (``torch._fused_adamw_``), which have no batching
rules in torch 2.13 (vmap refuses them), and Adam reads its step counters on the host
(``.item()``), which vmap refuses too. Inside :class:`StackedKernels` (a torch function mode,
entered around the optimizer's update only) these calls are carried out on the tensors vmap
wraps, the members' stacked storage:

* an elementwise ``_foreach_*`` op runs ONCE on the stacked tensors (every member's element
  gets the same arithmetic as in a run of its own: the same kernel, on a tensor E times
  larger). A per-member 0-d operand (a bias correction computed from the members' counters, a
  swept learning rate) is viewed as ``(E, 1, ..., 1)`` so that it broadcasts member by member,
  in the dtype the unbatched op would compute in;
* a fused optimizer kernel runs once with each member's slice of each tensor as a tensor of
  its lists (E times as many tensors): its vectorised blocks and scalar tail then fall where a
  separate run's do, which the stacked tensor would change (its bits differ by an ulp there);
* a reduction (``_foreach_norm``), or an op given a per-member *scalar* argument (``alpha=``, or
  a fused kernel's ``lr=``: a swept learning rate), runs once per member on that member's
  slices: what E separate runs do, E kernel calls;
* ``.item()`` / ``float()`` / ``int()`` / ``bool()`` of a per-member value reads it on the host
  when every member holds the same (Adam's step counters, which count the same steps); a value
  that differs between members cannot be one host number and is refused by name.

Everything else passes through to vmap's own batching rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch as _ft
from torch.overrides import TorchFunctionMode

__all__ = ["StackedKernels"]

# the fused optimizer kernels: elementwise over each parameter, the step counters read-only
_FUSED = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})
# foreach ops that reduce each tensor: per member, never over the stacked tensor
_REDUCING = frozenset({"norm", "max"})
# keyword arguments that a kernel takes as one number (a Scalar)
_SCALAR_KWARGS = frozenset({"alpha", "value"})
_HOST_READS = frozenset({"item", "__float__", "__int__", "__bool__", "__index__"})


class _Batched:
    """A tensor vmap wraps at the members' level: its stacked storage, members on dim 0."""

    __slots__ = ("logical", "stacked")

    def __init__(self, logical: Tensor, stacked: Tensor) -> None:
        self.logical = logical
        self.stacked = stacked


def _at_level(x: Any, level: int) -> _Batched | None:
    if isinstance(x, Tensor) and _ft.is_batchedtensor(x) and _ft.maybe_get_level(x) == level:
        inner = _ft.get_unwrapped(x)
        bdim = _ft.maybe_get_bdim(x)
        return _Batched(x, inner if bdim == 0 else inner.movedim(bdim, 0))
    return None


def _tensors(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for y in x if isinstance(y, Tensor)]
    return [x] if isinstance(x, Tensor) else []


class StackedKernels(TorchFunctionMode):
    """A torch function mode, entered inside ``torch.func.vmap`` around an optimizer update,
    that runs ``torch._foreach_*`` ops and fused optimizer kernels on the members' stacked
    tensors (see the module's docstring).

    Args:
        level: the vmap level of the members' axis
            (``torch._C._functorch.maybe_current_level()`` inside the mapped function).
    """

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_"):
            return self._foreach(func, name[len("_foreach_") :], args, kwargs)
        if name in _FUSED:
            return self._fused(func, args, kwargs)
        if name in _HOST_READS and args and _at_level(args[0], self.level) is not None:
            return self._host_read(func, name, args, kwargs)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ dispatch

    def _foreach(self, func: Callable, op: str, args: tuple, kwargs: dict) -> Any:
        level = self.level
        found = [_at_level(t, level) for a in (*args, *kwargs.values()) for t in _tensors(a)]
        if not any(found):
            return func(*args, **kwargs)  # nothing of the members': an ordinary call
        selves = [_at_level(x, level) for x in args[0]]
        if not all(selves):
            if op.endswith("_"):  # a shared tensor written from per-member values: vmap's
                return func(*args, **kwargs)  # own error says so
            return self._per_member(func, args, kwargs)
        base = op.rstrip("_")
        if (
            base in _REDUCING
            or any(_at_level(kwargs.get(k), level) for k in _SCALAR_KWARGS)
            or (base in ("addcmul", "addcdiv") and len(args) > 3 and _tensors(args[3]))
        ):
            return self._per_member(func, args, kwargs)
        stacked_args = [[b.stacked for b in selves if b is not None]]
        stacked_args += [self._operand(a, selves) for a in args[1:]]
        out = func(*stacked_args, **kwargs)
        if op.endswith("_") or out is None:
            return out
        return [_ft._add_batch_dim(r, 0, level) for r in out]

    def _operand(self, a: Any, selves: list[_Batched | None]) -> Any:
        """An operand of a foreach op, for the stacked call: each batched tensor on its stacked
        storage, shaped to broadcast member by member against its ``self``."""
        if isinstance(a, (list, tuple)):
            return [self._shaped(x, s) for x, s in zip(a, selves, strict=True)]
        b = _at_level(a, self.level)
        if b is None:
            return a  # a number, or one tensor every member shares
        return [self._shaped(a, s) for s in selves]  # one per-member scalar: one view each

    def _shaped(self, x: Any, self_: _Batched | None) -> Any:
        b = _at_level(x, self.level)
        if b is None or self_ is None:
            return x
        stacked, logical = b.stacked, b.logical
        missing = self_.logical.dim() - logical.dim()
        if missing > 0:  # a lower-rank operand (a 0-d scalar) broadcasts per member
            stacked = stacked.reshape(stacked.shape[0], *([1] * missing), *logical.shape)
        if logical.dim() == 0:
            # a 0-d operand does not decide the dtype an op computes in; its stacked storage
            # (one dimension) would: give it the dtype the unbatched op computes in
            dtype = torch.result_type(self_.logical, logical)
            if stacked.dtype != dtype:
                stacked = stacked.to(dtype)
        return stacked

    def _fused(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        level = self.level
        if any(_at_level(v, level) for v in kwargs.values()):  # a swept lr: one call per member
            return self._per_member(func, args, kwargs)
        # one call, each member's slice of each tensor a tensor of the call's lists: the
        # kernel splits each tensor into vector-width blocks and a tail, so a member's slice
        # must be a tensor of its own to get the blocks (and the bits) of a separate run;
        # the step counters are the members' own 0-d slices
        listed: list[Any] = []
        for a in args:
            items = [_at_level(x, level) for x in a] if isinstance(a, (list, tuple)) else []
            if items and all(items):
                listed.append([t for b in items for t in b.stacked.unbind(0)])  # type: ignore[union-attr]
            elif any(items):
                return self._per_member(func, args, kwargs)
            else:
                listed.append(a)
        return func(*listed, **kwargs)

    def _per_member(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func`` once per member on that member's slices: E separate runs' calls."""
        level = self.level
        size = next(
            b.stacked.shape[0]
            for a in (*args, *kwargs.values())
            for t in _tensors(a)
            if (b := _at_level(t, level)) is not None
        )

        def split(x: Any) -> list[Any]:
            """``x`` as each member sees it: one entry per member (slices are views)."""
            if isinstance(x, (list, tuple)):
                columns = [split(y) for y in x]
                return [type(x)(c[e] for c in columns) for e in range(size)]
            b = _at_level(x, level)
            return [x] * size if b is None else list(b.stacked.unbind(0))

        per_args = split(args)
        per_kwargs = {k: split(v) for k, v in kwargs.items()}
        outs = [func(*per_args[e], **{k: v[e] for k, v in per_kwargs.items()}) for e in range(size)]
        if outs[0] is None:
            return None
        if isinstance(outs[0], (list, tuple)):
            return [_ft._add_batch_dim(torch.stack(rs), 0, level) for rs in zip(*outs, strict=True)]
        return _ft._add_batch_dim(torch.stack(outs), 0, level)

    def _host_read(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        b = _at_level(args[0], self.level)
        assert b is not None
        first = b.stacked[0]
        if not torch.equal(b.stacked, first.expand_as(b.stacked)):
            raise ValueError(
                f"Tensor.{name}() of a value that differs between the ensemble's members "
                f"(one value per member: {b.stacked.reshape(b.stacked.shape[0], -1)[:, 0].tolist()}"
                "): a step of an ensemble reads a number on the host only where every member "
                "holds the same (such as Adam's step counters); keep per-member values as "
                "tensors"
            )
        return func(first, *args[1:], **kwargs)
