import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import engine as eg
from engine import optim


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_create_borrows_module_storage_instead_of_copying():
    model = _mlp()
    state = eg.TrainState.create(model, optim.adamw(1e-3), seed=3)
    for name, p in model.named_parameters():
        assert state.params[name].data_ptr() == p.data_ptr()
        assert state.params[name].requires_grad
    for name, b in model.named_buffers():
        assert state.buffers[name].data_ptr() == b.data_ptr()
    assert state.seed == 3 and state.module is model
    assert (state.step, state.epoch, state.batch_idx, state.micro_step) == (0, 0, 0, 0)


def test_frozen_parameters_travel_with_buffers_and_are_not_trained():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    state = eg.TrainState.create(model, optim.sgd(0.1))
    assert "0.weight" not in state.params and "0.weight" in state.buffers
    before = state.buffers["0.weight"].clone()
    step = eg.train_step(lambda m, b: m(b).square().mean(), optim.sgd(0.1))
    state, _ = step(state, torch.randn(16, 4))
    assert torch.equal(state.buffers["0.weight"], before)


def test_pure_function_model_from_a_dict_of_tensors():
    state = eg.TrainState.create(
        {"w": torch.zeros(3)}, optim.sgd(0.1), buffers={"scale": torch.ones(())}
    )
    assert state.module is None and state.params["w"].requires_grad
    assert set(state.buffers) == {"scale"}


def test_state_is_a_pytree_whose_leaves_are_its_tensors():
    state = eg.TrainState.create(_mlp(), optim.adamw(1e-3), seed=1)
    leaves, spec = pytree.tree_flatten(state)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    n_opt = len(optim.base.tree_tensors(state.opt_state))
    assert len(tensors) == len(state.params) + len(state.buffers) + n_opt
    doubled = pytree.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, state)
    assert isinstance(doubled, eg.TrainState) and doubled.seed == 1
    for k, v in state.params.items():
        assert torch.equal(doubled.params[k], v * 2)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert rebuilt.fingerprint() == state.fingerprint()


def test_replace_shares_tensors_and_copy_does_not():
    state = eg.TrainState.create(_mlp(), optim.sgd(0.1))
    moved = state.replace(epoch=2, extra={"note": 1})
    assert moved.epoch == 2 and state.epoch == 0 and moved.extra == {"note": 1}
    assert moved.params["0.weight"] is state.params["0.weight"]
    snap = state.copy()
    assert snap.params["0.weight"] is not state.params["0.weight"]
    assert snap.fingerprint() == state.fingerprint()
    with torch.no_grad():
        state.params["0.weight"].add_(1)
    assert snap.fingerprint() != state.fingerprint()


def test_fingerprint_sees_a_single_flipped_bit_and_the_counters():
    state = eg.TrainState.create(_mlp(), optim.adamw(1e-3))
    base = state.fingerprint()
    assert base == state.copy().fingerprint()
    assert state.replace(step=1).fingerprint() != base
    flipped = state.copy()
    w = flipped.params["3.bias"].detach()
    w.view(torch.int32)[0] ^= 1  # lowest mantissa bit
    assert flipped.fingerprint() != base
    opt = state.copy()
    optim.base.tree_tensors(opt.opt_state)[-1].add_(1)
    assert opt.fingerprint() != base


def test_load_into_exports_the_trained_values():
    state = eg.TrainState.create(_mlp(), optim.sgd(0.1)).copy()
    with torch.no_grad():
        state.params["3.bias"].fill_(5.0)
    fresh = state.load_into(_mlp())
    assert torch.equal(fresh[3].bias, torch.full((3,), 5.0))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tx": "adam"}, TypeError, "GradientTransformation"),
        ({"seed": -1}, ValueError, r"seed must be .* \(got -1\)"),
        ({"seed": 1.5}, ValueError, r"got 1.5"),
        ({"model": [1, 2]}, TypeError, "got list"),
        ({"model": {"w": torch.zeros(2, dtype=torch.long)}}, ValueError, "'w' has dtype"),
    ],
)
def test_create_rejects_bad_input_naming_the_value(kwargs, error, match):
    args = {"model": _mlp(), "tx": optim.sgd(0.1), "seed": 0} | kwargs
    with pytest.raises(error, match=match):
        eg.TrainState.create(args.pop("model"), args.pop("tx"), **args)


def test_load_into_fills_every_name_of_a_tied_weight():
    def tied() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        m[1].weight = m[0].weight
        return m

    state = eg.TrainState.create(tied(), optim.sgd(0.1)).copy()
    assert list(state.params) == ["0.weight"]  # held once
    with torch.no_grad():
        state.params["0.weight"].fill_(2.0)
    fresh = state.load_into(tied())
    assert torch.equal(fresh[0].weight, torch.full((5, 3), 2.0))
    assert fresh[1].weight is fresh[0].weight  # still tied
