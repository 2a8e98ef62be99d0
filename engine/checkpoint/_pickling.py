"""Pickling a run's code for replay (private): cloudpickle that keeps file names and source
lines, stops at a size limit, reduces a model's weights to shapes, and records an object by
reference (:class:`Rebuild`: its class and arguments) where asked. The training data's choice
of what to record is ``_data``'s.

Everything here that loads runs code from its input: only for trusted run directories.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import types
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from engine.optim.base import GradientTransformation
from engine.state import TrainState

__all__ = [
    "PayloadTooLarge",
    "Rebuild",
    "dump_skeleton",
    "dumps_code",
    "load_skeleton",
    "loads_code",
]

_CODE_FORMAT = "engine-code-v1"


def _meta_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, parameter: bool, requires_grad: bool
) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device="meta")
    return nn.Parameter(t, requires_grad=requires_grad) if parameter else t


class PayloadTooLarge(ValueError):
    """A pickle grew past the size it was allowed (see :func:`dumps_code`)."""


class _Capped(io.BytesIO):
    """A buffer that refuses to grow past ``limit`` bytes: pickling stops there, before a large
    object (an in-memory dataset) has been copied whole."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit

    def write(self, b: Any) -> int:
        n = super().write(b)
        if self.limit is not None and self.tell() > self.limit:
            raise PayloadTooLarge(f"more than {self.limit} bytes")
        return n


