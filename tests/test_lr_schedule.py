"""Learning rates driven by what training observes: ``ReduceLROnPlateau`` and per-epoch
schedules, against torch's schedulers and Lightning's stepping, resumed and replayed."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.listeners import LearningRateSchedule, ReduceLROnPlateau

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
}

SCORES = [1.0, 0.9, 0.95, 0.95, 0.96, 0.94, 0.97, 0.5, 0.5, 0.5, 0.51, 0.52, 0.53, 0.4]


class _Scores(eg.Listener):
    """Logs a given value of ``score`` at the end of each validation: the monitored metric."""

    def __init__(self, scores):
        self.scores = scores

    def on_validation_end(self, rec):
        return eg.Log({"score": self.scores[rec.run.current_epoch]})


class _Lrs(eg.Listener):
    def __init__(self):
        self.lrs = []

    def on_train_epoch_start(self, rec):
        self.lrs.append(optim.get_hyperparams(rec.state.opt_state)["lr"])


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(n: int = 3):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(n)
    ]


def _loader(batches):
    """The batches as a DataLoader, which Lightning wants (a plain list reads as many loaders)."""
    return torch.utils.data.DataLoader(batches, batch_size=None)


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _task(lr: float = 0.1) -> eg.Task:
    return eg.Task(_loss, optim.inject_hyperparams(optim.sgd)(lr=lr))


def _torch_lrs(scores, **kwargs):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kwargs)
    lrs = []
    for score in scores:
        lrs.append(opt.param_groups[0]["lr"])
        plateau.step(score)
    return lrs


@pytest.mark.parametrize(
    "kwargs",
    [
        {"patience": 1},
        {"patience": 0, "factor": 0.5, "cooldown": 2},
        {"mode": "max", "patience": 1, "threshold_mode": "abs", "threshold": 0.01},
        {"patience": 0, "factor": 0.1, "min_lr": 2e-3},
        {"patience": 2, "threshold": 0.2},
    ],
)
def test_plateau_lrs_follow_torchs_reduce_lr_on_plateau(kwargs):
    probe = _Lrs()
    trainer = eg.Trainer(
        max_epochs=len(SCORES),
        callbacks=[_Scores(SCORES), ReduceLROnPlateau("score", **kwargs), probe],
        **QUIET,
    )
    trainer.fit(_task(), _task().init(_model()), _data(), _data(1))
    assert probe.lrs == _torch_lrs(SCORES, **kwargs)


def test_plateau_steps_at_the_epoch_lightning_steps_it():
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()
            self.lrs = []

        def training_step(self, batch, i):
            return _loss(self.net, batch)

        def validation_step(self, batch, i):
            self.log("score", SCORES[self.current_epoch])

        def on_train_epoch_start(self):
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
            config = {"scheduler": plateau, "monitor": "score", "interval": "epoch", "frequency": 2}
            return {"optimizer": opt, "lr_scheduler": config}

    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_epochs=len(SCORES), accelerator="cpu", **QUIET).fit(
            module, _loader(_data()), _loader(_data(1))
        )
    probe = _Lrs()
    plateau = ReduceLROnPlateau("score", patience=1, frequency=2)
    eg.Trainer(max_epochs=len(SCORES), callbacks=[_Scores(SCORES), plateau, probe], **QUIET).fit(
        _task(), _task().init(_model()), _data(), _data(1)
    )
    assert probe.lrs == module.lrs and min(module.lrs) < 0.1


def test_a_per_epoch_schedule_follows_a_torch_scheduler_stepped_per_epoch():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    expected = []
    for epoch in range(8):
        expected.append(opt.param_groups[0]["lr"])
        if (epoch + 1) % 2 == 0:  # Lightning's frequency=2
            step_lr.step()
    probe = _Lrs()
    schedule = LearningRateSchedule(optim.step_lr(0.1, 2, 0.5), frequency=2)
    eg.Trainer(max_epochs=8, callbacks=[schedule, probe], **QUIET).fit(
        _task(), _task().init(_model()), _data()
    )
    assert probe.lrs == pytest.approx(expected, rel=1e-15)


def test_a_plateau_run_resumes_in_a_fresh_process_and_replays_bitwise(tmp_path):
    here = str(Path(__file__).parent)

    def script(root: Path, max_epochs: int, ckpt: str | None) -> str:
        return textwrap.dedent(f"""
            import sys; sys.path.insert(0, {here!r})
            import engine as eg
            from engine.listeners import ReduceLROnPlateau
            from test_lr_schedule import _Scores, _data, _model, _task, SCORES, QUIET
            trainer = eg.Trainer(max_epochs={max_epochs}, default_root_dir={str(root)!r},
                callbacks=[_Scores(SCORES), ReduceLROnPlateau("score", patience=0, factor=0.5)],
                **{{**QUIET, "enable_checkpointing": True}})
            state = trainer.fit(_task(), _task().init(_model()), _data(), _data(1),
                                ckpt_path={ckpt!r})
            print(trainer.run_dir)
            print(state.fingerprint())
        """)

    def run(code: str) -> list[str]:
        done = _procs.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()

    run_dir, whole = run(script(tmp_path / "a", 8, None))
    run(script(tmp_path / "b", 4, None))
    _, resumed = run(script(tmp_path / "b", 8, "last"))
    assert resumed == whole
    report = eg.replay(run_dir, trust_code=True)
    assert report.divergence is None and report.steps == 24, report


def test_a_plateau_needs_an_injected_lr_and_its_metric():
    plain = eg.Task(_loss, optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"inject_hyperparams\(optim\.adamw\)"):
        eg.Trainer(max_epochs=1, callbacks=[ReduceLROnPlateau("score")], **QUIET).fit(
            plain, plain.init(_model()), _data()
        )
    with pytest.raises(ValueError, match=r"monitor='nope'.*not available.*strict=False"):
        eg.Trainer(max_epochs=1, callbacks=[ReduceLROnPlateau("nope")], **QUIET).fit(
            _task(), _task().init(_model()), _data()
        )
    with pytest.warns(RuntimeWarning, match="the check is skipped"):
        eg.Trainer(max_epochs=1, callbacks=[ReduceLROnPlateau("nope", strict=False)], **QUIET).fit(
            _task(), _task().init(_model()), _data()
        )
    for bad, match in (
        ({"mode": "minimum"}, "mode='minimum'"),
        ({"factor": 1.5}, "factor=1.5"),
        ({"patience": -1}, "patience=-1"),
        ({"interval": "batch"}, "interval='batch'"),
        ({"frequency": 0}, "frequency=0"),
    ):
        with pytest.raises(ValueError, match=match):
            ReduceLROnPlateau("score", **bad)
