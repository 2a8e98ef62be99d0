"""Lightning's precisions as step transforms, against torch's own references: autocast and
``torch.amp.GradScaler`` for the mixed precisions, a float64 raw loop for ``"64-true"``, a fresh
process for resume."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim, transforms
from engine.errors import CheckpointError

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def _model(seed: int = 0) -> nn.Module:  # no dropout: a raw loop's randomness is not a step's
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(n: int = 12, seed: int = 0, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable batches: the class is the arg-max of a fixed linear map of the input."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(99))
    xs = [torch.randn(batch, 6, generator=g) for _ in range(n)]
    return [(x, (x @ w).argmax(-1)) for x in xs]


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _poison(data, at):
    """Batches whose inputs are inf: their gradients overflow, their steps are skipped."""
    data = list(data)
    for i in at:
        data[i] = (torch.full_like(data[i][0], float("inf")), data[i][1])
    return data


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("flag", "name", "kind"),
    [
        (None, "32-true", transforms.Float32),
        (32, "32-true", transforms.Float32),
        ("32", "32-true", transforms.Float32),
        (64, "64-true", transforms.TruePrecision),
        ("64", "64-true", transforms.TruePrecision),
        (16, "16-mixed", transforms.MixedPrecision),
        ("16", "16-mixed", transforms.MixedPrecision),
        ("bf16", "bf16-mixed", transforms.MixedPrecision),
        ("bf16-true", "bf16-true", transforms.TruePrecision),
        ("16-true", "16-true", transforms.TruePrecision),
    ],
)
def test_lightnings_precision_values_and_aliases_resolve_to_their_transform(flag, name, kind):
    trainer = eg.Trainer(precision=flag, **QUIET)
    assert trainer.precision == name  # Lightning's trainer.precision: the canonical name
    assert isinstance(trainer.assembly.precision, kind)
    assert repr(transforms.precision_transform(flag)) == repr(trainer.assembly.precision)


def test_transformer_engine_without_the_package_says_what_to_install():
    pytest.importorskip  # noqa: B018 - the package is absent on this machine
    if __import__("importlib").util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    for flag in ("transformer-engine", "transformer-engine-float16"):
        with pytest.raises(ValueError, match=r"pip install 'transformer-engine\[pytorch\]'"):
            eg.Trainer(precision=flag, **QUIET)


def test_a_precision_plugin_and_a_precision_flag_together_are_refused():
    with pytest.raises(ValueError, match="both set the precision"):
        eg.Trainer(precision="bf16-mixed", plugins=[transforms.MixedPrecision()], **QUIET)
    trainer = eg.Trainer(plugins=transforms.MixedPrecision(torch.float16), **QUIET)
    assert trainer.precision == "16-mixed"
    custom = transforms.MixedPrecision(torch.float16, loss_scale=transforms.DynamicLossScale(8.0))
    assert eg.Trainer(plugins=[custom], **QUIET).precision == repr(custom)


def test_mixed_precision_refuses_half_parameters_and_a_foreign_precision_state():
    tx = optim.sgd(0.1)
    half = eg.TrainState.create(_model().to(torch.bfloat16), tx)
    with pytest.raises(ValueError, match=r"float32 master parameters.*'bf16-true'"):
        transforms.MixedPrecision(torch.bfloat16).prepare(half)
    odd = eg.TrainState.create(_model(), tx).replace(precision={"ema": torch.zeros(())})
    with pytest.raises(ValueError, match="not a loss scale"):
        transforms.MixedPrecision(torch.float16).prepare(odd)
    with pytest.raises(ValueError, match=r"torch\.float16, torch\.bfloat16"):
        transforms.MixedPrecision(torch.float64)
    with pytest.raises(ValueError, match="backoff_factor"):
        transforms.DynamicLossScale(backoff_factor=1.5)


# --------------------------------------------------------------------------- 16-mixed


def _grad_scaler_run(data, make_opt, init_scale, growth_interval):
    """The reference: Lightning's 16-mixed step written with torch.amp by hand."""
    model = _model()
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales, losses = [], []
    for batch in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(loss.detach())
    return model, opt, scales, losses