def dumps_code(
    obj: Any,
    *,
    shapes_only: Iterable[Tensor] = (),
    limit: int | None = None,
    by_reference: Callable[[Any], Rebuild | None] | None = None,
) -> bytes:
    """Pickle ``obj`` with cloudpickle, keeping what a debugger needs and dropping weights.

    Code pickled by value keeps its file name, and the source lines of those files travel in the
    payload, so tracebacks of a replay (anomaly detection's forward traceback, say) show the
    original lines even where the script is gone. The tensors in ``shapes_only`` are reduced to
    their shape and dtype (they load as ``meta`` tensors). With ``limit``, pickling stops with
    :class:`PayloadTooLarge` as soon as the payload passes that many bytes. ``by_reference``
    is asked about each object met (not the atoms: numbers, strings, plain containers); where
    it returns a :class:`Rebuild`, the object is pickled as that call (nothing of its own
    state), and unpickling makes it again.
    """
    import cloudpickle

    reduce_code = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)
    ids = {id(t) for t in shapes_only}
    sources: dict[str, list[str]] = {}

    def keep_filename(code: types.CodeType) -> Any:
        assert reduce_code is not None
        fn, args = reduce_code(code)
        name = code.co_filename
        if name not in sources:
            sources[name] = linecache.getlines(name)
        return fn, tuple(name if a == "<dynamic-code>" else a for a in args)

    class _Pickler(cloudpickle.Pickler):
        if reduce_code is not None:  # cloudpickle's code reducer; without it, names are lost
            dispatch_table = ChainMap(
                {types.CodeType: keep_filename}, cloudpickle.Pickler.dispatch_table
            )

        def reducer_override(self, x: Any) -> Any:
            if isinstance(x, Tensor) and id(x) in ids:
                shape = tuple(x.shape)
                return _meta_tensor, (shape, x.dtype, isinstance(x, nn.Parameter), x.requires_grad)
            if by_reference is not None and not isinstance(x, type | Tensor):
                rebuild = by_reference(x)
                if rebuild is not None:  # made again on loading, as cls(**kwargs)
                    return _rebuilt, (rebuild.description, rebuild.cls, rebuild.kwargs)
            return super().reducer_override(x)

    buf = _Capped(limit)
    pickler = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(obj)
    return pickle.dumps((_CODE_FORMAT, sources, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def loads_code(payload: bytes) -> Any:
    """Unpickle a :func:`dumps_code` payload (this runs code from it: trusted input only) and
    make its source lines available to tracebacks."""
    fmt, sources, inner = pickle.loads(payload)
    if fmt != _CODE_FORMAT:
        raise ValueError(f"unknown pickled-code format {fmt!r}")
    for name, lines in sources.items():
        if lines and not os.path.exists(name):  # the script is gone: serve its saved lines
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return _CodeUnpickler(io.BytesIO(inner)).load()


def _make_function(code: types.CodeType, namespace: dict[str, Any], *args: Any) -> Any:
    """cloudpickle's ``_make_function`` for a function pickled by value, its namespace
    without ``__name__``: that names the module it was defined in (``__main__`` for a
    script's), which in this process is another module or none, and ``torch.compile`` reads a
    function's globals from the module its namespace names: a compiled replay of a script's
    task would look ``F`` up in the replaying program's ``__main__``. Without the name, the
    function's own namespace is read (relative imports go by ``__package__``)."""
    from cloudpickle import cloudpickle

    fn = cloudpickle._make_function(code, namespace, *args)
    namespace.pop("__name__", None)
    return fn


class _CodeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("cloudpickle.cloudpickle", "_make_function"):
            return _make_function
        return super().find_class(module, name)


class Rebuild:
    """How to make an object again: its class and the keyword arguments it was made with (a
    datamodule's or dataset's ``save_hyperparameters()`` record, Lightning's
    ``hparams_initial``). Calling it makes a new one, as ``Class(**kwargs)``.

    It pickles as ``(description, cls, kwargs)``, the description first: ``engine inspect``
    reads it from the pickle's opcodes without unpickling anything
    (``engine.checkpoint._data.references``).

    Example:
        >>> from engine.checkpoint._pickling import Rebuild
        >>> r = Rebuild(dict, {"a": 1})
        >>> r(), r.description
        ({'a': 1}, 'builtins.dict(a=1)')
    """

    def __init__(self, cls: type, kwargs: Mapping[str, Any]) -> None:
        self.cls, self.kwargs = cls, dict(kwargs)

    def __call__(self) -> Any:
        return self.cls(**self.kwargs)

    @property
    def description(self) -> str:
        """``module.Class(name=value, ...)``, each value's repr cut to 60 characters."""
        return _call_text(self.cls, self.kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _reference, (self.description, self.cls, self.kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.cls.__qualname__}({args})"


def _call_text(cls: type, kwargs: Mapping[str, Any]) -> str:
    def short(v: Any) -> str:
        try:
            text = repr(v)
        except Exception:  # a repr that fails: name the type
            text = f"<{type(v).__qualname__}>"
        return text if len(text) <= 60 else text[:57] + "..."

    args = ", ".join(f"{k}={short(v)}" for k, v in kwargs.items())
    return f"{cls.__module__}.{cls.__qualname__}({args})"


def _reference(description: str, cls: type, kwargs: Mapping[str, Any]) -> Rebuild:
    """Unpickle a :class:`Rebuild` (``description`` is for readers of the opcodes only)."""
    return Rebuild(cls, kwargs)


def _rebuilt(description: str, cls: type, kwargs: Mapping[str, Any]) -> Any:
    """Unpickle an object recorded by reference inside a pickle (``dumps_code(...,
    by_reference=...)``): it is made again here, as ``cls(**kwargs)``."""
    return cls(**kwargs)


# the functions a pickle calls for an object recorded by reference, each followed by its
# description in the opcodes: engine inspect and replay's report read them (_data.references)
REFERENCE_CALLS = {
    f"{__name__}._reference": "the data source",
    f"{__name__}._rebuilt": "inside the pickle",
}


def dump_skeleton(state: TrainState) -> bytes:
    """The state's model pickled with every parameter and buffer reduced to its shape and
    dtype: the structure a checkpoint is loaded into, without a copy of the weights.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.checkpoint._pickling import dump_skeleton, load_skeleton
        >>> state = eg.TrainState.create(torch.nn.Linear(1000, 1000), optim.sgd(0.1))
        >>> payload = dump_skeleton(state)
        >>> len(payload) < 4000  # the 4 MB of weights are not in it
        True
        >>> template = load_skeleton(payload, optim.sgd(0.1))
        >>> template.params["weight"].shape
        torch.Size([1000, 1000])
    """
    if state.module is not None:
        tensors = [*state.module.parameters(), *state.module.buffers()]
        return dumps_code(("module", state.module), shapes_only=tensors)
    obj = ("tensors", {"params": state.params, "buffers": state.buffers})
    return dumps_code(obj, shapes_only=[*state.params.values(), *state.buffers.values()])


def load_skeleton(payload: bytes, tx: GradientTransformation) -> TrainState:
    """A state of the skeleton's structure (uninitialised CPU tensors) to load a checkpoint into.

    Unpickling runs code from ``payload``: only for trusted run directories.
    """
    kind, obj = loads_code(payload)
    if kind == "module":
        module = obj.to_empty(device="cpu")
        return TrainState.create(module, tx)

    def materialize(d: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in d.items()}

    return TrainState.create(materialize(obj["params"]), tx, buffers=materialize(obj["buffers"]))
