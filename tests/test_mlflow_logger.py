"""``MLFlowLogger`` against real MLflow stores (a ``file:`` store in a temporary directory, and
the SQLite database it makes by default under MLflow 3), read back with ``MlflowClient``: the
params, every metric's history equal to what the ``CSVLogger`` of the same fit wrote, tags,
status, checkpoints as artifacts, a resumed fit continuing the same run, nothing on a rank
other than 0, and the arguments and the missing package refused by name.

No mocks of mlflow. The fits and resumes in fresh processes, and on 2 ranks, are in
``tests/test_remote_logger_runs.py``.
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
from _logger_fit import tiny_fit as _fit

mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from engine.loggers import CSVLogger, MLFlowLogger  # noqa: E402


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    """MLflow 3 refuses a ``file:`` store unless this is set; each test sets what it needs
    (and nothing reaches a server: no ``MLFLOW_TRACKING_URI``)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _uri(tmp_path: Path) -> str:
    return f"file:{tmp_path / 'mlruns'}"


def _csv_rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _csv_histories(path: str) -> dict[str, list[tuple[int, float]]]:
    """Each column of ``metrics.csv`` as ``[(step, value), ...]`` over the rows that fill it."""
    return _by_metric(_csv_rows(path))


def _by_metric(rows: list[dict[str, str]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, cell in row.items():
            if key != "step" and cell != "":
                out.setdefault(key, []).append((int(row["step"]), float(cell)))
    return out


def _histories(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in sorted(run.data.metrics)
    }


def _runs(client, experiment_name: str) -> list:
    experiment = client.get_experiment_by_name(experiment_name)
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


# ---------------------------------------------------------------------- a fit


def test_a_fit_logs_what_the_csv_logger_writes_and_its_params_tags_and_status(tmp_path):
    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), run_name="first", tags={"team": "a"})
    csv_logger = CSVLogger(tmp_path, name="csv")
    _fit([mlf, csv_logger], tmp_path)

    client = MlflowClient(_uri(tmp_path))
    (run,) = _runs(client, "exp")
    assert run.info.run_id == mlf.run_id == mlf.version
    assert mlf.name == mlf.experiment_id == run.info.experiment_id
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "lr": "0.05",
        "model/width": "4",
        "model/act": "None",
        "betas": "(0.9, 0.99)",
    }
    assert run.data.tags["team"] == "a"
    assert run.data.tags["mlflow.runName"] == "first"
    assert "mlflow.user" in run.data.tags  # MLflow's context tags, as Lightning adds them
    expected = _csv_histories(csv_logger.metrics_file)
    assert set(expected) >= {"train/loss", "val/loss", "epoch"}
    assert _histories(client, mlf.run_id) == expected  # every (step, value), in order
    assert mlf.save_dir == str(tmp_path / "mlruns") and mlf.log_dir is None


def test_a_failed_fit_marks_the_run_failed(tmp_path):
    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    with pytest.raises(RuntimeError, match="failed on purpose"):
        _fit([mlf], tmp_path, fail_at=3)
    run = MlflowClient(_uri(tmp_path)).get_run(mlf.run_id)
    assert run.info.status == "FAILED"
    assert [
        m.step for m in MlflowClient(_uri(tmp_path)).get_metric_history(mlf.run_id, "train/loss")
    ]


@pytest.mark.parametrize(
    ("status", "expected"),
    [("success", "FINISHED"), ("failed", "FAILED"), ("interrupted", "KILLED")],
)
def test_finalize_sets_the_runs_status(tmp_path, status, expected):
    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    mlf.log_metrics({"loss": 1.0}, step=0)
    mlf.finalize(status)
    assert mlf.experiment.get_run(mlf.run_id).info.status == expected
    with pytest.raises(ValueError, match="'success', 'failed' or 'interrupted'"):
        mlf.finalize("done")


