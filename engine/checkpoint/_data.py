"""What a run directory's ``data.pkl`` records of the training data (private): by reference
where it can be made again, pickled where it must be, and a warning, once, when that is large.

The rule (:func:`dumps_data`):

* An object that can be *rebuilt*, :func:`reference`, is one whose class is importable by name
  (its module imported, not ``__main__``, not a class made inside a function) and that exposes
  the arguments it was made with as ``hparams_initial`` or ``hparams`` (Lightning's
  ``save_hyperparameters()``), every named argument of its ``__init__`` among them: it is made
  again as ``Class(**hparams)``.
* A datamodule (or any data source other than a loader) that can be rebuilt is pickled whole
  when that takes at most :data:`SMALL` bytes (the pickle holds exactly the data the run had,
  however it was made); a larger one is recorded by reference alone, its tensors not pickled.
* A ``DataLoader`` is pickled with its own settings (sampler, generator, collate function,
  workers), and each dataset in it that can be rebuilt and would pickle to more than
  :data:`SMALL` bytes is recorded by reference inside that pickle.
* Recording by reference warns once per process and class: a replay makes the object again from
  its arguments, and a rebuild that does not give the same data (one that draws from the global
  random generator as it is made, or depends on more than its arguments) shows there as a
  divergence, since replay compares every replayed loss and fingerprint with the journal.
* A payload that still passes :data:`LARGE` bytes (tensors pickled because nothing could be
  rebuilt) warns once per process and class, naming the class, the size and what to do.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import pickletools
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from engine.checkpoint._pickling import REFERENCE_CALLS, PayloadTooLarge, Rebuild, dumps_code

__all__ = ["LARGE", "SMALL", "dumps_data", "reference", "references"]

SMALL = 256 * 2**10  # a rebuildable object up to this size is pickled whole: exact, and cheap
LARGE = 2**20  # a data.pkl past this size warns (once per class) that it pickles tensors

# the classes warned about in this process, by what was said: ("reference" | "large", name)
_warned: set[tuple[str, str]] = set()


def dumps_data(source: Any, *, limit: int | None = None, notes: list[str] | None = None) -> bytes:
    """Pickle a fit's training data source (a dataloader or a datamodule) for replay.

    A dataloader with ``persistent_workers`` is pickled without the iterator that keeps its
    workers. A datamodule is pickled without its ``trainer`` (the Trainer it was attached to,
    which holds open files and threads; a replay attaches its own, as a fit does). What is
    recorded by reference and what is pickled: see the module's docstring. A datamodule that
    does not pickle (an open file of its own), or pickles to more than ``limit`` bytes, is
    recorded as a :class:`Rebuild` when it has ``save_hyperparameters()`` arguments, even
    where they do not name all of its ``__init__``'s; else the error is raised.

    What it has to say (once per class and process: a reference, a payload over :data:`LARGE`
    bytes) is appended to ``notes`` when given (the Journal warns them once ``data.pkl`` is
    written), else warned here.

    Raises:
        PayloadTooLarge: the payload passes ``limit`` bytes.
    """
    found: list[tuple[Rebuild, int]] = []  # the datasets recorded by reference, with sizes
    by_reference = _large_datasets(found)
    if isinstance(source, torch.utils.data.DataLoader):
        if source._iterator is not None:
            # persistent_workers keeps its worker processes' iterator: a replay starts its own
            source = copy.copy(source)
            source.__dict__["_iterator"] = None
        payload = dumps_code(source, limit=limit, by_reference=by_reference)
        _said(found, notes)
        return _checked(payload, getattr(source, "dataset", source), notes)
    detached = source
    if "trainer" in getattr(source, "__dict__", {}):
        detached = copy.copy(source)
        detached.__dict__["trainer"] = None
    ref = reference(source)
    size = _size(detached) if ref is not None else None  # None: it does not pickle at all
    if ref is not None and (size is None or size > SMALL):
        try:
            payload = dumps_code(ref, limit=limit)
        except PayloadTooLarge:
            raise
        except Exception:  # an argument that does not pickle: try the object itself
            pass
        else:
            _said([(ref, -1 if size is None else size)], notes)
            return _checked(payload, source, notes)
    try:
        payload = dumps_code(detached, limit=limit, by_reference=by_reference)
    except Exception:
        hparams = _hparams(source)
        if detached is source or hparams is None:
            raise
        return dumps_code(Rebuild(type(source), hparams), limit=limit)
    _said(found, notes)
    return _checked(payload, source, notes)


def reference(obj: Any) -> Rebuild | None:
    """How to make ``obj`` again, or ``None``: its class, importable by name, called with the
    arguments its ``hparams_initial`` (or ``hparams``) records, which name every named
    argument of its ``__init__`` (and no argument it does not take).

    Example:
        >>> from engine.checkpoint._data import reference
        >>> from engine.checkpoint._pickling import Rebuild
        >>> reference(Rebuild(dict, {})) is None  # no hparams
        True
        >>> from torch.utils.data import TensorDataset
        >>> class Ones(TensorDataset):
        ...     def __init__(self, n):
        ...         super().__init__(torch.ones(n))
        ...         self.hparams = {"n": n}
        >>> reference(Ones(3)) is None  # its class is not importable: made in this doctest
        True
    """
    cls = type(obj)
    hparams = _hparams(obj)
    if hparams is None or not _importable(cls) or _unbound(cls, hparams) is not None:
        return None
    return Rebuild(cls, hparams)


def references(payload: bytes) -> list[tuple[str, str]]:
    """The objects a :func:`dumps_code` payload records by reference, read from its opcodes
    (nothing is unpickled): ``(where, description)`` pairs, ``where`` being ``"the data
    source"`` (the payload is a :class:`Rebuild`) or ``"inside the pickle"`` (a dataset in a
    pickled loader), the description ``module.Class(name=value, ...)``.

    Raises:
        ValueError: the payload is no pickle (a damaged file).
    """
    if not any(name.rpartition(".")[2].encode() in payload for name in REFERENCE_CALLS):
        return []  # the functions' names are not in it: nothing to read (a quick look)
    inner = max(
        (a for _, a, _ in pickletools.genops(payload) if isinstance(a, bytes | bytearray)),
        key=len,
        default=b"",
    )
    found: list[tuple[str, str]] = []
    memo: dict[int, tuple[str, str] | None] = {}  # slot -> ("str" | "global", value)
    last: tuple[str, str] | None = None  # what the last opcode pushed, where it matters
    strings: list[str] = []  # the last two strings pushed (a STACK_GLOBAL's module and name)
    waiting: str | None = None  # a reference call seen: its description is the next string
    count = 0
    for op, arg, _ in pickletools.genops(bytes(inner)):
        if op.name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
            slot = count if op.name == "MEMOIZE" else int(arg or 0)
            count = max(count, slot + 1)
            memo[slot] = last
            continue  # the stack is as it was
        pushed: tuple[str, str] | None = None
        if op.name == "STACK_GLOBAL" and len(strings) == 2:
            pushed = ("global", ".".join(strings))
        elif op.name == "GLOBAL" and isinstance(arg, str):
            pushed = ("global", arg.replace(" ", "."))
        elif isinstance(arg, str) and "UNICODE" in op.name:
            pushed = ("str", arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed = memo.get(int(arg or 0))
        if pushed is not None and pushed[0] == "str":
            if waiting is not None:
                found.append((REFERENCE_CALLS[waiting], pushed[1]))
                waiting = None
            strings = [*strings[-1:], pushed[1]]
        elif pushed is not None and pushed[1] in REFERENCE_CALLS:
            waiting = pushed[1]
        last = pushed
    return found


def _hparams(obj: Any) -> dict[str, Any] | None:
    """The arguments ``obj`` records it was made with: ``hparams_initial`` (Lightning's copy
    as ``save_hyperparameters()`` took it), else ``hparams``; ``None`` without either."""
    got: dict[str, Any] | None = None
    for name in ("hparams_initial", "hparams"):
        try:
            value = getattr(obj, name, None)
        except Exception:  # a property that fails: no record
            value = None
        if isinstance(value, Mapping):
            if value:
                return dict(value)
            got = {}  # empty: right for a class whose __init__ takes nothing (_unbound says)
    return got


def _importable(cls: type) -> bool:
    """Whether pickling names ``cls`` by reference (as cloudpickle does): its module is
    imported (not ``__main__``) and its qualified name leads there to ``cls`` itself."""
    name = getattr(cls, "__module__", None) or ""
    module = sys.modules.get(name)  # no import here: a module not imported yet is not it
    if module is None or name == "__main__" or getattr(module, "__name__", None) != name:
        return False
    found: Any = module
    for part in cls.__qualname__.split("."):  # "<locals>" (a class made in a function): none
        found = getattr(found, part, None)
    return found is cls


def _unbound(cls: type, hparams: Mapping[str, Any]) -> str | None:
    """Why ``cls(**hparams)`` would not make the object again from the record: its named
    arguments the record leaves out (``save_hyperparameters(ignore=...)``), or a call it
    refuses; ``None`` when every named argument is there and the call binds."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    params = signature.parameters.values()
    if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in params):
        return "its __init__ takes positional-only or *args arguments"
    missing = [p.name for p in params if p.kind != p.VAR_KEYWORD and p.name not in hparams]
    if missing:
        return f"save_hyperparameters() did not record {', '.join(missing)}"
    try:
        signature.bind(**hparams)
    except TypeError as e:
        return f"its hparams do not fit its __init__ ({e})"
    return None


