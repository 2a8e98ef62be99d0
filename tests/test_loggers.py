"""Loggers: run directories, what lands on disk, and reading it back with independent readers.

TensorBoard event files are parsed here record by record (TFRecord framing, CRCs checked) into
tensorboardX's protobuf classes; ``hparams.yaml`` is read back with PyYAML when it is installed.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import struct
import warnings
from typing import Any

import _procs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.loggers import CSVLogger, Logger, TensorBoardLogger
from engine.loggers.base import flatten_params, next_version, to_yaml

# ---------------------------------------------------------------------- readers


def _records(path: str) -> list[bytes]:
    """The payloads of a TFRecord file, with both masked CRC-32Cs verified."""
    from tensorboardX.record_writer import masked_crc32c

    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i : i + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", data[i + 8 : i + 12])
        assert len_crc == masked_crc32c(header)
        payload = data[i + 12 : i + 12 + length]
        (data_crc,) = struct.unpack("<I", data[i + 12 + length : i + 16 + length])
        assert data_crc == masked_crc32c(payload)
        out.append(payload)
        i += 16 + length
    return out


def _events(log_dir: str) -> list[Any]:
    from tensorboardX.proto.event_pb2 import Event

    files = sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))
    assert files, f"no event file in {log_dir}"
    return [Event.FromString(r) for path in files for r in _records(path)]


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for ev in _events(log_dir):
        for v in ev.summary.value:
            if v.WhichOneof("value") == "simple_value":
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def _plugin(log_dir: str, tag: str) -> Any:
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    found = [
        HParamsPluginData.FromString(v.metadata.plugin_data.content)
        for ev in _events(log_dir)
        for v in ev.summary.value
        if v.tag == tag
    ]
    assert found, f"no {tag} record"
    assert all(v for v in found)
    return found[-1]


def _csv_rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


# ---------------------------------------------------------------------- run directories


@pytest.mark.parametrize("cls", [CSVLogger, TensorBoardLogger])
def test_versions_follow_lightnings_layout(tmp_path, cls):
    first = cls(tmp_path)
    assert first.version == 0
    assert first.log_dir == os.path.join(tmp_path, "lightning_logs", "version_0")
    os.makedirs(os.path.join(tmp_path, "lightning_logs", "version_3"))
    os.makedirs(os.path.join(tmp_path, "lightning_logs", "version_x"))  # not a version
    open(os.path.join(tmp_path, "lightning_logs", "version_9"), "w").close()  # a file
    assert cls(tmp_path).version == 4
    assert cls(tmp_path, name="exp", version=7).log_dir == os.path.join(
        tmp_path, "exp", "version_7"
    )
    assert cls(tmp_path, version="run-a").log_dir == os.path.join(
        tmp_path, "lightning_logs", "run-a"
    )
    assert cls(tmp_path, name=None, version=2).log_dir == os.path.join(tmp_path, "version_2")
    assert cls(tmp_path, name="").name == ""


@pytest.mark.parametrize(
    ("version", "error", "match"),
    [
        (-1, ValueError, "-1"),
        ("", ValueError, "empty"),
        (1.5, TypeError, "float 1.5"),
        (True, TypeError, "True"),
    ],
)
def test_bad_versions_are_rejected(tmp_path, version, error, match):
    with pytest.raises(error, match=match):
        CSVLogger(tmp_path, version=version)


def test_loggers_built_together_share_a_run_and_the_next_pair_gets_a_new_one(tmp_path):
    pair = [TensorBoardLogger(tmp_path), CSVLogger(tmp_path)]
    for lg in pair:
        lg.log_metrics({"train/loss": 1.0}, step=0)
        lg.finalize("success")
    assert pair[0].log_dir == pair[1].log_dir
    assert sorted(os.listdir(os.path.join(tmp_path, "lightning_logs"))) == ["version_0"]
    assert TensorBoardLogger(tmp_path).version == CSVLogger(tmp_path).version == 1
    assert next_version(os.path.join(tmp_path, "missing")) == 0


def test_building_a_logger_writes_nothing(tmp_path):
    TensorBoardLogger(tmp_path)
    CSVLogger(tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_logger_must_implement_log_metrics(tmp_path):
    class Incomplete(Logger):
        pass

    with pytest.raises(NotImplementedError, match="Incomplete"):
        Incomplete(tmp_path).log_metrics({"a": 1.0}, 0)


# ---------------------------------------------------------------------- CSV


def test_csv_rows_have_a_step_column_and_the_union_of_metric_columns(tmp_path):
    lg = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    lg.log_metrics({"train/loss": 0.5}, step=0)
    assert not os.path.exists(lg.metrics_file)  # buffered until (step + 1) % 2 == 0
    lg.log_metrics({"train/loss": 0.25}, step=1)
    header, rows = _csv_rows(lg.metrics_file)
    assert header == ["step", "train/loss"] and len(rows) == 2
    # a new column after the file was written: the header is widened, old rows kept
    lg.log_metrics({"val/acc": 0.75, "lr": 0.1}, step=2)
    lg.log_metrics({"train/loss": 0.125}, step=2)
    lg.finalize("success")
    header, rows = _csv_rows(lg.metrics_file)
    assert header == ["step", "lr", "train/loss", "val/acc"]
    assert rows == [
        {"step": "0", "lr": "", "train/loss": "0.5", "val/acc": ""},
        {"step": "1", "lr": "", "train/loss": "0.25", "val/acc": ""},
        {"step": "2", "lr": "0.1", "train/loss": "", "val/acc": "0.75"},
        {"step": "2", "lr": "", "train/loss": "0.125", "val/acc": ""},
    ]


def test_csv_rows_without_a_step_are_numbered_in_order_across_flushes(tmp_path):
    lg = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    for v in (1.0, 2.0, 3.0):
        lg.log_metrics({"m": v})
    lg.save()
    assert [r["step"] for r in _csv_rows(lg.metrics_file)[1]] == ["0", "1", "2"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=5))
def test_csv_values_read_back_exactly(tmp_path_factory, values):
    lg = CSVLogger(tmp_path_factory.mktemp("csv"))
    for step, v in enumerate(values):
        lg.log_metrics({"m": v}, step)
    lg.save()
    _, rows = _csv_rows(lg.metrics_file)
    assert [float(r["m"]) for r in rows] == values


def test_csv_accepts_tensors_and_names_a_bad_metric(tmp_path):
    lg = CSVLogger(tmp_path)
    lg.log_metrics({"a": torch.tensor(0.5), "b": torch.tensor([2.0])}, step=0)
    lg.save()
    assert _csv_rows(lg.metrics_file)[1] == [{"step": "0", "a": "0.5", "b": "2.0"}]
    with pytest.raises(TypeError, match=r"'c'.*str"):
        lg.log_metrics({"c": "high"}, step=1)
    with pytest.raises(TypeError, match="'d'"):
        lg.log_metrics({"d": torch.ones(3)}, step=1)
    with pytest.raises(ValueError, match="'step'"):
        lg.log_metrics({"step": 1.0}, step=1)
    with pytest.raises(ValueError, match="0"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_csv_replaces_an_old_metrics_file_with_a_warning(tmp_path):
    lg = CSVLogger(tmp_path, version=0)
    lg.log_metrics({"old": 1.0}, 0)
    lg.save()
    again = CSVLogger(tmp_path, version=0)
    again.log_metrics({"new": 2.0}, 0)
    with pytest.warns(UserWarning, match="metrics.csv"):
        again.save()
    assert _csv_rows(again.metrics_file) == (["step", "new"], [{"step": "0", "new": "2.0"}])


def test_csv_hparams_yaml_reads_back(tmp_path):
    yaml = pytest.importorskip("yaml")
    lg = CSVLogger(tmp_path)
    params = {
        "lr": 1e-05,
        "name": "run: #1 'quoted' \"double\"",
        "model": {"width": 64, "act": "relu", "dropout": None, "layers": [8, 16]},
        "flags": {"amp": True, "yes": False},
        "schedule": float("inf"),
    }
    lg.log_hyperparams(params)
    lg.log_hyperparams({"seed": 3})  # merged, file rewritten
    with open(os.path.join(lg.log_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f) == {**params, "seed": 3}


_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
_scalars_st = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text
_trees = st.recursive(
    _scalars_st,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_text, _trees, max_size=4))
def test_to_yaml_round_trips_through_a_yaml_parser(data):
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(to_yaml(data)) == (data or {})


def test_to_yaml_writes_nan_tuples_tensors_and_other_objects():
    yaml = pytest.importorskip("yaml")
    loaded = yaml.safe_load(
        to_yaml({"nan": math.nan, "t": (1, 2), "x": torch.tensor(3), "o": object})
    )
    assert math.isnan(loaded["nan"]) and loaded["t"] == [1, 2] and loaded["x"] == 3
    assert loaded["o"] == "<class 'object'>"
    with pytest.raises(TypeError, match="list"):
        to_yaml([1, 2])  # type: ignore[arg-type]


def test_flatten_params_joins_nested_keys():
    assert flatten_params({"a": {"b": {"c": 1}, "d": {}}, "e": 2}) == {
        "a/b/c": 1,
        "a/d": {},
        "e": 2,
    }


# ---------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_round_trip(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    for step in range(3):
        lg.log_metrics({"train/loss": 1.0 / (step + 1), "lr": torch.tensor(0.5)}, step=step)
    lg.log_metrics({"val/acc": 0.75}, step=2)
    lg.finalize("success")
    scalars = _scalars(lg.log_dir)
    assert scalars["train/loss"] == [
        (0, 1.0),
        (1, pytest.approx(0.5)),
        (2, pytest.approx(1 / 3, rel=1e-6)),
    ]
    assert scalars["lr"] == [(0, 0.5), (1, 0.5), (2, 0.5)]
    assert scalars["val/acc"] == [(2, 0.75)]
    with pytest.raises(TypeError, match="'bad'"):
        TensorBoardLogger(tmp_path).log_metrics({"bad": "x"}, step=0)


def test_tensorboard_hparams_reach_the_hparams_plugin_and_yaml(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    lg.log_hyperparams({"lr": 0.1, "opt": {"name": "adamw", "amsgrad": False}, "fn": len})
    lg.log_metrics({"train/loss": 0.5}, step=1)
    lg.finalize("success")
    start = _plugin(lg.log_dir, "_hparams_/session_start_info").session_start_info
    hp = start.hparams
    assert hp["lr"].number_value == pytest.approx(0.1)
    assert hp["opt/name"].string_value == "adamw"
    assert hp["opt/amsgrad"].bool_value is False and hp["opt/amsgrad"].HasField("bool_value")
    assert hp["fn"].string_value == "<built-in function len>"
    end = _plugin(lg.log_dir, "_hparams_/session_end_info").session_end_info
    from tensorboardX.proto.api_pb2 import Status

    assert end.status == Status.Value("STATUS_SUCCESS")
    assert os.path.isfile(os.path.join(lg.log_dir, "hparams.yaml"))


def test_tensorboard_hparams_with_metrics_declare_an_experiment(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    lg.log_hyperparams({"lr": 0.1}, metrics={"hp/val_loss": 1.0})
    lg.finalize("failed")
    experiment = _plugin(lg.log_dir, "_hparams_/experiment").experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["hp/val_loss"]
    assert _scalars(lg.log_dir)["hp/val_loss"] == [(0, 1.0)]
    from tensorboardX.proto.api_pb2 import Status

    end = _plugin(lg.log_dir, "_hparams_/session_end_info").session_end_info
    assert end.status == Status.Value("STATUS_FAILURE")


def test_tensorboard_logging_after_finalize_reopens_a_writer(tmp_path):
    lg = TensorBoardLogger(tmp_path, flush_secs=3600)
    lg.log_metrics({"a": 1.0}, step=0)
    lg.save()
    lg.finalize("success")
    assert _scalars(lg.log_dir)["a"] == [(0, 1.0)]
    lg.log_metrics({"a": 2.0}, step=1)  # a fresh writer, a second event file
    lg.finalize("success")
    assert _scalars(lg.log_dir)["a"] == [(0, 1.0), (1, 2.0)]


# ---------------------------------------------------------------------- several loggers


def test_several_loggers_receive_the_same_metrics(tmp_path):
    from test_listeners import FakeFit, _Task  # the fake driver (tests/ is on sys.path)

    from engine.listeners import LearningRateMonitor

    loggers = [TensorBoardLogger(tmp_path, name="exp"), CSVLogger(tmp_path, name="exp")]
    fit = FakeFit(
        [LearningRateMonitor()],
        max_epochs=1,
        num_training_batches=3,
        loggers=loggers,
        task=_Task(lambda step: 0.5**step),
    )
    fit.fit()
    for lg in loggers:
        lg.finalize("success")
    assert _scalars(loggers[0].log_dir)["lr-SGD"] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    header, rows = _csv_rows(loggers[1].metrics_file)
    assert header == ["step", "lr-SGD"]
    expected = [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert [(int(r["step"]), float(r["lr-SGD"])) for r in rows] == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loggers[1].finalize("success")  # a second finalize is harmless


# ---------------------------------------------------------------------- full disks


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a real 64 KiB tmpfs (skipped where this machine refuses ``mount``)."""

    where = tmp_path / "disk"
    where.mkdir()
    done = _procs.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield where
    _procs.run(["umount", str(where)], check=True)


