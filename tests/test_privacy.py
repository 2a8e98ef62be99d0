"""Per-example gradients and DP-SGD (engine.per_example, engine.privacy) against Opacus.

Opacus (``GradSampleModule``'s hooks, ``DPOptimizer``'s clipping, ``RDPAccountant``) is the
reference: the same model and batch give the same per-example gradients, the same clipped and
summed gradients with the noise off, and the same epsilon.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim, privacy, transforms
from engine.privacy import DPSGD

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
B = 16


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 10),
    )  # fmt: skip


class CNN(nn.Module):
    """A small CNN on 8x8 images (GroupNorm: batch norm has no per-example gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv1(x.view(-1, 1, 8, 8))))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


MODELS = {"mlp": mlp, "cnn": CNN}


def batch(seed: int = 0, n: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def loss_fn(model, b):
    logits = model(b[0])
    return F.cross_entropy(logits, b[1]), {"acc": (logits.argmax(-1) == b[1]).float().mean()}


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def opacus_grad_samples(model: nn.Module, b) -> dict[str, torch.Tensor]:
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    F.cross_entropy(gsm(b[0]), b[1]).backward()
    return {n.removeprefix("_module."): p.grad_sample for n, p in gsm.named_parameters()}


# ------------------------------------------------------------------ per-example gradients


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_per_example_grads_match_opacus_grad_samples(kind):
    model, b = make(kind), batch()
    state = eg.TrainState.create(copy.deepcopy(model), optim.sgd(0.1))
    ours = eg.per_example_grads(loss_fn, state, b)
    theirs = opacus_grad_samples(model, b)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].shape == (B, *state.params[k].shape)
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-6, rtol=0, msg=k)
    # a pure-function model: the dict of tensors itself
    params = {k: v.detach() for k, v in state.params.items()}
    pure = eg.per_example_grads(
        lambda p, b: loss_fn(eg.ModelView(state.module, p, {}), b)[0], params, b
    )
    for k in ours:
        torch.testing.assert_close(pure[k], ours[k], atol=0, rtol=0)


def test_per_example_grads_are_those_of_each_example_alone_and_the_state_is_kept():
    model, b = make("mlp"), batch(n=4)
    state = eg.TrainState.create(model, optim.sgd(0.1))
    before = {k: v.clone() for k, v in state.params.items()}
    ours = eg.per_example_grads(loss_fn, state, b)
    for i in range(4):
        view = eg.ModelView(state.module, state.params, {})
        loss = loss_fn(view, (b[0][i : i + 1], b[1][i : i + 1]))[0]
        alone = torch.autograd.grad(loss, list(state.params.values()))
        for k, g in zip(state.params, alone, strict=True):
            torch.testing.assert_close(ours[k][i], g, atol=1e-6, rtol=0)
    assert all(torch.equal(before[k], state.params[k]) for k in before)
    state.check_alive()  # read, not consumed


# ------------------------------------------------------------------ clipping, against Opacus


def pipeline(dp: DPSGD, observe=None, **kwargs) -> transforms.Pipeline:
    return transforms.compose(privacy=dp, observe=observe, **kwargs)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_clipped_and_summed_gradients_match_opacus_dp_optimizer_with_the_noise_off(kind):
    model, b = make(kind), batch(1)
    norms = privacy.per_example_norms(opacus_grad_samples(model, b))
    clip = float(norms.median())  # half the examples clipped, half not
    lr = 0.5
    # Opacus: hooks, DPOptimizer with noise_multiplier=0, then torch's SGD
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=lr),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=B,
    )
    F.cross_entropy(gsm(b[0]), b[1]).backward()
    opt.step()
    theirs = {n.removeprefix("_module."): p for n, p in gsm.named_parameters()}
    # engine: the DPSGD transform in a custom loop; Observe (outside it) sees its gradients
    seen = {}
    tx = optim.sgd(lr)
    dp = DPSGD(clip, 0.0, sample_rate=B / 1000, expected_batch_size=B)
    pipe = pipeline(dp, transforms.Observe(after_backward=lambda g: seen.update(grads=g)))
    state = pipe.prepare(eg.TrainState.create(copy.deepcopy(model), tx))
    state, metrics = pipe.train_step(loss_fn, tx)(state, pipe.move(b))
    grads = dict(zip(state.params, seen["grads"], strict=True))
    for k, p in theirs.items():
        torch.testing.assert_close(grads[k], p.grad, atol=1e-6, rtol=0, msg=k)
        torch.testing.assert_close(state.params[k], p.detach(), atol=1e-6, rtol=0, msg=k)
    # the same, piece by piece: per-example gradients -> clip_and_sum -> / expected batch size
    fresh = eg.TrainState.create(copy.deepcopy(model), tx)
    summed = privacy.clip_and_sum(eg.per_example_grads(loss_fn, fresh, b), clip)
    for k in theirs:
        torch.testing.assert_close(summed[k] / B, grads[k], atol=1e-6, rtol=0)
    # the reported loss and metrics are the batch's (means over the examples)
    loss, aux = loss_fn(model, b)
    torch.testing.assert_close(metrics["loss"], loss.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["acc"], aux["acc"], atol=1e-6, rtol=0)


