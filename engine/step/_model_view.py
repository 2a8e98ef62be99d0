"""The stateless view of a module (private): :class:`ModelView` runs a module with a state's
tensors bound into its parameter and buffer slots (``_Binder`` finds the slots once per module),
and ``_view`` gives a step's function that view, or the dict of tensors of a pure-function model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn
from torch.func import functional_call


class _Binder:
    """Binds a module's parameter and buffer slots to given tensors for one call.

    ``torch.func.functional_call`` rediscovers the module tree and its tied weights on every call,
    which costs about 100 us on a small MLP, more than its forward. The slots are fixed for a
    module, so the binder finds them once (tied weights included: every slot that held the same
    tensor is bound to its canonical name) and each call is a handful of dict stores.
    """

    __slots__ = ("slots",)

    def __init__(self, module: nn.Module) -> None:
        canonical: dict[int, str] = {}
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            canonical.setdefault(id(t), name)
        self.slots: list[tuple[dict[str, Any], str, str]] = []
        for _, sub in module.named_modules(remove_duplicate=False):
            for store in (sub._parameters, sub._buffers):
                for attr, t in store.items():
                    if t is not None:
                        self.slots.append((store, attr, canonical[id(t)]))

    def call(self, fn: Callable, tensors: Mapping[str, Tensor], args: tuple, kwargs: dict) -> Any:
        """Call ``fn(*args, **kwargs)`` with ``tensors`` bound into the module's slots."""
        saved = []
        try:
            for store, attr, key in self.slots:
                t = tensors.get(key)
                if t is not None:
                    saved.append((store, attr, store[attr]))
                    store[attr] = t
            return fn(*args, **kwargs)
        finally:
            for store, attr, old in saved:
                store[attr] = old


_binders: weakref.WeakKeyDictionary[nn.Module, _Binder] = weakref.WeakKeyDictionary()


def _binder(module: nn.Module) -> _Binder:
    b = _binders.get(module)
    if b is None:
        b = _binders[module] = _Binder(module)
    return b


class ModelView:
    """A callable, stateless view of a module bound to a state's tensors.

    ``view(*args, **kwargs)`` runs the module with the state's tensors in place of its own (the
    semantics of :func:`torch.func.functional_call`); the module's own parameters are never read.
    ``view.params`` / ``view.buffers`` expose the tensors and ``view.module`` the template.
    """

    __slots__ = ("buffers", "module", "params", "prebound")

    def __init__(
        self,
        module: nn.Module,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        prebound: bool = False,
    ) -> None:
        self.module = module
        self.params = params
        self.buffers = buffers
        self.prebound = prebound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.prebound:
            # A compiled step bound these tensors into the module's slots around the whole
            # compiled call, so the graph reads them as ordinary module parameters.
            return self.module(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Dynamo traces functional_call natively; the binder's dict stores would be
            # side effects it has to replay.
            tensors = (self.params, self.buffers) if self.buffers else self.params
            return functional_call(self.module, tensors, args, kwargs, strict=False)  # type: ignore[arg-type]
        tensors = {**self.params, **self.buffers} if self.buffers else self.params
        return _binder(self.module).call(self.module, tensors, args, kwargs)


@attrs.frozen
class _Prebound:
    """Marks a module whose slots hold the state's tensors for the duration of a compiled call."""

    module: nn.Module


#: a transform's view of the parameters, ``bind(module, params) -> params`` (Transform.bind)
Bind = Callable[[Any, Any], Any]


def _view(
    module: nn.Module | _Prebound | None,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    bind: Bind | None = None,
) -> Any:
    if bind is not None:
        # a transform's view of the parameters (a sharding strategy's gathered shards): the
        # forward reads what it returns, and the gradients flow back through it to ``params``
        template = module.module if isinstance(module, _Prebound) else module
        params = bind(template, params)
        module = template  # a compiled core binds the returned tensors, not the slots
    if module is None:
        return {**params, **buffers} if buffers else params
    if isinstance(module, _Prebound):
        return ModelView(module.module, params, buffers, prebound=True)
    return ModelView(module, params, buffers)