@pytest.mark.parametrize(
    ("make_opt", "tx"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), optim.sgd(0.1, momentum=0.9)),
        (lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True), optim.adam(1e-2, fused=False)),
    ],
    ids=["sgd", "adam"],
)
def test_16_mixed_matches_autocast_and_grad_scaler_bitwise_with_overflows(make_opt, tx):
    data = _poison(_data(12), at=(2, 3, 8))
    model, _, scales, _ = _grad_scaler_run(data, make_opt, 2.0**12, growth_interval=3)

    pipeline = transforms.compose(
        precision=transforms.MixedPrecision(
            torch.float16, loss_scale=transforms.DynamicLossScale(2.0**12, growth_interval=3)
        )
    )
    state = pipeline.prepare(eg.TrainState.create(_model(), tx))
    step = pipeline.train_step(_loss, tx)
    ours, skipped = [], []
    for batch in data:
        state, metrics = step(state, pipeline.move(batch))
        ours.append(float(state.precision["scale"]))
        skipped.append(int(metrics["skipped"]))
    assert skipped == [int(i in (2, 3, 8)) for i in range(12)]
    assert ours == scales and min(scales) < 2.0**12  # backed off ...
    assert any(b > a for a, b in itertools.pairwise(scales))  # ... and grew
    assert state.step == 12  # a skipped step counts, as Lightning's global_step does
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


def test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged():
    tx = optim.adamw(1e-2)
    pipeline = transforms.compose(precision=transforms.MixedPrecision(torch.float16))
    state = pipeline.prepare(eg.TrainState.create(_model(), tx))
    step = pipeline.train_step(_loss, tx)
    (good,) = _data(1)
    state, _ = step(state, good)
    before = state.copy()
    state, metrics = step(state, _poison([good], at=(0,))[0])
    assert float(metrics["skipped"]) == 1.0
    after = state.replace(precision=before.precision, step=before.step, batch_idx=before.batch_idx)
    assert after.fingerprint() == before.fingerprint()  # params, moments, counters
    assert float(state.precision["scale"]) == float(before.precision["scale"]) / 2
    assert int(state.precision["growth_tracker"]) == 0


def test_16_mixed_through_the_trainer_journals_the_skipped_steps(tmp_path):
    data = _poison(_data(8), at=(1, 5))
    task = eg.Task(_loss, optim.sgd(0.1))
    trainer = eg.Trainer(
        max_epochs=1,
        precision="16-mixed",
        log_every_n_steps=4,
        default_root_dir=tmp_path,
        **QUIET,
    )
    state = trainer.fit(task, task.init(_model()), data)
    journal = (Path(trainer.run_dir) / "journal.jsonl").read_text()
    lines = [json.loads(x) for x in journal.splitlines()]
    skipped = [s for line in lines for s in line.get("skipped", [])]
    assert skipped == [2, 6]  # optimizer steps are numbered from 1 in the journal
    assert float(state.precision["scale"]) == 2.0**16 / 4
    assert trainer.callback_metrics["train/skipped"] in (0.0, 1.0)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.divergence is None and report.steps == 8, report


# --------------------------------------------------------------------------- true precisions


