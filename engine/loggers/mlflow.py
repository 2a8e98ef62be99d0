"""``MLFlowLogger``: metrics, hyperparameters and checkpoints to an MLflow tracking store.

Lightning's ``MLFlowLogger``, with its arguments: the run is created in the experiment
``experiment_name`` (made if missing) at the first write, or continued when ``run_id`` names
one; metrics go to it at the Trainer's steps, hyperparameters (flattened with ``/``) as
params, and ``finalize`` sets its status (``FINISHED``, ``FAILED``, ``KILLED`` for an
interrupted fit). With ``log_model`` the checkpoints a ``ModelCheckpoint`` saves are logged as
artifacts: each checkpoint directory under its name (``epoch=0-step=4/``, loadable as it is
once downloaded), beside it ``<name>.yaml`` with its score, aliases (``latest``, ``best``) and
the ``ModelCheckpoint``'s settings.

Only global rank 0 talks to MLflow: on another rank :attr:`MLFlowLogger.experiment` is a
stand-in that does nothing and no run, file or database is created. Building the logger
touches nothing either: the client (and a local store's files) comes at the first write.

A checkpoint records the run (:meth:`MLFlowLogger.state_dict`) and a fit resumed from it
continues that run, not a new one. MLflow cannot delete a metric's values (its API and its
stores only add), so the values that a run killed past the checkpoint logged after it stay
in the histories: those steps then hold two values, the killed run's, then the resumed fit's,
which come later and are the run's latest (see :meth:`MLFlowLogger.load_state_dict`).

Example (a local file store, which MLflow 3 accepts when ``MLFLOW_ALLOW_FILE_STORE`` is set;
by default this logger writes a SQLite database under ``save_dir`` there):

    >>> import os, tempfile
    >>> from engine.loggers import MLFlowLogger
    >>> os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    >>> root = tempfile.mkdtemp()
    >>> lg = MLFlowLogger("demo", tracking_uri=f"file:{root}/mlruns", tags={"team": "a"})
    >>> lg.log_hyperparams({"lr": 0.1, "model": {"width": 64}})
    >>> lg.log_metrics({"train/loss": 0.5}, step=0)
    >>> lg.log_metrics({"train/loss": 0.25}, step=1)
    >>> lg.finalize("success")
    >>> run = lg.experiment.get_run(lg.run_id)
    >>> run.info.status, run.data.params, run.data.tags["team"]
    ('FINISHED', {'lr': '0.1', 'model/width': '64'}, 'a')
    >>> [(m.step, m.value) for m in lg.experiment.get_metric_history(lg.run_id, "train/loss")]
    [(0, 0.5), (1, 0.25)]
    >>> lg.save_dir == f"{root}/mlruns"
    True
    >>> del os.environ["MLFLOW_ALLOW_FILE_STORE"]
"""

from __future__ import annotations

import os
import re
import time
import urllib.parse
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
from engine.loggers.base import _as_params, _to_float, flatten_params, to_yaml

__all__ = ["MLFlowLogger"]

_STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}
_STATUS.update(interrupted="KILLED", killed="KILLED")
# the characters MLflow's metric names may hold (Lightning removes the others)
_NOT_ALLOWED = re.compile(r"[^a-zA-Z0-9_/. -]+")
_PARAMS_PER_BATCH, _METRICS_PER_BATCH = 100, 1000
_NOTHING = NoExperiment()


