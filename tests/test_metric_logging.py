"""Metrics as Lightning users log them: the names they write, ``self.log``'s options,
torchmetrics objects computed over the whole epoch, and errors for what cannot be logged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.listeners import EarlyStopping, ModelCheckpoint
from engine.metrics import LogOptions


class _Rows:
    """A logger that keeps every row."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params):
        pass


QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}


def _data(n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def test_names_written_with_their_stage_are_kept_so_lightning_monitors_work(tmp_path):
    def training_step(model, batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        return loss, {"train_acc": (model(batch[0]).argmax(-1) == batch[1]).float().mean()}

    def validation_step(model, batch):
        logits = model(batch[0])
        return {
            "val_loss": F.cross_entropy(logits, batch[1]),
            "val_acc": (logits.argmax(-1) == batch[1]).float().mean(),
        }

    rows = _Rows()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1)
    task = eg.Task(training_step, optim.sgd(0.1), eval_fn=validation_step)
    trainer = eg.Trainer(
        max_epochs=2,
        logger=rows,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        callbacks=[saver, EarlyStopping(monitor="val_loss", patience=5)],
        **QUIET,
    )
    trainer.fit(task, task.init(_model()), _data(), _data(2))
    assert {"val_loss", "val_acc", "train_acc", "train/loss"} <= set(trainer.callback_metrics)
    assert "val/val_loss" not in trainer.callback_metrics
    val_losses = [r["val_loss"] for _, r in rows.rows if "val_loss" in r]
    assert saver.best_model_path and float(saver.best_model_score) == min(val_losses)
    named = set().union(*(set(r) for _, r in rows.rows))
    assert {"val_loss", "train_acc", "train_acc_epoch", "epoch"} <= named
    # every row the run logs says its epoch, as Lightning's loggers get it
    assert all("epoch" in r for _, r in rows.rows)
    assert [r["epoch"] for _, r in rows.rows if "val_loss" in r] == [0.0, 1.0]


def test_log_options_choose_step_and_epoch_rows_and_the_reduction():
    def training_step(model, batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        return loss, {"peak": loss * 2, "only_epoch": loss, "both": loss}

    rows = _Rows()
    task = eg.Task(
        training_step,
        optim.sgd(0.1),
        log_options={
            "peak": LogOptions(reduce_fx="max"),
            "only_epoch": LogOptions(on_step=False, on_epoch=True),
            "both": LogOptions(on_step=True, on_epoch=True, prog_bar=True),
        },
    )
    seen = []
    probe = eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda rec: seen.append(float(rec.outputs["loss"])))
    trainer = eg.Trainer(max_epochs=1, logger=rows, log_every_n_steps=1, callbacks=[probe], **QUIET)
    trainer.fit(task, task.init(_model()), _data())
    step_rows = [r for _, r in rows.rows if "train/peak" in r]
    assert len(step_rows) == 4
    assert all("train/only_epoch" not in r for r in step_rows)  # on_step=False
    assert all("train/both_step" in r and "train/both" not in r for r in step_rows)
    # the loss is logged under the names given it ("both", "only_epoch"), not again as
    # train/loss (Lightning logs only what self.log names)
    assert not any("train/loss" in r or "train/loss_epoch" in r for _, r in rows.rows)
    (epoch_row,) = [r for _, r in rows.rows if "train/peak_epoch" in r]
    assert epoch_row["train/peak_epoch"] == pytest.approx(2 * max(seen), rel=1e-6)  # "max"
    assert epoch_row["train/only_epoch"] == pytest.approx(sum(seen) / 4, rel=1e-6)
    assert "train/both_step" in trainer.progress_bar_metrics  # prog_bar=True


def test_a_torchmetrics_metric_is_computed_over_the_whole_epoch_and_reset():
    torchmetrics = pytest.importorskip("torchmetrics")
    auroc = torchmetrics.AUROC(task="multiclass", num_classes=3)

    def validation_step(model, batch):
        probs = model(batch[0]).softmax(-1)
        auroc.update(probs, batch[1])
        return {"val_auroc": auroc, "val_loss": F.cross_entropy(model(batch[0]), batch[1])}

    task = eg.Task(
        lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1), eval_fn=validation_step
    )
    state = task.init(_model())
    data = _data(5, seed=3)
    (result,) = eg.Trainer(logger=False, **QUIET).validate(task, state, data, verbose=False)
    # the dataset-level value, not a mean of per-batch AUROCs
    model = state.load_into(_model())
    with torch.no_grad():
        probs = torch.cat([model(x).softmax(-1) for x, _ in data])
    labels = torch.cat([y for _, y in data])
    expected = torchmetrics.functional.auroc(probs, labels, task="multiclass", num_classes=3)
    assert result["val_auroc"] == pytest.approx(float(expected), rel=1e-6)
    per_batch = [
        float(
            torchmetrics.functional.auroc(model(x).softmax(-1), y, task="multiclass", num_classes=3)
        )
        for x, y in data
    ]
    assert result["val_auroc"] != pytest.approx(sum(per_batch) / len(per_batch), rel=1e-6)
    assert auroc.update_count == 0  # reset for the next epoch


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("fast", TypeError, r"metric 'note' is a str .* cannot be logged"),
        (torch.ones(3), ValueError, r"metric 'note' is a tensor of shape \(3,\).*note\.mean\(\)"),
        ([1.0, 2.0], TypeError, r"metric 'note' is a list"),
        ({"a": 1}, TypeError, r"metric 'note' is a dict"),
    ],
)
def test_a_value_that_cannot_be_logged_is_named(value, error, match):
    task = eg.Task(lambda m, b: (F.cross_entropy(m(b[0]), b[1]), {"note": value}), optim.sgd(0.1))
    with pytest.raises(error, match=match):
        eg.Trainer(max_epochs=1, barebones=True).fit(task, task.init(_model()), _data(1))


