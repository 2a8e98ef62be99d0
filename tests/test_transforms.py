"""Step transforms: one declared order, a custom loop equal to the Trainer's flags bitwise, and a
seam that carries a dynamic loss scale (its state in ``TrainState.precision``, a skipped step)
exactly as ``torch.amp.GradScaler`` runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim, transforms
from engine.optim.base import tree_tensors
from engine.transforms import Transform


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))


def _data(n: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)
    ]


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_custom_loop_composing_the_transforms_equals_the_trainers_flags_bitwise(algorithm):
    tx = optim.adamw(optim.warmup_cosine(1e-2, warmup_steps=2, total_steps=12))
    task = eg.Task(_loss, tx)
    epochs, accumulate, clip = 3, 3, 0.05
    trainer = eg.Trainer(
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_journal=False,
    )
    by_flags = trainer.fit(task, task.init(_model(), seed=3), _data())

    by_hand = optim.clip_by_global_norm if algorithm == "norm" else optim.clip_by_value
    pipeline = transforms.compose(clip=by_hand(clip), accumulate=accumulate)
    state = pipeline.prepare(eg.TrainState.create(_model(), tx, seed=3))
    step = pipeline.train_step(_loss, tx)
    data = _data()
    for _ in range(epochs):
        for i, batch in enumerate(data):  # Lightning steps the optimizer on an epoch's last batch
            state, _ = step(state, pipeline.move(batch), flush=i == len(data) - 1)
        state = state.replace(epoch=state.epoch + 1, batch_idx=0)
    assert state.step == by_flags.step == epochs * 3  # 7 batches: windows of 3, 3 and 1
    assert state.fingerprint() == by_flags.fingerprint()


def test_the_engine_step_builders_are_the_default_pipeline():
    tx = optim.sgd(0.1, momentum=0.9)
    pipeline = transforms.compose(clip=optim.clip_by_global_norm(0.1), accumulate=2)
    a = pipeline.train_step(_loss, tx)
    b = eg.train_step(_loss, tx, clip=optim.clip_by_global_norm(0.1), accumulate=2)
    sa, sb = (eg.TrainState.create(_model(), tx, seed=1) for _ in range(2))
    for batch in _data(5):
        sa, ma = a(sa, batch)
        sb, mb = b(sb, batch)
        assert torch.equal(ma["loss"], mb["loss"])
    assert sa.fingerprint() == sb.fingerprint()
    evaluate = pipeline.eval_step(_loss)
    assert torch.equal(
        evaluate(sa, _data()[0])["loss"], eg.eval_step(_loss)(sb, _data()[0])["loss"]
    )


class _Recorder(Transform):
    """Records the order in which its hooks run, under its name."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def prepare(self, state):
        self.log.append(f"prepare {self.name}")
        return state

    def move(self, batch):
        self.log.append(f"move {self.name}")
        return batch

    def wrap_grad(self, inner):
        def grad_fn(*args):
            self.log.append(f"grad {self.name} >")
            out = inner(*args)
            self.log.append(f"grad {self.name} <")
            return out

        return grad_fn

    def wrap_update(self, inner):
        def update(*args):
            self.log.append(f"update {self.name}")
            return inner(*args)

        return update

    def wrap_core(self, inner):
        def core(*args):
            self.log.append(f"core {self.name}")
            return inner(*args)

        return core


class _StrategyRecorder(_Recorder, transforms.Strategy):
    """A strategy that records its hooks, its gradient reduction too."""

    def reduce(self, grads):
        self.log.append(f"reduce {self.name}")
        return grads


