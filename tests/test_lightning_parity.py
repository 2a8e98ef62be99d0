"""Lightning itself is the oracle: the same configurations through both trainers must announce
the same hooks, in the same order, with the same batch indices, ``global_step`` and
``current_epoch``, and end with the same counters.

The sequence includes ``training_step`` (the user's loss function, on engine's side) and the
hooks Lightning calls inside the step, ``on_before_backward``, ``on_after_backward`` and
``on_before_optimizer_step``: engine calls them where Lightning does, through the step transform
``engine.transforms.Observe``. ``on_before_zero_grad`` has no counterpart (a pure step has no
gradients to zero) and is dropped from Lightning's sequence.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import engine as eg
from engine import optim

pl = pytest.importorskip("pytorch_lightning")

INSIDE_THE_STEP = {"on_before_zero_grad"}
NOT_COMPARED = INSIDE_THE_STEP | {"on_save_checkpoint", "on_load_checkpoint", "on_exception"}


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _Stream(IterableDataset):
    """An iterable dataset without a length."""

    def __init__(self, n: int) -> None:
        self.data = torch.randn(n, 2, generator=torch.Generator().manual_seed(1))

    def __iter__(self):
        yield from ((x,) for x in self.data)


def _loaders(n_train=10, train_bs=2, n_val=10, val_bs=5, n_val_loaders=1, iterable=False):
    g = torch.Generator().manual_seed(0)
    train_ds = _Stream(n_train) if iterable else TensorDataset(torch.randn(n_train, 2, generator=g))
    train = DataLoader(train_ds, batch_size=train_bs)
    vals = [
        DataLoader(TensorDataset(torch.randn(n_val, 2, generator=g)), batch_size=val_bs)
        for _ in range(n_val_loaders)
    ]
    return train, (vals[0] if n_val_loaders == 1 else vals) if n_val_loaders else None


def _row(name, trainer, batch_idx=None, dataloader_idx=None):
    return (name, batch_idx, dataloader_idx, trainer.global_step, trainer.current_epoch)


# ----------------------------------------------------------------------------- Lightning side


def _lightning_run(kwargs, loaders, stop_at=None):
    _quiet()
    calls = []

    class Recorder(pl.Callback):
        pass

    def make(name):
        def hook(self, trainer, pl_module=None, *args, **kw):
            if name == "on_train_batch_start":
                calls.append(_row(name, trainer, args[1]))
            elif name == "on_train_batch_end":
                calls.append(_row(name, trainer, args[2]))
            elif name.endswith("_batch_start"):
                di = args[2] if len(args) > 2 else kw.get("dataloader_idx", 0)
                calls.append(_row(name, trainer, args[1], di))
            elif name.endswith("_batch_end"):
                di = args[3] if len(args) > 3 else kw.get("dataloader_idx", 0)
                calls.append(_row(name, trainer, args[2], di))
            else:
                calls.append(_row(name, trainer))
            if stop_at is not None and stop_at(name, trainer):
                trainer.should_stop = True

        return hook

    for name in dir(pl.Callback):
        if name.startswith("on_") or name in ("setup", "teardown"):
            setattr(Recorder, name, make(name))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            calls.append(_row("training_step", self.trainer, batch_idx))
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("v", self.layer(batch[0]).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        callbacks=[Recorder()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    train, val = loaders
    trainer.fit(Module(), train, val)
    rows = [c for c in calls if c[0] not in NOT_COMPARED]
    return rows, (trainer.global_step, trainer.current_epoch)


# ----------------------------------------------------------------------------- engine side


def _engine_run(kwargs, loaders, stop_at=None):
    calls = []

    class Recorder(eg.Listener):
        pass

    now = {}  # the trainer and the batch index, for the loss function's row

    def make(name):
        def handle(self, rec):
            t = rec.run
            if name == "on_train_batch_start":
                now.update(trainer=t, batch_idx=rec.batch_idx)
            if name.endswith("_batch_start") or name.endswith("_batch_end"):
                di = None if "train" in name else rec.dataloader_idx
                calls.append(_row(name, t, rec.batch_idx, di))
            else:
                calls.append(_row(name, t))
            if stop_at is not None and stop_at(name, t):
                return eg.Stop("test")
            return None

        return handle

    for ev in eg.Event:
        setattr(Recorder, ev.value, make(ev.value))

    def training_step(m, b):
        calls.append(_row("training_step", now["trainer"], now["batch_idx"]))
        return m(b[0]).pow(2).mean()

    task = eg.Task(
        training_step,
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"v": m(b[0]).mean()},
    )
    torch.manual_seed(0)
    state = task.init(torch.nn.Linear(2, 1))
    trainer = eg.Trainer(
        callbacks=[Recorder()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    train, val = loaders
    trainer.fit(task, state, train, val)
    rows = [c for c in calls if c[0] not in NOT_COMPARED]
    return rows, (trainer.global_step, trainer.current_epoch)


def _compare(kwargs, loader_kw=None, stop_at=None):
    loader_kw = loader_kw or {}
    theirs = _lightning_run(kwargs, _loaders(**loader_kw), stop_at)
    ours = _engine_run(kwargs, _loaders(**loader_kw), stop_at)
    assert ours[1] == theirs[1], (
        f"(global_step, current_epoch): ours {ours[1]}, Lightning {theirs[1]}"
    )
    for i, (a, b) in enumerate(zip(ours[0], theirs[0], strict=False)):
        assert a == b, f"event {i}: ours {a}, Lightning {b}"
    assert len(ours[0]) == len(theirs[0]), (len(ours[0]), len(theirs[0]))


FIT_CONFIGS = {
    "defaults-2-epochs": ({"max_epochs": 2}, {}),
    "val-twice-per-epoch-accumulate": (
        {"max_epochs": 1, "val_check_interval": 0.5, "accumulate_grad_batches": 2},
        {},
    ),
    "val-quarter": ({"max_epochs": 2, "val_check_interval": 0.25}, {}),
    "val-every-2-batches": ({"max_epochs": 2, "val_check_interval": 2}, {}),
    "val-every-3-batches-across-epochs": (
        {"max_epochs": 3, "val_check_interval": 3, "check_val_every_n_epoch": None},
        {},
    ),
    "val-every-2nd-epoch": ({"max_epochs": 4, "check_val_every_n_epoch": 2}, {}),
    "accumulate-3-partial-window": ({"max_epochs": 2, "accumulate_grad_batches": 3}, {}),
    "limit-train-int": ({"max_epochs": 2, "limit_train_batches": 3}, {}),
    "limit-train-fraction": ({"max_epochs": 2, "limit_train_batches": 0.5}, {}),
    "limit-val-int": ({"max_epochs": 1, "limit_val_batches": 1}, {}),
    "limit-val-zero": ({"max_epochs": 2, "limit_val_batches": 0}, {}),
    "max-steps-mid-epoch": ({"max_steps": 3}, {}),
    "max-steps-with-accumulation": ({"max_steps": 4, "accumulate_grad_batches": 2}, {}),
    "max-steps-and-epochs": ({"max_steps": 100, "max_epochs": 2}, {}),
    "no-sanity": ({"max_epochs": 1, "num_sanity_val_steps": 0}, {}),
    "sanity-all": ({"max_epochs": 1, "num_sanity_val_steps": -1}, {"n_val": 15}),
    "sanity-one": ({"max_epochs": 1, "num_sanity_val_steps": 1}, {}),
    "fast-dev-run": ({"fast_dev_run": True}, {}),
    "fast-dev-run-3": ({"fast_dev_run": 3}, {}),
    "overfit-batches": ({"max_epochs": 2, "overfit_batches": 2}, {}),
    "two-val-loaders": ({"max_epochs": 1}, {"n_val_loaders": 2}),
    "no-val-loader": ({"max_epochs": 2}, {"n_val_loaders": 0}),
    "iterable-train": ({"max_epochs": 2, "accumulate_grad_batches": 2}, {"iterable": True}),
    "iterable-train-val-int": (
        {"max_epochs": 2, "val_check_interval": 2, "check_val_every_n_epoch": None},
        {"iterable": True},
    ),
    "min-steps": ({"max_epochs": 1, "min_steps": 8}, {}),
}


@pytest.mark.parametrize(("kwargs", "loader_kw"), FIT_CONFIGS.values(), ids=FIT_CONFIGS.keys())
def test_fit_matches_lightning(kwargs, loader_kw):
    _compare(kwargs, loader_kw)


def _stop_after_first_validation(name, trainer):
    return name == "on_validation_end" and not trainer.sanity_checking


def _stop_at_batch(k):
    def stop(name, trainer):
        return name == "on_train_batch_end" and trainer.global_step == k

    return stop


STOP_CONFIGS = {
    "stop-at-validation": ({"max_epochs": 5}, _stop_after_first_validation),
    "stop-respects-min-epochs": (
        {"max_epochs": 5, "min_epochs": 3},
        _stop_after_first_validation,
    ),
    "stop-mid-epoch": ({"max_epochs": 5}, _stop_at_batch(2)),
    "stop-mid-epoch-min-steps": ({"max_epochs": 5, "min_steps": 7}, _stop_at_batch(2)),
    "stop-mid-epoch-val-quarter": (
        {"max_epochs": 3, "val_check_interval": 0.25},
        _stop_at_batch(3),
    ),
}


@pytest.mark.parametrize(("kwargs", "stop_at"), STOP_CONFIGS.values(), ids=STOP_CONFIGS.keys())
def test_stopping_matches_lightning(kwargs, stop_at):
    _compare(kwargs, stop_at=stop_at)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_stages_match_lightning(stage):
    _quiet()
    theirs: list[str] = []
    ours: list[str] = []

    class Recorder(pl.Callback):
        pass

    for name in dir(pl.Callback):
        if name.startswith("on_") or name in ("setup", "teardown"):
            setattr(Recorder, name, lambda self, *a, _n=name, **k: theirs.append(_n))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def validation_step(self, batch, batch_idx):
            self.log("v", self.layer(batch[0]).mean())

        def test_step(self, batch, batch_idx):
            self.log("v", self.layer(batch[0]).mean())

        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])

    loader = DataLoader(TensorDataset(torch.randn(5, 2)), batch_size=2)
    trainer = pl.Trainer(
        callbacks=[Recorder()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    kwargs = {} if stage == "predict" else {"verbose": False}
    expected = getattr(trainer, stage)(Module(), loader, **kwargs)

    class Ours(eg.Listener):
        pass

    for ev in eg.Event:
        setattr(Ours, ev.value, lambda self, rec, _n=ev.value: ours.append(_n))
    task = eg.Task(
        lambda m, b: m(b[0]).mean(),
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"v": m(b[0]).mean()},
        predict_fn=lambda m, b: m(b[0]),
    )
    ours_trainer = eg.Trainer(
        callbacks=[Ours()], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    got = getattr(ours_trainer, stage)(task, task.init(torch.nn.Linear(2, 1)), loader, **kwargs)
    assert ours == [n for n in theirs if n not in NOT_COMPARED]
    assert type(got) is type(expected) and len(got) == len(expected)
    if stage != "predict":
        assert [len(d) for d in got] == [len(d) for d in expected]


# ----------------------------------------------------------------------------- logged rows


def _csv_pairs(path):
    """The (step, name) of every non-empty cell of a metrics.csv, and its epoch cells."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    pairs = sorted((int(r["step"]), k) for r in rows for k, v in r.items() if k != "step" and v)
    return pairs, sorted({r["epoch"] for r in rows if r.get("epoch")})