def _fill(where, leave: int) -> None:
    """Fill the file system of ``where`` but for about ``leave`` bytes."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, os.path.getsize(filler) - leave))


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _parsed(path):
    """Every line of a metrics.csv, parsed; each must have the header's cells (none torn)."""
    with open(path, newline="") as f:
        text = f.read()
    assert text.endswith("\n"), text[-80:]
    rows = list(csv.reader(text.splitlines()))
    assert all(len(r) == len(rows[0]) for r in rows), rows
    return rows


def test_csv_on_a_full_disk_says_so_and_keeps_whole_rows(small_disk):
    lg = CSVLogger(small_disk, flush_logs_every_n_steps=1)
    lg.log_metrics({"train/loss": 0.5}, step=0)
    _fill(small_disk, leave=4096)
    with pytest.raises(OSError, match=r"metrics\.csv: the disk is full") as caught:
        for step in range(1, 10_000):
            lg.log_metrics({"train/loss": 1.0 / step, "pad": 1e300 * step}, step=step)
    assert str(lg.metrics_file) in str(caught.value)
    rows = _parsed(lg.metrics_file)
    assert rows[0] == ["step", "pad", "train/loss"]
    assert [int(r[0]) for r in rows[1:]] == list(range(len(rows) - 1))  # written rows kept
    os.remove(small_disk / "filler")  # space again: the buffered rows are written next time
    lg.save()
    assert len(_parsed(lg.metrics_file)) > len(rows)