def test_a_store_failing_at_the_end_of_a_failed_run_warns_instead_of_hiding_its_error(tmp_path):
    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    mlf.log_metrics({"loss": 1.0}, step=0)
    shutil.rmtree(tmp_path / "mlruns" / mlf.experiment_id / mlf.run_id)  # the run is gone
    with pytest.warns(UserWarning, match=r"could not end run .* as FAILED .* its own error"):
        mlf.finalize("failed")
    with pytest.raises(mlflow.exceptions.MlflowException):
        mlf.finalize("success")


def test_metric_names_values_prefix_and_equal_values_at_one_step(tmp_path):
    import torch

    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), prefix="fold1")
    with pytest.warns(RuntimeWarning, match="'fold1-a:b' is logged as 'fold1-ab'"):
        mlf.log_metrics({"a:b": torch.tensor(2.0)}, step=3)
    with pytest.warns(UserWarning, match="left out fold1-note='x', a string"):
        mlf.log_metrics({"note": "x", "n": 1}, step=None)
    for _ in range(3):  # the same value at the same step, within a millisecond: kept thrice
        mlf.log_metrics({"same": 0.5}, step=7)
    with pytest.raises(TypeError, match="metric 'fold1-bad' must be a number"):
        mlf.log_metrics({"bad": [1, 2]}, step=8)
    assert _histories(mlf.experiment, mlf.run_id) == {
        "fold1-ab": [(3, 2.0)],
        "fold1-n": [(0, 1.0)],
        "fold1-same": [(7, 0.5)] * 3,
    }


def test_hyperparameters_in_batches_and_long_values_cut(tmp_path):
    from argparse import Namespace

    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    many = {f"p{i}": i for i in range(250)}  # 3 batches of at most 100
    mlf.log_hyperparams(Namespace(**many, long="x" * (MAX_PARAM_VAL_LENGTH + 10)))
    params = mlf.experiment.get_run(mlf.run_id).data.params
    assert len(params) == 251 and params["p249"] == "249"
    assert params["long"] == "x" * MAX_PARAM_VAL_LENGTH


def test_asynchronous_logging_is_waited_for_at_a_checkpoint(tmp_path):
    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), synchronous=False)
    mlf.log_hyperparams({"lr": 0.1})
    for step in range(50):
        mlf.log_metrics({"loss": float(step)}, step)
    state = mlf.state_dict()  # what a checkpoint records is in the store
    client = MlflowClient(_uri(tmp_path))
    history = client.get_metric_history(state["run_id"], "loss")
    # every value; MLflow's writer threads may store them out of order: the timestamps say it
    assert [m.step for m in sorted(history, key=lambda m: m.timestamp)] == list(range(50))
    assert client.get_run(state["run_id"]).data.params == {"lr": "0.1"}
    mlf.finalize("success")


def test_a_pickled_logger_continues_its_run(tmp_path):
    import pickle

    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    mlf.log_metrics({"loss": 1.0}, 0)
    copy = pickle.loads(pickle.dumps(mlf))  # what a spawned process gets
    copy.log_metrics({"loss": 0.5}, 1)
    assert copy.run_id == mlf.run_id
    assert _histories(mlf.experiment, mlf.run_id) == {"loss": [(0, 1.0), (1, 0.5)]}


def test_an_existing_run_id_is_logged_to_and_experiments_are_found_by_name(tmp_path):
    first = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    first.log_metrics({"loss": 1.0}, step=0)
    again = MLFlowLogger("other", tracking_uri=_uri(tmp_path), run_id=first.run_id)
    again.log_metrics({"loss": 0.5}, step=1)
    same_experiment = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    assert again.experiment_id == first.experiment_id == same_experiment.experiment_id
    assert same_experiment.run_id != first.run_id
    assert _histories(first.experiment, first.run_id) == {"loss": [(0, 1.0), (1, 0.5)]}


def test_a_deleted_experiment_is_refused_by_name(tmp_path):
    first = MLFlowLogger("gone", tracking_uri=_uri(tmp_path))
    first.experiment.delete_experiment(first.experiment_id)
    with pytest.raises(ValueError, match=r"experiment 'gone' in file:.* is deleted; restore it"):
        MLFlowLogger("gone", tracking_uri=_uri(tmp_path)).log_metrics({"a": 1.0}, 0)


