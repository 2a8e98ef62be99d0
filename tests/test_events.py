"""Listeners are checked when they are registered: a handler named after no event is an error
naming it, never a silent no-op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine as eg
from engine import optim
from engine.events import check_listener


class _Typo(eg.Listener):
    def on_validaton_end(self, rec):  # misspelt
        raise AssertionError("never called")

    def on_fit_start(self, rec):
        pass


class _LightningOnly(eg.Listener):
    def on_before_zero_grad(self, rec):
        pass


class _Fine(eg.Listener):
    def on_train_batch_end(self, rec):
        pass

    def _on_helper(self):  # private: not a handler
        pass

    on_value = 3  # not callable: not a handler


def test_a_misspelt_handler_is_named_with_the_event_it_resembles():
    with pytest.raises(
        ValueError, match=r"_Typo\.on_validaton_end .* did you mean on_validation_end"
    ):
        check_listener(_Typo())


def test_a_lightning_hook_engine_does_not_have_says_why():
    with pytest.raises(ValueError, match=r"a pure step has no \.grad buffers to zero"):
        check_listener(_LightningOnly())


def test_private_helpers_and_plain_attributes_are_not_handlers():
    check_listener(_Fine())
    check_listener(eg.on(eg.Event.ON_TRAIN_END, print))
    for listener in (eg.ModelCheckpoint(), eg.EarlyStopping("val/loss"), eg.ProgressBar()):
        check_listener(listener)


def test_the_trainer_refuses_a_misspelt_handler_before_training():
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    trainer = eg.Trainer(max_epochs=1, callbacks=[_Typo()], logger=False)
    with pytest.raises(ValueError, match="on_validaton_end is not an engine event"):
        trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