class MLFlowLogger(LogsCheckpoints):
    """Log to `MLflow <https://mlflow.org>`_: metrics, hyperparameters, checkpoints.

    Args:
        experiment_name: the experiment the run is in; created if there is none.
        run_name: the run's name (its ``mlflow.runName`` tag, replacing one in ``tags``).
        tracking_uri: the tracking store: a server (``http://...``), a database
            (``sqlite:///path.db``) or a directory (``file:path``). ``None``: the
            ``MLFLOW_TRACKING_URI`` variable, else ``file:<save_dir>`` as in Lightning where
            the installed MLflow accepts a file store, else (MLflow 3, which refuses one
            unless ``MLFLOW_ALLOW_FILE_STORE`` is set) ``sqlite:///<save_dir>/mlflow.db``
            with the artifacts in ``<save_dir>/artifacts``.
        tags: tags of the run when this logger creates it.
        save_dir: the local directory of the default store (unused with ``tracking_uri``).
        log_model: ``False``; ``True``: the checkpoints the ``ModelCheckpoint`` keeps (last,
            best, top-k), logged when the fit ends (as they are saved with
            ``save_top_k=-1``); ``"all"``: each checkpoint as it is saved.
        prefix: put before every metric name, with ``-`` (``prefix-train/loss``).
        artifact_location: where the experiment's artifacts go when this logger creates it.
        run_id: an existing run to log to, instead of a new one.
        synchronous: ``False`` logs in the background (MLflow's asynchronous logging; waited
            for at each checkpoint and at the end; values may reach the store out of order,
            their timestamps keep it), ``True`` waits for each write; ``None`` follows MLflow
            (``MLFLOW_ENABLE_ASYNC_LOGGING``).

    Raises:
        ModuleNotFoundError: if mlflow is not installed (``pip install 'engine[mlflow]'``).
        ValueError: for a ``log_model`` other than ``False``, ``True`` and ``"all"``, or an
            empty ``experiment_name``.
        TypeError: for an argument of the wrong type (the message names it).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        save_dir: str | os.PathLike[str] | None = "./mlruns",
        log_model: Literal[True, False, "all"] = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
    ) -> None:
        need("mlflow", "mlflow", "MLFlowLogger")
        if not isinstance(experiment_name, str) or not experiment_name:
            raise ValueError(
                f"MLFlowLogger(experiment_name={experiment_name!r}): pass the experiment's "
                "name, a non-empty string"
            )
        for arg, value in [
            ("run_name", run_name),
            ("tracking_uri", tracking_uri),
            ("artifact_location", artifact_location),
            ("run_id", run_id),
        ]:
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"MLFlowLogger({arg}={value!r}): pass a str or None "
                    f"(got {type(value).__name__})"
                )
        if tags is not None and not isinstance(tags, Mapping):
            raise TypeError(f"MLFlowLogger(tags={tags!r}): pass a dict of tag name -> value")
        if not isinstance(prefix, str):
            raise TypeError(f"MLFlowLogger(prefix={prefix!r}): pass a str ('' for none)")
        if synchronous is not None and not isinstance(synchronous, bool):
            raise TypeError(f"MLFlowLogger(synchronous={synchronous!r}): pass True, False or None")
        check_log_model("MLFlowLogger", log_model)
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._given_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._save_dir = None if save_dir is None else os.fspath(save_dir)
        if self._given_uri is None and not self._save_dir:
            raise ValueError(
                "MLFlowLogger(tracking_uri=None, save_dir=None): pass a tracking_uri, or a "
                "save_dir for a local store"
            )
        self._tracking_uri: str | None = self._given_uri  # resolved at first use
        self.tags: dict[str, Any] | None = None if tags is None else dict(tags)
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._run_id_given = run_id is not None
        self._experiment_id: str | None = None
        self._synchronous = synchronous
        self._client: Any = None
        self._initialized = False
        self._pending: list[Any] = []  # asynchronous writes not yet waited for
        self._last_ms = 0  # the timestamp of the latest value this logger logged
        self._logged_models: dict[str, int] = {}  # checkpoint path -> meta mtime when logged
        self._checkpoint_listeners: dict[int, Any] = {}  # log_model=True: logged at the end

    # ------------------------------------------------------------------ the run

    @property
    def experiment(self) -> Any:
        """The ``mlflow.tracking.MlflowClient``, the run created (or found) at first use.

        On a rank other than 0: a stand-in whose every call does nothing."""
        if global_rank() != 0:
            return _NOTHING
        if self._initialized:
            return self._client
        client = self._mlflow_client()
        if self._run_id is not None:  # given, or continued from a checkpoint
            self._experiment_id = client.get_run(self._run_id).info.experiment_id
        else:
            self._experiment_id = self._find_experiment(client)
            tags = dict(self.tags or {})
            if self._run_name is not None:
                from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

                if MLFLOW_RUN_NAME in tags:
                    warnings.warn(
                        f"MLFlowLogger: tags[{MLFLOW_RUN_NAME!r}] is replaced by "
                        f"run_name={self._run_name!r}",
                        stacklevel=2,
                    )
                tags[MLFLOW_RUN_NAME] = self._run_name
            run = client.create_run(experiment_id=self._experiment_id, tags=_resolve_tags(tags))
            self._run_id = run.info.run_id
        self._initialized = True
        return client

    def _mlflow_client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            uri = self.tracking_uri
            if uri.startswith("sqlite:///") and self._given_uri is None:  # ours: its directory
                os.makedirs(os.path.dirname(uri[len("sqlite:///") :]), exist_ok=True)
            self._client = MlflowClient(uri)
        return self._client

    def _find_experiment(self, client: Any) -> str:
        """The id of ``experiment_name``, created if there is none (another process that
        creates it meanwhile wins, and its experiment is the one)."""
        from mlflow.exceptions import MlflowException

        name = self._experiment_name
        found = client.get_experiment_by_name(name)
        if found is None:
            location = self._artifact_location
            if location is None and self._given_uri is None and self._tracking_uri_is_sqlite():
                location = os.path.join(os.path.abspath(self._save_dir or "."), "artifacts")
            try:
                return str(client.create_experiment(name=name, artifact_location=location))
            except MlflowException:  # created by another process meanwhile?
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            raise ValueError(
                f"MLFlowLogger: the experiment {name!r} in {self.tracking_uri} is deleted; "
                "restore it (MlflowClient.restore_experiment), delete it for good (mlflow gc) "
                "or pass another experiment_name"
            )
        return str(found.experiment_id)

    @property
    def tracking_uri(self) -> str:
        """The tracking store's URI (resolved from ``save_dir`` when none was given)."""
        if self._tracking_uri is None:
            assert self._save_dir
            if _file_store_allowed():
                self._tracking_uri = f"file:{self._save_dir}"
            else:
                path = os.path.abspath(os.path.join(self._save_dir, "mlflow.db"))
                self._tracking_uri = f"sqlite:///{path}"
        return self._tracking_uri

    def _tracking_uri_is_sqlite(self) -> bool:
        return self.tracking_uri.startswith("sqlite:")

    @property
    def run_id(self) -> str | None:
        """The run's id (the run is created if it is not yet); ``None`` on another rank."""
        _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        """The experiment's id (created with the run if it is not yet)."""
        _ = self.experiment
        return self._experiment_id

    @property
    def name(self) -> str | None:
        """The experiment's id, as in Lightning (creates the run if it is not yet)."""
        return self.experiment_id

    @property
    def version(self) -> str | None:
        """The run's id, as in Lightning (creates the run if it is not yet)."""
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        """The local directory of the store: a ``file:`` URI's, or ``save_dir`` for the
        SQLite store this logger chose there; ``None`` for another store."""
        if self._given_uri is None and self._tracking_uri_is_sqlite():
            return self._save_dir
        uri = self._given_uri or self.tracking_uri
        if uri.startswith("file://"):
            return urllib.parse.unquote(urllib.parse.urlparse(uri).path)
        return uri[len("file:") :] if uri.startswith("file:") else None

    @property
    def log_dir(self) -> None:
        """``None``: MLflow keeps the run in its store, not in a run directory (the
        Trainer's checkpoints go to another logger's ``log_dir`` or ``default_root_dir``)."""
        return None

    # ------------------------------------------------------------------ logging

    def log_hyperparams(self, params: Any) -> None:
        """Log ``params`` (a mapping or a ``Namespace``) as the run's params: nested
        mappings flattened with ``/``, each value as its ``str()`` cut to MLflow's longest
        (6000 characters in MLflow 3). A param logged again must keep its value (MLflow's
        rule): a resumed fit logs the same ones."""
        flat = flatten_params(_as_params(params))
        if not flat or global_rank() != 0:
            return
        from mlflow.entities import Param

        longest = _max_param_length()
        items = [Param(key=str(k), value=str(v)[:longest]) for k, v in flat.items()]
        client = self.experiment
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self._batch(client, params=items[i : i + _PARAMS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` (numbers or one-element tensors) at ``step`` (0 when ``None``).

        A name with characters MLflow refuses loses them, with a warning; a string value is
        left out, with a warning (as Lightning). Timestamps are the wall clock in
        milliseconds, one later than this logger's previous value when they would be equal:
        MLflow's SQL stores keep only one of two equal values logged at the same step and
        millisecond, and this keeps every value logged, in the order logged."""
        if global_rank() != 0:
            return
        from mlflow.entities import Metric

        now = max(int(time.time() * 1000), self._last_ms + 1)
        out = []
        for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, str):
                warnings.warn(f"MLFlowLogger: left out {key}={value!r}, a string", stacklevel=2)
                continue
            name = _NOT_ALLOWED.sub("", key)
            if name != key:
                warnings.warn(
                    "MLFlowLogger: MLflow allows only letters, digits, '_', '/', '.', '-' and "
                    f"' ' in metric names: {key!r} is logged as {name!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            number = _to_float(key, value)
            out.append(Metric(key=name, value=float(number), timestamp=now, step=int(step or 0)))
        if not out:
            return
        client = self.experiment
        for i in range(0, len(out), _METRICS_PER_BATCH):
            self._batch(client, metrics=out[i : i + _METRICS_PER_BATCH])
        self._last_ms = now

    def _batch(self, client: Any, **items: Any) -> None:
        extra = {} if self._synchronous is None else {"synchronous": self._synchronous}
        done = client.log_batch(run_id=self._run_id, **items, **extra)
        if done is not None and callable(getattr(done, "wait", None)):  # asynchronous
            self._pending.append(done)
            if len(self._pending) >= 100:
                self.save()

    def save(self) -> None:
        """Wait for the writes still in flight (``synchronous=False``)."""
        pending, self._pending = self._pending, []
        for operation in pending:
            operation.wait()

    def finalize(self, status: str = "success") -> None:
        """End the run: log the checkpoints kept for ``log_model=True`` (after a successful
        fit), wait for what is in flight and set the run's status: ``FINISHED``
        (``"success"``), ``FAILED`` (``"failed"``) or ``KILLED`` (``"interrupted"``).

        After a run that failed or was interrupted, an error of MLflow's here (the server
        gone, the store full) is a warning: the run's own error is the one raised."""
        state = _STATUS.get(status)
        if state is None:
            raise ValueError(
                f"MLFlowLogger.finalize({status!r}): pass 'success', 'failed' or 'interrupted'"
            )
        if not self._initialized or global_rank() != 0:
            return
        try:
            if status == "success":
                for listener in self._checkpoint_listeners.values():
                    self._log_checkpoints(listener)
            self.save()
            self._client.set_terminated(self._run_id, state)
        except Exception as e:
            if status == "success":
                raise
            warnings.warn(
                f"MLFlowLogger: could not end run {self._run_id} as {state} ({type(e).__name__}: "
                f"{e}) at the end of a {status} run: its own error follows",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ checkpoints

    def _log_checkpoints(self, listener: Any) -> None:
        client = self.experiment
        for ckpt in kept_checkpoints(listener, self._logged_models):
            name = os.path.basename(os.path.normpath(ckpt.path))
            client.log_artifacts(self._run_id, ckpt.path, name)
            text = to_yaml({**ckpt.metadata, "aliases": ckpt.aliases})
            client.log_text(self._run_id, text, f"{name}.yaml")
            self._logged_models[ckpt.path] = ckpt.mtime_ns

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """The run, for a checkpoint: a fit resumed from it logs to the same run (see
        :meth:`load_state_dict`). Writes still in flight are waited for first. ``{}`` before
        the run exists."""
        if not self._initialized or self._run_id is None:
            return {}
        self.save()
        return {
            "tracking_uri": self.tracking_uri,
            "experiment_name": self._experiment_name,
            "experiment_id": self._experiment_id,
            "run_id": self._run_id,
            "timestamp": self._last_ms,  # every value logged before the checkpoint: <= this
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the run a checkpoint recorded: called when a fit resumes from it, before
        anything is logged. When the checkpoint's run is this logger's (the same tracking
        store and experiment name, and no other ``run_id`` given), the fit logs to that run,
        set ``RUNNING`` again, instead of a new one; otherwise it changes nothing.

        MLflow cannot delete metric values, so what a run that went on past the checkpoint
        logged after it stays: for those steps a metric's history holds that run's value,
        then this fit's (later timestamps; the run's latest value is this fit's). A warning
        says how many and at which steps. A run that is gone from the store (deleted) is
        not continued: the fit starts a new one, with a warning."""
        if not state or global_rank() != 0:
            return
        run_id = state.get("run_id")
        if (
            not isinstance(run_id, str)
            or state.get("tracking_uri") != self.tracking_uri
            or state.get("experiment_name") != self._experiment_name
            or (self._run_id_given and self._run_id != run_id)
        ):
            return
        from mlflow.exceptions import MlflowException

        client = self._mlflow_client()
        try:
            run = client.get_run(run_id)
        except MlflowException as e:
            warnings.warn(
                f"MLFlowLogger: the run {run_id} that the checkpoint records is not in "
                f"{self.tracking_uri} ({e.error_code}); this fit logs to a new run",
                stacklevel=2,
            )
            return
        if run.info.lifecycle_stage == "deleted":
            warnings.warn(
                f"MLFlowLogger: the run {run_id} that the checkpoint records is deleted; "
                "this fit logs to a new run",
                stacklevel=2,
            )
            return
        self.save()
        self._run_id, self._experiment_id = run_id, run.info.experiment_id
        self._initialized = True
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        recorded = int(state.get("timestamp") or 0)
        stale = self._stale(client, run, recorded)
        # this fit's values come after everything the run holds, as the reader expects
        self._last_ms = max([self._last_ms, recorded, *(m.timestamp for m in stale)])

    def _stale(self, client: Any, run: Any, after_ms: int) -> list[Any]:
        """The values logged after ``after_ms`` (by a run that went on past the checkpoint),
        which stay in the histories, with a warning that says so."""
        stale = [
            m
            for key in run.data.metrics
            for m in client.get_metric_history(run.info.run_id, key)
            if m.timestamp > after_ms
        ]
        if stale:
            steps = sorted({m.step for m in stale})
            names = sorted({m.key for m in stale})
            warnings.warn(
                f"MLFlowLogger: run {run.info.run_id} holds {len(stale)} values of "
                f"{len(names)} metrics logged after the checkpoint this fit resumes from (steps "
                f"{steps[0]}..{steps[-1]}); MLflow cannot delete metric values, so those steps "
                "keep them and get this fit's values too (later, and the run's latest)",
                stacklevel=3,
            )
        return stale

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawned process's copy) without the client: it is made again at first
        use, and continues this logger's run."""
        state = self.__dict__.copy()
        state["_client"] = None
        state["_initialized"] = False
        state["_pending"] = []
        return state

    def __repr__(self) -> str:
        return (
            f"MLFlowLogger(experiment_name={self._experiment_name!r}, "
            f"tracking_uri={self._given_uri or self._tracking_uri or self._save_dir!r})"
        )


def _file_store_allowed() -> bool:
    """Whether the installed MLflow accepts a ``file:`` store: MLflow 3 refuses one unless
    ``MLFLOW_ALLOW_FILE_STORE`` is set (the setting exists since it refuses)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow from before: file stores are fine
        return True
    return bool(MLFLOW_ALLOW_FILE_STORE.get())


def _max_param_length() -> int:
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    except ImportError:
        return 250
    return int(MAX_PARAM_VAL_LENGTH)


def _resolve_tags(tags: dict[str, Any]) -> dict[str, Any]:
    """``tags`` with MLflow's context tags (user, source) added, as MLflow's fluent API and
    Lightning add them."""
    try:
        from mlflow.tracking.context.registry import resolve_tags
    except ImportError:
        return tags
    return dict(resolve_tags(tags))