def _large_datasets(found: list[tuple[Rebuild, int]]) -> Any:
    """``dumps_code``'s ``by_reference``: a dataset that can be rebuilt and would pickle to
    more than :data:`SMALL` bytes is recorded as its :class:`Rebuild` (appended to ``found``
    with its size)."""
    seen: dict[int, Rebuild | None] = {}

    def by_reference(x: Any) -> Rebuild | None:
        if not isinstance(x, torch.utils.data.Dataset):
            return None
        if id(x) not in seen:
            ref = reference(x)
            size = _size(x) if ref is not None else None
            seen[id(x)] = ref if ref is not None and (size is None or size > SMALL) else None
            if seen[id(x)] is not None:
                found.append((ref, -1 if size is None else size))  # type: ignore[arg-type]
        return seen[id(x)]

    return by_reference


class _Counter:
    """A file that keeps only how many bytes were written to it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n


def _nothing() -> None:
    return None


def _size(obj: Any) -> int | None:
    """About how many bytes ``obj`` pickles to, without copying a tensor's data: each tensor
    storage counts its bytes once, the rest is pickled into a counter. ``None`` when it does
    not pickle."""
    import cloudpickle

    storages: dict[Any, int] = {}

    class _Sizer(cloudpickle.Pickler):
        def reducer_override(self, x: Any) -> Any:
            if isinstance(x, Tensor):
                try:
                    s = x.untyped_storage()
                    storages[(s.data_ptr(), s.device)] = s.nbytes()
                except (RuntimeError, NotImplementedError):  # sparse, say: its elements
                    storages[id(x)] = x.numel() * x.element_size()
                return _nothing, ()
            return super().reducer_override(x)

    sink = _Counter()
    try:
        _Sizer(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:
        return None
    return sink.n + sum(storages.values())


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _tell(message: str, notes: list[str] | None) -> None:
    if notes is not None:
        notes.append(message)
    else:
        warnings.warn(message, UserWarning, stacklevel=4)


def _said(refs: list[tuple[Rebuild, int]], notes: list[str] | None) -> None:
    """Say, once per class, that each of ``refs`` is recorded by reference."""
    for ref, size in refs:
        key = ("reference", _name(ref.cls))
        if key in _warned:
            continue
        _warned.add(key)
        saved = f"instead of pickling its {_mib(size)}" if size >= 0 else "(it does not pickle)"
        _tell(
            f"Journal: data.pkl records {_name(ref.cls)} by reference, as "
            f"{ref.description}, {saved}: a replay makes it again from these arguments. "
            "engine replay compares every replayed loss and fingerprint with the journal, so "
            f"a {ref.cls.__qualname__} that does not make the same data again (one that draws "
            "from the global random generator as it is made, or depends on more than these "
            "arguments) shows there as a divergence (said once per class)",
            notes,
        )


def _checked(payload: bytes, holder: Any, notes: list[str] | None) -> bytes:
    """``payload``, after saying (once per class) that it passes :data:`LARGE` bytes."""
    if len(payload) <= LARGE:
        return payload
    cls = type(holder)
    key = ("large", _name(cls))
    if key not in _warned:
        _warned.add(key)
        why = _why_pickled(holder)
        _tell(
            f"Journal: data.pkl holds {_mib(len(payload))} of pickled data for {_name(cls)}, "
            f"because {why}. To record it by reference instead (a replay makes it again from "
            "its arguments), make the data in a LightningDataModule (or a dataset class) "
            "defined in an importable module, whose __init__ calls "
            "self.save_hyperparameters() (said once per class)",
            notes,
        )
    return payload


def _why_pickled(obj: Any) -> str:
    cls = type(obj)
    hparams = _hparams(obj)
    if hparams is None:
        return "it records no arguments it was made with (no hparams)"
    if not _importable(cls):
        if cls.__module__ == "__main__":
            where = "in the script run as __main__"
        elif "<locals>" in cls.__qualname__:
            where = "inside a function"
        else:
            where = f"in a module not imported as {cls.__module__}"
        return f"its class is defined {where}, so it cannot be imported by name"
    unbound = _unbound(cls, hparams)
    if unbound is not None:
        return f"its hparams do not make it again: {unbound}"
    return "its arguments, or what is pickled beside them, take that much"
