"""``WandbLogger`` in W&B's offline mode (``wandb-core`` writes the run's ``.wandb``
transaction log in a temporary directory; nothing reaches a network), read back with W&B's
own reader (``wandb leet inspect --json``'s): the rows equal to what the ``CSVLogger`` of the
same fit wrote, with ``trainer/global_step`` as their step metric, the config, checkpoints as
``model`` artifacts, a resumed fit continuing the same run (and rewinding it, recorded as the
run's branch point), nothing on a rank other than 0, and the arguments and the missing
package refused by name.

No mocks of wandb. The fits and resumes in fresh processes, and on 2 ranks, are in
``tests/test_remote_logger_runs.py``.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _logger_fit import tiny_fit as _fit

wandb = pytest.importorskip("wandb")

from engine.loggers import CSVLogger, WandbLogger  # noqa: E402

QUIET = {"settings": {"silent": True}}


@pytest.fixture(scope="module", autouse=True)
def _offline(tmp_path_factory):
    """Offline, quiet, and W&B's own directories (artifact staging, cache, settings) in a
    temporary one, for the whole module: W&B reads them when it first starts in a process."""
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as mp:
        for var, value in {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(home),
            "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_ERROR_REPORTING": "false",
        }.items():
            mp.setenv(var, value)
        for var in ("RANK", "SLURM_PROCID", "WANDB_PROJECT", "WANDB_RUN_ID"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(autouse=True)
def _no_run_left():
    yield
    if wandb.run is not None:
        wandb.finish()


def records(save_dir: Path, n: int = -1) -> list[dict[str, Any]]:
    """The records of the ``n``-th offline run in ``save_dir`` (by start time), read by W&B's
    own reader: what ``wandb leet inspect --json RUN.wandb`` runs, ``wandb-core``'s inspector
    (called directly, without the CLI's second of Python start-up), one JSON record a line."""
    from wandb.util import get_core_path

    runs = sorted((Path(save_dir) / "wandb").glob("offline-run-*"))
    (log,) = runs[n].glob("run-*.wandb")
    command = [get_core_path(), "leet", "inspect", "--no-observability", "--json"]
    done = subprocess.run(
        [*command, "--run-file", str(log), str(log.parent.parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def of(recs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r[kind] for r in recs if r["type"] == kind]


def rows(recs: list[dict[str, Any]], *, internal: bool = False) -> list[dict[str, Any]]:
    """The history rows; without W&B's own keys (``_step``, ``_runtime``...) unless asked."""
    return [
        {k: v for k, v in h["item"].items() if internal or not k.startswith("_")}
        for h in of(recs, "history")
    ]


def config(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's config: the run record's, then every update, merged (without ``_wandb``)."""
    out: dict[str, Any] = {}
    for r in recs:
        update = r.get("run", {}).get("config", {}).get("update") or r.get("config", {}).get(
            "update"
        )
        out.update(update or {})
    out.pop("_wandb", None)
    return out


def csv_rows(path: str) -> list[dict[str, Any]]:
    """``metrics.csv``'s rows as W&B rows: the filled cells as numbers, ``step`` as
    ``trainer/global_step``."""
    with open(path, newline="") as f:
        out = []
        for row in csv.DictReader(f):
            item: dict[str, Any] = {k: float(v) for k, v in row.items() if v and k != "step"}
            item["trainer/global_step"] = int(row["step"])
            out.append(item)
    return out


# ---------------------------------------------------------------------- a fit


def test_a_fit_logs_the_csv_loggers_rows_at_trainer_global_step_and_its_config(tmp_path):
    lg = WandbLogger(name="first", project="p", save_dir=tmp_path, offline=True, **QUIET)
    csv_logger = CSVLogger(tmp_path, name="csv")
    _fit([lg, csv_logger], tmp_path)
    run_id = lg.version
    lg.experiment.finish()

    recs = records(tmp_path)
    (run,) = of(recs, "run")
    assert (run["run_id"], run["project"], run["display_name"]) == (run_id, "p", "first")
    assert config(recs) == {"lr": 0.05, "model": {"width": 4, "act": None}, "betas": [0.9, 0.99]}
    expected = csv_rows(csv_logger.metrics_file)
    assert {"train/loss", "val/loss", "epoch"} <= set().union(*expected)
    assert rows(recs) == expected  # every row, value and step, in order
    # the charts' x axis: trainer/global_step for every metric; W&B's own step counts rows
    metrics = of(recs, "metric")
    assert {"name": "trainer/global_step", "options": {"defined": True}} in metrics
    assert any(
        m.get("glob_name") == "*" and m.get("step_metric") == "trainer/global_step" for m in metrics
    )
    assert [r["_step"] for r in rows(recs, internal=True)] == list(range(len(expected)))
    assert [e.get("exit_code") for e in of(recs, "exit")] == [0]  # and its runtime, if any
    assert lg.name == "p" and lg.save_dir == str(tmp_path) and lg.log_dir is None


def test_metric_values_prefix_and_hyperparameters_json_cannot_hold(tmp_path):
    import torch

    lg = WandbLogger(project="p", save_dir=tmp_path, offline=True, prefix="fold1", **QUIET)
    lg.log_hyperparams({"fn": len, "nested": {"t": torch.tensor(0.5), "path": Path("/x")}})
    lg.log_metrics({"loss": torch.tensor(2.0), "n": 3}, step=7)
    lg.log_metrics({"loss": 1.5})  # no step: W&B carries the last one over (step_sync)
    lg.experiment.finish()
    recs = records(tmp_path)
    assert rows(recs) == [
        {"fold1-loss": 2.0, "fold1-n": 3, "trainer/global_step": 7},
        {"fold1-loss": 1.5, "trainer/global_step": 7},
    ]
    assert config(recs) == {"fn": str(len), "nested": {"t": 0.5, "path": "/x"}}


def test_watch_logs_parameter_histograms_but_not_gradients(tmp_path):
    """The step differentiates the state's tensors, not the module's parameters: W&B's
    gradient hooks never fire; its forward hook sees the parameters the step uses."""
    import torch

    lg = WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET)
    model = torch.nn.Linear(4, 1)
    lg.watch(model, log="all", log_freq=1, log_graph=False)
    _fit([lg], tmp_path, max_steps=4, model=model)
    lg.experiment.finish()
    logged = rows(records(tmp_path))
    keys = set().union(*logged)
    assert {"parameters/weight.values", "parameters/bias.values"} <= keys
    assert not [k for k in keys if k.startswith("gradients/")]
    weights = [r["parameters/weight.values"] for r in logged if "parameters/weight.values" in r]
    assert len(weights) >= 3 and weights[0] != weights[-1]  # the trained values, step by step


def test_a_pickled_logger_starts_the_same_run_again(tmp_path):
    import pickle

    lg = WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET)
    lg.log_metrics({"loss": 1.0}, 0)
    copy = pickle.loads(pickle.dumps(lg))  # what a spawned process gets: no run object
    assert copy._experiment is None and copy.version == lg.version
    lg.experiment.finish()
    copy.log_metrics({"loss": 0.5}, 1)
    copy.experiment.finish()
    (run,) = of(records(tmp_path, -1), "run")
    assert run["run_id"] == lg.version and run["resume"] is True
    assert rows(records(tmp_path, -1)) == [{"loss": 0.5, "trainer/global_step": 1}]


def test_a_run_in_progress_is_used_and_one_given_is_logged_to(tmp_path):
    mine = wandb.init(project="mine", dir=str(tmp_path), mode="offline", **QUIET)
    with pytest.warns(UserWarning, match="a W&B run is already in progress"):
        assert WandbLogger(project="p", save_dir=tmp_path).experiment is mine
    given = WandbLogger(experiment=mine)
    given.log_metrics({"a": 1.0}, step=0)
    assert given.version == mine.id and given.state_dict() == {}  # the user's run: not resumed
    given.load_state_dict({"id": "other", "project": "lightning_logs", "step": 3})
    assert given.experiment is mine
    mine.finish()
    recs = records(tmp_path)
    assert rows(recs) == [{"a": 1.0, "trainer/global_step": 0}]
    assert of(recs, "metric") == []  # the user's run's axes are left as they are


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_model": "best"}, ValueError, r"log_model='best'\): pass False .* True .* 'all'"),
        ({"version": "a", "id": "b"}, ValueError, r"version='a', id='b'\): they name the same"),
        ({"save_dir": "a", "dir": "b"}, ValueError, r"save_dir='a', dir='b'\): they name the"),
        ({"add_file_policy": "copy"}, ValueError, r"add_file_policy='copy'\): pass 'mutable'"),
        ({"prefix": 1}, TypeError, r"prefix=1\): pass a str"),
        ({"offline": True, "mode": "online"}, ValueError, r"offline=True, mode='online'"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        WandbLogger(**kwargs)


def test_dir_and_id_are_lightnings_aliases_and_nothing_starts_before_use(tmp_path):
    lg = WandbLogger(dir=tmp_path / "w", id="abc123", offline=True)
    assert (lg.save_dir, lg.version, lg.name) == (str(tmp_path / "w"), "abc123", "lightning_logs")
    assert not (tmp_path / "w").exists() and wandb.run is None


def test_a_missing_wandb_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'engine\[wandb\]'") as e:
        WandbLogger()
    assert e.value.name == "wandb"


def test_a_rank_other_than_0_starts_no_run_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    lg = WandbLogger(project="p", save_dir=tmp_path, offline=True, log_model="all")
    assert not lg.experiment  # the stand-in
    assert lg.experiment.config.update({"a": 1}) is lg.experiment
    lg.log_hyperparams({"lr": 0.1})
    lg.log_metrics({"loss": 1.0}, step=0)
    lg.after_save_checkpoint(object())
    lg.load_state_dict({"id": "abc", "project": "p", "step": 2})
    lg.finalize("success")
    assert (lg.version, lg.state_dict()) == (None, {})
    assert list(tmp_path.iterdir()) == [] and wandb.run is None


# ---------------------------------------------------------------------- log_model


def _artifacts(recs):
    return [
        {
            "name": a["name"],
            "type": a["type"],
            "aliases": sorted(a["aliases"]),  # W&B records them in no fixed order
            "files": sorted(f["path"] for f in a["manifest"]["contents"]),
            "metadata": json.loads(a["metadata"]),
        }
        for a in of(recs, "artifact")
    ]


def test_log_model_all_logs_each_checkpoint_as_a_model_artifact_offline_too(tmp_path):
    from engine.listeners import ModelCheckpoint

    lg = WandbLogger(project="p", save_dir=tmp_path, offline=True, log_model="all", **QUIET)
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    _fit([lg, CSVLogger(tmp_path)], tmp_path, callbacks=[saver])
    run_id = lg.version
    lg.experiment.finish()
    logged = _artifacts(records(tmp_path))
    saved = sorted(p for p in Path(saver.dirpath).iterdir() if p.is_dir())
    assert [a["metadata"]["original_filename"] for a in logged] == [p.name for p in saved]
    for artifact, path in zip(logged, saved, strict=True):
        assert artifact["name"] == f"model-{run_id}" and artifact["type"] == "model"
        assert artifact["files"] == sorted(p.name for p in path.iterdir())
        assert artifact["aliases"] == ["best", "latest"]  # without monitor: the latest is best
        assert artifact["metadata"]["ModelCheckpoint"]["save_top_k"] == -1


def test_log_model_true_logs_the_kept_checkpoints_when_the_fit_ends(tmp_path):
    from engine.listeners import ModelCheckpoint

    lg = WandbLogger(
        project="p", save_dir=tmp_path, offline=True, log_model=True, checkpoint_name="ck", **QUIET
    )
    saver = ModelCheckpoint(
        every_n_train_steps=2, save_top_k=1, save_last=True, monitor="train/loss"
    )
    _fit([lg, CSVLogger(tmp_path)], tmp_path, callbacks=[saver])
    lg.experiment.finish()
    logged = _artifacts(records(tmp_path))
    names = {a["metadata"]["original_filename"]: a for a in logged}
    assert set(names) == {Path(saver.best_model_path).name, "last"}
    assert names[Path(saver.best_model_path).name]["aliases"] == ["best", "latest"]
    assert names["last"]["aliases"] == ["latest"]
    best = names[Path(saver.best_model_path).name]["metadata"]["score"]
    assert best == pytest.approx(float(saver.best_model_score))
    assert {a["name"] for a in logged} == {"ck"}


# ---------------------------------------------------------------------- resume


def _three_rows(lg: WandbLogger, start: int = 0) -> None:
    for step in range(start, start + 3):
        lg.log_metrics({"loss": float(step)}, step)


def test_a_resumed_logger_continues_the_same_run(tmp_path):
    first = WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET)
    _three_rows(first)
    state = first.state_dict()
    assert state == {"id": first.version, "project": "p", "step": 3, "offline": True}
    first.log_metrics({"loss": 30.0}, 3)  # past the checkpoint
    first.experiment.finish()

    again = WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET)
    again.load_state_dict(state)
    _three_rows(again, start=3)
    assert again.version == first.version
    again.experiment.finish()
    (run,) = of(records(tmp_path, -1), "run")
    assert run["run_id"] == first.version and run["resume"] is True
    # W&B resumes the run: this fit's rows join it; the row past the checkpoint stays there
    assert rows(records(tmp_path, 0)) == [
        {"loss": float(s), "trainer/global_step": s} for s in (0, 1, 2)
    ] + [{"loss": 30.0, "trainer/global_step": 3}]
    assert rows(records(tmp_path, -1)) == [
        {"loss": float(s), "trainer/global_step": s} for s in (3, 4, 5)
    ]


def test_rewind_on_resume_branches_the_run_at_the_checkpoints_last_row(tmp_path):
    """``resume_from="<id>?_step=2"``: recorded as the run's branch point, this fit's rows
    numbered from W&B step 3 on; the rows a sync keeps (the first file's up to step 2, then
    the second's) are each step once, as an uninterrupted run's."""
    first = WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET)
    _three_rows(first)
    state = first.state_dict()
    first.log_metrics({"loss": 30.0}, 3)
    first.log_metrics({"loss": 40.0}, 4)
    first.experiment.finish()

    again = WandbLogger(
        project="p", save_dir=tmp_path, offline=True, rewind_on_resume=True, **QUIET
    )
    again.load_state_dict(state)
    _three_rows(again, start=3)
    again.experiment.finish()
    second = records(tmp_path, -1)
    (run,) = of(second, "run")
    assert run["run_id"] == first.version and "resume" not in run
    assert run["branch_point"] == {"run": first.version, "metric": "_step", "value": 2}
    before = [r for r in rows(records(tmp_path, 0), internal=True) if r["_step"] <= 2]
    after = rows(second, internal=True)
    assert [r["_step"] for r in after] == [3, 4, 5]
    merged = [{k: v for k, v in r.items() if not k.startswith("_")} for r in before + after]
    assert merged == [{"loss": float(s), "trainer/global_step": s} for s in range(6)]


def test_rewind_in_the_same_process_restarts_the_run_at_the_branch_point(tmp_path):
    lg = WandbLogger(project="p", save_dir=tmp_path, offline=True, rewind_on_resume=True, **QUIET)
    _three_rows(lg)
    state = lg.state_dict()
    lg.log_metrics({"loss": 30.0}, 3)
    lg.load_state_dict(state)  # the same logger, its run in progress: finished, then rewound
    _three_rows(lg, start=3)
    lg.experiment.finish()
    assert of(records(tmp_path, -1), "run")[0]["branch_point"]["value"] == 2
    assert [r["_step"] for r in rows(records(tmp_path, -1), internal=True)] == [3, 4, 5]


def test_a_resume_into_another_project_or_run_or_before_any_row(tmp_path):
    first = WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET)
    assert first.state_dict() == {}  # no run yet
    first.log_hyperparams({"lr": 0.1})
    empty = first.state_dict()
    assert empty["step"] == 0
    _three_rows(first)
    state = first.state_dict()
    first.experiment.finish()
    other_project = WandbLogger(project="q", save_dir=tmp_path, offline=True)
    other_run = WandbLogger(project="p", save_dir=tmp_path, offline=True, id="mine0001")
    for lg in (other_project, other_run):
        lg.load_state_dict(state)
    assert other_project.version is None and other_run.version == "mine0001"
    rewinding = WandbLogger(project="p", save_dir=tmp_path, offline=True, rewind_on_resume=True)
    rewinding.load_state_dict(empty)  # nothing to rewind to: resumed
    assert rewinding._wandb_init["resume"] == "allow" and "resume_from" not in rewinding._wandb_init


def test_a_fit_resumed_from_a_checkpoint_continues_the_run(tmp_path):
    from engine.listeners import ModelCheckpoint

    def loggers(**kw):
        return [
            WandbLogger(project="p", save_dir=tmp_path, offline=True, **QUIET, **kw),
            CSVLogger(tmp_path, version=0),
        ]

    first = loggers()
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    _fit(first, tmp_path, max_steps=4, callbacks=[saver])
    run_id = first[0].version
    first[0].experiment.finish()
    ckpt = Path(saver.dirpath) / "epoch=0-step=2"
    again = loggers(rewind_on_resume=True)
    _fit(again, tmp_path, max_steps=6, callbacks=[ModelCheckpoint()], ckpt_path=str(ckpt))
    again[0].experiment.finish()
    from engine import checkpoint

    step = checkpoint.read_meta(ckpt)["extra"]["loggers"]["WandbLogger"]["step"]
    kept = checkpoint.read_meta(ckpt)["extra"]["loggers"]["CSVLogger"]["rows"]
    assert step == kept > 0  # a row of each logger at each log
    second = records(tmp_path, -1)
    assert of(second, "run")[0]["branch_point"] == {
        "run": run_id,
        "metric": "_step",
        "value": step - 1,
    }
    before = [r for r in rows(records(tmp_path, 0), internal=True) if r["_step"] < step]
    merged = [{k: v for k, v in r.items() if not k.startswith("_")} for r in before] + rows(second)
    assert merged == csv_rows(again[1].metrics_file)  # the CSV: each step once
