"""Weight averaging as pure state: the EMA inside the optimizer step (``ema_weights``) against
torch's ``AveragedModel``, its listener's validation swaps and final weights, SWA against
Lightning's own callback and torch's ``SWALR``, and bitwise resume (fresh process) and replay
of runs with each."""

from __future__ import annotations

import copy
import hashlib
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim
from engine.listeners.averaging import EMAWeightAveraging, StochasticWeightAveraging, swalr
from engine.optim.averaging import EmaState, ema_params, ema_weights, find_ema

HERE = str(Path(__file__).parent)


def _mse(m, b):
    return F.mse_loss(m(b[0]), b[1])


def _batches(n: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _quiet(**flags) -> eg.Trainer:
    base = dict(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return eg.Trainer(**{**base, **flags})


# ----------------------------------------------------------------------------- EMA, optimizer


def test_ema_matches_torchs_averaged_model_bitwise():
    decay = 0.9
    data = _batches(8)
    theirs = _net()
    averaged = AveragedModel(theirs, multi_avg_fn=get_ema_multi_avg_fn(decay))
    opt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, foreach=True)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(theirs(x), y).backward()
        opt.step()
        averaged.update_parameters(theirs)

    tx = ema_weights(optim.sgd(0.05, momentum=0.9), decay=decay)
    state = eg.TrainState.create(_net(), tx, seed=0)
    step = eg.train_step(_mse, tx)
    for batch in data:
        state, _ = step(state, batch)
    ours = ema_params(state.opt_state)
    for name, p in averaged.module.named_parameters():
        assert torch.equal(ours[name], p), name
    for name, p in theirs.named_parameters():
        assert torch.equal(state.params[name], p), name  # the optimizer itself is untouched
    assert float(find_ema(state.opt_state).step) == len(data)


def test_ema_update_form_equals_its_apply_form_bitwise():
    tx = ema_weights(optim.adamw(1e-2, fused=False), decay=0.8)
    g = torch.Generator().manual_seed(1)
    params_a = {"w": torch.randn(5, generator=g), "b": torch.randn(2, generator=g)}
    params_b = {k: v.clone() for k, v in params_a.items()}
    sa, sb = tx.init(params_a), tx.init(params_b)
    for i in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params_a.items()}
        params_a, sa = optim.apply_gradients(tx, dict(grads), sa, params_a, i)
        updates, sb = tx.update(dict(grads), sb, params_b, i)
        optim.apply_updates(params_b, updates)
    assert all(torch.equal(sa.ema[k], sb.ema[k]) for k in sa.ema)
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)


def test_ema_state_checkpoints_and_loads_as_optimizer_state(tmp_path):
    tx = ema_weights(optim.adam(1e-2), decay=0.5)
    state = eg.TrainState.create(nn.Linear(3, 1), tx, seed=0)
    state, _ = eg.train_step(_mse, tx)(state, _batches(1)[0])
    keys = optim.state_dict(state.opt_state)
    assert any(k.startswith(".ema") or ".ema[" in k for k in keys), sorted(keys)
    assert isinstance(state.opt_state, EmaState)


@pytest.mark.slow
def test_ema_step_compiles_and_matches_eager():
    tx = ema_weights(optim.sgd(0.05, momentum=0.9), decay=0.9)
    data = _batches(3)
    states = []
    for compile in (False, True):
        torch.manual_seed(0)
        state = eg.TrainState.create(nn.Linear(3, 1), tx, seed=0)
        step = eg.train_step(_mse, tx, compile=compile)
        for batch in data:
            state, _ = step(state, batch)
        states.append(ema_params(state.opt_state))
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- EMA, listener


class _Watch(eg.Listener):
    """What the state holds around each validation and at the end of training."""

    def __init__(self) -> None:
        self.before, self.during, self.buffers, self.losses, self.final = [], [], [], [], None

    @staticmethod
    def _both(rec):
        ema = find_ema(rec.state.opt_state).ema
        params = {k: v.detach().clone() for k, v in rec.state.params.items()}
        return params, {k: v.clone() for k, v in ema.items()}

    def on_validation_start(self, rec):
        self.before.append(self._both(rec))

    def on_validation_epoch_end(self, rec):
        self.during.append(self._both(rec))
        if not rec.run.sanity_checking:
            self.losses.append(rec.metrics["val/loss"])
            self.buffers.append({k: v.clone() for k, v in rec.state.buffers.items()})

    def on_train_end(self, rec):
        self.final = self._both(rec)[1]  # the average, before the final transition


