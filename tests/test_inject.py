"""Hyperparameters as optimizer state (``optim.inject_hyperparams``), against torch.optim with a
learning rate changed mid-run."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import engine as eg
from engine import checkpoint, optim


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize(
    ("make_tx", "make_opt"),
    [
        (
            lambda: optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        ),
        (
            lambda: optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        ),
    ],
    ids=["adamw", "sgd"],
)
def test_an_injected_lr_changed_mid_run_equals_torch_optim_with_its_param_group_changed(
    make_tx, make_opt
):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(6)]
    model = _model()
    opt = make_opt(model.parameters())
    tx = make_tx()
    state = eg.TrainState.create(_model(), tx)
    step = eg.train_step(lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), tx)
    for i, (x, y) in enumerate(data):
        if i == 3:  # what ReduceLROnPlateau does to the param group, and to the state here
            for group in opt.param_groups:
                group["lr"] *= 0.1
            lr = optim.get_hyperparams(state.opt_state)["lr"]
            state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, lr=lr * 0.1))
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        state, _ = step(state, (x, y))
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


def test_injected_hyperparameters_round_trip_through_a_checkpoint():
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.1)
    state = eg.TrainState.create(_model(), tx)
    state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, lr=3e-3))
    with tempfile.TemporaryDirectory() as d:
        back = checkpoint.load(checkpoint.save(state, f"{d}/c"), eg.TrainState.create(_model(), tx))
    assert optim.get_hyperparams(back.opt_state) == {"lr": 3e-3, "weight_decay": 0.1}
    assert back.fingerprint() == state.fingerprint()


def test_bad_uses_are_named():
    with pytest.raises(TypeError, match="by name"):
        optim.inject_hyperparams(optim.sgd)(0.1)
    with pytest.raises(ValueError, match="'lr' must be"):
        optim.inject_hyperparams(optim.sgd)(lr=-1.0)
    plain = optim.sgd(0.1).init({"w": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"inject_hyperparams\(optim\.adamw\)"):
        optim.get_hyperparams(plain)
    injected = optim.inject_hyperparams(optim.sgd)(lr=0.1).init({"w": torch.zeros(1)})
    with pytest.raises(KeyError, match="momentum"):
        optim.set_hyperparams(injected, momentum=0.9)
    with pytest.raises(TypeError, match="pass a number"):
        optim.set_hyperparams(injected, lr="0.1")


@pytest.mark.slow
def test_an_injected_optimizer_compiles_and_follows_a_changed_lr():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(4)]
    loss_fn = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()  # noqa: E731
    finals = []
    for compile in (False, True):
        tx = optim.inject_hyperparams(optim.adamw)(lr=1e-2)
        state = eg.TrainState.create(_model(), tx)
        step = eg.train_step(loss_fn, tx, compile=compile)
        for i, batch in enumerate(data):
            if i == 2:
                state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, lr=1e-3))
            state, _ = step(state, batch)
        finals.append(state)
    for name, p in finals[0].params.items():
        torch.testing.assert_close(finals[1].params[name], p, rtol=1e-5, atol=1e-6)