def _failing_open(monkeypatch, when):
    """Writes to the files ``when(path)`` says fail as a full disk does: half the bytes are
    written, then ``ENOSPC`` (the loggers write through ``os.write``)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell which file a descriptor writes")
    real = os.write

    def write(fd, data):
        if when(os.readlink(f"/proc/self/fd/{fd}")):
            real(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("wider", [False, True], ids=["append", "rewrite-wider-header"])
def test_csv_write_failing_midway_leaves_what_was_written(tmp_path, monkeypatch, wider):
    lg = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    lg.log_metrics({"a": 1.0}, step=0)
    lg.log_metrics({"a": 2.0}, step=1)
    before = _read(lg.metrics_file)
    _failing_open(monkeypatch, lambda path: "metrics.csv" in path)
    with pytest.raises(OSError, match=r"could not write .*metrics\.csv: the disk is full"):
        lg.log_metrics({"a": 3.0, **({"b": 4.0} if wider else {})}, step=2)
    assert _read(lg.metrics_file) == before  # no torn line, nothing lost
    assert os.listdir(lg.log_dir) == ["metrics.csv"]  # no temporary file left
    monkeypatch.undo()
    lg.save()  # the row is still buffered: written once the disk has room
    assert [r[0] for r in _parsed(lg.metrics_file)[1:]] == ["0", "1", "2"]


@pytest.mark.parametrize("cls", [CSVLogger, TensorBoardLogger])
def test_hparams_yaml_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch, cls):
    lg = cls(tmp_path)
    lg.log_hyperparams({"lr": 0.1})
    path = os.path.join(lg.log_dir, "hparams.yaml")
    before = _read(path)
    _failing_open(monkeypatch, lambda p: "hparams.yaml" in p)
    with pytest.raises(OSError, match=r"hparams\.yaml: the disk is full"):
        lg.log_hyperparams({"lr": 0.2, "model": "wide"})
    assert _read(path) == before
    assert not os.path.exists(path + ".tmp")
    lg.finalize("success")


# ---------------------------------------------------------------------- two runs at once


def test_a_version_another_process_took_meanwhile_is_not_shared(tmp_path):
    pair = [CSVLogger(tmp_path), TensorBoardLogger(tmp_path)]  # both chose version_0
    assert [lg.version for lg in pair] == [0, 0]
    os.makedirs(tmp_path / "lightning_logs" / "version_0")  # ... and another run took it
    assert pair[0].claim().endswith("version_1")
    assert pair[1].claim().endswith("version_1")  # loggers of one run still share theirs
    for lg in pair:
        lg.log_metrics({"a": 1.0}, step=0)
        lg.finalize("success")
    assert sorted(os.listdir(tmp_path / "lightning_logs" / "version_0")) == []
    assert "metrics.csv" in os.listdir(pair[0].log_dir)
    explicit = CSVLogger(tmp_path, version=0)  # a version asked for is the one used
    assert explicit.claim().endswith("version_0")


_CONCURRENT_FIT = """
import os, sys, time, torch
import torch.nn.functional as F
import engine as eg
from engine import optim
from engine.loggers import CSVLogger