def test_validation_evaluates_the_average_and_fit_returns_it():
    watch = _Watch()
    task = eg.Task(_mse, ema_weights(optim.adamw(1e-2), decay=0.7))
    val = _batches(2, seed=5)
    trainer = _quiet(max_epochs=2, val_check_interval=3, callbacks=[EMAWeightAveraging(), watch])
    state = trainer.fit(task, task.init(_net(), seed=0), _batches(6), val)
    assert len(watch.before) == 5  # the sanity check, then two a epoch
    for (params, ema), (params_in, ema_in) in zip(watch.before, watch.during, strict=True):
        assert all(torch.equal(params_in[k], ema[k]) for k in params)  # swapped in
        assert all(torch.equal(ema_in[k], params[k]) for k in params)
    params, ema = watch.before[-1]
    assert any(not torch.equal(params[k], ema[k]) for k in params)  # they differ by then
    # the validation loss is that of the averaged weights, evaluated by hand
    for (_, ema), buffers, loss in zip(watch.before[1:], watch.buffers, watch.losses, strict=True):
        model = copy.deepcopy(state.module).eval()
        model.load_state_dict({**ema, **buffers})
        with torch.no_grad():
            by_hand = sum(F.mse_loss(model(x), y).item() for x, y in val) / len(val)
        assert loss == pytest.approx(by_hand, rel=1e-6)
    # training went on with its own weights: swapped back after each validation
    assert all(torch.equal(state.params[k], watch.final[k]) for k in state.params)


def test_ema_listener_refuses_an_optimizer_without_an_average():
    task = eg.Task(_mse, optim.adamw(1e-3))
    trainer = _quiet(max_epochs=1, callbacks=[EMAWeightAveraging()])
    with pytest.raises(ValueError, match=r"tx=optim\.ema_weights\(optim\.adamw\(1e-3\)"):
        trainer.fit(task, task.init(nn.Linear(3, 1)), _batches(2))


def test_ema_listener_leaves_validate_alone():
    task = eg.Task(_mse, ema_weights(optim.adamw(1e-2)))
    state = task.init(nn.Linear(3, 1))
    trainer = _quiet(callbacks=[EMAWeightAveraging()])
    assert trainer.validate(task, state, _batches(2), verbose=False)  # no transition refused


# ----------------------------------------------------------------------------- resume and replay


class SaveAt(eg.Listener):
    """Saves once: at ``event`` of epoch ``epoch`` and batch ``batch`` (any batch if None)."""

    def __init__(self, event: str, epoch: int, path: Path, batch: int | None = None) -> None:
        self.epoch, self.batch, self.path, self.saved = epoch, batch, path, False
        setattr(self, event, self._save)

    def _save(self, rec):
        here = rec.run.current_epoch == self.epoch and not rec.run.sanity_checking
        if here and (self.batch is None or rec.batch_idx == self.batch) and not self.saved:
            self.saved = True
            return eg.Save(self.path)
        return None


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


def fit(root: Path, kind: str, listeners=(), ckpt_path=None) -> tuple[eg.Trainer, eg.TrainState]:
    """A run with EMA (``kind="ema"``) or SWA with BatchNorm (``"swa"``), on shuffled data."""
    torch.manual_seed(0)
    if kind == "ema":
        task = eg.Task(_mse, ema_weights(optim.adamw(1e-2), decay=0.8))
        averaging: eg.Listener = EMAWeightAveraging()
    else:
        task = eg.Task(_mse, optim.inject_hyperparams(optim.sgd)(lr=0.05, momentum=0.9))
        averaging = StochasticWeightAveraging(0.01, swa_epoch_start=2, annealing_epochs=2)
    trainer = _quiet(
        max_epochs=4,
        val_check_interval=2,
        default_root_dir=root,
        log_every_n_steps=1,
        callbacks=[averaging, *listeners],
    )
    state = trainer.fit(
        task, task.init(_net(), seed=1), _loader(), _batches(2, seed=9), ckpt_path=ckpt_path
    )
    return trainer, state


def digest(state: eg.TrainState) -> str:
    """The fingerprint and the bits of ``extra``'s tensors (which fingerprints leave out)."""
    h = hashlib.sha256(state.fingerprint().encode())
    swa = state.extra.get("swa")
    if swa is not None:
        for k, v in sorted(swa["average"].items()):
            h.update(k.encode() + v.numpy().tobytes())
        h.update(swa["n_averaged"].numpy().tobytes() + str(swa["epoch"]).encode())
    return h.hexdigest()