def test_test_metrics_from_the_best_checkpoint_are_logged_after_the_fits_rows(tmp_path):
    rows = _Rows()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/loss", mode="max")
    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.5))
    trainer = eg.Trainer(
        max_epochs=4,
        logger=rows,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        callbacks=[saver],
        **QUIET,
    )
    state = trainer.fit(task, task.init(_model()), _data(), _data(2))
    assert "step=16" not in saver.best_model_path  # an earlier checkpoint is the "best" here
    trainer.test(task, state, _data(2), ckpt_path="best", verbose=False)
    steps = [step for step, _ in rows.rows]
    assert steps == sorted(steps) and "test/loss" in rows.rows[-1][1]
    assert rows.rows[-1][0] == 16  # at the step the run had reached, as Lightning logs it
    assert rows.rows[-1][1]["epoch"] == 4  # and its epoch (the fit's 4, not the best one's)


def test_metric_objects_must_give_one_number_and_collections_are_named():
    torchmetrics = pytest.importorskip("torchmetrics")
    per_class = torchmetrics.F1Score(task="multiclass", num_classes=3, average=None)

    def per_class_step(model, batch):
        per_class.update(model(batch[0]).argmax(-1), batch[1])
        return {"val_f1": per_class}

    task = eg.Task(
        lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1), eval_fn=per_class_step
    )
    with pytest.raises(ValueError, match=r"metric 'val_f1': its compute\(\) gave shape \(3,\)"):
        eg.Trainer(logger=False, **QUIET).validate(task, task.init(_model()), _data(2))
    collection = torchmetrics.MetricCollection(
        {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)}
    )
    task = eg.Task(
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"scores": collection},
    )
    with pytest.raises(TypeError, match=r"metric 'scores' is a collection.*\{\*\*collection\}"):
        eg.Trainer(logger=False, **QUIET).validate(task, task.init(_model()), _data(2))


def test_numbers_lightning_logs_are_logged_and_complex_ones_refused():
    import numpy as np

    task = eg.Task(
        lambda m, b: (F.cross_entropy(m(b[0]), b[1]), {"flag": True, "np": np.float32(2.0)}),
        optim.sgd(0.1),
    )
    trainer = eg.Trainer(max_epochs=1, logger=False, log_every_n_steps=1, **QUIET)
    trainer.fit(task, task.init(_model()), _data(1))
    assert trainer.callback_metrics["train_flag" if False else "train/flag"] == 1.0
    assert trainer.callback_metrics["train/np"] == 2.0
    assert eg.LogOptions is LogOptions  # exported where the docs name it
    bad = eg.Task(
        lambda m, b: (F.cross_entropy(m(b[0]), b[1]), {"z": torch.tensor(1 + 2j)}),
        optim.sgd(0.1),
    )
    with pytest.raises(ValueError, match="metric 'z' is a tensor complex"):
        eg.Trainer(max_epochs=1, barebones=True).fit(bad, bad.init(_model()), _data(1))


