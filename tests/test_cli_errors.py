"""Every bad value given to ``engine fit`` is answered with one ``error:`` line and exit status 2:
no traceback, no directory made. The command runs in a process of its own: ``python -m engine``
forked from the suite's fork server (tests/_procs.py) for the values issue 16 named, the
installed ``engine`` script itself, started cold, where the script is the point, and, for the
table of wrong values of every ``--trainer.*`` flag, one interpreter that forks a child per value
(each child runs ``engine.cli.main`` as the script does, in its own empty directory; forking
spares ~3 s of imports per value)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import yaml
from test_cli import _CONFIG, _MODULE

from engine.cli import _checks as checks

HUGE = str(2**70)
NOT_A_BOOL = ["abc", "2", "[true]", "{a: 1}"]
NOT_A_NUMBER = ["abc", "[1, 2]", "{a: 1}", HUGE]
LISTENER = (
    "{class_path: engine.listeners.EarlyStopping, init_args: {monitor: val/loss, patience: -1}}"
)
CHECKPOINT = "{class_path: engine.listeners.ModelCheckpoint, init_args: {save_top_k: -5}}"
LOGGER = "{class_path: engine.loggers.TensorBoardLogger, init_args: {save_dir: ., version: -3}}"
# a list where a path is expected: jsonargparse made directories named "['a', 'b']" of these
DIRPATH = "{class_path: engine.listeners.ModelCheckpoint, init_args: {dirpath: [a, b]}}"
SAVE_DIR = "{class_path: engine.loggers.CSVLogger, init_args: {save_dir: [a, b]}}"

# wrong values of every --trainer.* flag: wrong types, negatives, huge ints, lists where a
# scalar is expected, strings where a number is; each is refused by the parser, the CLI's own
# checks, the Trainer, or the loop when it meets the data
WRONG: dict[str, list[str]] = {
    "accelerator": ["abc", "[a, b]", "3", "{a: 1}"],
    "strategy": ["abc", "[1]", "3"],
    "devices": ["abc", "-5", HUGE, "[a]", "[-1]", "0", "1.5", "{a: 1}"],
    "num_nodes": ["0", "-1", "1.5", *NOT_A_NUMBER],
    "precision": ["abc", "[16]", "7", "{a: 1}", HUGE],
    "fast_dev_run": ["-1", "abc", "[1]", HUGE],
    "max_epochs": ["-5", "1.5", *NOT_A_NUMBER],
    "min_epochs": ["-5", "1.5", *NOT_A_NUMBER],
    "max_steps": ["-5", "1.5", *NOT_A_NUMBER],
    "min_steps": ["-3", "1.5", *NOT_A_NUMBER],
    "max_time": ["abc", "-5", "{days: -1}", "[1]", "{hours: " + HUGE + "}", "00:25:00:00:00"],
    "limit_train_batches": ["-1", "1.5", "-0.5", *NOT_A_NUMBER],
    "limit_val_batches": ["-1", "1.5", "-0.5", *NOT_A_NUMBER],
    "limit_test_batches": ["-1", "1.5", *NOT_A_NUMBER],
    "limit_predict_batches": ["-1", "1.5", *NOT_A_NUMBER],
    "overfit_batches": ["-1", "1.5", *NOT_A_NUMBER],
    "val_check_interval": ["-1", "0", "1.5", "50", *NOT_A_NUMBER],
    "check_val_every_n_epoch": ["0", "-2", "1.5", *NOT_A_NUMBER],
    "num_sanity_val_steps": ["-5", "1.5", *NOT_A_NUMBER],
    "log_every_n_steps": ["-1", "1.5", *NOT_A_NUMBER],
    "enable_checkpointing": NOT_A_BOOL,
    "enable_progress_bar": NOT_A_BOOL,
    "enable_model_summary": NOT_A_BOOL,
    "accumulate_grad_batches": ["0", "-1", "1.5", *NOT_A_NUMBER],
    "gradient_clip_val": ["-1", "nan", "inf", "abc", "[1, 2]", "{a: 1}"],
    "gradient_clip_algorithm": ["abc", "[norm]", "3"],
    "deterministic": ["abc", "[true]", "3"],
    "benchmark": NOT_A_BOOL,
    "inference_mode": NOT_A_BOOL,
    "use_distributed_sampler": NOT_A_BOOL,
    "profiler": ["abc", "[a]", "3"],
    "detect_anomaly": NOT_A_BOOL,
    "barebones": NOT_A_BOOL,
    "plugins": ["abc", "3", "[1, 2]", "{a: 1}"],
    "sync_batchnorm": NOT_A_BOOL,
    "reload_dataloaders_every_n_epochs": ["-1", "1.5", *NOT_A_NUMBER],
    "steps_per_call": ["0", "-2", "1.5", *NOT_A_NUMBER],
    "default_root_dir": ["[a, b]", "{a: 1}", "[]", "{CONFIG}", "{CONFIG}/sub", ""],
    "compile": ["abc", "[1]", "{nope: 1}", "2"],
    "enable_journal": NOT_A_BOOL,
    "enable_autolog_hparams": NOT_A_BOOL,
    "model_registry": ["hub", "my-model", "0"],
    "callbacks": ["abc", "3", "[1, 2]", "engine.listeners.Nope", LISTENER, CHECKPOINT, DIRPATH],
    "logger": ["abc", "3", "[1]", "{a: 1}", "cliproj.Net", LOGGER, SAVE_DIR],
}
# ... and the same for the top-level keys that are not the Trainer's
WRONG_TOP: dict[str, list[str]] = {
    "seed_everything": ["-1", HUGE, str(2**63), "abc", "1.5", "[1]"],
}
# refused only when the loop meets the data, after Trainer.fit has made the run directory
# (lightning_logs/version_0): Trainer.fit would have to check the schedule before it does
MAKES_THE_RUN_DIRECTORY = {("val_check_interval", "50")}
# values the table leaves out: what is right in Lightning is right here (a 99-hour max_time,
# max_epochs=2**62, ...) and would start a fit
CASES = [(f"trainer.{k}", v) for k, vs in WRONG.items() for v in vs] + [
    (k, v) for k, vs in WRONG_TOP.items() for v in vs
]

_DRIVER = r"""
import json, os, signal, sys, traceback
import engine.cli._stages as config
import engine.cli