def test_frozen_parameters_get_no_gradient_and_do_not_count_in_the_clip_as_in_opacus():
    from engine.optim.freezing import freezable

    model, b = make("mlp"), batch(3)
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    for name, p in gsm.named_parameters():
        p.requires_grad_(not name.startswith("_module.0."))  # the first layer frozen
    opt = DPOptimizer(
        torch.optim.SGD([p for p in gsm.parameters() if p.requires_grad], lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        expected_batch_size=B,
    )
    F.cross_entropy(gsm(b[0]), b[1]).backward()
    opt.pre_step()  # clip, sum, (no) noise, divide: p.grad
    seen = {}
    tx = freezable(optim.sgd(1.0), frozen=["0"])
    dp = DPSGD(0.1, 0.0, sample_rate=0.1, expected_batch_size=B)
    pipe = pipeline(dp, transforms.Observe(after_backward=lambda g: seen.update(g=g)))
    state = pipe.prepare(eg.TrainState.create(copy.deepcopy(model), tx))
    pipe.train_step(loss_fn, tx)(state, b)
    grads = dict(zip(state.params, seen["g"], strict=True))
    for name, p in gsm.named_parameters():
        k = name.removeprefix("_module.")
        if p.requires_grad:
            torch.testing.assert_close(grads[k], p.grad, atol=1e-6, rtol=0, msg=k)
        else:
            assert torch.count_nonzero(grads[k]) == 0, k


def test_chunks_of_examples_give_the_whole_batchs_gradient():
    def grads_with(chunk_size):
        seen = {}
        tx = optim.sgd(0.1)
        dp = DPSGD(0.05, 0.0, sample_rate=0.1, expected_batch_size=B, chunk_size=chunk_size)
        pipe = pipeline(dp, transforms.Observe(after_backward=lambda g: seen.update(g=g)))
        state = pipe.prepare(eg.TrainState.create(make("cnn"), tx))
        _, metrics = pipe.train_step(loss_fn, tx)(state, batch(2))
        return seen["g"], metrics

    (whole, m1), (chunked, m2) = grads_with(None), grads_with(5)  # chunks of 5, 5, 5 and 1
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(m1["loss"], m2["loss"])
    torch.testing.assert_close(m1["acc"], m2["acc"])


def test_clip_and_sum_bounds_each_example_by_the_norm():
    grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), "b": torch.zeros(3, 1)}
    summed = privacy.clip_and_sum(grads, 1.0)
    # 5 -> 1 (factor 1/(5 + 1e-6)); 0.5 kept; 0 kept
    expected = torch.tensor([3.0, 4.0]) / (5 + 1e-6) + torch.tensor([0.3, 0.4])
    torch.testing.assert_close(summed["w"], expected, atol=1e-7, rtol=0)


# ------------------------------------------------------------------ noise and determinism


def zero_loss(model, b):  # the gradient is exactly zero: a step's update is the noise alone
    return 0.0 * model(b[0]).sum()


def noise_of(seed: int, step: int = 0, *, sigma=1.3, clip=0.7, expected=50):
    tx = optim.sgd(1.0)
    pipe = pipeline(DPSGD(clip, sigma, sample_rate=0.01, expected_batch_size=expected))
    torch.manual_seed(0)
    state = pipe.prepare(eg.TrainState.create(nn.Linear(100, 100), tx, seed=seed))
    state = state.replace(step=step)
    before = {k: v.clone() for k, v in state.params.items()}
    state, _ = pipe.train_step(zero_loss, tx)(state, (torch.randn(4, 100),))
    # sgd(1.0): params -= noise / expected
    return torch.cat([((before[k] - state.params[k]) * expected).flatten() for k in before])


