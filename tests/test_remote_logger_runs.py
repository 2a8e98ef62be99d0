"""``MLFlowLogger`` and ``WandbLogger`` in whole runs of their own processes: a fit killed
(``kill -9``) past its last checkpoint and resumed from it in a new process continues the
same MLflow run and the same W&B run, and what each then holds is exactly what is said
(MLflow: every value the killed fit logged, then the resumed fit's from the checkpoint on;
W&B: the resumed run rewound to the checkpoint's last row); a fit on 2 gloo ranks launched by
the Trainer (``strategy="ddp", devices=2``) logs once, from rank 0, and rank 1 starts no run
and writes no file.

The stores are real and local: an MLflow ``file:`` store, W&B offline runs read back with
``wandb-core``'s inspector (``tests/test_wandb_logger.py``'s ``records``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import _procs
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from test_ddp_trainer import _env, _ok
from test_mlflow_logger import _by_metric, _csv_histories, _csv_rows, _histories
from test_wandb_logger import csv_rows, of, records, rows

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    """MLflow 3 reads a ``file:`` store here only with this set (the scripts set it too)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim
    from engine.listeners import ModelCheckpoint
    from engine.loggers import CSVLogger, MLFlowLogger, WandbLogger

    args = json.loads(sys.argv[1])
    root = args["root"]
    where = os.path.join(root, "rank" + os.environ.get("RANK", "0"))  # each rank's own

    class Killer(eg.Listener):
        def on_train_batch_end(self, rec):
            if rec.state.step == args.get("kill_at"):
                os.kill(os.getpid(), signal.SIGKILL)

    def loss(m, b):
        return F.mse_loss(m(b[0]), b[1])

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = args.get("n", 48)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    task = eg.Task(loss, optim.adamw(0.05), eval_fn=loss, hparams={"lr": 0.05, "m": {"w": 4}})
    loggers = [
        MLFlowLogger("exp", tracking_uri="file:" + os.path.join(where, "mlruns"),
                     log_model=args.get("log_model", False)),
        WandbLogger(project="p", save_dir=where, offline=True, rewind_on_resume=True,
                    log_model=args.get("log_model", False), settings={"silent": True}),
        CSVLogger(os.path.join(root, "csv"), version=0, flush_logs_every_n_steps=1),
    ]
    trainer = eg.Trainer(
        accelerator="cpu", strategy=args.get("strategy", "auto"), devices=args.get("devices", 1),
        max_steps=args["max_steps"], log_every_n_steps=1, val_check_interval=4,
        logger=loggers, default_root_dir=root, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Killer(), ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)],
    )
    state = trainer.fit(
        task, task.init(torch.nn.Linear(4, 1)), DataLoader(ds, batch_size=8),
        DataLoader(ds, batch_size=8), ckpt_path=args.get("ckpt_path"),
    )
    print("DONE", trainer.global_rank, state.step, loggers[0].run_id, loggers[1].version,
          flush=True)
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "fit.py"
    path.write_text(SCRIPT)
    return path