def test_building_the_logger_touches_nothing_and_the_env_names_the_store(tmp_path, monkeypatch):
    MLFlowLogger("exp", save_dir=tmp_path / "a")  # the default store, never used
    MLFlowLogger("exp", tracking_uri=f"sqlite:///{tmp_path}/b/mlflow.db")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _uri(tmp_path))
    assert MLFlowLogger("exp").tracking_uri == _uri(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    lg = MLFlowLogger("exp", save_dir=tmp_path / "c")  # a file store is allowed: Lightning's
    assert lg.tracking_uri == f"file:{tmp_path / 'c'}" and lg.save_dir == str(tmp_path / "c")
    assert MLFlowLogger("exp", tracking_uri=f"file://{tmp_path}/d").save_dir == f"{tmp_path}/d"
    assert MLFlowLogger("exp", tracking_uri="http://localhost:5000").save_dir is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_model": "best"}, ValueError, r"log_model='best'\): pass False .* True .* 'all'"),
        ({"log_model": 1}, ValueError, r"log_model=1\)"),
        ({"experiment_name": ""}, ValueError, r"experiment_name=''\): pass the experiment's"),
        ({"tracking_uri": 5}, TypeError, r"tracking_uri=5\): pass a str or None"),
        ({"tags": ["a"]}, TypeError, r"tags=\['a'\]\): pass a dict"),
        ({"prefix": None}, TypeError, r"prefix=None\): pass a str"),
        ({"synchronous": "yes"}, TypeError, r"synchronous='yes'\): pass True, False or None"),
        ({"save_dir": None}, ValueError, r"pass a tracking_uri, or a save_dir"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        MLFlowLogger(**kwargs)


def test_a_missing_mlflow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an uninstalled package looks like
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'engine\[mlflow\]'") as e:
        MLFlowLogger()
    assert e.value.name == "mlflow"


def test_importing_engine_imports_neither_mlflow_nor_wandb(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import engine
        from engine.loggers import MLFlowLogger, WandbLogger
        MLFlowLogger("exp", save_dir="mlruns")
        WandbLogger(project="p", offline=True)
        print(sorted(m for m in ("mlflow", "wandb") if m in sys.modules))
        """
    )
    done = _procs.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]"]


# ---------------------------------------------------------------------- other ranks


def test_a_rank_other_than_0_creates_no_run_and_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    mlf = MLFlowLogger("exp", save_dir=tmp_path / "mlruns", log_model="all")
    assert not mlf.experiment  # the stand-in
    assert mlf.experiment.log_batch(run_id="x") is mlf.experiment
    mlf.log_hyperparams({"lr": 0.1})
    mlf.log_metrics({"loss": 1.0}, step=0)
    mlf.after_save_checkpoint(object())
    mlf.load_state_dict({"run_id": "abc", "tracking_uri": "file:x", "experiment_name": "exp"})
    mlf.finalize("success")
    assert (mlf.run_id, mlf.version, mlf.name, mlf.state_dict()) == (None, None, None, {})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- log_model


def _artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for info in client.list_artifacts(run_id, path):
        out.extend(_artifacts(client, run_id, info.path) if info.is_dir else [info.path])
    return sorted(out)


def test_log_model_all_logs_each_checkpoint_directory_as_it_is_saved(tmp_path):
    from engine import checkpoint
    from engine.listeners import ModelCheckpoint

    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), log_model="all")
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="train/loss")
    _fit([mlf, CSVLogger(tmp_path)], tmp_path, callbacks=[saver])
    client = mlf.experiment
    names = _artifacts(client, mlf.run_id)
    saved = {p.name for p in Path(saver.dirpath).iterdir() if p.is_dir()}
    # every checkpoint saved (those the top-2 dropped too), each a directory of its files
    assert {n.split("/")[0] for n in names if "/" in n} == {
        "epoch=0-step=2",
        "epoch=0-step=4",
        "epoch=1-step=6",
    }
    assert saved < {n.split("/")[0] for n in names if "/" in n}
    root = Path(client.get_run(mlf.run_id).info.artifact_uri.removeprefix("file://"))
    for name in saved:  # a logged checkpoint verifies, and holds what the saved one holds
        checkpoint.verify(root / name)
        assert sorted(p.name for p in (root / name).iterdir()) == sorted(
            p.name for p in (Path(saver.dirpath) / name).iterdir()
        )
    meta = (root / "epoch=1-step=6.yaml").read_text()
    assert 'aliases:\n  - "latest"\n' in meta and "ModelCheckpoint:" in meta and "score:" in meta


def test_log_model_true_logs_the_kept_checkpoints_when_the_fit_ends(tmp_path):
    from engine.listeners import ModelCheckpoint

    mlf = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), log_model=True)
    saver = ModelCheckpoint(
        every_n_train_steps=2, save_top_k=1, save_last=True, monitor="train/loss"
    )
    _fit([mlf, CSVLogger(tmp_path)], tmp_path, callbacks=[saver])
    client = mlf.experiment
    tops = {n.split("/")[0] for n in _artifacts(client, mlf.run_id) if "/" in n}
    kept = {Path(saver.best_model_path).name, Path(saver.last_model_path).name}
    assert tops == kept and "last" in kept
    root = Path(client.get_run(mlf.run_id).info.artifact_uri.removeprefix("file://"))
    best = Path(saver.best_model_path).name
    assert '- "best"' in (root / f"{best}.yaml").read_text()
    assert '- "best"' not in (root / "last.yaml").read_text()


# ---------------------------------------------------------------------- resume


def test_a_resumed_logger_continues_the_run_and_says_what_mlflow_keeps(tmp_path):
    first = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    for step in range(4):
        first.log_metrics({"loss": float(step)}, step)
    state = first.state_dict()
    assert state["run_id"] == first.run_id and state["tracking_uri"] == _uri(tmp_path)
    first.log_metrics({"loss": 40.0}, 4)  # past the checkpoint: a run that went on, then died
    first.log_metrics({"loss": 50.0, "extra": 1.0}, 5)

    again = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    with pytest.warns(UserWarning, match=r"holds 3 values of 2 metrics .* \(steps 4\.\.5\)"):
        again.load_state_dict(state)
    assert again.run_id == first.run_id
    assert again.experiment.get_run(again.run_id).info.status == "RUNNING"
    again.log_metrics({"loss": 4.0}, 4)
    again.log_metrics({"loss": 5.0}, 5)
    again.finalize("success")
    client = MlflowClient(_uri(tmp_path))
    assert len(_runs(client, "exp")) == 1
    history = client.get_metric_history(first.run_id, "loss")
    # what was logged before the checkpoint, what the run past it logged, then this fit's
    assert [(m.step, m.value) for m in history] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (4, 4.0),
        (5, 5.0),
    ]
    stamps = [m.timestamp for m in history]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert client.get_run(first.run_id).data.metrics["loss"] == 5.0  # the latest: this fit's
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_a_resume_into_another_store_experiment_or_run_starts_as_without_one(tmp_path):
    first = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    first.log_metrics({"loss": 1.0}, 0)
    state = first.state_dict()
    other_store = MLFlowLogger("exp", tracking_uri=f"file:{tmp_path / 'other'}")
    other_experiment = MLFlowLogger("exp2", tracking_uri=_uri(tmp_path))
    given = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), run_id=first.run_id)
    mine = MlflowClient(_uri(tmp_path)).create_run(first.experiment_id).info.run_id
    another_run = MLFlowLogger("exp", tracking_uri=_uri(tmp_path), run_id=mine)
    for lg in (other_store, other_experiment, given, another_run):
        lg.load_state_dict(state)
        lg.log_metrics({"loss": 2.0}, 1)
    assert other_store.run_id != first.run_id and other_experiment.run_id != first.run_id
    assert given.run_id == first.run_id and another_run.run_id == mine
    assert MLFlowLogger("exp", tracking_uri=_uri(tmp_path)).state_dict() == {}  # no run yet


def test_a_checkpoints_run_that_was_deleted_is_not_continued(tmp_path):
    first = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    first.log_metrics({"loss": 1.0}, 0)
    state = first.state_dict()
    first.experiment.delete_run(first.run_id)
    again = MLFlowLogger("exp", tracking_uri=_uri(tmp_path))
    with pytest.warns(UserWarning, match="is deleted; this fit logs to a new run"):
        again.load_state_dict(state)
    again.log_metrics({"loss": 2.0}, 1)
    assert again.run_id != first.run_id


def test_a_fit_resumed_after_a_failure_continues_the_run_holding_the_rows_past_it(tmp_path):
    """The precise history of a resumed run: the failed fit's every row (those past the
    checkpoint too), then the resumed fit's from the checkpoint on; the CSV of the same fits
    holds each step once."""
    from engine import checkpoint
    from engine.listeners import ModelCheckpoint

    def loggers():
        return [MLFlowLogger("exp", tracking_uri=_uri(tmp_path)), CSVLogger(tmp_path, version=0)]

    first = loggers()
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(RuntimeError, match="failed on purpose"):
        _fit(first, tmp_path, callbacks=[saver], fail_at=5)
    client = MlflowClient(_uri(tmp_path))
    assert client.get_run(first[0].run_id).info.status == "FAILED"
    failed_rows = _csv_rows(first[1].metrics_file)
    ckpt = Path(saver.dirpath) / "epoch=0-step=4"
    kept = checkpoint.read_meta(ckpt)["extra"]["loggers"]["CSVLogger"]["rows"]
    assert 0 < kept < len(failed_rows)  # rows were logged past the checkpoint

    again = loggers()
    with pytest.warns(UserWarning, match="logged after the checkpoint this fit resumes from"):
        _fit(
            again, tmp_path, callbacks=[ModelCheckpoint(every_n_train_steps=2)], ckpt_path=str(ckpt)
        )
    assert again[0].run_id == first[0].run_id and len(_runs(client, "exp")) == 1
    assert client.get_run(first[0].run_id).info.status == "FINISHED"
    resumed_rows = _csv_rows(again[1].metrics_file)
    assert resumed_rows[:kept] == failed_rows[:kept]
    assert _histories(client, first[0].run_id) == _by_metric(failed_rows + resumed_rows[kept:])


# ---------------------------------------------------------------------- the SQLite default


@pytest.fixture(scope="module")
def empty_database(tmp_path_factory) -> Path:
    """An MLflow SQLite database with its tables made (MLflow's migrations take ~7 s: once)."""
    path = tmp_path_factory.mktemp("db") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.mark.slow
def test_the_default_store_under_mlflow_3_is_a_sqlite_database_in_save_dir(
    tmp_path, monkeypatch, empty_database
):
    from engine.listeners import ModelCheckpoint

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    save_dir = tmp_path / "ml"
    save_dir.mkdir()
    shutil.copy(empty_database, save_dir / "mlflow.db")  # what the first use would make
    mlf = MLFlowLogger("exp", save_dir=save_dir, log_model="all")
    assert mlf.tracking_uri == f"sqlite:///{save_dir / 'mlflow.db'}"
    csv_logger = CSVLogger(tmp_path, name="csv")
    _fit([mlf, csv_logger], tmp_path, callbacks=[ModelCheckpoint(every_n_train_steps=3)])
    client = MlflowClient(mlf.tracking_uri)
    run = client.get_run(mlf.run_id)
    assert run.info.status == "FINISHED" and run.data.params["model/width"] == "4"
    assert _histories(client, mlf.run_id) == _csv_histories(csv_logger.metrics_file)
    # the artifacts in save_dir too, not in the working directory's ./mlruns
    assert run.info.artifact_uri.startswith(str(save_dir / "artifacts"))
    assert (save_dir / "artifacts" / mlf.run_id / "artifacts" / "epoch=1-step=6").is_dir()
    assert mlf.save_dir == str(save_dir) and not os.path.exists("mlruns")