def _tb_pairs(log_dir):
    """The (step, tag) of every scalar in a directory's TensorBoard event files."""
    import struct
    from pathlib import Path

    from tensorboardX.proto.event_pb2 import Event as TBEvent

    out = []
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = TBEvent.FromString(data[i + 12 : i + 12 + n])
            i += 16 + n
            out += [(ev.step, v.tag) for v in ev.summary.value if v.WhichOneof("value")]
    return sorted(out)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_logged_rows_have_lightnings_steps_names_and_integer_epochs(tmp_path, accumulate):
    """One program under both trainers: training rows every 2 steps, an on_epoch-only metric,
    validation twice an epoch, a test after the fit, the learning rate; the CSV and TensorBoard
    files must hold the same (step, name) pairs, with integer epochs."""
    import torch.nn.functional as F

    from engine.listeners import LearningRateMonitor
    from engine.loggers import CSVLogger, TensorBoardLogger

    _quiet()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 2, generator=g), torch.randn(24, 1, generator=g))
    loader = DataLoader(data, batch_size=4)
    flags = {
        "max_epochs": 2,
        "log_every_n_steps": 2,
        "val_check_interval": 3,
        "accumulate_grad_batches": accumulate,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss)
            self.log("train_mae", F.l1_loss(self.layer(batch[0]), batch[1]), on_epoch=True)
            self.log("train_size", float(len(batch[0])), on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

        def test_step(self, batch, batch_idx):
            self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl_trainer = pl.Trainer(
        logger=[
            pl.loggers.CSVLogger(tmp_path / "pl_csv"),
            pl.loggers.TensorBoardLogger(tmp_path / "pl_tb", default_hp_metric=False),
        ],
        callbacks=[pl.callbacks.LearningRateMonitor()],
        **flags,
    )
    module = Module()
    pl_trainer.fit(module, loader, loader)
    # Lightning's TensorBoardLogger reopens its writer for the test in the same second, whose
    # event file then replaces the fit's: its fit's rows are read before
    tb_theirs = _tb_pairs(tmp_path / "pl_tb")
    pl_trainer.test(module, loader, verbose=False)

    def training_step(m, b):
        loss = F.mse_loss(m(b[0]), b[1])
        return loss, {
            "train_loss": loss,
            "train_mae": F.l1_loss(m(b[0]), b[1]),
            "train_size": float(len(b[0])),
        }

    task = eg.Task(
        training_step,
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"val_loss": F.mse_loss(m(b[0]), b[1])},
        test_fn=lambda m, b: {"test_loss": F.mse_loss(m(b[0]), b[1])},
        lr=0.1,
        log_options={
            "train_loss": eg.LogOptions(on_epoch=False),
            "train_mae": eg.LogOptions(on_step=True, on_epoch=True),
            "train_size": eg.LogOptions(on_step=False, on_epoch=True),
        },
    )
    csv_logger = CSVLogger(tmp_path / "eg_csv")
    trainer = eg.Trainer(
        logger=[csv_logger, TensorBoardLogger(tmp_path / "eg_tb")],
        callbacks=[LearningRateMonitor()],
        default_root_dir=tmp_path,
        **{k: v for k, v in flags.items() if k != "enable_checkpointing"},
    )
    torch.manual_seed(0)
    state = trainer.fit(task, task.init(torch.nn.Linear(2, 1)), loader, loader)
    tb_ours = _tb_pairs(tmp_path / "eg_tb")
    trainer.test(task, state, loader, verbose=False)

    (theirs,) = (tmp_path / "pl_csv").rglob("metrics.csv")
    lightning, lightning_epochs = _csv_pairs(theirs)
    ours, our_epochs = _csv_pairs(csv_logger.metrics_file)
    assert lightning_epochs == ["0", "1", "2"]  # the test's row: after the fit's 2 epochs
    assert our_epochs == lightning_epochs
    # every row as Lightning writes it; the rate once per step where Lightning writes it at
    # each micro-batch of an accumulation window (and again at the epoch's start)
    assert [p for p in ours if p[1] != "lr-SGD"] == [p for p in lightning if p[1] != "lr-SGD"]
    assert sorted(set(ours)) == sorted(set(lightning))
    assert tb_theirs  # the fit's rows
    assert [p for p in tb_ours if p[1] != "lr-SGD"] == [p for p in tb_theirs if p[1] != "lr-SGD"]
    assert sorted(set(tb_ours)) == sorted(set(tb_theirs))
    # and the test's rows too: every row of the CSV, each of its values a scalar
    assert sorted(set(_tb_pairs(tmp_path / "eg_tb"))) == sorted(set(lightning))