def test_the_noise_has_the_documented_std_and_is_a_function_of_seed_and_step():
    sigma, clip = 1.3, 0.7
    noise = noise_of(seed=5, sigma=sigma, clip=clip)
    n = noise.numel()  # 10,100 draws: the std's standard error is ~0.7% of it
    assert abs(noise.std().item() / (sigma * clip) - 1) < 0.05
    assert abs(noise.mean().item()) < 5 * sigma * clip / math.sqrt(n)
    assert torch.equal(noise, noise_of(seed=5))  # (seed, step) decide it, bitwise
    assert not torch.allclose(noise, noise_of(seed=6))
    assert not torch.allclose(noise, noise_of(seed=5, step=1))
    assert torch.count_nonzero(noise_of(seed=5, sigma=0.0)) == 0  # no noise, no draw


def dropout_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))


DP = {"max_grad_norm": 0.5, "noise_multiplier": 1.1, "sample_rate": 0.05, "expected_batch_size": B}


def run(steps: int, *, seed: int = 3, state=None, accumulate: int = 1):
    tx = optim.adam(1e-2)
    pipe = pipeline(DPSGD(**DP), accumulate=accumulate)
    if state is None:
        state = pipe.prepare(eg.TrainState.create(dropout_mlp(), tx, seed=seed))
    step = pipe.train_step(loss_fn, tx)
    while state.step < steps:
        state, _ = step(state, batch(state.batch_idx))
    return state


def test_two_runs_with_the_same_seed_are_bitwise_equal_and_another_seed_differs():
    a, b, c = run(4), run(4), run(4, seed=4)
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert not all(torch.equal(a.params[k], c.params[k]) for k in a.params)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_run_resumed_from_a_checkpoint_is_bitwise_the_uninterrupted_one(tmp_path, accumulate):
    whole = run(6, accumulate=accumulate)
    half = run(3, accumulate=accumulate)
    half = privacy.set_hyperparams(half, noise_multiplier=1.1)  # the same: no new segment
    path = checkpoint.save(half, tmp_path / "c")
    tx = optim.adam(1e-2)
    template = pipeline(DPSGD(**{**DP, "noise_multiplier": 9.0})).prepare(
        eg.TrainState.create(dropout_mlp(), tx, seed=99)
    )
    resumed = checkpoint.load(path, template)
    assert privacy.hyperparams(resumed) == privacy.hyperparams(half)  # the checkpoint's win
    resumed = run(6, state=resumed, accumulate=accumulate)
    assert resumed.step == whole.step == 6
    assert all(torch.equal(whole.params[k], resumed.params[k]) for k in whole.params)