parser = config.build_parser("fit")  # built once; each forked case parses with its own copy
config.build_parser = lambda stage: parser


def start(case):
    pid = os.fork()
    if pid:
        return pid
    # the case, as the `engine` script runs it: sys.exit(main())
    signal.alarm(120)
    os.chdir(case["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        code = engine.cli.main(case["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (e.code is not None)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


cases = json.load(sys.stdin)
codes, running, todo = [None] * len(cases), {}, list(range(len(cases)))
while todo or running:
    while todo and len(running) < 2:  # two at a time: the machines have two cores
        i = todo.pop(0)
        running[start(cases[i])] = i
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
json.dump(codes, sys.stdout)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("project")
    (root / "cliproj.py").write_text(textwrap.dedent(_MODULE))
    (root / "cfg.yaml").write_text(textwrap.dedent(_CONFIG))
    return root


def _env(pythonpath: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def _script() -> Path:
    script = Path(sys.executable).with_name("engine")
    if not script.is_file():
        pytest.skip(
            f"the engine script is not installed beside {sys.executable} (pip install -e .)"
        )
    return script


def _engine(*args: str | Path, cwd: Path, pythonpath: Path | None = None, script: bool = False):
    """``python -m engine`` in a forked process, or (``script``) the installed ``engine``
    script (.venv/bin/engine) started cold, as a user runs it."""
    command = [str(_script())] if script else [sys.executable, "-m", "engine"]
    return _procs.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(pythonpath),
        timeout=300,
    )


def _one_error_line(rc: int, stderr: str) -> None:
    assert rc == 2, (rc, stderr)
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr  # nothing else: no usage, no tips


def test_the_table_names_every_trainer_flag_the_cli_exposes():
    from engine.cli._stages import build_parser

    parser = build_parser("fit")
    exposed = {
        a.dest.removeprefix("trainer.")
        for a in parser._actions
        if a.dest.startswith("trainer.") and not a.dest.endswith(".help")
    }
    assert exposed == set(WRONG), (exposed ^ set(WRONG), "give each new flag its wrong values")
    for values in WRONG.values():
        assert len(values) >= 3


@pytest.mark.slow
def test_every_wrong_value_of_every_flag_is_one_error_line(project, tmp_path):
    cases = []
    for i, (key, value) in enumerate(CASES):
        cwd = tmp_path / f"case{i}"
        cwd.mkdir()
        value = value.replace("{CONFIG}", str(project / "cfg.yaml"))
        cases.append(
            {
                "argv": ["fit", "--config", str(project / "cfg.yaml"), f"--{key}={value}"],
                "cwd": str(cwd),
                "stdout": str(tmp_path / f"case{i}.out"),
                "stderr": str(tmp_path / f"case{i}.err"),
            }
        )
    done = _procs.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=_env(project),
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout)
    failures = []
    for (key, value), case, rc in zip(CASES, cases, codes, strict=True):
        stderr = Path(case["stderr"]).read_text()
        made = sorted(os.listdir(case["cwd"]))
        if (key.removeprefix("trainer."), value) in MAKES_THE_RUN_DIRECTORY:
            made = []  # see test_a_value_refused_at_fit_time_makes_no_directory
        try:
            _one_error_line(rc, stderr)
            assert not made, f"made {made}"
        except AssertionError as e:
            failures.append(f"--{key}={value}: {e}")
    assert not failures, "\n".join(failures)


def test_a_value_refused_at_fit_time_makes_no_directory(project, tmp_path):
    done = _engine(
        "fit",
        "--config",
        project / "cfg.yaml",
        "--trainer.val_check_interval=50",
        cwd=tmp_path,
        script=True,
        pythonpath=project,
    )
    _one_error_line(done.returncode, done.stderr)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--seed_everything=-1"], ["seed_everything", "-1", "[0, 2**63)"]),
        ([f"--seed_everything={HUGE}"], ["seed_everything", HUGE]),
        (["--trainer.val_check_interval=50"], ["val_check_interval=50", "(4)"]),
        (["--trainer.default_root_dir=[a, b]"], ["default_root_dir", "one directory"]),
        (["--trainer.accumulate_grad_batches=" + HUGE], ["accumulate_grad_batches", HUGE]),
    ],
)
def test_the_values_the_issue_named_are_one_error_line(project, tmp_path, args, words):
    """Issue 16: these gave tracebacks, or made a directory named ``['a', 'b']``."""
    done = _engine("fit", "--config", project / "cfg.yaml", *args, cwd=tmp_path, pythonpath=project)
    _one_error_line(done.returncode, done.stderr)
    for word in words:
        assert word in done.stderr, (word, done.stderr)
    if "val_check_interval" not in args[0]:
        assert not list(tmp_path.iterdir())