def _run_env(home: Path) -> dict[str, str]:
    env = _env()
    env.update(
        MLFLOW_ALLOW_FILE_STORE="true",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(home),
        WANDB_DATA_DIR=str(home / "data"),
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_CONFIG_DIR=str(home / "config"),
        WANDB_ERROR_REPORTING="false",
    )
    # WANDB_SERVICE: this process's wandb-core, once a test here started one; a script that
    # inherits it logs through that service, which still holds a killed script's run "in use"
    for var in ("MLFLOW_TRACKING_URI", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_SERVICE"):
        env.pop(var, None)
    return env


def _fit(tmp_path: Path, args: dict, *, launched: bool = False):
    """The script in a new process: forked (``_procs``), or started cold where the Trainer
    launches its ranks itself (they start with ``sys.executable``)."""
    cmd = [sys.executable, str(_script(tmp_path)), json.dumps(args)]
    env = _run_env(tmp_path / "wandb_home")
    if launched:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    return _procs.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_a_killed_fit_resumed_in_a_new_process_continues_the_same_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    from engine import checkpoint

    root = tmp_path / "run"
    killed = _fit(tmp_path, {"root": str(root), "max_steps": 16, "kill_at": 13})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    csv_path = root / "csv" / "lightning_logs" / "version_0" / "metrics.csv"
    killed_rows = _csv_rows(str(csv_path))  # flushed every step: all it logged
    ckpt = root / "csv" / "lightning_logs" / "version_0" / "checkpoints" / "epoch=1-step=10"
    saved = checkpoint.read_meta(ckpt)["extra"]["loggers"]
    kept = saved["CSVLogger"]["rows"]
    assert saved["WandbLogger"]["step"] == kept and 0 < kept < len(killed_rows)

    resumed = _fit(tmp_path, {"root": str(root), "max_steps": 16, "ckpt_path": "last"})
    _ok(resumed)
    (done,) = [line for line in resumed.stdout.splitlines() if line.startswith("DONE")]
    _, rank, step, run_id, wandb_id = done.split()
    assert (rank, step) == ("0", "16")
    assert "logged after the checkpoint this fit resumes from" in resumed.stderr
    resumed_rows = _csv_rows(str(csv_path))
    assert resumed_rows[:kept] == killed_rows[:kept]  # the CSV: each step once

    # MLflow: the same run, FINISHED; every value the killed fit logged (those past the
    # checkpoint too: MLflow cannot delete them), then the resumed fit's
    client = MlflowClient(f"file:{root / 'rank0' / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "exp"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert _histories(client, run_id) == _by_metric(killed_rows + resumed_rows[kept:])
    assert run.data.params == {"lr": "0.05", "m/w": "4"}

    # W&B: a second offline file of the same run, rewound to the checkpoint's last row; the
    # killed process's file holds what wandb-core had flushed (every 15 s: little or nothing)
    wandb_root = root / "rank0"
    runs = sorted((wandb_root / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{wandb_id}") for r in runs)
    first, second = records(wandb_root, 0), records(wandb_root, -1)
    (run_record,) = of(second, "run")
    assert run_record["run_id"] == wandb_id
    assert run_record["branch_point"] == {"run": wandb_id, "metric": "_step", "value": kept - 1}
    got = rows(first)
    assert got == _as_wandb(killed_rows)[: len(got)]
    assert [r["_step"] for r in rows(second, internal=True)] == list(range(kept, len(resumed_rows)))
    assert rows(second) == csv_rows(str(csv_path))[kept:]


def _as_wandb(csv_dict_rows: list[dict[str, str]]) -> list[dict]:
    """CSV rows as W&B rows (as ``test_wandb_logger.csv_rows`` reads a file)."""
    out = []
    for r in csv_dict_rows:
        item: dict = {k: float(v) for k, v in r.items() if v and k != "step"}
        item["trainer/global_step"] = int(r["step"])
        out.append(item)
    return out


def test_two_ranks_log_once_from_rank_0_and_rank_1_creates_nothing(tmp_path):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "run"
    args = {
        "root": str(root),
        "max_steps": 6,
        "strategy": "ddp",
        "devices": 2,
        "n": 96,
        "log_model": "all",
    }
    done = _fit(tmp_path, args, launched=True)
    _ok(done)
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("DONE")]
    assert sorted(line[1] for line in lines) == ["0", "1"]
    zero = next(line for line in lines if line[1] == "0")
    one = next(line for line in lines if line[1] == "1")
    assert one[3:] == ["None", "None"]  # rank 1's loggers: no run, no id
    assert not (root / "rank1").exists()  # nothing of rank 1's: no store, no wandb directory

    csv_path = root / "csv" / "lightning_logs" / "version_0" / "metrics.csv"
    client = MlflowClient(f"file:{root / 'rank0' / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "exp"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == zero[3] and run.info.status == "FINISHED"
    assert _histories(client, zero[3]) == _csv_histories(str(csv_path))
    logged = {info.path for info in client.list_artifacts(zero[3])}
    assert {"epoch=0-step=5", "epoch=0-step=5.yaml"} <= logged

    wandb_runs = sorted((root / "rank0" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and wandb_runs[0].name.endswith(zero[4])
    recs = records(root / "rank0")
    assert rows(recs) == csv_rows(str(csv_path))
    assert [a["metadata"] for a in of(recs, "artifact")]  # the checkpoints, from rank 0
    assert os.listdir(root / "csv" / "lightning_logs") == ["version_0"]
