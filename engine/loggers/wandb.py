"""``WandbLogger``: metrics, hyperparameters and checkpoints to Weights & Biases.

Lightning's ``WandbLogger``, with its arguments: the run (:attr:`WandbLogger.experiment`, a
``wandb`` Run) starts at the first write, on global rank 0 only (another rank gets a
stand-in that does nothing, and starts no run and no ``wandb-core`` service); hyperparameters
go to the run's config; each row of metrics is one ``run.log`` with the Trainer's step as
``trainer/global_step``, which the run's charts use as their x axis (``define_metric``), so
W&B's own step only counts rows and never goes back. With ``log_model`` the checkpoints a
``ModelCheckpoint`` saves become ``model`` artifacts (``model-<run id>``, aliases
``latest`` and ``best``), each checkpoint directory's files at the artifact's root. Offline
(``offline=True``) everything is written to ``<save_dir>/wandb/offline-run-*`` for
``wandb sync``, artifacts included.

A checkpoint records the run (:meth:`WandbLogger.state_dict`) and a fit resumed from it
continues it: the same run id, with W&B's ``resume``, so its rows join the run's. What a run
that went on past the checkpoint logged after it stays unless the run is rewound to the
checkpoint: ``rewind_on_resume=True`` starts the resumed run with W&B's ``resume_from``
(``<id>?_step=<the checkpoint's last row>``), which truncates the run's history there when
the server applies it (a W&B feature in preview, not on every server: see
:meth:`WandbLogger.load_state_dict`).

Example (offline, into a temporary directory):

    >>> import tempfile
    >>> from engine.loggers import WandbLogger
    >>> root = tempfile.mkdtemp()
    >>> lg = WandbLogger(project="demo", save_dir=root, offline=True, settings={"silent": True})
    >>> lg.log_hyperparams({"lr": 0.1, "model": {"width": 64}})
    >>> lg.log_metrics({"train/loss": 0.5}, step=0)
    >>> lg.log_metrics({"train/loss": 0.25}, step=1)
    >>> lg.experiment.config["model"], lg.experiment.offline
    ({'width': 64}, True)
    >>> lg.version == lg.experiment.id, lg.name, lg.save_dir == root
    (True, 'demo', True)
    >>> lg.finalize("success")
    >>> lg.experiment.finish()  # at the process's exit otherwise
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from engine.loggers._remote import (
    LogsCheckpoints,
    NoExperiment,
    add_prefix,
    check_log_model,
    global_rank,
    kept_checkpoints,
    need,
)
from engine.loggers.base import _as_params

__all__ = ["WandbLogger"]

STEP_METRIC = "trainer/global_step"
_NOTHING = NoExperiment()


class WandbLogger(LogsCheckpoints):
    """Log to `Weights & Biases <https://wandb.ai>`_: metrics, config, checkpoints.

    Args:
        name: the run's display name.
        save_dir: the directory ``wandb/`` is written in (the run's files, offline runs).
        version: the run's id, to continue a run (``id`` too).
        offline: write the run locally (``wandb sync`` uploads it later).
        dir: the same as ``save_dir`` (Lightning's alias): either, not both.
        id: the same as ``version``: either, not both (or the same).
        anonymous: let W&B log without an account (``anonymous="allow"``) where the
            installed wandb still supports it.
        project: the project; ``None``: the ``WANDB_PROJECT`` variable, else
            ``"lightning_logs"`` (as Lightning).
        log_model: ``False``; ``True``: the checkpoints the ``ModelCheckpoint`` keeps (last,
            best, top-k), logged when the fit ends (as they are saved with
            ``save_top_k=-1``); ``"all"``: each checkpoint as it is saved.
        experiment: a W&B run of your own to log to (this logger starts none).
        prefix: put before every metric name, with ``-``.
        checkpoint_name: the checkpoints' artifact name; default ``model-<run id>``.
        add_file_policy: ``"mutable"`` (the checkpoint's files are copied when logged) or
            ``"immutable"`` (referenced: do not change them before the upload ends).
        rewind_on_resume: a fit resumed from a checkpoint rewinds the run to it (W&B's
            ``resume_from``) instead of resuming it: see :meth:`load_state_dict`.
        **kwargs: passed to ``wandb.init`` (``entity``, ``group``, ``tags``, ``notes``,
            ``config``, ``settings``, ``mode``, ...).

    Raises:
        ModuleNotFoundError: if wandb is not installed (``pip install 'engine[wandb]'``).
        ValueError: for a ``log_model`` other than ``False``, ``True`` and ``"all"``,
            ``version`` and ``id`` (or ``save_dir`` and ``dir``) that differ, another
            ``add_file_policy``, or ``offline=True`` with another ``mode``.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike[str] = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike[str] | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: Literal["all"] | bool = False,
        experiment: Any = None,
        prefix: str = "",
        checkpoint_name: str | None = None,
        add_file_policy: Literal["mutable", "immutable"] = "mutable",
        rewind_on_resume: bool = False,
        **kwargs: Any,
    ) -> None:
        need("wandb", "wandb", "WandbLogger")
        check_log_model("WandbLogger", log_model)
        if version is not None and id is not None and version != id:
            raise ValueError(
                f"WandbLogger(version={version!r}, id={id!r}): they name the same thing, the "
                "run's id; pass one of them"
            )
        where = os.fspath(save_dir) if save_dir is not None else None
        if dir is not None:
            if where not in (None, ".", os.fspath(dir)):
                raise ValueError(
                    f"WandbLogger(save_dir={where!r}, dir={os.fspath(dir)!r}): they name the "
                    "same directory; pass one of them"
                )
            where = os.fspath(dir)
        if add_file_policy not in ("mutable", "immutable"):
            raise ValueError(
                f"WandbLogger(add_file_policy={add_file_policy!r}): pass 'mutable' or 'immutable'"
            )
        if not isinstance(prefix, str):
            raise TypeError(f"WandbLogger(prefix={prefix!r}): pass a str ('' for none)")
        mode = kwargs.pop("mode", None)
        if offline and mode not in (None, "offline"):
            raise ValueError(
                f"WandbLogger(offline=True, mode={mode!r}): pass one of them (offline=True is "
                "mode='offline')"
            )
        run_id = version if version is not None else id
        init: dict[str, Any] = {
            "name": name,
            "project": project or os.environ.get("WANDB_PROJECT", "lightning_logs"),
            "dir": where,
            "id": run_id,
            "resume": "allow",
        }
        if anonymous:
            init["anonymous"] = "allow"
        if offline or mode is not None:
            init["mode"] = "offline" if offline else mode
        init.update(kwargs)
        self._wandb_init = init
        self._project: str = init["project"]
        self._save_dir: str | None = where
        self._name = name
        self._id: str | None = run_id
        self._offline = bool(offline or mode == "offline")
        self._log_model = log_model
        self._prefix = prefix
        self._checkpoint_name = checkpoint_name
        self._add_file_policy = add_file_policy
        self._rewind_on_resume = bool(rewind_on_resume)
        self._experiment = experiment
        self._own_experiment = experiment is None  # a run this logger starts (and may resume)
        self._rows = 0  # rows this logger logged (W&B's step, where it cannot be asked)
        self._logged_models: dict[str, int] = {}
        self._checkpoint_listeners: dict[int, Any] = {}

    # ------------------------------------------------------------------ the run

    @property
    def experiment(self) -> Any:
        """The ``wandb`` Run, started at first use (``wandb.init`` with this logger's
        arguments; a run already started in this process is used instead, with a warning,
        as in Lightning). On a rank other than 0: a stand-in whose every call does nothing."""
        if self._experiment is not None:
            return self._experiment
        if global_rank() != 0:
            return _NOTHING
        import wandb

        if wandb.run is not None:
            warnings.warn(
                "WandbLogger: a W&B run is already in progress in this process and is the one "
                "logged to; call wandb.finish() before building the logger to start a new one",
                stacklevel=2,
            )
            self._experiment = wandb.run
            return self._experiment
        kwargs = dict(self._wandb_init)
        if kwargs.get("dir"):
            os.makedirs(kwargs["dir"], exist_ok=True)
        run = wandb.init(**kwargs)
        if callable(getattr(run, "define_metric", None)):
            if kwargs.get("sync_tensorboard"):
                run.define_metric("*", step_metric="global_step")
            else:
                run.define_metric(STEP_METRIC)
                run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
        self._experiment = run
        return run

    @property
    def name(self) -> str:
        """The project, as in Lightning."""
        return self._project

    @property
    def version(self) -> str | None:
        """The run's id: the run's once it has started, else the one given (or ``None``)."""
        return self._experiment.id if self._experiment is not None else self._id

    @property
    def save_dir(self) -> str | None:
        """The directory ``wandb/`` is written in."""
        return self._save_dir

    @property
    def log_dir(self) -> None:
        """``None``: W&B keeps the run in its own directories (the Trainer's checkpoints go
        to another logger's ``log_dir`` or ``default_root_dir``)."""
        return None

    def watch(
        self, model: Any, log: str | None = "gradients", log_freq: int = 100, log_graph: bool = True
    ) -> None:
        """``run.watch(model, ...)``: W&B's hooks on ``model``'s modules and parameters."""
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    # ------------------------------------------------------------------ logging

    def log_hyperparams(self, params: Any) -> None:
        """Add ``params`` (a mapping or a ``Namespace``) to the run's config, nested as given;
        a value JSON cannot hold is its ``str()``. Values logged again may change
        (``allow_val_change``)."""
        values = _json_safe(_as_params(params))
        if global_rank() != 0:
            return
        self.experiment.config.update(values, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log one row: ``metrics`` (one-element tensors as numbers, W&B media as they are)
        and, with a ``step``, ``trainer/global_step`` (the charts' x axis)."""
        if global_rank() != 0:
            return
        row = {k: _value(v) for k, v in add_prefix(metrics, self._prefix, "-").items()}
        if step is not None and not self._wandb_init.get("sync_tensorboard"):
            row[STEP_METRIC] = int(step)
        self.experiment.log(row)
        self._rows += 1

    def save(self) -> None:
        """Nothing: W&B writes in its own process (``wandb-core``), which flushes an offline
        run's file every 15 s and at the end of the run."""
        return None

    def finalize(self, status: str) -> None:
        """After a successful fit, log the checkpoints kept for ``log_model=True``. The run
        is not finished (as in Lightning: a ``test`` after the fit logs to it): it ends with
        ``run.finish()`` or at the process's exit, with its exit status."""
        if status != "success" or self._experiment is None or global_rank() != 0:
            return
        for listener in self._checkpoint_listeners.values():
            self._log_checkpoints(listener)

    # ------------------------------------------------------------------ checkpoints

    def _log_checkpoints(self, listener: Any) -> None:
        import wandb

        run = self.experiment
        for ckpt in kept_checkpoints(listener, self._logged_models):
            if not self._checkpoint_name:
                self._checkpoint_name = f"model-{run.id}"
            artifact = wandb.Artifact(
                name=self._checkpoint_name, type="model", metadata=ckpt.metadata
            )
            artifact.add_dir(ckpt.path, policy=self._add_file_policy)
            run.log_artifact(artifact, aliases=ckpt.aliases)
            self._logged_models[ckpt.path] = ckpt.mtime_ns

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """The run, for a checkpoint: its id, project and W&B step (the rows logged so far),
        so that a fit resumed from it continues the run (see :meth:`load_state_dict`).
        ``{}`` before the run has started, or for a run given as ``experiment``.

        W&B has no call that writes what its service holds, so an offline run killed later
        may lose the rows of its last seconds (up to the service's 15 s flush interval)."""
        run = self._experiment
        if run is None or not self._own_experiment:
            return {}
        try:
            step = int(run.step)
        except Exception:  # a "shared" run cannot say: the rows this logger logged
            step = self._rows
        return {"id": run.id, "project": self._project, "step": step, "offline": self._offline}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the run a checkpoint recorded: called when a fit resumes from it, before
        anything is logged. When it is this logger's (the same project, no other
        ``version``/``id`` and no ``experiment`` given), the run starts with that id and
        W&B's ``resume="allow"``: its rows join the run's, from the checkpoint's step on.

        The rows a run that went on past the checkpoint logged after it are not dropped:
        they stay (W&B's ``_step`` goes on, and those ``trainer/global_step`` values appear
        twice in the history) unless ``rewind_on_resume=True``. Then the run starts with
        ``resume_from="<id>?_step=<last row before the checkpoint>"``: W&B rewinds it there,
        dropping the later rows and numbering this fit's rows from that step on, when the
        server applies it (W&B's "rewind", in preview on W&B's cloud and not on every server;
        offline, the branch point is recorded in the run's file and applied by
        ``wandb sync``). With no row before the checkpoint there is nothing to rewind to,
        and the run is resumed."""
        if not state or global_rank() != 0 or not self._own_experiment:
            return
        run_id = state.get("id")
        if not isinstance(run_id, str) or state.get("project") != self._project:
            return
        if self._id is not None and self._id != run_id:
            return  # the user's choice of run
        step = int(state.get("step") or 0)
        rewind = self._rewind_on_resume and step > 0
        if self._experiment is not None:  # a run this logger started in this process
            if self._experiment.id != run_id:
                warnings.warn(
                    f"WandbLogger: the run {self._experiment.id} is in progress; this fit logs "
                    f"to it, not to the run {run_id} that the checkpoint records",
                    stacklevel=2,
                )
                return
            if not rewind:
                return
            self._experiment.finish()
            self._experiment = None
        self._wandb_init["id"] = run_id
        if rewind:
            self._wandb_init.pop("resume", None)
            self._wandb_init["resume_from"] = f"{run_id}?_step={step - 1}"
        else:
            self._wandb_init.pop("resume_from", None)
            self._wandb_init["resume"] = "allow"
        self._rows = step

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawned process's copy) without the run: the copy starts one with the
        same id at first use (W&B's resume), which continues it."""
        state = self.__dict__.copy()
        if self._experiment is not None and self._own_experiment:
            state["_wandb_init"] = {**self._wandb_init, "id": self._experiment.id}
            state["_id"] = self._experiment.id
        state["_experiment"] = None
        return state

    def __repr__(self) -> str:
        return f"WandbLogger(project={self._project!r}, save_dir={self._save_dir!r})"


def _value(value: Any) -> Any:
    """A one-element tensor (or array) as a Python number; anything else as it is (numbers,
    W&B media and tables)."""
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", None)
    if size == 1 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def _json_safe(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every value JSON cannot hold as its ``str()`` (mappings and lists
    kept, their items made safe; a one-element tensor as its number)."""

    def safe(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): safe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [safe(v) for v in value]
        value = _value(value)
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            return str(value)
        return value

    return {str(k): safe(v) for k, v in params.items()}
