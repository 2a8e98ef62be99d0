"""Lightning's hooks inside the step (``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``) fire where Lightning fires them, with this batch's loss and
gradients; without a listener on them the step stays one call. Their order against Lightning
itself is pinned in tests/test_lightning_parity.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import engine as eg
from engine import optim, transforms


def _loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]


class _Seen(eg.Listener):
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_start(self, rec):
        self.batch, self.params = rec.batch, {k: v.clone() for k, v in rec.state.params.items()}

    def on_before_backward(self, rec):
        self.rows.append(
            ("before_backward", rec.batch_idx, rec.loss.clone(), self.batch, self.params)
        )

    def on_after_backward(self, rec):
        self.rows.append(
            ("after_backward", rec.batch_idx, {k: g.clone() for k, g in rec.grads.items()})
        )

    def on_before_optimizer_step(self, rec):
        self.rows.append(
            ("before_optimizer_step", rec.batch_idx, {k: g.clone() for k, g in rec.grads.items()})
        )


def _trainer(listeners, **kw) -> eg.Trainer:
    return eg.Trainer(
        callbacks=listeners,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_journal=False,
        **kw,
    )


def test_the_step_hooks_carry_this_batchs_loss_and_gradients():
    task = eg.Task(_loss, optim.sgd(0.1))
    model = nn.Linear(3, 1)
    seen = _Seen()
    _trainer([seen], max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=1e-3).fit(
        task, task.init(model, seed=0), _data()
    )
    kinds = [r[0] for r in seen.rows]
    assert kinds == ["before_backward", "after_backward"] * 2 + ["before_optimizer_step"] + (
        ["before_backward", "after_backward"] * 2 + ["before_optimizer_step"]
    ) + ["before_backward", "after_backward", "before_optimizer_step"]  # the last: flushed
    window: dict[str, torch.Tensor] = {}
    for row in seen.rows:
        if row[0] == "before_backward":
            _, _, loss, batch, params = row
            params = {k: p.requires_grad_() for k, p in params.items()}
            ref = _loss(lambda x, p=params: functional_call(model, p, (x,)), batch)
            assert torch.equal(loss, ref.detach())
            grads = torch.autograd.grad(ref / 2, list(params.values()))
            expected = dict(zip(params, grads, strict=True))
        elif row[0] == "after_backward":
            assert all(torch.equal(row[2][k], expected[k]) for k in expected)  # of loss / 2
            window = {k: expected[k] + window[k] if k in window else expected[k] for k in expected}
        else:  # the window's sum, before clipping (1e-3 would have shrunk it)
            assert all(torch.equal(row[2][k], window[k]) for k in window)
            assert sum(g.norm() ** 2 for g in window.values()) ** 0.5 > 1e-3
            window = {}


def test_without_a_listener_on_them_the_step_is_not_observed():
    task = eg.Task(_loss, optim.sgd(0.1))
    trainer = _trainer([], max_epochs=1)
    trainer.fit(task, task.init(nn.Linear(3, 1)), _data())
    assert not any(isinstance(t, transforms.Observe) for t in trainer.pipeline.transforms)
    trainer = _trainer([_Seen()], max_epochs=1)
    trainer.fit(task, task.init(nn.Linear(3, 1)), _data())
    assert any(isinstance(t, transforms.Observe) for t in trainer.pipeline.transforms)


def test_observing_the_step_and_compiling_it_is_a_clear_error():
    task = eg.Task(_loss, optim.sgd(0.1))
    with pytest.raises(ValueError, match="on_after_backward run inside the step"):
        _trainer([eg.on(eg.Event.ON_AFTER_BACKWARD, print)], max_epochs=1, compile=True).fit(
            task, task.init(nn.Linear(3, 1)), _data()
        )


def test_an_observed_step_trains_exactly_as_the_fused_one():
    task = eg.Task(_loss, optim.adam(1e-2))

    def state() -> eg.TrainState:
        torch.manual_seed(0)
        return task.init(nn.Linear(3, 1), seed=1)

    fused = _trainer([], max_epochs=2, accumulate_grad_batches=2).fit(task, state(), _data())
    observed = _trainer([_Seen()], max_epochs=2, accumulate_grad_batches=2).fit(
        task, state(), _data()
    )
    assert observed.fingerprint() == fused.fingerprint()
