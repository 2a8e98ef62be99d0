"""The logger interface, versioned run directories and a small YAML writer for hyperparameters.

A logger is any object with ``log_metrics(metrics, step)``; the Trainer calls every logger it
holds, in order. :class:`Logger` is the base class of the bundled loggers and documents the full
interface (Lightning's ``Logger``): ``name``, ``version``, ``log_dir``, ``log_metrics``,
``log_hyperparams``, ``save`` and ``finalize``.

Run directories follow Lightning's layout, ``save_dir/name/version_N``: ``version=None`` takes the
next free ``N``, an int gives ``version_N`` and a string is used as the directory name as is.
The version is chosen when the logger is built, so loggers built together (a TensorBoard and a CSV
logger, say) share one run directory. A ``version=None`` directory is *claimed* when the run starts
(or at the logger's first write): ``os.mkdir`` of ``version_N``, which only one process can
succeed at; a process that finds it taken by another takes the next free ``N``, so two runs
started at once into one directory never share a version (loggers of one process that chose the
same ``N`` still share it).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from engine.checkpoint._writable import append_whole as _append
from engine.checkpoint._writable import explain, replace_whole

__all__ = [
    "Logger",
    "append_whole",
    "claim_version",
    "flatten_params",
    "next_version",
    "to_yaml",
    "write_atomically",
]


class Logger:
    """Base class for loggers: a run directory plus metric and hyperparameter sinks.

    Subclasses implement :meth:`log_metrics` and :meth:`log_hyperparams`; :meth:`save` and
    :meth:`finalize` default to flushing nothing. The directory is
    ``save_dir/name/<version>`` where ``<version>`` is ``version_N`` for an int (or for the
    next free ``N`` when ``version`` is ``None``) and the string itself for a string.

    Args:
        save_dir: the directory that holds the experiments.
        name: the experiment's directory under ``save_dir``; ``None`` or ``""`` for none.
        version: ``None`` (next free ``version_N``), an int ``N`` or a directory name.

    Raises:
        TypeError: if ``version`` is not ``None``, an int or a string.
        ValueError: if ``version`` is a negative int or an empty string.

    Example:
        >>> import tempfile
        >>> from engine.loggers import Logger
        >>> class PrintLogger(Logger):
        ...     def log_metrics(self, metrics, step):
        ...         print(step, dict(metrics))
        >>> lg = PrintLogger(tempfile.mkdtemp(), name="exp")
        >>> lg.version, lg.log_dir.endswith("exp/version_0")
        (0, True)
        >>> lg.log_metrics({"train/loss": 0.5}, step=3)
        3 {'train/loss': 0.5}
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "lightning_logs",
        version: int | str | None = None,
    ) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        root = os.path.join(self._save_dir, self._name)
        auto = version is None
        if version is None:
            version = next_version(root)
        elif isinstance(version, bool) or not isinstance(version, (int, str)):
            raise TypeError(
                f"version must be None, an int or a str (got {type(version).__name__} "
                f"{version!r}); pass None to take the next free version_N"
            )
        elif isinstance(version, int) and version < 0:
            raise ValueError(f"version must be a non-negative int (got {version})")
        elif isinstance(version, str) and not version:
            raise ValueError("version must not be an empty string; pass None or an int instead")
        self._version: int | str = version
        self._claimed = not auto  # an explicit version is the user's: used as it is

    def claim(self) -> str:
        """Create this run's directory, atomically: a ``version=None`` logger whose
        ``version_N`` another process took meanwhile takes the next free one. Returns
        :attr:`log_dir`. Idempotent; the Trainer calls it when a run starts, the bundled loggers
        before their first write."""
        if not self._claimed:
            assert isinstance(self._version, int)
            self._version = claim_version(os.path.join(self._save_dir, self._name), self._version)
            self._claimed = True
        return self.log_dir

    def adopt(self, version: int | str) -> None:
        """Take the version another process claimed (rank 0 of a multi-process run): this
        logger names the same directory and never claims or writes one itself."""
        if isinstance(version, bool) or not isinstance(version, (int, str)):
            raise TypeError(f"adopt(version={version!r}): pass the int or str rank 0 claimed")
        self._version, self._claimed = version, True

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Name this logger in the ``OSError`` a failed write raises (a full disk), which
        already names the file and says what is wrong."""
        try:
            yield
        except OSError as e:
            prefix = f"{type(self).__name__}: "
            text = e.strerror or str(e)
            if text.startswith(prefix):
                raise
            raise OSError(e.errno, prefix + text) from (e.__cause__ or e)

    def _finish(self, status: str, write: Callable[[], None]) -> None:
        """Run ``write``, :meth:`finalize`'s last writes. After a run that failed or was
        interrupted, a write that fails too (the disk that failed the run is still full) is a
        warning: the run's own error is the one the Trainer raises."""
        try:
            with self._writing():
                write()
        except OSError as e:
            if status == "success":
                raise
            warnings.warn(
                f"{e.strerror or e} (at the end of a {status} run: its own error follows)",
                stacklevel=3,
            )

    def _make_dir(self) -> str:
        """:meth:`claim` this run's directory and make sure it exists; returns it."""
        path = self.claim()
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise explain(e, path, "create the run directory") from e
        return path

    @property
    def name(self) -> str:
        """The experiment name (the directory under ``save_dir``; ``""`` for none)."""
        return self._name

    @property
    def version(self) -> int | str:
        """The run's version: an int for ``version_N`` directories, else the directory name."""
        return self._version

    @property
    def save_dir(self) -> str:
        """The directory that holds the experiments."""
        return self._save_dir

    @property
    def log_dir(self) -> str:
        """This run's directory: ``save_dir/name/version_N`` (or ``.../<version string>``)."""
        leaf = self._version if isinstance(self._version, str) else f"version_{self._version}"
        return os.path.join(self._save_dir, self._name, leaf)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar ``metrics`` (name -> value) at ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics()")

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (a possibly nested mapping)."""
        return None

    def save(self) -> None:
        """Write anything buffered to disk."""
        return None

    def finalize(self, status: str) -> None:
        """End the run (``status`` is ``"success"``, ``"failed"`` or ``"interrupted"``)."""
        self.save()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of this logger, so that a fit resumed from it continues
        the log (see :meth:`load_state_dict`); ``{}`` (the default) for nothing.

        The Trainer calls it on rank 0 while it writes a checkpoint, after every row logged
        before that checkpoint: a logger that records something here writes what it buffers
        first, so what the checkpoint describes is on disk."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the log a checkpoint recorded with :meth:`state_dict`: called on rank 0
        when a fit resumes from that checkpoint, before anything is logged. The bundled
        loggers keep what was written before the checkpoint and drop what was written after
        it (a run killed past the checkpoint logged steps that the resumed run logs again),
        when the log is this logger's own (the same ``log_dir``); another directory starts a
        new log, as before. The default does nothing."""
        return None

    def _own_log(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` (from :meth:`state_dict`) describes this logger's directory."""
        recorded = state.get("log_dir") if state else None
        return isinstance(recorded, str) and recorded == os.path.realpath(self.log_dir)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(log_dir={self.log_dir!r})"


_VERSION_DIR = re.compile(r"version_(\d+)")


def next_version(root: str | os.PathLike[str]) -> int:
    """One more than the largest ``N`` of the ``version_N`` directories in ``root`` (0 if none).

    Args:
        root: the experiment directory (``save_dir/name``); it need not exist.

    Example:
        >>> import os, tempfile
        >>> from engine.loggers.base import next_version
        >>> root = tempfile.mkdtemp()
        >>> next_version(root)
        0
        >>> os.makedirs(os.path.join(root, "version_4"))
        >>> next_version(root)
        5
    """
    try:
        entries = list(os.scandir(root))
    except OSError:  # missing (or unreadable) root: nothing taken yet
        return 0
    taken = [
        int(m.group(1))
        for e in entries
        if e.is_dir() and (m := _VERSION_DIR.fullmatch(e.name)) is not None
    ]
    return max(taken) + 1 if taken else 0


# the version directories this process claimed: loggers built together share theirs
_CLAIMED: set[str] = set()
_CLAIM_LOCK = threading.Lock()


def claim_version(root: str | os.PathLike[str], version: int = 0) -> int:
    """Create ``root/version_N`` for the first ``N >= version`` no other process holds, and
    return ``N``.

    ``os.mkdir`` is atomic: of two processes that try the same ``N`` one succeeds, the other
    gets ``FileExistsError`` and tries the next free ``N``. A directory this process claimed
    before is its own (loggers built together share it).

    Args:
        root: the experiment directory (``save_dir/name``), created if missing.
        version: the ``N`` to try first (what :func:`next_version` gave).

    Raises:
        OSError: if the directory cannot be created (a read-only or full disk: the message
            names it).

    Example:
        >>> import os, tempfile
        >>> from engine.loggers.base import claim_version
        >>> root = tempfile.mkdtemp()
        >>> os.makedirs(os.path.join(root, "version_0"))  # another process took it
        >>> claim_version(root, 0), claim_version(root, 1)  # ours: claimed once, then shared
        (1, 1)
    """
    root = os.path.abspath(os.fspath(root))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise explain(e, root, "create the run directories in") from e
    n = version
    elastic = _elastic_run()
    with _CLAIM_LOCK:
        if elastic is not None and elastic[1] > 0:  # a torchrun restart: its first attempt's
            earlier = _attempts_version(root, elastic[0])
            if earlier is not None:
                _CLAIMED.add(os.path.join(root, f"version_{earlier}"))
                return earlier
        while True:
            path = os.path.join(root, f"version_{n}")
            if path in _CLAIMED:
                return n
            try:
                os.mkdir(path)
            except FileExistsError:  # another process's run (or an old one): the next free N
                n += 1
                continue
            except OSError as e:
                raise explain(e, path, "create the run directory") from e
            _CLAIMED.add(path)
            if elastic is not None:  # whose it is, for the attempts after a restart
                try:
                    with open(os.path.join(path, ELASTIC_RUN_FILE), "x") as f:
                        f.write(elastic[0])
                except OSError as e:
                    raise explain(e, path, "write the run directory's torchrun run id in") from e
            return n


#: in a ``version_N`` claimed under torchrun: its ``TORCHELASTIC_RUN_ID``, so that the attempts
#: after a restart (attempt > 0) continue in the first one's directory
ELASTIC_RUN_FILE = ".torchelastic_run_id"


def _elastic_run() -> tuple[str, int] | None:
    """``(TORCHELASTIC_RUN_ID, attempt)`` under torchrun, else ``None``: the attempt the ranks
    agreed on when they joined (:func:`engine.parallel.elastic.attempt`, the same on every
    node; a node's own restart count is not)."""
    from engine.parallel import elastic

    run_id, number = elastic.run_id(), elastic.attempt()
    return (run_id, number) if run_id is not None and number is not None else None


def _attempts_version(root: str, run_id: str) -> int | None:
    """The largest ``N`` of the ``version_N`` in ``root`` that torchrun's run ``run_id``
    claimed (its :data:`ELASTIC_RUN_FILE` says so), or ``None``."""
    found = []
    with contextlib.suppress(OSError):
        for e in os.scandir(root):
            m = _VERSION_DIR.fullmatch(e.name)
            if m is None or not e.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError), open(os.path.join(e.path, ELASTIC_RUN_FILE)) as f:
                if f.read(4096) == run_id:
                    found.append(int(m.group(1)))
    return max(found) if found else None


def _to_float(name: str, value: Any) -> float | int:
    """``value`` as a Python number (a one-element tensor is read with ``.item()``): an int
    stays an int (the ``epoch`` Lightning adds to each row is written ``3``, not ``3.0``),
    anything else is a float."""
    try:
        value = value.item() if hasattr(value, "item") else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"metric {name!r} must be a number or a one-element tensor "
            f"(got {type(value).__name__} {value!r:.80})"
        ) from e


def flatten_params(params: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """Flatten nested mappings into one level, joining keys with ``sep`` (Lightning's style).

    Args:
        params: a possibly nested mapping.
        sep: the separator between a parent key and its child's key.

    Example:
        >>> from engine.loggers.base import flatten_params
        >>> flatten_params({"opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "seed": 0})
        {'opt/lr': 0.1, 'opt/betas': (0.9, 0.99), 'seed': 0}
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            for sub, v in flatten_params(value, sep).items():
                out[f"{key}{sep}{sub}"] = v
        else:
            out[str(key)] = value
    return out


# ---------------------------------------------------------------------- YAML

# Plain (unquoted) keys: identifier-like and not one of the words YAML 1.1 resolves to a bool or
# null. Everything else is written double-quoted, which YAML reads back exactly.
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*")
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _yaml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        c = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif (
            0x20 <= c <= 0x7E
            or (0xA0 <= c <= 0xD7FF and c != 0x2028 and c != 0x2029)
            or (0xE000 <= c <= 0xFFFD and c != 0xFEFF)
            or c >= 0x10000
        ):
            out.append(ch)
        elif c <= 0xFF:
            out.append(f"\\x{c:02x}")
        else:
            out.append(f"\\u{c:04x}")
    out.append('"')
    return "".join(out)


def _yaml_key(key: Any) -> str:
    if isinstance(key, bool) or key is None:
        return _yaml_scalar(key)
    if isinstance(key, int):
        return str(key)
    key = str(key)
    if _PLAIN_KEY.fullmatch(key) and key.lower() not in _RESERVED:
        return key
    return _yaml_str(key)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        # YAML 1.1 floats need a dot: PyYAML reads "1e-05" as a string, "1.0e-05" as a float.
        if "." not in text:
            text = text.replace("e", ".0e") if "e" in text else text + ".0"
        return text
    if isinstance(value, str):
        return _yaml_str(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d tensor / array
        return _yaml_scalar(value.item())
    return _yaml_str(str(value))


def _is_container(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple))


def _yaml_block(value: Any) -> list[str]:
    """The lines of a non-empty mapping or sequence in block style, at indentation 0."""
    lines: list[str] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            key = _yaml_key(k)
            if _is_container(v) and len(v):
                lines.append(f"{key}:")
                lines.extend("  " + line for line in _yaml_block(v))
            else:
                lines.append(f"{key}: {_yaml_inline(v)}")
    else:
        for v in value:
            if _is_container(v) and len(v):
                child = _yaml_block(v)
                lines.append("- " + child[0])
                lines.extend("  " + line for line in child[1:])
            else:
                lines.append(f"- {_yaml_inline(v)}")
    return lines


def _yaml_inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _yaml_scalar(value)


def to_yaml(data: Mapping[str, Any]) -> str:
    """A YAML document for a (nested) mapping of scalars, strings, lists and mappings.

    Strings are always double-quoted with YAML escapes, so any text reads back unchanged; other
    objects are written as their ``str()``. Tuples are written as lists.

    Args:
        data: the mapping to write.

    Raises:
        TypeError: if ``data`` is not a mapping.

    Example:
        >>> from engine.loggers.base import to_yaml
        >>> print(to_yaml({"lr": 1e-05, "name": "run: 1", "opt": {"betas": [0.9, 0.999]}}), end="")
        lr: 1.0e-05
        name: "run: 1"
        opt:
          betas:
          - 0.9
          - 0.999
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"hyperparameters must be a mapping (got {type(data).__name__})")
    if not data:
        return "{}\n"
    return "\n".join(_yaml_block(data)) + "\n"


def _write_hparams_yaml(path: str, params: Mapping[str, Any]) -> None:
    """Write ``params`` to ``path`` as YAML, atomically (a reader never sees half a file)."""
    write_atomically(path, to_yaml(params))


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written whole to a temporary file beside
    it, then renamed over it, so a reader sees the old file or the new one, never part of
    one. A failed write (a full disk) leaves the old file as it was and raises an ``OSError``
    that names ``path`` and says what is wrong."""
    try:
        replace_whole(path, text.encode("utf-8"))
    except OSError as e:
        raise explain(e, path, "write") from e


def append_whole(path: str, text: str) -> None:
    """Append ``text`` (whole lines) to ``path``: a failed write (a full disk) is undone, the
    file cut back to what it held, so no line is ever torn, and raises an ``OSError`` that
    names ``path`` and says what is wrong."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _append(fd, text.encode("utf-8"), os.fstat(fd).st_size)
        finally:
            os.close(fd)
    except OSError as e:
        raise explain(e, path, "write") from e


def _as_params(params: Any) -> dict[str, Any]:
    """``params`` as a dict: a mapping, or an object with ``vars()`` (an argparse Namespace)."""
    if isinstance(params, Mapping):
        return dict(params)
    if hasattr(params, "__dict__") and not isinstance(params, type):
        return dict(vars(params))
    raise TypeError(
        f"hyperparameters must be a mapping such as a dict (got {type(params).__name__}); "
        "pass dict(...) of the values to record"
    )