def test_the_names_a_lightning_module_logs_reach_engines_loggers_unchanged(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    import csv
    import warnings

    from engine.loggers import CSVLogger

    data = _data(4)
    loader = torch.utils.data.DataLoader(data, batch_size=None)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, i):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            self.log(
                "train_acc",
                (self.net(batch[0]).argmax(-1) == batch[1]).float().mean(),
                on_step=False,
                on_epoch=True,
                prog_bar=True,
            )
            return loss

        def validation_step(self, batch, i):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            logger=pl.loggers.CSVLogger(tmp_path / "pl"),
        ).fit(Module(), loader, loader)
    (theirs,) = (tmp_path / "pl").rglob("metrics.csv")

    def training_step(model, batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        return loss, {
            "train_loss": loss,
            "train_acc": (model(batch[0]).argmax(-1) == batch[1]).float().mean(),
        }

    task = eg.Task(
        training_step,
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"val_loss": F.cross_entropy(m(b[0]), b[1])},
        log_options={"train_acc": LogOptions(on_step=False, on_epoch=True, prog_bar=True)},
    )
    logger = CSVLogger(tmp_path / "eg")
    eg.Trainer(max_epochs=2, log_every_n_steps=1, logger=logger, **QUIET).fit(
        task, task.init(_model()), data, data
    )

    def columns(path):
        with open(path) as f:
            return set(next(csv.reader(f)))

    lightning = columns(theirs) - {"step"}  # epoch, train_loss, train_acc, val_loss
    ours = columns(logger.metrics_file)
    assert {"epoch", "train_loss", "val_loss"} <= lightning
    assert lightning <= ours, (lightning, ours)  # engine adds train/loss and its epoch mean


def _nan_after(k: int):
    """A loss that turns NaN from the step whose batch carries index ``k`` on."""

    def loss_fn(model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        return loss * float("nan") if x[0, 0].item() >= k else loss

    return loss_fn


def _indexed(n: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(8, 4, generator=g)
        x[0, 0] = i  # the batch's index, which the loss reads
        out.append((x, torch.randint(0, 3, (8,), generator=g)))
    return out


@pytest.mark.parametrize("log_every", [1, 4])
def test_a_non_finite_training_loss_is_reported_once_naming_the_step(log_every):
    import warnings

    task = eg.Task(_nan_after(5), optim.sgd(0.1))
    trainer = eg.Trainer(max_epochs=2, logger=_Rows(), log_every_n_steps=log_every, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, task.init(_model()), _indexed(10))
    reports = [w for w in caught if "non-finite" in str(w.message) or " is nan" in str(w.message)]
    assert len(reports) == 1, [str(w.message) for w in caught]
    message = str(reports[0].message)
    # read when logged: the 6th step (index 5) with every step logged, else the next logged one
    step = 6 if log_every == 1 else 8
    assert f"the training loss is nan at global_step {step} (epoch 0)" in message
    assert f"log_every_n_steps={log_every}" in message and "detect_anomaly=True" in message


def test_a_non_finite_loss_is_read_with_the_logged_values_only(monkeypatch):
    """No extra synchronisation: the loss reaches the host in the logged values' one transfer."""
    import warnings

    reads = []
    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def training_step(model, batch):
        loss = _nan_after(2)(model, batch)
        return loss, {"train_loss": loss}  # the loss logged under the user's name

    task = eg.Task(
        training_step, optim.sgd(0.1), log_options={"train_loss": LogOptions(on_epoch=False)}
    )
    trainer = eg.Trainer(
        max_epochs=1, logger=_Rows(), log_every_n_steps=2, enable_journal=False, **QUIET
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, task.init(_model()), _indexed(4))
    assert [str(w.message)[:45] for w in caught if " is nan" in str(w.message)] == [
        "the training loss is nan at global_step 4 (ep"
    ]
    # one read per logging step (2 values: loss and train_loss) and one at the epoch's end
    assert reads == [2, 2, 2]


@pytest.mark.parametrize(
    ("own", "options", "expected"),
    [
        (False, {}, {"train/loss", "train/loss_epoch"}),  # returned alone: train/loss
        (True, {}, {"train_loss", "train_loss_epoch"}),  # logged under its own name only
        (False, {"loss": LogOptions(on_step=False, on_epoch=False)}, set()),  # left out
    ],
    ids=["returned-alone", "named-by-the-user", "left-out"],
)
def test_the_returned_loss_is_logged_once_under_the_name_the_user_chose(own, options, expected):
    def training_step(model, batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        return (loss, {"train_loss": loss}) if own else loss

    rows = _Rows()
    task = eg.Task(training_step, optim.sgd(0.1), log_options=options)
    trainer = eg.Trainer(max_epochs=1, logger=rows, log_every_n_steps=1, **QUIET)
    trainer.fit(task, task.init(_model()), _data())
    assert set().union(*(set(r) for _, r in rows.rows)) - {"epoch"} == expected


def test_on_step_in_validation_and_test_logs_lightnings_rows(tmp_path):
    """``self.log(name, on_step=True)`` in validation_step and test_step, against Lightning's
    own CSV: a ``<name>_step`` row per batch, at the count of that loader's batches evaluated
    so far (a fit's validations count on across epochs), and ``<name>_epoch`` at the epoch's
    end (not the name alone). Values to float rounding (the same model and batches)."""
    pl = pytest.importorskip("pytorch_lightning")
    import csv
    import warnings

    from engine.loggers import CSVLogger

    data, val = _data(4), _data(3, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    val_loader = torch.utils.data.DataLoader(val, batch_size=None)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, i):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, i):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]), on_step=True)

        def test_step(self, batch, i):
            self.log("test_loss", F.cross_entropy(self.net(batch[0]), batch[1]), on_step=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            log_every_n_steps=100,  # no training rows: the evaluation rows are compared
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            logger=pl.loggers.CSVLogger(tmp_path / "pl"),
        )
        module = Module()
        trainer.fit(module, loader, val_loader)
        trainer.test(module, val_loader, verbose=False)
    (theirs,) = (tmp_path / "pl").rglob("metrics.csv")

    task = eg.Task(
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"val_loss": F.cross_entropy(m(b[0]), b[1])},
        test_fn=lambda m, b: {"test_loss": F.cross_entropy(m(b[0]), b[1])},
        log_options={k: LogOptions(on_step=True) for k in ("val_loss", "test_loss")},
    )
    logger = CSVLogger(tmp_path / "eg")
    ours = eg.Trainer(max_epochs=2, log_every_n_steps=100, logger=logger, **QUIET)
    state = ours.fit(task, task.init(_model()), data, val)
    ours.test(task, state, val, verbose=False)
    logger.finalize("success")

    def rows(path):
        with open(path) as f:
            out = []
            for r in csv.DictReader(f):
                kept = {k: v for k, v in r.items() if v and k.startswith(("val", "test"))}
                if kept:
                    out.append((int(r["step"]), r.get("epoch"), kept))
            return out

    lightning, engine_rows = rows(theirs), rows(logger.metrics_file)
    assert [(s, e, sorted(r)) for s, e, r in engine_rows] == [
        (s, e, sorted(r)) for s, e, r in lightning
    ]
    assert [s for s, _, r in lightning if "val_loss_step" in r] == [0, 1, 2, 3, 4, 5]
    for (_, _, a), (_, _, b) in zip(engine_rows, lightning, strict=True):
        for k in b:
            assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-6), k