root, me = sys.argv[1], sys.argv[2]
task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1), hparams={"me": me})
trainer = eg.Trainer(
    max_epochs=1, logger=CSVLogger(root), default_root_dir=root, log_every_n_steps=1,
    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
)
open(os.path.join(root, f"ready-{me}"), "w").close()  # both built: both chose version_0
while not all(os.path.exists(os.path.join(root, f"ready-{p}")) for p in ("a", "b")):
    time.sleep(0.01)
data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(5)]
trainer.fit(task, task.init(torch.nn.Linear(2, 1)), data)
print(trainer.loggers[0].version)
"""


def test_two_processes_fitting_at_once_get_their_own_versions(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "fit.py"
    script.write_text(_CONCURRENT_FIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        _procs.Popen(
            [sys.executable, str(script), str(tmp_path), me],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for me in ("a", "b")
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert sorted(int(out.split()[-1]) for out, _ in outs) == [0, 1]
    owners = []
    for version in ("version_0", "version_1"):
        run = tmp_path / "lightning_logs" / version
        rows = _parsed(run / "metrics.csv")
        step, loss = rows[0].index("step"), rows[0].index("train/loss")
        # one run's rows, not two interleaved
        assert [r[step] for r in rows[1:] if r[loss]] == ["0", "1", "2", "3", "4"]
        (owner,) = [ln for ln in _read(run / "hparams.yaml").splitlines() if ln.startswith("me:")]
        owners.append(owner)
        # the journal is in the run's own directory too: one run's lines
        lines = [json.loads(ln) for ln in _read(run / "journal.jsonl").splitlines()]
        steps = [line["step"] for line in lines if "loss" in line]
        assert steps == [1, 2, 3, 4, 5], steps
        assert all(version in line["checkpoint"] for line in lines if "checkpoint" in line)
    assert sorted(owners) == ['me: "a"', 'me: "b"']


def test_a_torchrun_restart_claims_its_first_attempts_version(tmp_path, monkeypatch):
    """Under torchrun, a ``version=None`` directory records the run's TORCHELASTIC_RUN_ID; an
    attempt after a restart (TORCHELASTIC_RESTART_COUNT > 0) of the same run continues in it,
    so the default ModelCheckpoint directory under it holds the checkpoint to resume from.
    Another run, a first attempt, or no torchrun: the next free version, as before."""
    import engine.loggers.base as base

    def claim(run_id: str | None, restart: int | None) -> int:
        monkeypatch.setattr(base, "_CLAIMED", set())  # a new process: nothing claimed yet
        for var, value in (
            ("TORCHELASTIC_RUN_ID", run_id),
            ("TORCHELASTIC_RESTART_COUNT", restart),
        ):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, str(value))
        lg = CSVLogger(tmp_path)
        lg.claim()
        return lg.version

    assert claim("job-a", 0) == 0
    assert (tmp_path / "lightning_logs/version_0" / base.ELASTIC_RUN_FILE).read_text() == "job-a"
    assert claim("job-a", 1) == 0  # the restart: the first attempt's directory
    assert claim("job-a", 2) == 0
    assert claim("job-b", 1) == 1  # another run's restart with nothing of its own: a new one
    assert claim("job-a", 0) == 2  # a new run that reuses the id starts a new directory
    assert claim("job-a", 1) == 2  # and its restarts continue there, the newest
    assert claim(None, None) == 3  # outside torchrun: today's behaviour
    assert not (tmp_path / "lightning_logs/version_3" / base.ELASTIC_RUN_FILE).exists()