@pytest.mark.parametrize(
    ("kind", "event", "epoch", "batch"),
    [
        ("ema", "on_train_batch_end", 1, 2),
        ("ema", "on_validation_batch_end", 2, 0),  # saved with the average swapped in
        ("swa", "on_train_batch_end", 2, 1),
        ("swa", "on_train_epoch_start", 3, None),  # right after an averaging transition
    ],
)
def test_a_fit_resumed_in_a_fresh_process_is_bitwise_the_uninterrupted_one(
    tmp_path, kind, event, epoch, batch
):
    ckpt = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        from pathlib import Path
        from test_averaging import SaveAt, digest, fit
        saver = SaveAt({event!r}, {epoch}, Path({str(ckpt)!r}), {batch!r})
        _, state = fit(Path({str(tmp_path / "full")!r}), {kind!r}, [saver])
        assert saver.saved
        print(digest(state))
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _, resumed = fit(tmp_path / "resumed", kind, ckpt_path=str(ckpt))
    assert digest(resumed) == done.stdout.split()[-1]


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_a_run_with_averaging_replays_bitwise(tmp_path, kind):
    ckpt = tmp_path / "ckpt"
    trainer, _ = fit(tmp_path / "run", kind, [SaveAt("on_train_batch_end", 2, ckpt, 1)])
    lines = eg.Journal.read(trainer.run_dir)
    names = {x["transition"] for x in lines if "transition" in x}
    assert names >= (
        {"ema: average in", "ema: average out"}
        if kind == "ema"
        else {"swa: average", "swa: learning rate"}
    )
    report = eg.replay(trainer.run_dir, 1, 20, trust_code=True)
    assert report.identical and report.steps == 20, str(report)
    saved = next(x for x in lines if x.get("checkpoint") == str(ckpt.resolve()))
    report = eg.replay(trainer.run_dir, saved["step"] + 1, 20, trust_code=True)
    assert report.identical and report.checkpoint == str(ckpt.resolve()), str(report)


# ----------------------------------------------------------------------------- SWA


@pytest.mark.parametrize("strategy", ["cos", "linear"])
@pytest.mark.parametrize("anneal_epochs", [0, 1, 3])
def test_swalr_is_torchs_schedule_bitwise(strategy, anneal_epochs):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    scheduler = SWALR(opt, swa_lr=0.02, anneal_epochs=anneal_epochs, anneal_strategy=strategy)
    lr = swalr(0.3, 0.02, 0, anneal_epochs, strategy)  # building it steps once
    assert lr == opt.param_groups[0]["lr"] == (0.3 if anneal_epochs else 0.02)
    for k in range(1, 8):
        opt.step()
        scheduler.step()
        lr = swalr(lr, 0.02, k, anneal_epochs, strategy)
        assert lr == opt.param_groups[0]["lr"], k


def _lightning_swa(net, loader, max_epochs, **swa):
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.lrs: list[float] = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

        def on_train_epoch_start(self):
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            if self.trainer.current_epoch == max_epochs:  # its BatchNorm epoch, which begins
                # with the average transferred (and then moves the weights: see below)
                self.average = {k: v.detach().clone() for k, v in self.net.named_parameters()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, foreach=True)

    module = Module()
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[pl.callbacks.StochasticWeightAveraging(**swa)],
    )
    trainer.fit(module, loader)
    return module


class _Lrs(eg.Listener):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_epoch_start(self, rec):
        self.lrs.append(optim.get_hyperparams(rec.state.opt_state)["lr"])


@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_swa_matches_lightnings_callback(strategy):
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    swa = dict(swa_lrs=0.02, swa_epoch_start=3, annealing_epochs=2, annealing_strategy=strategy)
    theirs = _lightning_swa(_net(), loader, 6, **swa)

    lrs = _Lrs()
    task = eg.Task(_mse, optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9))
    trainer = _quiet(
        max_epochs=6, enable_journal=False, callbacks=[StochasticWeightAveraging(**swa), lrs]
    )
    state = trainer.fit(task, task.init(_net(), seed=0), loader)
    assert lrs.lrs == theirs.lrs[:6]  # bitwise (its 7th epoch is the BatchNorm pass)
    assert int(state.extra["swa"]["n_averaged"]) == 4  # epochs 2..5 (0-based) at their start
    # the average Lightning transfers at the start of its extra (BatchNorm) epoch; that epoch
    # then takes an optimizer step of its own (its weights end elsewhere: 3.bias -0.135 where
    # the average is -0.182), which torch's update_bn, and this listener, do not
    for name, p in theirs.average.items():
        assert torch.equal(state.params[name], p), name
    # the BatchNorm statistics, recomputed with the average over the same batches
    for name, b in theirs.net.named_buffers():
        assert torch.equal(state.buffers[name], b), name