def test_test_and_predict_after_a_fit_need_no_task_or_state(tmp_path):
    """As Lightning's ``trainer.test(ckpt_path="best")`` without a model: the fit's task and
    final state (the structure the checkpoint is loaded into); with no checkpoint named, the
    best one, with a warning; a Trainer that has not fit says what to pass."""
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/loss", mode="max")
    task = eg.Task(
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        optim.sgd(0.5),
        predict_fn=lambda m, b: m(b[0]),
    )
    trainer = eg.Trainer(max_epochs=4, logger=False, callbacks=[saver], **QUIET)
    final = trainer.fit(task, task.init(_model()), _data(), _data(2))
    explicit = trainer.test(task, final.copy(), _data(2), ckpt_path="best", verbose=False)
    assert trainer.test(dataloaders=_data(2), ckpt_path="best", verbose=False) == explicit
    with pytest.warns(UserWarning, match="the best checkpoint of that fit is used"):
        assert trainer.test(dataloaders=_data(2), verbose=False) == explicit
    out = trainer.predict(dataloaders=_data(1), ckpt_path="best")
    best = eg.checkpoint.load(saver.best_model_path, final.copy())
    expected = trainer.predict(task, best, _data(1))
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert final.step == 16  # the template's values were not touched: it gave the structure

    fresh = eg.Trainer(logger=False, **QUIET)
    with pytest.raises(ValueError, match=r"a checkpoint holds values, not the model's structure"):
        fresh.test(task, dataloaders=_data(2), ckpt_path=saver.best_model_path)
    with pytest.raises(ValueError, match=r"Trainer.predict\(\) needs the task"):
        fresh.predict(dataloaders=_data(1))