def test_64_true_equals_a_float64_raw_loop_bitwise():
    data = _data(6)
    model = _model().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x.double()), y).backward()
        opt.step()

    task = eg.Task(_loss, optim.adamw(1e-2, fused=False))
    trainer = eg.Trainer(max_epochs=1, precision="64-true", barebones=True)
    state = trainer.fit(task, task.init(_model()), data)
    for name, p in model.named_parameters():
        assert state.params[name].dtype == torch.float64
        assert torch.equal(state.params[name], p.detach()), name
    # the moments are in the parameters' dtype, the step counters float32 as torch keeps them
    (adam,) = [s for s in state.opt_state if hasattr(s, "exp_avg")]
    assert {t.dtype for t in adam.exp_avg.values()} == {torch.float64}
    assert {t.dtype for t in adam.step.values()} == {torch.float32}


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_the_half_true_precisions_train(precision):
    data = _data(16, batch=64)
    # float16 holds no 1e-8: Adam's default eps is 0 there and torch.optim's default path then
    # divides 0 by 0 where a gradient is 0 (engine warns, naming eps); 1e-4 is what it advises
    tx = optim.adam(1e-2, eps=1e-4) if precision == "16-true" else optim.adam(1e-2)
    task = eg.Task(_loss, tx, eval_fn=_loss)
    trainer = eg.Trainer(max_epochs=4, precision=precision, barebones=True)
    state = task.init(_model())
    (before,) = trainer.validate(task, state, data, verbose=False)
    state = trainer.fit(task, state, data)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    assert {p.dtype for p in state.params.values()} == {dtype}
    (after,) = trainer.validate(task, state, data, verbose=False)
    assert after["val/loss"] < 0.8 * before["val/loss"]


def test_true_precision_casts_batches_floating_tensors_only():
    cast = transforms.TruePrecision(torch.float16)
    x, y, meta = cast.move((torch.ones(2), torch.tensor([1, 2]), {"w": torch.ones(1).double()}))
    assert (x.dtype, y.dtype, meta["w"].dtype) == (torch.float16, torch.int64, torch.float16)
    state = cast.prepare(eg.TrainState.create(_model(), optim.sgd(0.1)))
    assert cast.prepare(state) is state  # idempotent: a resume template is prepared once more


# --------------------------------------------------------------------------- bf16-mixed


def test_bf16_mixed_autocasts_training_evaluation_and_prediction():
    seen = []

    def loss_fn(model, batch):
        out = model(batch[0])
        seen.append(out.dtype)
        return F.cross_entropy(out, batch[1])

    task = eg.Task(loss_fn, optim.sgd(0.1))
    trainer = eg.Trainer(max_epochs=1, precision="bf16-mixed", barebones=True)
    state = trainer.fit(task, task.init(_model()), _data(2))
    assert seen == [torch.bfloat16, torch.bfloat16]  # the forward ran in bfloat16 ...
    assert {p.dtype for p in state.params.values()} == {torch.float32}  # ... master weights not
    trainer.validate(task, state, _data(1), verbose=False)
    assert seen[-1] == torch.bfloat16
    (out,) = trainer.predict(task, state, [x for x, _ in _data(1)])
    assert out.dtype == torch.bfloat16


def test_bf16_mixed_trains_digits_within_a_point_of_float32():
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from digits import load, make_model, make_task
    from torch.utils.data import DataLoader

    train, _, test = load(0)
    accuracies = {}
    for precision in ("32-true", "bf16-mixed"):
        loader = DataLoader(train, batch_size=64, sampler=eg.data.ShuffleSampler(train, seed=0))
        task = make_task(12 * len(loader))
        torch.manual_seed(0)
        state = task.init(make_model(), seed=0)
        trainer = eg.Trainer(max_epochs=12, precision=precision, barebones=True)
        state = trainer.fit(task, state, loader)
        (result,) = trainer.test(task, state, DataLoader(test, batch_size=256), verbose=False)
        accuracies[precision] = result["test/acc"]
    assert accuracies["32-true"] > 0.9
    assert abs(accuracies["bf16-mixed"] - accuracies["32-true"]) <= 0.01, accuracies


@pytest.mark.slow
def test_compiled_and_eager_bf16_mixed_agree_within_tolerance():
    data = _data(6)
    task = eg.Task(_loss, optim.adamw(1e-2))
    states = {}
    for compile in (False, True):
        trainer = eg.Trainer(max_epochs=1, precision="bf16-mixed", compile=compile, barebones=True)
        states[compile] = trainer.fit(task, task.init(_model()), data)
    for name, p in states[False].params.items():
        torch.testing.assert_close(states[True].params[name], p, rtol=2e-2, atol=2e-3)


