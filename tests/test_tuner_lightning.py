"""``engine.Tuner`` against Lightning's ``Tuner`` on the same program: a small MLP on fixed
random data, the same initial weights, the same batches in the same order, SGD with momentum
or Adam (engine's ``fused=False`` form; Lightning's ``torch.optim.Adam`` on CPU).

The learning-rate grid is compared as floats, exactly. The loss curves are compared exactly
too (NaN where Lightning has NaN): engine's SGD and non-fused Adam take torch.optim's steps
bitwise, its step takes the gradients of the same forward pass, and the smoothing is the same
sequence of float operations, so nothing but a bug can move a loss by one ulp; a tolerance
would hide that. The suggestion, the step the search stops at, and the rate ``update_attr``
sets follow. The batch-size search is compared by the sizes each tries, in order, against a
failure injected above a size (a ``torch.cuda.OutOfMemoryError`` raised by the loss), and by
the size it returns.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_tuner import LIGHTNING_TRIED
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim

pl = pytest.importorskip("pytorch_lightning")

pytestmark = pytest.mark.budget(
    share=0.06,
    why="Lightning's own Tuner is the oracle: four batch-size searches of Lightning's, each a "
    "few Lightning fits (its Trainer's start-up is most of it)",
)

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _torch_optimizer(kind: str, params, lr: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def _engine_optimizer(kind: str, lr: float):
    return optim.sgd(lr, momentum=0.9) if kind == "sgd" else optim.adam(lr, fused=False)


class _PLNet(pl.LightningModule):
    """The Lightning side of the program: the same network, loss and optimizer."""

    def __init__(self, kind: str, lr: float = 0.1, fail_above: int | None = None):
        super().__init__()
        self.net, self.kind, self.lr, self.fail_above = _net(), kind, lr, fail_above
        self.sizes: list[int] = []  # the batch size of each training step

    def training_step(self, batch, batch_idx):
        return _failing(self.fail_above, self.sizes)(self.net, batch)

    def configure_optimizers(self):
        return _torch_optimizer(self.kind, self.parameters(), self.lr)


def _failing(fail_above: int | None, sizes: list[int]):
    """The loss, raising an out-of-memory error (as CUDA's) on batches larger than
    ``fail_above``; records each batch's size."""

    def loss(model, batch):
        n = batch[0].shape[0]
        sizes.append(n)
        if fail_above is not None and n > fail_above:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: batch {n})")
        return _loss(model, batch)

    return loss


