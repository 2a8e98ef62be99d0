"""Lightning's DataModule protocol, with a real ``pytorch_lightning.LightningDataModule``
subclass run by Lightning's Trainer and by engine's side by side."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim

pl = pytest.importorskip("pytorch_lightning")

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


class Digits(pl.LightningDataModule):
    """A LightningDataModule as a Lightning user writes one: data made in prepare_data, split
    in setup(stage), one loader per stage; it records every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup({getattr(stage, 'value', stage)})")  # Lightning: a str enum
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)
        if stage in ("fit", "validate"):
            self.train_set = TensorDataset(x[:32], y[:32])
            self.val_set = TensorDataset(x[32:], y[32:])
        if stage in ("test", "predict"):
            self.test_set = TensorDataset(x[32:], y[32:])

    def train_dataloader(self) -> DataLoader:
        self.calls.append("train_dataloader")
        return DataLoader(self.train_set, batch_size=8)

    def val_dataloader(self) -> DataLoader:
        self.calls.append("val_dataloader")
        return DataLoader(self.val_set, batch_size=8)

    def test_dataloader(self) -> DataLoader:
        self.calls.append("test_dataloader")
        return DataLoader(self.test_set, batch_size=8)

    def predict_dataloader(self) -> DataLoader:
        self.calls.append("predict_dataloader")
        return DataLoader(self.test_set, batch_size=8)

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown({getattr(stage, 'value', stage)})")


def _hooks(calls: list[str]) -> list[str]:
    return [c for c in calls if not c.endswith("_dataloader")]


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def training_step(self, batch, i):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, i):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def test_step(self, batch, i):
        self.log("test_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def predict_step(self, batch, i):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning_calls() -> list[str]:
    dm, module = Digits(), _Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_epochs=1, accelerator="cpu", **QUIET)
        trainer.fit(module, datamodule=dm)
        trainer.validate(module, datamodule=dm, verbose=False)
        trainer.test(module, datamodule=dm, verbose=False)
        trainer.predict(module, datamodule=dm)
    return dm.calls


def _engine_calls() -> list[str]:
    def loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    dm = Digits()
    task = eg.Task(loss, optim.sgd(0.1), predict_fn=lambda m, b: m(b[0]))
    trainer = eg.Trainer(max_epochs=1, **QUIET)
    state = trainer.fit(task, task.init(nn.Linear(4, 3)), datamodule=dm)
    trainer.validate(task, state, datamodule=dm, verbose=False)
    trainer.test(task, state, datamodule=dm, verbose=False)
    out = trainer.predict(task, state, datamodule=dm)
    assert out is not None and len(out) == 2
    return dm.calls


def test_a_lightning_datamodule_gets_lightnings_hooks_at_lightnings_points():
    theirs, ours = _lightning_calls(), _engine_calls()
    assert ours == theirs  # loaders included: validation's first, for the sanity check
    assert _hooks(ours) == _hooks(theirs)
    assert _hooks(ours) == [
        "prepare_data",
        "setup(fit)",
        "teardown(fit)",
        "prepare_data",
        "setup(validate)",
        "teardown(validate)",
        "prepare_data",
        "setup(test)",
        "teardown(test)",
        "prepare_data",
        "setup(predict)",
        "teardown(predict)",
    ]
    # each loader is asked for after its stage's setup and before its teardown
    for calls in (theirs, ours):
        for loader, stage in (("train", "fit"), ("test", "test"), ("predict", "predict")):
            i = calls.index(f"{loader}_dataloader")
            assert calls.index(f"setup({stage})") < i < calls.index(f"teardown({stage})")
    assert sorted(set(ours)) == sorted(set(theirs))


def test_a_datamodule_without_a_loader_for_a_stage_is_told_so():
    class TrainOnly(pl.LightningDataModule):
        def train_dataloader(self):
            return [(torch.randn(4, 4), torch.randint(0, 3, (4,)))]

    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1))
    trainer = eg.Trainer(max_epochs=1, **QUIET)
    state = trainer.fit(task, task.init(nn.Linear(4, 3)), datamodule=TrainOnly())
    assert state.step == 1  # no val_dataloader override: no validation, as Lightning
    with pytest.raises(ValueError, match=r"test_dataloader\(\)"):
        trainer.test(task, state, datamodule=TrainOnly())


def test_a_loader_that_reads_what_setup_did_not_make_names_the_setup_call():
    class Forgetful:
        def setup(self, stage):
            if stage == "fit":
                self.train = [(torch.randn(4, 4), torch.randint(0, 3, (4,)))]

        def train_dataloader(self):
            return self.train

        def test_dataloader(self):
            return self.test_set  # setup("test") never makes it

    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1))
    trainer = eg.Trainer(max_epochs=1, **QUIET)
    state = trainer.fit(task, task.init(nn.Linear(4, 3)), datamodule=Forgetful())
    with pytest.raises(AttributeError, match=r"test_dataloader\(\) failed.*setup\('test'\)"):
        trainer.test(task, state, datamodule=Forgetful())


def test_a_datamodule_passed_positionally_is_set_up_too():
    dm = Digits()
    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1))
    eg.Trainer(max_epochs=1, **QUIET).fit(task, task.init(nn.Linear(4, 3)), dm)
    assert _hooks(dm.calls) == ["prepare_data", "setup(fit)", "teardown(fit)"]


def test_a_datamodules_state_dict_travels_in_checkpoints_and_is_restored(tmp_path):
    class Counting(Digits):
        def __init__(self):
            super().__init__()
            self.epochs_served = 0

        def train_dataloader(self):
            self.epochs_served += 1
            return super().train_dataloader()

        def state_dict(self):
            return {"epochs_served": self.epochs_served}

        def load_state_dict(self, state):
            self.epochs_served = state["epochs_served"] + 100  # marks that it was called

    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1))
    flags = {**QUIET, "enable_checkpointing": True}
    first = eg.Trainer(max_epochs=2, default_root_dir=tmp_path, **flags)
    first.fit(task, task.init(nn.Linear(4, 3)), datamodule=Counting())
    first.save_checkpoint(tmp_path / "c")
    assert eg.checkpoint.read_meta(tmp_path / "c")["extra"]["datamodule"] == {"epochs_served": 1}
    resumed = Counting()
    eg.Trainer(max_epochs=3, default_root_dir=tmp_path, **flags).fit(
        task, task.init(nn.Linear(4, 3)), datamodule=resumed, ckpt_path=tmp_path / "c"
    )
    assert resumed.epochs_served == 102  # restored (1 + 100), then asked for its loader


def test_a_lightning_datamodule_reads_the_trainer_as_it_does_under_lightning():
    seen = []

    class Reads(Digits):
        def setup(self, stage):
            seen.append(
                (self.trainer.max_epochs, self.trainer.world_size, self.trainer.global_rank)
            )
            super().setup(stage)

    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.sgd(0.1))
    eg.Trainer(max_epochs=2, **QUIET).fit(task, task.init(nn.Linear(4, 3)), datamodule=Reads())
    assert seen == [(2, 1, 0)]