@pytest.mark.slow
def test_compiled_16_mixed_skips_overflowing_steps_without_a_host_sync_as_grad_scaler_does():
    data = _poison(_data(8), at=(2, 5))
    model, _, scales, _ = _grad_scaler_run(
        data, lambda p: torch.optim.SGD(p, lr=0.1), 2.0**10, growth_interval=2
    )
    tx = optim.sgd(0.1)
    pipeline = transforms.compose(
        precision=transforms.MixedPrecision(
            torch.float16, loss_scale=transforms.DynamicLossScale(2.0**10, growth_interval=2)
        ),
        compile=True,
    )
    state = pipeline.prepare(eg.TrainState.create(_model(), tx))
    step = pipeline.train_step(_loss, tx)
    ours = []
    for batch in data:
        state, _ = step(state, pipeline.move(batch))
        ours.append(float(state.precision["scale"]))
    assert ours == scales
    for name, p in model.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_resume_mid_accumulation_window_in_a_fresh_process_is_bitwise(tmp_path, precision):
    # a checkpoint taken after micro-batch 2 of a 3-batch window, an overflow before it
    save = eg.on(
        eg.Event.ON_TRAIN_BATCH_END,
        lambda rec: eg.Save(str(tmp_path / "mid")) if rec.batch_idx == 4 else None,
    )
    task = eg.Task(_loss, optim.adamw(1e-2))
    flags = dict(max_epochs=2, precision=precision, accumulate_grad_batches=3, **QUIET)
    data = _poison(_data(10), at=(4,))
    whole = eg.Trainer(callbacks=[save], default_root_dir=tmp_path / "w", **flags).fit(
        task, task.init(_model()), data
    )
    meta = checkpoint.read_meta(tmp_path / "mid")
    assert meta["micro_step"] == 2
    assert (meta["trees"]["precision"] is not None) == (precision == "16-mixed")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import engine as eg
        from engine import optim
        from test_precision import _data, _loss, _model, _poison
        task = eg.Task(_loss, optim.adamw(1e-2))
        trainer = eg.Trainer(max_epochs=2, precision={precision!r}, accumulate_grad_batches=3,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, default_root_dir={str(tmp_path / "r")!r})
        state = trainer.fit(task, task.init(_model(seed=5)), _poison(_data(10), at=(4,)),
            ckpt_path={str(tmp_path / "mid")!r})
        print(state.fingerprint())
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == whole.fingerprint()


def test_a_checkpoint_resumed_under_another_precision_is_refused_naming_it(tmp_path):
    task = eg.Task(_loss, optim.sgd(0.1))
    saver = eg.Trainer(max_epochs=1, precision="bf16-true", default_root_dir=tmp_path, **QUIET)
    saver.fit(task, task.init(_model()), _data(2))
    saver.save_checkpoint(tmp_path / "bf16")
    with pytest.raises(
        CheckpointError, match=r"precision 'bf16-true' and this Trainer runs '32-true'"
    ):
        eg.Trainer(max_epochs=2, default_root_dir=tmp_path, **QUIET).fit(
            task, task.init(_model()), _data(2), ckpt_path=tmp_path / "bf16"
        )
    plain = eg.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    plain.fit(task, task.init(_model()), _data(2))
    plain.save_checkpoint(tmp_path / "f32")
    with pytest.raises(
        CheckpointError, match=r"precision '32-true' and this Trainer runs '16-mixed'"
    ):
        eg.Trainer(max_epochs=2, precision="16-mixed", default_root_dir=tmp_path, **QUIET).fit(
            task, task.init(_model()), _data(2), ckpt_path=tmp_path / "f32"
        )


