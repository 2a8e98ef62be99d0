"""A dropped Trainer, its loaders and its run go by reference counting after every entry point,
with the defaults on (journal, logger, checkpoints, progress bar, model summary).

Anything left to the garbage collector is freed at whatever later allocation triggers it. For a
``DataLoader`` with persistent workers that costs torch 5 s a worker (it finalizes the workers'
queues before the iterator's ``__del__`` can tell them to stop), so a cycle that reaches a loader
stalls some later step of the program for seconds (tests/test_data_resume.py has the persistent
workers case itself). These fits use loaders without workers, which cost nothing to check.
"""

from __future__ import annotations

import gc
import io
import weakref
from collections.abc import Iterator
from contextlib import redirect_stderr

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


def _task() -> eg.Task:
    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return eg.Task(loss, optim.adamw(1e-2), predict_fn=lambda model, batch: model(batch[0]))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict", "fit_then_test"])
def test_a_dropped_trainer_and_its_loaders_go_without_the_garbage_collector(tmp_path, no_gc, stage):
    task = _task()
    state = task.init(_model(), seed=1)
    train, val = _loader(1), _loader(2)
    trainer = eg.Trainer(default_root_dir=tmp_path, max_epochs=2)
    with redirect_stderr(io.StringIO()):
        if stage.startswith("fit"):
            state = trainer.fit(task, state, train, val)
        if stage.endswith("test"):
            trainer.test(task, state, val, verbose=False)
        elif stage == "validate":
            trainer.validate(task, state, val, verbose=False)
        elif stage == "predict":
            assert len(trainer.predict(task, state, val)) == 6
    gone = {"trainer": weakref.ref(trainer), "train": weakref.ref(train), "val": weakref.ref(val)}
    del trainer, train, val, state
    left = [name for name, ref in gone.items() if ref() is not None]
    if left:  # say what holds them: the referrers' types, for whoever breaks this
        held = {n: sorted({type(r).__name__ for r in gc.get_referrers(gone[n]())}) for n in left}
        pytest.fail(f"left to the garbage collector: {held}")