def test_the_noise_multiplier_is_state_a_transition_changes_and_a_checkpoint_restores(tmp_path):
    state = run(2)
    state = privacy.set_hyperparams(state, noise_multiplier=2.0, sample_rate=0.1)
    state = run(5, state=state)
    held = state.extra["dpsgd"]
    assert held["history"] == [[1.1, 0.05, 0], [2.0, 0.1, 2]]
    # epsilon: Opacus's RDP accountant over the same history
    acc = RDPAccountant()
    acc.history = [(1.1, 0.05, 2), (2.0, 0.1, 3)]
    assert privacy.epsilon(state, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    loaded = checkpoint.load(checkpoint.save(state, tmp_path / "c"), run(0))
    assert loaded.extra["dpsgd"] == held
    assert privacy.epsilon(loaded, 1e-5) == privacy.epsilon(state, 1e-5)
    # the changed multiplier is the one the steps use: the noise doubles relative to 1.0
    low = noise_of(seed=1, sigma=1.0)
    tx = optim.sgd(1.0)
    pipe = pipeline(DPSGD(0.7, 1.0, sample_rate=0.01, expected_batch_size=50))
    torch.manual_seed(0)
    s = pipe.prepare(eg.TrainState.create(nn.Linear(100, 100), tx, seed=1))
    s = privacy.set_hyperparams(s, noise_multiplier=2.0)
    before = {k: v.clone() for k, v in s.params.items()}
    s, _ = pipe.train_step(zero_loss, tx)(s, (torch.randn(4, 100),))
    high = torch.cat([((before[k] - s.params[k]) * 50).flatten() for k in before])
    torch.testing.assert_close(high, 2 * low, atol=1e-4, rtol=1e-5)


def test_epsilon_matches_opacus_and_falls_as_the_noise_rises():
    def eps(sigma, steps=500):
        dp = DPSGD(1.0, sigma, sample_rate=0.02, expected_batch_size=32)
        state = dp.prepare(eg.TrainState.create(nn.Linear(2, 1), optim.sgd(0.1)))
        return privacy.epsilon(state.replace(step=steps), 1e-5)

    acc = RDPAccountant()
    acc.history = [(1.0, 0.02, 500)]
    assert eps(1.0) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert eps(0.8) > eps(1.0) > eps(2.0) > 0
    assert eps(1.0, steps=0) == 0.0 and eps(0.0) == math.inf


def test_epsilon_without_opacus_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    dp = DPSGD(1.0, 1.0, sample_rate=0.02, expected_batch_size=32)
    state = dp.prepare(eg.TrainState.create(nn.Linear(2, 1), optim.sgd(0.1))).replace(step=3)
    with pytest.raises(ImportError, match="pip install opacus"):
        privacy.epsilon(state, 1e-5)


# ------------------------------------------------------------------ under the Trainer


def data(n: int = 4):
    return [batch(100 + i) for i in range(n)]


def trainer_fit(tmp_path, dp=None, ckpt_path=None, **flags):
    tx = optim.adam(1e-2)
    task = eg.Task(loss_fn, tx)
    trainer = eg.Trainer(
        plugins=[dp or DPSGD(**DP)],
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
        **{"enable_checkpointing": False, **QUIET, **flags},
    )
    state = task.init(dropout_mlp(), seed=3)
    return trainer, trainer.fit(task, state, data(), ckpt_path=ckpt_path)


def test_the_trainer_with_the_dpsgd_plugin_equals_the_custom_loop_bitwise(tmp_path):
    _, fitted = trainer_fit(tmp_path, max_epochs=2, accumulate_grad_batches=3)
    assert fitted.step == 4  # 2 epochs of 4 batches: windows of 3 and the epoch's last 1
    tx = optim.adam(1e-2)
    pipe = pipeline(DPSGD(**DP), accumulate=3)
    state = pipe.prepare(eg.TrainState.create(dropout_mlp(), tx, seed=3))
    step = pipe.train_step(loss_fn, tx)
    for _ in range(2):
        for i, b in enumerate(data()):
            state, _ = step(state, pipe.move(b), flush=i == 3)
    assert all(torch.equal(fitted.params[k], state.params[k]) for k in state.params)
    assert privacy.hyperparams(fitted) == DP and privacy.epsilon(fitted, 1e-5) > 0


class MoreNoiseAfterTheFirstEpoch(eg.Listener):
    def on_train_epoch_end(self, rec):
        if rec.run.current_epoch == 0:
            return eg.Transition(
                lambda s: privacy.set_hyperparams(s, noise_multiplier=2.0), name="noise"
            )
        return None


def test_a_listeners_transition_changes_the_noise_multiplier_for_the_steps_after_it(tmp_path):
    _, fitted = trainer_fit(tmp_path, max_epochs=2, callbacks=[MoreNoiseAfterTheFirstEpoch()])
    assert privacy.hyperparams(fitted)["noise_multiplier"] == 2.0
    assert fitted.extra["dpsgd"]["history"] == [[1.1, 0.05, 0], [2.0, 0.05, 4]]
    acc = RDPAccountant()
    acc.history = [(1.1, 0.05, 4), (2.0, 0.05, 4)]
    assert privacy.epsilon(fitted, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    # the second epoch's steps ran with it: a custom loop that changes it there agrees bitwise
    tx = optim.adam(1e-2)
    pipe = pipeline(DPSGD(**DP))
    state = pipe.prepare(eg.TrainState.create(dropout_mlp(), tx, seed=3))
    step = pipe.train_step(loss_fn, tx)
    for epoch in range(2):
        for b in data():
            state, _ = step(state, b)
        if epoch == 0:
            state = privacy.set_hyperparams(state, noise_multiplier=2.0)
    assert all(torch.equal(fitted.params[k], state.params[k]) for k in state.params)


@pytest.mark.filterwarnings("ignore:resuming mid-epoch:UserWarning")
def test_a_trainer_fit_resumed_mid_way_is_bitwise_the_uninterrupted_one(tmp_path):
    every = eg.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _, whole = trainer_fit(
        tmp_path / "a", max_steps=6, max_epochs=-1, enable_checkpointing=True, callbacks=[every]
    )
    path = tmp_path / "ckpt" / "epoch=0-step=3"  # inside the first epoch of 4 batches
    _, resumed = trainer_fit(tmp_path / "b", max_steps=6, max_epochs=-1, ckpt_path=path)
    assert resumed.step == 6
    assert all(torch.equal(whole.params[k], resumed.params[k]) for k in whole.params)
    tx = optim.adam(1e-2)
    task = eg.Task(loss_fn, tx)
    # a DP-SGD checkpoint is not resumed without DP-SGD
    plain = eg.Trainer(max_steps=6, max_epochs=-1, default_root_dir=tmp_path / "d", **QUIET)
    with pytest.raises(checkpoint.CheckpointError, match="DPSGD plugin"):
        plain.fit(task, task.init(dropout_mlp(), seed=3), data(), ckpt_path=path)
    # nor a checkpoint of a fit without DP-SGD resumed with it
    path = checkpoint.save(task.init(dropout_mlp()), tmp_path / "plain")
    with pytest.raises(checkpoint.CheckpointError, match="without DP-SGD"):
        trainer_fit(tmp_path / "e", max_steps=6, max_epochs=-1, ckpt_path=path)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_grad_norm": -1.0}, r"max_grad_norm=-1\.0"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm=0\.0"),
        ({"noise_multiplier": -0.5}, r"noise_multiplier=-0\.5"),
        ({"noise_multiplier": math.nan}, r"noise_multiplier=nan"),
        ({"sample_rate": 1.5}, r"sample_rate=1\.5.*at most 1"),
        ({"expected_batch_size": 0}, r"expected_batch_size=0"),
        ({"chunk_size": 0}, r"chunk_size=0"),
    ],
)
def test_bad_numbers_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGD(**{**DP, **kwargs})