def test_a_custom_loop_with_the_transforms_equals_the_trainers_precision_flag_bitwise():
    tx = optim.adamw(1e-2)
    task = eg.Task(_loss, tx)
    data = _poison(_data(6), at=(3,))
    by_flags = eg.Trainer(
        max_epochs=1, precision="16-mixed", accumulate_grad_batches=2, barebones=True
    ).fit(task, task.init(_model(), seed=1), data)
    pipeline = transforms.compose(
        precision=transforms.precision_transform("16-mixed"), accumulate=2
    )
    state = pipeline.prepare(eg.TrainState.create(_model(), tx, seed=1))
    step = pipeline.train_step(_loss, tx)
    for i, batch in enumerate(data):
        state, _ = step(state, pipeline.move(batch), flush=i == len(data) - 1)
    assert state.replace(epoch=1, batch_idx=0).fingerprint() == by_flags.fingerprint()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_compile_compiles_the_eval_and_predict_steps_too(precision):
    from torch._dynamo.utils import counters

    task = eg.Task(_loss, optim.sgd(0.1), eval_fn=_loss)
    state = task.init(_model())
    data = _data(2)
    results = {}
    for compile in (False, True):
        trainer = eg.Trainer(precision=precision, compile=compile, barebones=True)
        torch._dynamo.reset()
        counters.clear()
        (metrics,) = trainer.validate(task, state, data, verbose=False)
        outputs = trainer.predict(task, state, [x for x, _ in data])
        results[compile] = (metrics["val/loss"], torch.cat(outputs))
        graphs = counters["stats"]["unique_graphs"]
        assert (graphs >= 2) == compile, graphs  # one for evaluation, one for prediction
    assert results[True][0] == pytest.approx(results[False][0], rel=2e-2)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=2e-2, atol=2e-2)


def test_16_mixed_clips_the_unscaled_gradients_as_lightning_does_with_grad_scaler():
    data = _poison(_data(8), at=(3,))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    for batch in data:  # Lightning's order: unscale, clip, step (skipped on overflow), update
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=True)
        scaler.step(opt)
        scaler.update()
    precision = transforms.MixedPrecision(
        torch.float16, loss_scale=transforms.DynamicLossScale(2.0**8, growth_interval=2)
    )
    task = eg.Task(_loss, optim.sgd(0.5))
    trainer = eg.Trainer(max_epochs=1, plugins=[precision], gradient_clip_val=0.1, barebones=True)
    state = trainer.fit(task, task.init(_model()), data)
    assert float(state.precision["scale"]) == scaler.get_scale()
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


_LIGHTNING_CPU_VALUES = [None, 64, "64", 32, "32", "bf16", "64-true", "32-true", "bf16-mixed"]
_LIGHTNING_CPU_VALUES += ["16-true", "bf16-true"]


def test_precision_names_and_refusals_match_lightnings_own():
    pl = pytest.importorskip("pytorch_lightning")
    import warnings

    def theirs(value):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pl.Trainer(
                precision=value,
                accelerator="cpu",
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
            ).precision

    for value in _LIGHTNING_CPU_VALUES:
        assert eg.Trainer(precision=value, **QUIET).precision == theirs(value), value
    for value in ("fp16", 8, "16-MIXED", 32.0):
        with pytest.raises((ValueError, RuntimeError)):
            theirs(value)
        with pytest.raises(ValueError, match=rf"precision={value!r}"):
            eg.Trainer(precision=value, **QUIET)