def _lightning_lr_find(kind: str, loader, tmp_path, **kw):
    module = _PLNet(kind)
    flags = {k: kw.pop(k) for k in FLAGS if k in kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(**QUIET, **flags, accelerator="cpu", default_root_dir=tmp_path)
        found = pl.tuner.Tuner(trainer).lr_find(module, train_dataloaders=loader, **kw)
    return found, module


def _engine_lr_find(kind: str, loader, **kw):
    task = eg.Task(_loss, _engine_optimizer(kind, 0.1))
    state = task.init(_net())
    flags = {k: kw.pop(k) for k in FLAGS if k in kw}
    trainer = eg.Trainer(**QUIET, **flags, enable_journal=False)
    return eg.Tuner(trainer).lr_find(task, state, loader, **kw), state


def _same_floats(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


# the searches compared: a grid that diverges (early stop), a linear grid, one left to run
SEARCHES = {
    "exponential": {"min_lr": 1e-4, "max_lr": 10.0, "num_training": 80},
    "linear": {"min_lr": 1e-3, "max_lr": 0.5, "num_training": 60, "mode": "linear"},
    "no-early-stop": {"min_lr": 1e-4, "max_lr": 10.0, "num_training": 80,
                      "early_stop_threshold": None},
    "accumulating": {"min_lr": 1e-4, "max_lr": 1.0, "num_training": 30,
                     "accumulate_grad_batches": 2},
}  # fmt: skip
FLAGS = ("accumulate_grad_batches",)  # the Trainer's, not the search's


@pytest.mark.filterwarnings("ignore:no learning rate suggested")  # a window too short: None
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_lr_find_matches_lightnings_grid_curve_stop_and_suggestion(kind, search, tmp_path):
    kw = SEARCHES[search]
    loader = DataLoader(_dataset(), batch_size=8)  # 8 batches: the search spans epochs
    theirs, module = _lightning_lr_find(kind, loader, tmp_path, **kw)
    ours, state = _engine_lr_find(kind, loader, **kw)
    kw = {k: v for k, v in kw.items() if k not in FLAGS}
    # the grid, float for float; the curve, bitwise (NaN where it diverged to NaN)
    assert ours.results["lr"] == theirs.results["lr"]
    assert _same_floats(ours.results["loss"], theirs.results["loss"])
    steps = len(theirs.results["lr"])
    if search == "exponential":  # the loss diverged: both stopped at the same step, early
        assert steps < kw["num_training"]
        assert ours.results["loss"][-1] > 4 * min(ours.results["loss"][1:-1])
    elif search == "no-early-stop":
        assert steps == kw["num_training"]
    # the suggestion, from the same rule, and what update_attr sets with it
    suggested = theirs.suggestion()
    assert suggested is not None and ours.suggestion() == suggested
    assert ours.optimal_idx == theirs._optimal_idx
    assert module.lr == suggested == ours.task_lr == ours.task.lr
    assert ours.task.tx.recipe.arguments["lr"] == suggested
    for skips in [(0, 0), (5, 3), (20, 10)]:  # other windows (Lightning's slice drops all
        # for skip_end=0: compared from 1)
        begin, end = skips
        assert ours.suggestion(begin, max(end, 1)) == theirs.suggestion(begin, max(end, 1))
    assert not state.consumed


def test_lr_find_update_attr_task_trains_at_lightnings_rate(tmp_path):
    """The task ``update_attr`` returns trains at the rate Lightning sets on its model: a fit
    of it equals a fit of the task built with that rate by hand, and lowers the loss."""
    kw = {"min_lr": 1e-3, "max_lr": 1.0, "num_training": 100}
    loader = DataLoader(_dataset(), batch_size=8)
    _, module = _lightning_lr_find("adam", loader, tmp_path, **kw)
    ours, state = _engine_lr_find("adam", loader, **kw)
    assert ours.task_lr == module.lr != 0.1
    task = ours.task
    by_hand = eg.Task(_loss, _engine_optimizer("adam", module.lr))
    fits = [
        eg.Trainer(**QUIET, enable_journal=False, max_epochs=2).fit(t, state.copy(), loader)
        for t in (task, by_hand)
    ]
    assert fits[0].fingerprint() == fits[1].fingerprint()
    before = eg.Trainer(**QUIET, enable_journal=False).validate(task, state, loader, verbose=False)
    trained = eg.Trainer(**QUIET, enable_journal=False, max_epochs=3).fit(task, state, loader)
    after = eg.Trainer(**QUIET, enable_journal=False).validate(task, trained, loader, verbose=False)
    assert after[0]["val/loss"] < before[0]["val/loss"]


class _PLData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 2):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(_dataset(1000), batch_size=self.batch_size)


def _runs(sizes: list[int]) -> list[int]:
    """The sizes tried, in order: the batch sizes of the steps, one per trial."""
    return [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n]


def _lightning_scale(mode: str, fail_above: int, tmp_path, **kw):
    # the datamodule starts at init_val: Lightning's first trial runs on the loader it built
    # before setting init_val, at the datamodule's own size (engine's runs at init_val)
    module, data = _PLNet("sgd", fail_above=fail_above), _PLData(kw.get("init_val", 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(**QUIET, accelerator="cpu", default_root_dir=tmp_path)
        size = pl.tuner.Tuner(trainer).scale_batch_size(module, datamodule=data, mode=mode, **kw)
    return size, _runs(module.sizes), data.batch_size


# the golden sizes re-derived from Lightning here: one case of each option (the fast tier checks
# all ten against the recorded sizes; each case here is a few of Lightning's fits)
ORACLE_CASES = [
    ("power", 48, ()),
    ("binsearch", 100, (("init_val", 3), ("steps_per_trial", 2))),
    ("binsearch", 37, (("max_trials", 4),)),
    ("binsearch", 300, (("max_val", 256), ("margin", 0.1))),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", ORACLE_CASES, ids=repr)
def test_scale_batch_size_tries_lightnings_sizes(case, tmp_path):
    """Lightning's search and engine's, through the Tuner on a datamodule and on a DataLoader,
    try the same sizes and find the same; they are the golden sizes the fast tier's
    ``test_tuner.py`` checks the strategies against."""
    mode, fail_above, args = case
    kw = dict(args)
    size, tried, dm_size = _lightning_scale(mode, fail_above, tmp_path, **kw)
    assert (size, tried) == LIGHTNING_TRIED[case]
    sizes: list[int] = []
    task = eg.Task(_failing(fail_above, sizes), _engine_optimizer("sgd", 0.1))
    state = task.init(_net())
    fingerprint = state.fingerprint()
    data = _PLData()
    tuner = eg.Tuner(eg.Trainer(**QUIET, enable_journal=False))
    ours = tuner.scale_batch_size(task, state, datamodule=data, mode=mode, **kw)
    assert _runs(sizes) == tried
    assert ours == size and data.batch_size == dm_size == size
    # a DataLoader, rebuilt with each size, tries the same
    sizes.clear()
    loader = DataLoader(_dataset(1000), batch_size=5)
    assert tuner.scale_batch_size(task, state, loader, mode=mode, **kw) == size
    assert _runs(sizes) == tried
    assert state.fingerprint() == fingerprint and not state.consumed


@pytest.mark.parametrize(
    ("callback", "name"),
    [
        (lambda: pl.callbacks.LearningRateFinder(), "LearningRateFinder"),
        (lambda: pl.callbacks.BatchSizeFinder(), "BatchSizeFinder"),
    ],
)
def test_lightnings_tuner_callbacks_are_refused_naming_engines(callback, name):
    with pytest.raises(ValueError, match=f"use engine.listeners.{name}"):
        eg.Trainer(**QUIET, callbacks=[callback()])