def test_batch_norm_is_refused_with_what_to_use_instead():
    model = nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    state = eg.TrainState.create(model, optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"'1' is BatchNorm1d.*GroupNorm"):
        eg.per_example_grads(loss_fn, state, batch())
    with pytest.raises(ValueError, match="BatchNorm1d"):
        DPSGD(**DP).prepare(state)


def test_what_cannot_run_under_dpsgd_is_refused(tmp_path):
    with pytest.raises(ValueError, match="precision wraps the forward pass"):
        transforms.compose(privacy=DPSGD(**DP), precision=transforms.MixedPrecision())
    with pytest.raises(ValueError, match="two privacy plugins"):
        eg.Trainer(plugins=[DPSGD(**DP), DPSGD(**DP)])
    with pytest.raises(ValueError, match="precision wraps the forward pass"):
        trainer_fit(tmp_path, max_steps=1, precision="bf16-mixed")
    with pytest.raises(ValueError, match="step_fn is its own step"):
        task = eg.Task(step_fn=lambda s, b: (s, {}), tx=optim.sgd(0.1))
        eg.Trainer(plugins=[DPSGD(**DP)], max_steps=1, default_root_dir=tmp_path, **QUIET).fit(
            task, task.init(dropout_mlp()), data()
        )
    # a state the pipeline did not prepare
    tx = optim.sgd(0.1)
    step = pipeline(DPSGD(**DP)).train_step(loss_fn, tx)
    with pytest.raises(ValueError, match=r"pipeline\.prepare\(state\)"):
        step(eg.TrainState.create(dropout_mlp(), tx), batch())
    # examples along different first dimensions
    state = eg.TrainState.create(dropout_mlp(), tx)
    with pytest.raises(ValueError, match=r"same, non-empty first.*\[\(16, 64\), \(3,\)\]"):
        eg.per_example_grads(loss_fn, state, (batch()[0], torch.zeros(3, dtype=torch.long)))