def test_compose_applies_every_hook_in_the_one_declared_order():
    log: list[str] = []
    pipeline = transforms.compose(
        placement=_Recorder("placement", log),
        precision=_Recorder("precision", log),
        strategy=_StrategyRecorder("strategy", log),
        detect_anomaly=_Recorder("anomaly", log),
        compile=_Recorder("compile", log),
    )
    tx = optim.sgd(0.1)
    state = pipeline.prepare(eg.TrainState.create(_model(), tx))
    batch = pipeline.move(_data(1)[0])
    pipeline.train_step(_loss, tx)(state, batch)
    stages = ["placement", "precision", "strategy", "anomaly", "compile"]
    grads_in = [f"grad {s} >" for s in stages]
    assert log == [
        *(f"prepare {s}" for s in stages),  # place, cast, shard
        *(f"move {s}" for s in stages),
        # outermost first: anomaly detection wraps the compiled core, never the reverse
        *(f"core {s}" for s in stages),
        # the precision wraps the gradient computation (a loss scale around backward), the
        # strategy's all-reduce runs inside it, right after backward ...
        *grads_in,
        *(f"grad {s} <" for s in reversed(stages)),
        # the strategy averages the window's gradients once, before every update hook (the
        # precision's finite check sees the global gradient) ...
        "reduce strategy",
        # ... and the precision wraps the update, before the gradients chain (unscale, clip)
        *(f"update {s}" for s in stages),
    ]
    with pytest.raises(TypeError, match=r"engine\.transforms\.Strategy"):
        transforms.compose(strategy=_Recorder("strategy", log))


def test_prepare_gives_the_precisions_param_dtype_and_the_optimizer_to_who_declares_them():
    seen: list[tuple] = []

    class Gathers(Transform):  # a sharding strategy's prepare, as FSDP's declares it
        def prepare(self, state, tx=None, param_dtype=None):
            seen.append((tx, param_dtype))
            return state

    tx = optim.sgd(0.1)
    for precision in ("bf16-mixed", "16-mixed", "32-true", "bf16-true"):
        pipeline = transforms.compose(
            precision=transforms.precision_transform(precision), observe=Gathers()
        )
        pipeline.prepare(eg.TrainState.create(_model(), tx), tx)
    # bf16-mixed gathers in bfloat16; 16-mixed keeps float32 gathers; a true precision's
    # parameters are already in their dtype
    assert seen == [(tx, torch.bfloat16), (tx, None), (tx, None), (tx, None)]
    assert transforms.compose(precision=transforms.MixedPrecision()).param_dtype == torch.bfloat16


def test_compose_refuses_what_is_not_a_transform():
    with pytest.raises(TypeError, match=r"not an engine\.transforms\.Transform"):
        transforms.compose(precision="bf16-mixed")
    with pytest.raises(ValueError, match=r"compose\(accumulate=0\)"):
        transforms.compose(accumulate=0)
    with pytest.raises(TypeError, match="stateless"):
        transforms.compose(clip=optim.adam(1e-3))
    with pytest.raises(TypeError, match=r"compose\(compile='yes'\)"):
        transforms.compose(compile="yes")
    with pytest.raises(TypeError, match=r"Observe\(after_backward=5\)"):
        transforms.Observe(after_backward=5)
    with pytest.raises(ValueError, match=r"SingleDevice\('gpu0'\): not a device"):
        transforms.SingleDevice("gpu0")


# ------------------------------------------- the seam carries a dynamic loss scale (issue 11)


