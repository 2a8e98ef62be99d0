"""The mistakes a Lightning user makes in a first port, each answered with what to do."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.state import ConsumedStateError


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _data(n: int = 2):
    return [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(n)]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1),
            "optim.from_torch(torch.optim.Adam, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1)",
        ),
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.5), "from_torch(torch.optim.SGD, lr=0.5"),
        (lambda m: torch.optim.AdamW, "optim.from_torch(torch.optim.AdamW"),
    ],
)
def test_a_torch_optimizer_in_a_task_points_to_from_torch(make, expected):
    with pytest.raises(TypeError) as err:
        eg.Task(_loss, make(nn.Linear(3, 1)))
    assert expected in str(err.value), str(err.value)
    with pytest.raises(TypeError, match="GradientTransformation"):
        eg.Task(_loss, "adam")


def test_the_suggested_from_torch_runs():
    tx = optim.from_torch(torch.optim.Adam, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1)
    task = eg.Task(_loss, tx)
    eg.Trainer(max_epochs=1, barebones=True).fit(task, task.init(nn.Linear(3, 1)), _data())


def test_lightning_callbacks_are_refused_naming_their_replacement():
    pl = pytest.importorskip("pytorch_lightning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [
            (pl.callbacks.ModelCheckpoint(monitor="val_loss"), "engine.listeners.ModelCheckpoint"),
            (pl.callbacks.EarlyStopping("val_loss"), "engine.listeners.EarlyStopping"),
            (pl.callbacks.LearningRateMonitor(), "engine.listeners.LearningRateMonitor"),
            (pl.callbacks.TQDMProgressBar(), "engine.listeners.ProgressBar"),
            (pl.callbacks.LambdaCallback(on_train_start=print), "engine.on(engine.Event"),
        ]

    class Mine(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass

    cases.append((Mine(), "subclass engine.Listener"))
    for callback, replacement in cases:
        with pytest.raises(ValueError) as err:
            eg.Trainer(callbacks=[callback])
        message = str(err.value)
        assert "is a Lightning Callback" in message and replacement in message, message


def test_the_state_given_to_fit_says_to_use_the_one_fit_returned():
    task = eg.Task(_loss, optim.sgd(0.1))
    state = task.init(nn.Linear(3, 1))
    trainer = eg.Trainer(max_epochs=1, barebones=True)
    trainer.fit(task, state, _data())  # the returned state dropped: a common first mistake
    with pytest.raises(ConsumedStateError, match=r"state = trainer\.fit\(task, state, \.\.\.\)"):
        trainer.fit(task, state, _data())
    with pytest.raises(ConsumedStateError, match=r"given to Trainer\.fit"):
        trainer.validate(task, state, _data(), verbose=False)  # so does every other use


def test_training_on_predict_outputs_says_how_to_get_trainable_tensors():
    task = eg.Task(_loss, optim.sgd(0.1))
    state = task.init(nn.Linear(3, 1))
    trainer = eg.Trainer(max_epochs=1, barebones=True)
    (pred,) = trainer.predict(task, state, [torch.randn(4, 3)])
    assert pred.is_inference()
    with pytest.raises(RuntimeError, match=r"Trainer\.predict.*t\.clone\(\)"):
        trainer.fit(task, state.copy(), [(torch.randn(4, 3), pred)])
    (pred,) = eg.Trainer(max_epochs=1, barebones=True, inference_mode=False).predict(
        task, state, [torch.randn(4, 3)]
    )
    assert not pred.is_inference()
    trainer.fit(task, state, [(torch.randn(4, 3), pred)])  # the suggested fix works