def test_swa_stopped_early_keeps_its_weights_and_a_model_without_batchnorm_skips_the_pass():
    task = eg.Task(_mse, optim.inject_hyperparams(optim.sgd)(lr=0.1))
    watch = []

    class Last(eg.Listener):
        def on_train_end(self, rec):
            watch.append({k: v.clone() for k, v in rec.state.params.items()})

    swa = StochasticWeightAveraging(0.05, swa_epoch_start=2)
    trainer = _quiet(max_epochs=4, max_steps=14, enable_journal=False, callbacks=[swa, Last()])
    state = trainer.fit(task, task.init(nn.Linear(3, 1), seed=0), _batches(6))
    assert int(state.extra["swa"]["n_averaged"]) == 2  # epochs 1 and 2, then max_steps
    assert all(torch.equal(state.params[k], watch[0][k]) for k in state.params)

    swa = StochasticWeightAveraging(0.05, swa_epoch_start=2)
    trainer = _quiet(max_epochs=3, enable_journal=False, callbacks=[swa])
    state = trainer.fit(task, task.init(nn.Linear(3, 1), seed=0), _batches(6))
    average = state.extra["swa"]["average"]
    assert all(torch.equal(state.params[k], average[k]) for k in state.params)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"swa_lrs": -0.1}, r"swa_lrs=-0\.1"),
        ({"swa_lrs": [0.1, 0.2]}, r"swa_lrs=\[0\.1, 0\.2\].*a list of one"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 0}, r"swa_epoch_start=0\b"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, r"swa_epoch_start=1\.5"),
        ({"swa_lrs": 0.1, "annealing_epochs": -1}, r"annealing_epochs=-1"),
        ({"swa_lrs": 0.1, "annealing_strategy": "exp"}, r"annealing_strategy='exp'"),
        ({"swa_lrs": 0.1, "avg_fn": 3}, r"avg_fn=3"),
        ({"swa_lrs": 0.1, "device": 0}, r"device=0"),
    ],
)
def test_bad_swa_arguments_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StochasticWeightAveraging(**kwargs)


def test_bad_ema_decay_and_optimizers_are_refused():
    with pytest.raises(ValueError, match=r"decay=1\.5"):
        ema_weights(optim.sgd(0.1), decay=1.5)
    with pytest.raises(TypeError, match="pass the optimizer"):
        ema_weights("adamw")
    with pytest.raises(ValueError, match=r"holds no moving average"):
        ema_params(optim.sgd(0.1).init({"w": torch.zeros(1)}))


@pytest.mark.parametrize(
    ("tx", "flags", "match"),
    [
        (optim.sgd(0.1), {}, r"inject_hyperparams"),
        (optim.inject_hyperparams(optim.sgd)(momentum=0.5), {}, r"have no 'lr'"),
        (optim.inject_hyperparams(optim.sgd)(lr=0.1), {"max_epochs": -1, "max_steps": 3}, "int"),
    ],
)
def test_swa_refuses_at_fit_start_what_it_cannot_anneal(tx, flags, match):
    task = eg.Task(_mse, tx)
    swa = StochasticWeightAveraging(0.05, swa_epoch_start=0.5)
    trainer = _quiet(**{"max_epochs": 2, **flags}, callbacks=[swa])
    with pytest.raises(ValueError, match=match):
        trainer.fit(task, task.init(nn.Linear(3, 1)), _batches(2))


@pytest.mark.parametrize(("every", "start"), [(2, 0), (3, 2), (1, 5)])
def test_ema_every_n_steps_from_a_step_matches_averaged_model_updated_then(every, start):
    decay = 0.8
    data = _batches(9)
    theirs = _net()
    averaged = AveragedModel(theirs, multi_avg_fn=get_ema_multi_avg_fn(decay))
    opt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, foreach=True)
    for n, (x, y) in enumerate(data):  # n: the steps taken before this one (global_step - 1)
        opt.zero_grad()
        F.mse_loss(theirs(x), y).backward()
        opt.step()
        if n >= start and n % every == 0:  # Lightning's WeightAveraging.should_update
            averaged.update_parameters(theirs)

    tx = ema_weights(
        optim.sgd(0.05, momentum=0.9), decay=decay, every_n_steps=every, start_step=start
    )
    state = eg.TrainState.create(_net(), tx, seed=0)
    step = eg.train_step(_mse, tx)
    for batch in data:
        state, _ = step(state, batch)
    ours = ema_params(state.opt_state)
    for name, p in averaged.module.named_parameters():
        assert torch.equal(ours[name], p), name
    with pytest.raises(ValueError, match="every_n_steps=0"):
        ema_weights(optim.sgd(0.1), every_n_steps=0)