class _LossScale(Transform):
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s own kernels, its state in
    ``TrainState.precision``: the shape the 16-mixed precision takes on this seam."""

    def __init__(self, init_scale: float, growth_interval: int) -> None:
        self.init_scale, self.growth_interval = init_scale, growth_interval

    def prepare(self, state):
        if state.precision is not None:
            return state
        return state.replace(
            precision={
                "scale": torch.full((), self.init_scale),
                "growth_tracker": torch.zeros((), dtype=torch.int32),
            }
        )

    def wrap_grad(self, inner):
        def grad_fn(forward, params, accumulate, precision):
            kept = {}

            def scaled():
                loss, aux = forward()
                kept["loss"] = loss
                return loss * precision["scale"], aux

            grads, _, aux = inner(scaled, params, accumulate, precision)
            return grads, kept["loss"], aux

        return grad_fn

    def wrap_update(self, inner):
        def update(grads, params, opt_state, precision, step):
            scale, tracker = precision["scale"].clone(), precision["growth_tracker"].clone()
            found_inf = torch.zeros(())
            inv = scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(list(grads.values()), found_inf, inv)
            if not found_inf.item():  # a skipped step leaves parameters and optimizer state alone
                opt_state, _, _ = inner(grads, params, opt_state, precision, step)
            torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, self.growth_interval)
            return opt_state, {"scale": scale, "growth_tracker": tracker}, {}

        return update


def test_the_seam_carries_a_dynamic_loss_scale_exactly_as_grad_scaler_runs_it(tmp_path):
    data = _data(10)
    poisoned = {2, 3, 7}  # batches whose loss overflows: their steps are skipped
    for i in poisoned:
        data[i] = (data[i][0].clone().fill_(float("inf")), data[i][1])

    def plain() -> nn.Module:  # no dropout: the raw loop's randomness is not the step's
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    loss_fn = _loss
    model = plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for batch in data:
        opt.zero_grad()
        scaler.scale(loss_fn(model, batch)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())

    tx = optim.sgd(0.1)
    pipeline = transforms.compose(precision=_LossScale(2.0**10, growth_interval=2))
    state = pipeline.prepare(eg.TrainState.create(plain(), tx))
    step = pipeline.train_step(loss_fn, tx)
    ours = []
    for i, batch in enumerate(data):
        state, metrics = step(state, pipeline.move(batch))
        ours.append(float(state.precision["scale"]))
        assert torch.isfinite(metrics["loss"]) == (i not in poisoned)  # the unscaled loss
        if i == 4:  # the loss scale's state round-trips through a checkpoint mid-run
            path = checkpoint.save(state, tmp_path / "c")
            state = checkpoint.load(path, pipeline.prepare(eg.TrainState.create(plain(), tx)))
    assert ours == scales and min(scales) < 2.0**10 < max(scales)  # backed off and grew
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


def test_single_device_moves_every_tensor_of_the_state_and_of_batches():
    tx = optim.adam(1e-2)
    state = eg.TrainState.create(_model(), tx, seed=2)
    placement = transforms.SingleDevice("meta")  # a device every machine has
    moved = placement.prepare(state)
    counters = tree_tensors(moved.opt_state[0].step)  # Adam reads them on the host, as torch
    leaves = [
        *moved.params.values(),
        *moved.buffers.values(),
        *(t for t in tree_tensors(moved.opt_state) if not any(t is c for c in counters)),
    ]
    assert leaves and all(t.device.type == "meta" for t in leaves)
    assert counters and all(t.device.type == "cpu" for t in counters)
    assert all(p.requires_grad for p in moved.params.values())
    assert moved.step == state.step and moved.seed == state.seed
    assert all(t.device.type == "cpu" for t in state.params.values())  # the input is untouched
    x, y = placement.move((torch.ones(2), {"y": torch.zeros(1)}))
    assert x.device.type == "meta" and y["y"].device.type == "meta"
    cpu = transforms.SingleDevice()
    assert cpu.prepare(state) is state  # already there: nothing to do


@pytest.mark.slow
def test_a_compiled_custom_loop_equals_the_trainers_compiled_flags_bitwise():
    tx = optim.adamw(1e-2)
    task = eg.Task(_loss, tx)

    def model() -> nn.Module:  # no dropout: eager and compiled draw different masks
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    trainer = eg.Trainer(
        max_epochs=1,
        accumulate_grad_batches=2,
        compile=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_journal=False,
    )
    by_flags = trainer.fit(task, task.init(model(), seed=3), _data())
    pipeline = transforms.compose(accumulate=2, compile=True)
    state = pipeline.prepare(eg.TrainState.create(model(), tx, seed=3))
    step = pipeline.train_step(_loss, tx)
    data = _data()
    for i, batch in enumerate(data):
        state, _ = step(state, pipeline.move(batch), flush=i == len(data) - 1)
    state = state.replace(epoch=1, batch_idx=0)
    assert state.fingerprint() == by_flags.fingerprint()