def test_a_path_key_takes_a_path_not_the_text_of_a_value(project, tmp_path):
    """jsonargparse turned any value of an ``os.PathLike`` key into its ``str()``: ``null``
    became a directory named ``None``, a list in a file one named ``['a', 'b']``."""
    (tmp_path / "listed.yaml").write_text("trainer:\n  default_root_dir: [a, b]\n")
    done = _engine(
        "fit",
        "--config",
        project / "cfg.yaml",
        "--config",
        tmp_path / "listed.yaml",
        cwd=tmp_path,
        pythonpath=project,
    )
    _one_error_line(done.returncode, done.stderr)
    assert "default_root_dir" in done.stderr
    done = _engine(
        "fit",
        "--config",
        project / "cfg.yaml",
        "--trainer.default_root_dir=null",
        "--trainer.max_epochs=1",
        "--print_config",
        cwd=tmp_path,
        pythonpath=project,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["trainer"]["default_root_dir"] is None


# ------------------------------------------------------------------------- the config's bounds


def _laughs(levels: int) -> str:
    """The "billion laughs": each level a list of ten aliases of the one before."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        refs = ", ".join([f"*l{i - 1}"] * 10)
        lines.append(f"l{i}: &l{i} [{refs}]")
    return "\n".join(lines) + "\n"


def _laugh_nodes(levels: int) -> int:
    """What ``_laughs(levels)`` expands to: per level a list node holding ten of the last."""
    size = 11  # level 0: a list of ten scalars
    total = 1 + 1 + size  # the mapping, level 0's key, level 0
    for _ in range(1, levels):
        size = 1 + 10 * size
        total += 1 + size  # the key, the list
    return total


def test_yaml_nodes_counts_the_expansion_without_expanding():
    assert checks.yaml_nodes(_laughs(2)) == _laugh_nodes(2) == 1 + 1 + 11 + 1 + 111
    bomb = _laughs(9)
    assert checks.yaml_nodes(bomb) == _laugh_nodes(9) > 10**9  # counted, never built
    assert checks.yaml_nodes(bomb, limit=checks.MAX_CONFIG_NODES) == checks.MAX_CONFIG_NODES + 1
    assert checks.yaml_nodes(textwrap.dedent(_CONFIG)) < 100
    with pytest.raises(checks.ConfigTooLarge, match="contains it"):
        checks.yaml_nodes("a: &x [1, *x]")


def test_a_yaml_alias_bomb_is_refused_by_its_node_count(project, tmp_path):
    """The billion laughs took 85 s before jsonargparse's error; the bounded loader refuses it
    by counting nodes (each of its distinct nodes once), before anything is expanded."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(textwrap.dedent(_CONFIG) + "laughs:\n" + textwrap.indent(_laughs(9), "  "))
    done = _engine("fit", "--config", bomb, cwd=tmp_path, pythonpath=project)
    _one_error_line(done.returncode, done.stderr)
    assert f"more than {checks.MAX_CONFIG_NODES:,} YAML nodes" in done.stderr
    # the same bomb in a --KEY=VALUE is never expanded either
    value = "{" + _laughs(6).replace("\n", ", ").rstrip(", ") + "}"
    done = _engine(
        "fit",
        "--config",
        project / "cfg.yaml",
        f"--model.init_args={value}",
        cwd=tmp_path,
        pythonpath=project,
    )
    _one_error_line(done.returncode, done.stderr)


def test_a_config_over_the_size_limit_is_refused_before_it_is_read(project, tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(textwrap.dedent(_CONFIG) + "#" * checks.MAX_CONFIG_BYTES + "\n")
    for args in (["--config", big], [f"--config={big}"]):
        done = _engine("fit", *args, cwd=tmp_path, pythonpath=project)
        _one_error_line(done.returncode, done.stderr)
        assert f"more than the {checks.MAX_CONFIG_BYTES:,}" in done.stderr


def test_a_self_referring_alias_is_refused(project, tmp_path):
    cfg = tmp_path / "loop.yaml"
    cfg.write_text(textwrap.dedent(_CONFIG) + "loop: &x [1, *x]\n")
    done = _engine("fit", "--config", cfg, cwd=tmp_path, pythonpath=project)
    _one_error_line(done.returncode, done.stderr)
    assert "contains it" in done.stderr


# ------------------------------------------------------------------- the user's module, found


def test_fit_finds_the_users_module_in_the_current_directory(project):
    """``engine fit --config cfg.yaml`` from the directory holding the user's module, with no
    PYTHONPATH: the script's own directory is .venv/bin, yet ``cliproj`` imports, as it would
    under ``python -m engine`` or ``python script.py``."""
    done = _engine(
        "fit",
        "--config",
        "cfg.yaml",
        "--trainer.max_epochs=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_journal=false",
        "--print_config",
        cwd=project,
        script=True,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["model"]["class_path"] == "cliproj.Net"