def test_grad_norm_under_16_mixed_is_of_the_unscaled_gradients():
    (batch,) = _data(1)
    norms = {}
    for precision in ("32-true", "16-mixed"):
        task = eg.Task(_loss, optim.sgd(0.1), grad_norm=True)
        seen = []
        probe = eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda rec, seen=seen: seen.append(rec.outputs))
        trainer = eg.Trainer(max_epochs=1, precision=precision, callbacks=[probe], **QUIET)
        trainer.fit(task, task.init(_model()), [batch])
        norms[precision] = float(seen[0]["grad_norm"])
    assert norms["16-mixed"] == pytest.approx(norms["32-true"], rel=1e-2)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_replay_runs_with_the_recorded_precision(tmp_path, precision):
    task = eg.Task(_loss, optim.adamw(1e-2))
    trainer = eg.Trainer(
        max_epochs=1, precision=precision, log_every_n_steps=2, default_root_dir=tmp_path, **QUIET
    )
    trainer.fit(task, task.init(_model()), _data(6))
    config = json.loads((Path(trainer.run_dir) / "config.json").read_text())
    assert (config["precision"], config["device"]) == (precision, "cpu")
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.divergence is None and report.steps == 6 and report.compared > 0, report


@pytest.mark.parametrize("kill_at", [5, 8])  # after a skipped step; mid accumulation window
@pytest.mark.parametrize("asynchronous", [False, True])
def test_sigkill_mid_fit_under_16_mixed_resumes_from_last_bitwise(tmp_path, kill_at, asynchronous):
    here = str(Path(__file__).parent)
    flags = "max_epochs=2, precision='16-mixed', accumulate_grad_batches=2"
    script = textwrap.dedent(f"""
        import os, signal, sys; sys.path.insert(0, {here!r})
        import engine as eg
        from engine import optim
        from engine.listeners import ModelCheckpoint
        from test_precision import _data, _loss, _model, _poison

        class Kill(eg.Listener):
            def on_train_batch_start(self, rec):
                if rec.run.global_step == {kill_at}:
                    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally

        saver = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1,
                                asynchronous={asynchronous})
        task = eg.Task(_loss, optim.adamw(1e-2))
        eg.Trainer({flags}, default_root_dir={str(tmp_path)!r}, callbacks=[saver, Kill()],
                   logger=False, enable_progress_bar=False, enable_model_summary=False,
                   ).fit(task, task.init(_model()), _poison(_data(10), at=(3,)))
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    task = eg.Task(_loss, optim.adamw(1e-2))
    data = _poison(_data(10), at=(3,))
    full = eg.Trainer(
        max_epochs=2, precision="16-mixed", accumulate_grad_batches=2, barebones=True
    ).fit(task, task.init(_model()), data)
    resumed = eg.Trainer(
        max_epochs=2,
        precision="16-mixed",
        accumulate_grad_batches=2,
        default_root_dir=tmp_path,
        **QUIET,
    ).fit(task, task.init(_model()), data, ckpt_path="last")  # none landed: from the start
    assert resumed.fingerprint() == full.fingerprint()
    assert torch.equal(resumed.precision["scale"], full.precision["scale"])


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ("16-mixed", "bf16-mixed"),
        ("16-mixed", "32-true"),
        ("bf16-mixed", "32-true"),
        ("32-true", "bf16-mixed"),
        ("64-true", "32-true"),
    ],
)
def test_every_change_of_precision_on_resume_is_refused_by_name(tmp_path, saved, resumed):
    task = eg.Task(_loss, optim.sgd(0.1), eval_fn=_loss)
    first = eg.Trainer(max_epochs=1, precision=saved, default_root_dir=tmp_path, **QUIET)
    state = first.fit(task, task.init(_model()), _data(2))
    first.save_checkpoint(tmp_path / "c")
    with pytest.raises(CheckpointError, match=rf"'{saved}' and this Trainer runs '{resumed}'"):
        eg.Trainer(max_epochs=2, precision=resumed, default_root_dir=tmp_path, **QUIET).fit(
            task, task.init(_model()), _data(2), ckpt_path=tmp_path / "c"
        )
    if saved.endswith("mixed") and resumed.endswith(("mixed", "32-true")):  # same dtypes
        evaluator = eg.Trainer(precision=resumed, default_root_dir=tmp_path, **QUIET)
        (metrics,) = evaluator.validate(
            task, state, _data(2), ckpt_path=tmp_path / "c", verbose=False
        )
        assert metrics["val/loss"] > 0  # evaluating its weights under another one is fine
