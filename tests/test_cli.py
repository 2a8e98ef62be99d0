"""The ``engine`` command, run as a subprocess: ``fit`` / ``validate`` / ``test`` / ``predict`` from
config files with overrides and ``--print_config``; ``demo``; and ``replay``'s exit statuses
(2 for every error, in one ``error:`` line; 1 only for a divergence)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import yaml

_MODULE = """
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import engine as eg
from engine import optim


class Net(nn.Module):
    def __init__(self, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.body(x)


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def predict_fn(model, batch):
    return model(batch[0]).argmax(-1)


def make_task(lr: float = 0.1, momentum: float = 0.0) -> eg.Task:
    return eg.Task(loss_fn, optim.sgd(lr, momentum=momentum), predict_fn=predict_fn)


class Data:
    def __init__(self, n: int = 32, batch_size: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.ds, self.batch_size = TensorDataset(x, y), batch_size

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size)

    test_dataloader = predict_dataloader = val_dataloader
"""

_CONFIG = """
seed_everything: 3
trainer:
  max_epochs: 5
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
model:
  class_path: cliproj.Net
  init_args:
    hidden: 16
task:
  class_path: cliproj.make_task
  init_args:
    lr: 0.05
data:
  class_path: cliproj.Data
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``cliproj.py`` (model, task, data) and ``cfg.yaml``."""
    root = tmp_path_factory.mktemp("project")
    (root / "cliproj.py").write_text(textwrap.dedent(_MODULE))
    (root / "cfg.yaml").write_text(textwrap.dedent(_CONFIG))
    return root


def _env(project: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    if project is not None:
        env["PYTHONPATH"] = str(project)
    return env


def engine(
    *args: str | Path, project: Path | None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m engine ARGS`` with ``project`` on PYTHONPATH."""
    return _procs.run(
        [sys.executable, "-m", "engine", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(project),
        cwd=cwd or project,
        timeout=300,
    )


def _failed_cleanly(done: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit status 2, an ``error:`` line naming ``words``, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.fixture(scope="module")
def fitted(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root directory of one ``engine fit`` run (2 epochs of 4 steps)."""
    out = tmp_path_factory.mktemp("fitted")
    done = engine(
        "fit",
        "--config",
        "cfg.yaml",
        "--trainer.max_epochs=2",
        f"--trainer.default_root_dir={out}",
        project=project,
    )
    assert done.returncode == 0, done.stderr
    return out


# ---------------------------------------------------------------------------- fit and friends


def test_fit_trains_from_a_config_file_and_overrides(project, fitted):
    assert sorted(p.name for p in (fitted / "checkpoints").iterdir()) == ["epoch=1-step=8"]
    run = fitted / "lightning_logs" / "version_0"
    lines = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    assert max(x["step"] for x in lines) == 8  # --trainer.max_epochs=2 beat the file's 5
    assert json.loads((run / "config.json").read_text())["max_epochs"] == 2


@pytest.mark.slow
def test_fit_on_two_ranks_reports_once(project, tmp_path):
    done = engine(
        "fit",
        "--config",
        "cfg.yaml",
        "--trainer.max_epochs=1",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.accelerator=cpu",
        f"--trainer.default_root_dir={tmp_path}",
        project=project,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("fit: 1 epochs, 2 optimizer steps") == 1  # 32 samples, 8 a rank
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch=0-step=2"]


def test_fit_prints_what_it_did(project, tmp_path):
    done = engine(
        "fit",
        "--config=cfg.yaml",
        "--trainer.max_epochs=1",
        f"--trainer.default_root_dir={tmp_path}",
        project=project,
    )
    assert done.returncode == 0, done.stderr
    assert "fit: 1 epochs, 4 optimizer steps" in done.stdout
    assert "val/loss = " in done.stdout and "val/acc = " in done.stdout
    assert f"checkpoint: {tmp_path / 'checkpoints' / 'epoch=0-step=4'}" in done.stdout
    assert "run directory: " in done.stdout


def test_print_config_merges_files_and_overrides_and_parses_back(project, tmp_path):
    later = tmp_path / "later.yaml"
    later.write_text("trainer:\n  max_epochs: 7\nmodel:\n  init_args:\n    hidden: 32\n")
    done = engine(
        "fit",
        "--config",
        "cfg.yaml",
        "--config",
        later,
        "--trainer.max_epochs=3",
        "--task.init_args.momentum=0.9",
        "--print_config",
        project=project,
    )
    assert done.returncode == 0, done.stderr
    merged = yaml.safe_load(done.stdout)
    assert merged["trainer"]["max_epochs"] == 3  # the command line beats both files
    assert merged["model"] == {
        "class_path": "cliproj.Net",
        "init_args": {"hidden": 32, "classes": 3},  # the later file beats the first
    }
    assert merged["task"]["init_args"] == {"lr": 0.05, "momentum": 0.9}
    assert merged["data"]["init_args"] == {"n": 32, "batch_size": 8}  # defaults filled in
    assert merged["seed_everything"] == 3 and merged["ckpt_path"] is None
    assert "config" not in merged and "print_config" not in merged
    # the printed config is a complete config: given back, it prints the same
    (tmp_path / "printed.yaml").write_text(done.stdout)
    again = engine("fit", "--config", tmp_path / "printed.yaml", "--print_config", project=project)
    assert again.returncode == 0, again.stderr
    assert yaml.safe_load(again.stdout) == merged


def test_validate_test_and_predict_a_checkpoint(project, fitted, tmp_path):
    (ckpt,) = (fitted / "checkpoints").iterdir()
    common = [
        "--config",
        "cfg.yaml",
        f"--ckpt_path={ckpt}",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    done = engine("validate", *common, project=project)
    assert done.returncode == 0, done.stderr
    assert "val/loss" in done.stdout and "val/acc" in done.stdout
    # the checkpoint's ModelCheckpoint saved elsewhere: news to a fit, not to an evaluation
    assert "ModelCheckpoint" not in done.stderr, done.stderr
    done = engine("test", *common, project=project)
    assert done.returncode == 0, done.stderr
    assert "test/loss" in done.stdout and "test/acc" in done.stdout
    assert "ModelCheckpoint" not in done.stderr, done.stderr
    out = tmp_path / "predictions.pt"
    done = engine("predict", *common, f"--predictions_path={out}", project=project)
    assert done.returncode == 0, done.stderr
    assert "ModelCheckpoint" not in done.stderr, done.stderr
    assert "predict: 4 batches; the first batch's output: Tensor[8] int64" in done.stdout
    predictions = torch.load(out)
    assert len(predictions) == 4 and predictions[0].shape == (8,)


def test_evaluating_without_a_checkpoint_warns(project, tmp_path):
    done = engine("validate", "--config", project / "cfg.yaml", project=project, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "without --ckpt_path uses the model's initial weights" in done.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--trainer.max_epoch=1"], ["--trainer.max_epoch=1"]),
        (["--trainer.max_epochs=abc"], ["max_epochs", "abc"]),
        (["--model.init_args.hiden=3"], ["hiden"]),
        (["--model.class_path=cliproj.Nope"], ["cliproj.Nope"]),
        (["--task.init_args.learning_rate=1"], ["learning_rate"]),
        (["--trainer.max_epochs=-7"], ["max_epochs"]),  # refused by the Trainer itself
        (["--trainer.gradient_clip_algorithm=max"], ["gradient_clip_algorithm", "max"]),
        (["--config=missing.yaml"], ["missing.yaml"]),
        (["--config=bad_key.yaml"], ["max_epoch"]),
        (["--config=bad_section.yaml"], ["modle"]),
        (["--data.class_path=cliproj.Net"], ["cliproj.Net"]),  # no *_dataloader method
    ],
)
def test_bad_keys_and_values_exit_2_naming_them(project, args, words):
    (project / "bad_key.yaml").write_text("trainer:\n  max_epoch: 3\n")
    (project / "bad_section.yaml").write_text("modle:\n  class_path: cliproj.Net\n")
    done = engine("fit", "--config", "cfg.yaml", *args, project=project)
    _failed_cleanly(done, *words)


def test_a_datamodule_without_the_stage_loader_exits_2(project, tmp_path):
    module = tmp_path / "trainonly.py"
    module.write_text("import cliproj\n\n\nclass Data(cliproj.Data):\n    test_dataloader = None\n")
    env_path = f"{tmp_path}{os.pathsep}{project}"
    done = _procs.run(
        [sys.executable, "-m", "engine", "test", "--config=cfg.yaml", "--data=trainonly.Data"],
        capture_output=True,
        text=True,
        env={**_env(project), "PYTHONPATH": env_path},
        cwd=project,
    )
    _failed_cleanly(done, "test_dataloader()")


def test_the_top_level_help_lists_every_command():
    done = engine("--help", project=None, cwd=Path.cwd())
    assert done.returncode == 0
    for command in ("fit", "validate", "test", "predict", "demo", "inspect", "replay"):
        assert command in done.stdout


def test_demo_trains_on_digits(tmp_path):
    pytest.importorskip("sklearn")
    done = engine("demo", "--epochs", "1", "--root", tmp_path, project=None, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "trained 1 epochs" in done.stdout and "test accuracy" in done.stdout
    assert list(tmp_path.glob("lightning_logs/version_0/checkpoints/epoch=0-step=*"))


# ---------------------------------------------------------------------------------- replay


@pytest.fixture
def run_dir(fitted: Path, tmp_path: Path) -> Path:
    """A copy of the fitted run directory, to damage."""
    run = tmp_path / "run"
    shutil.copytree(fitted / "lightning_logs" / "version_0", run)
    return run


def _replay(run: Path | str, *args: str, project: Path | None) -> subprocess.CompletedProcess[str]:
    return engine("replay", run, "--trust-code", *args, project=project)


def test_replay_of_an_intact_run_exits_0_and_a_divergence_exits_1(project, run_dir):
    done = _replay(run_dir, project=project)
    assert done.returncode == 0, done.stderr
    assert "bitwise identical" in done.stdout
    journal = run_dir / "journal.jsonl"
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    last = next(x for x in reversed(lines) if "loss" in x)
    last["loss"] = 123.0
    journal.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = _replay(run_dir, project=project)
    assert done.returncode == 1, done.stderr
    assert "123.0" in done.stdout and "error:" not in done.stderr


def test_replay_without_the_runs_module_exits_2(run_dir):
    done = _replay(run_dir, project=None)  # cliproj is not importable
    _failed_cleanly(done, "cliproj", "PYTHONPATH")


def test_replay_with_a_class_the_module_no_longer_defines_exits_2(project, run_dir, tmp_path):
    changed = tmp_path / "changed"
    changed.mkdir()
    source = (project / "cliproj.py").read_text()
    (changed / "cliproj.py").write_text(source.replace("class Net(", "class Renamed("))
    done = _replay(run_dir, project=changed)
    _failed_cleanly(done, "'Net'", "restore the definition")


def test_replay_with_a_missing_data_module_exits_2(project, run_dir):
    done = _replay(run_dir, "--data", "no_such_module:loader", project=project)
    _failed_cleanly(done, "no_such_module")
    done = _replay(run_dir, "--data", "cliproj:no_such_loader", project=project)
    _failed_cleanly(done, "no_such_loader")
    done = _replay(run_dir, "--data", "cliproj", project=project)
    _failed_cleanly(done, "MODULE:ATTRIBUTE")


def test_replay_of_a_missing_or_unreadable_run_exits_2(project, tmp_path, run_dir):
    _failed_cleanly(_replay(tmp_path / "nowhere", project=project), "no such directory")
    (tmp_path / "file").write_text("x")
    _failed_cleanly(_replay(tmp_path / "file", project=project), "not a directory")
    (tmp_path / "empty").mkdir()
    _failed_cleanly(_replay(tmp_path / "empty", project=project), "journal.jsonl")
    (run_dir / "task.pkl").write_bytes((run_dir / "task.pkl").read_bytes()[:40])
    _failed_cleanly(_replay(run_dir, project=project), "cannot be read")


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda text: text.replace("}\n", "\n", 1), ["line 1", "damaged"]),
        (lambda text: text + "\x00\xff\n", ["damaged"]),
        (lambda text: '{"no_step": 1}\n' + text, ["line 1", "'step'"]),
        (lambda text: "", ["empty"]),
    ],
)
def test_replay_of_a_damaged_journal_exits_2(project, run_dir, damage, words):
    journal = run_dir / "journal.jsonl"
    journal.write_bytes(damage(journal.read_text()).encode("latin-1"))
    _failed_cleanly(_replay(run_dir, project=project), *words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--from", "0"], ["from_step=0"]),
        (["--from", "6", "--to", "3"], ["before"]),
        (["--to", "999"], ["past the journal's last step"]),
        (["--from", "abc"], ["--from", "abc"]),
    ],
)
def test_replay_with_bad_steps_exits_2(project, run_dir, args, words):
    _failed_cleanly(_replay(run_dir, *args, project=project), *words)


def test_replay_without_trust_code_exits_2(project, run_dir):
    done = engine("replay", run_dir, project=project)
    _failed_cleanly(done, "--trust-code")


def test_a_missing_checkpoint_exits_2_with_one_error_line(project, tmp_path):
    done = engine(
        "fit", "--config", "cfg.yaml", f"--ckpt_path={tmp_path / 'nope'}", project=project
    )
    _failed_cleanly(done, "ckpt_path", "does not exist")


def test_ckpt_path_best_in_a_new_process_finds_the_fits_best_from_disk(project, tmp_path):
    """``engine test --ckpt_path best`` after ``engine fit``: this process's ModelCheckpoint has
    ranked nothing, so the run's best comes from what its newest checkpoint records; with no
    checkpoints there, the error says where it looked."""
    root = tmp_path / "run"
    monitored = [
        "--trainer.callbacks=engine.listeners.ModelCheckpoint",
        "--trainer.callbacks.monitor=val/loss",
        "--trainer.callbacks.save_top_k=2",
    ]
    common = ["--config", "cfg.yaml", f"--trainer.default_root_dir={root}", *monitored]
    done = engine("fit", *common, "--trainer.max_epochs=3", project=project)
    assert done.returncode == 0, done.stderr
    best = [ln for ln in done.stdout.splitlines() if ln.startswith("best checkpoint: ")]
    assert best, done.stdout
    expected = best[0].split(": ", 1)[1]
    done = engine("test", *common, "--ckpt_path=best", project=project)
    assert done.returncode == 0, done.stderr
    assert "test/loss" in done.stdout
    # the same numbers as naming the best checkpoint's path
    named = engine("test", *common, f"--ckpt_path={expected}", project=project)
    assert named.returncode == 0, named.stderr
    assert [x for x in done.stdout.splitlines() if "test/" in x] == [
        x for x in named.stdout.splitlines() if "test/" in x
    ]
    empty = engine(
        "test",
        "--config",
        "cfg.yaml",
        f"--trainer.default_root_dir={tmp_path / 'none'}",
        "--ckpt_path=best",
        project=project,
    )
    _failed_cleanly(empty, "ckpt_path", "no checkpoint is on disk in")


_SCRIPT = """
import sys
import torch
from engine.cli import build

cli = build()
state = cli.trainer.fit(cli.task, cli.state, datamodule=cli.datamodule)
(results,) = cli.trainer.test(datamodule=cli.datamodule, ckpt_path="best", verbose=False)
outputs = cli.trainer.predict(datamodule=cli.datamodule, ckpt_path="best")
print("SCRIPT", state.step, sorted(results), len(outputs), cli.seed, flush=True)
"""


def test_a_script_builds_from_the_config_and_calls_fit_test_and_predict(project, tmp_path):
    """LightningCLI's run=False: engine.cli.build parses the command's arguments, the script
    calls fit, then test and predict of the best checkpoint; a bad key is the command's one
    error line and status 2."""
    script = project / "train_script.py"
    script.write_text(_SCRIPT)
    args = [
        "--config",
        "cfg.yaml",
        "--trainer.max_epochs=2",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks=engine.listeners.ModelCheckpoint",
        "--trainer.callbacks.monitor=val/loss",
    ]
    cmd = [sys.executable, str(script), *args]
    done = _procs.run(
        cmd, capture_output=True, text=True, env=_env(project), cwd=project, timeout=300
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("SCRIPT")]
    assert line == "SCRIPT 8 ['test/acc', 'test/loss'] 4 3", line
    bad = [sys.executable, str(script), "--config", "cfg.yaml", "--trainer.max_epoch=2"]
    done = _procs.run(
        bad, capture_output=True, text=True, env=_env(project), cwd=project, timeout=300
    )
    _failed_cleanly(done, "max_epoch")
