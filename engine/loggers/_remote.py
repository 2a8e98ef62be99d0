"""What the loggers of tracking services (:mod:`engine.loggers.mlflow`,
:mod:`engine.loggers.wandb`) share: the optional package they need, the process's global rank
(only rank 0 talks to the service), a stand-in experiment for the other ranks, metric-name
prefixes and the checkpoints a ``ModelCheckpoint`` keeps (for ``log_model``)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "Checkpoint",
    "NoExperiment",
    "add_prefix",
    "check_log_model",
    "global_rank",
    "kept_checkpoints",
    "need",
]


def need(module: str, extra: str, who: str) -> None:
    """Raise ``ModuleNotFoundError`` naming the extra that installs ``module`` when it is not
    installed (found without importing it: importing mlflow alone takes a second)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a ``None`` in sys.modules, or a broken entry
        found = False
    if not found:
        raise ModuleNotFoundError(
            f"{who} needs the {module!r} package, which is not installed: "
            f"pip install 'engine[{extra}]' (or pip install {module})",
            name=module,
        )


def global_rank() -> int:
    """This process's global rank (:func:`engine.parallel.environments.process_rank`). The
    loggers read it so that a rank other than 0 never starts a run, whatever calls them (the
    Trainer calls them on rank 0 only)."""
    from engine.parallel.environments import process_rank

    return process_rank()


class LogsCheckpoints:
    """``after_save_checkpoint`` of a logger that uploads checkpoints (``log_model``), as
    Lightning's: ``"all"`` logs the checkpoints not logged yet at each save (an asynchronous one
    once it has landed: at a later save or at the end); ``True`` remembers the listener, to log
    what it keeps when the fit ends (at once with ``save_top_k=-1``). The logger gives
    ``_log_model``, ``_checkpoint_listeners`` and ``_log_checkpoints(listener)``."""

    _log_model: Any
    _checkpoint_listeners: dict[int, Any]

    def after_save_checkpoint(self, checkpoint_listener: Any) -> None:
        """Called by the Trainer after a ``ModelCheckpoint`` saved (see the class)."""
        if not self._log_model or global_rank() != 0:
            return
        every = self._log_model == "all" or getattr(checkpoint_listener, "save_top_k", 1) == -1
        self._checkpoint_listeners[id(checkpoint_listener)] = checkpoint_listener
        if every:
            self._log_checkpoints(checkpoint_listener)

    def _log_checkpoints(self, listener: Any) -> None:
        raise NotImplementedError


class NoExperiment:
    """What ``experiment`` is on a rank other than 0 (Lightning's ``DummyExperiment``): every
    attribute, call and item is itself, and does nothing.

    Example:
        >>> from engine.loggers._remote import NoExperiment
        >>> nothing = NoExperiment()
        >>> nothing.log({"loss": 1.0}) is nothing, nothing.config["lr"] is nothing
        (True, True)
    """

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getitem__(self, key: Any) -> Any:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        return None

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NoExperiment()"


def add_prefix(metrics: Mapping[str, Any], prefix: str, sep: str) -> dict[str, Any]:
    """``metrics`` with ``prefix + sep`` before each name (unchanged without a prefix).

    Example:
        >>> from engine.loggers._remote import add_prefix
        >>> add_prefix({"loss": 0.5}, "fold1", "-")
        {'fold1-loss': 0.5}
    """
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{sep}{k}": v for k, v in metrics.items()}


def check_log_model(who: str, log_model: Any) -> None:
    """``log_model`` is ``False``, ``True`` or ``"all"`` (Lightning's values)."""
    if log_model not in (True, False, "all") or (
        log_model != "all" and type(log_model) is not bool
    ):
        raise ValueError(
            f"{who}(log_model={log_model!r}): pass False (no checkpoints), True (the kept "
            "checkpoints, at the end of the fit) or 'all' (each checkpoint as it is saved)"
        )


class Checkpoint(NamedTuple):
    """A checkpoint a ``ModelCheckpoint`` keeps, to log as an artifact."""

    mtime_ns: int  # its meta file's: a checkpoint saved again under the same name is newer
    path: str
    score: float | None
    aliases: list[str]
    metadata: dict[str, Any]


#: the ModelCheckpoint settings recorded with a logged checkpoint (those it has)
_SETTINGS = (
    "monitor",
    "mode",
    "save_last",
    "save_top_k",
    "save_weights_only",
    "_every_n_train_steps",
    "_every_n_val_epochs",
    "every_n_epochs",
    "train_time_interval",
)


def kept_checkpoints(listener: Any, logged: Mapping[str, int]) -> list[Checkpoint]:
    """The checkpoints ``listener`` (a ``ModelCheckpoint``) keeps and that are on disk (their
    meta file written: an asynchronous save that has not landed is not yet), oldest first,
    leaving out those in ``logged`` (path -> the meta file's mtime when logged) unless saved
    again since: its last, its best and its top-k (Lightning's choice)."""
    from engine.checkpoint._files import META

    found: dict[str, float | None] = {}
    last = getattr(listener, "last_model_path", "") or ""
    if last:
        found[last] = getattr(listener, "current_score", None)
    best = getattr(listener, "best_model_path", "") or ""
    if best:
        found[best] = getattr(listener, "best_model_score", None)
    for path, score in dict(getattr(listener, "best_k_models", None) or {}).items():
        found[path] = score
    settings = {k: _plain(getattr(listener, k)) for k in _SETTINGS if hasattr(listener, k)}
    out = []
    for path, score in found.items():
        try:
            mtime = os.stat(os.path.join(path, META)).st_mtime_ns
        except OSError:  # not (or no longer) on disk
            continue
        if logged.get(path) == mtime:
            continue
        value = None if score is None else float(score)
        out.append(
            Checkpoint(
                mtime,
                path,
                value,
                ["latest", "best"] if path == best else ["latest"],
                {
                    "score": value,
                    "original_filename": os.path.basename(os.path.normpath(path)),
                    type(listener).__name__: settings,
                },
            )
        )
    return sorted(out)


def _plain(value: Any) -> Any:
    """``value`` as a YAML/JSON-friendly scalar (a timedelta or a path as its text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
