"""Fine-tuning as journaled state transitions: frozen parameters keep their bits, an unfrozen
group trains as a new torch.optim param group would, BackboneFinetuning's learning rates are
Lightning's own, and resume (fresh process) and replay stay bitwise."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.listeners.finetuning import BackboneFinetuning, Finetuning
from engine.optim.freezing import (
    freezable,
    freeze,
    frozen_names,
    get_group_hyperparams,
    unfreeze,
)


class Net(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, 8), nn.Tanh()]
        if bn:
            layers.append(nn.BatchNorm1d(8))
        self.backbone = nn.Sequential(*layers, nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def _net(bn: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(bn)


def _data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _labels(params):
    return {k: "backbone" if k.startswith("backbone.") else "head" for k in params}


def _two_groups(lr: float = 1e-2) -> optim.GradientTransformation:
    return freezable(
        optim.multi_transform(
            {
                "backbone": optim.inject_hyperparams(optim.adam)(lr=lr),
                "head": optim.inject_hyperparams(optim.adam)(lr=lr),
            },
            _labels,
        )
    )


def _trainer(root: Path | None = None, callbacks=(), **kw) -> eg.Trainer:
    flags = dict(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    if root is None:
        flags["enable_journal"] = False
    else:
        flags["default_root_dir"] = root
    return eg.Trainer(callbacks=list(callbacks), **{**flags, **kw})


# ------------------------------------------------------------------------ the optimizer


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.adamw(0.1, weight_decay=0.1),  # fused apply
        lambda: optim.adam(0.1, fused=False),  # foreach apply
        lambda: optim.sgd(0.1, momentum=0.9),  # update, no apply of its own
    ],
)
def test_frozen_parameters_keep_their_bits_and_their_state_is_not_advanced(make):
    tx = freezable(make(), frozen=["a"])
    params = {"a.w": torch.tensor([-0.0, 1.0, 2.0]), "b.w": torch.ones(3)}
    before = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    fresh = optim.state_dict(tx.init({k: v.clone() for k, v in params.items()}))
    for step in range(3):
        grads = {k: torch.full((3,), 0.5 + step) for k in params}
        params, state = optim.apply_gradients(tx, grads, state, params, step)
    assert torch.equal(params["a.w"].view(torch.int32), before["a.w"].view(torch.int32))  # -0.0
    assert not torch.equal(params["b.w"], before["b.w"])
    now = optim.state_dict(state)
    a_keys = [k for k in now if "['a.w']" in k and isinstance(now[k], torch.Tensor)]
    assert a_keys  # the moments (and Adam's step counters) of the frozen parameter
    for k in a_keys:
        assert torch.equal(now[k], fresh[k]), k
    # the update form: a frozen parameter's update is -0.0, so p + u keeps p's bits
    updates, _ = tx.update({k: torch.ones(3) for k in params}, state, params, 3)
    assert torch.equal(updates["a.w"], torch.full((3,), -0.0))
    assert torch.equal(
        (params["a.w"] + updates["a.w"]).view(torch.int32), before["a.w"].view(torch.int32)
    )


def test_an_unfrozen_parameter_restarts_from_a_fresh_state():
    """Trained, frozen, unfrozen: Adam's step counter and moments start again (torch.optim's
    state of a param group added anew), while the other parameter's go on."""
    tx = freezable(optim.adam(0.1))
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    state = tx.init(params)
    g = {"a": torch.full((2,), 0.5), "b": torch.full((2,), 0.5)}
    for step in range(2):
        params, state = optim.apply_gradients(tx, dict(g), state, params, step)
    state = freeze(state, ["a"])
    params, state = optim.apply_gradients(tx, dict(g), state, params, 2)
    assert frozen_names(state) == ["a"]
    state = unfreeze(state, ["a"])
    a_before = params["a"].clone()
    params, state = optim.apply_gradients(
        tx, {k: v.clone() for k, v in g.items()}, state, params, 3
    )
    adam = state.inner[-1]
    assert adam.step["a"].item() == 1.0 and adam.step["b"].item() == 4.0
    assert torch.equal(adam.exp_avg["a"], (1 - 0.9) * g["a"])
    ref = torch.nn.Parameter(a_before.clone())  # a new torch.optim group: first Adam step
    opt = torch.optim.Adam([ref], lr=0.1)
    ref.grad = g["a"].clone()
    opt.step()
    assert torch.equal(params["a"], ref.detach())
    # unfreezing a trainable parameter changes nothing
    assert unfreeze(state, ["b"]).fresh == state.fresh


# ------------------------------------------------------------------------ against torch.optim


@pytest.mark.parametrize("which", ["adam", "sgd"])
def test_unfreezing_at_an_epoch_equals_torch_adding_a_param_group(which):
    """Bitwise: the Trainer with Finetuning equals a torch.optim loop whose optimizer starts
    with the head and gets the backbone as a new param group at epoch 2 (fresh state)."""
    epochs, k, data = 4, 2, _data()
    model = _net()
    ref = copy.deepcopy(model)
    inner = optim.adam(1e-2) if which == "adam" else optim.sgd(1e-2, momentum=0.9)
    task = eg.Task(_loss, freezable(inner))
    trainer = _trainer(max_epochs=epochs, callbacks=[Finetuning({k: ["backbone"]}, ["backbone"])])
    state = trainer.fit(task, task.init(model, seed=0), data)

    def make(ps):
        if which == "adam":
            return torch.optim.Adam(ps, lr=1e-2)
        return torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True)

    ref.backbone.requires_grad_(False)
    opt = make(list(ref.head.parameters()))
    backbone_at_k = None
    for epoch in range(epochs):
        if epoch == k:
            backbone_at_k = {n: p.detach().clone() for n, p in ref.backbone.named_parameters()}
            ref.backbone.requires_grad_(True)
            opt.add_param_group({"params": list(ref.backbone.parameters())})
        for batch in data:
            opt.zero_grad()
            _loss(ref, batch).backward()
            opt.step()
    assert backbone_at_k is not None
    first = _net()
    assert all(  # frozen until epoch k: the backbone had not moved
        torch.equal(backbone_at_k[n], p) for n, p in first.backbone.named_parameters()
    )
    for name, p in ref.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


# ------------------------------------------------------------------------ against Lightning


def _lightning_run(net: Net, data, epochs: int, callback_kw: dict):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BackboneFinetuning as PLBackboneFinetuning

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = net.backbone, net.head

        def forward(self, x):
            return self.head(torch.tanh(self.backbone(x)))

        def training_step(self, batch, batch_idx):
            return _loss(self, batch)

        def configure_optimizers(self):
            ps = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.Adam(ps, lr=1e-2)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.lrs: list[list[float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])

    record = Record()
    module = Module()
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PLBackboneFinetuning(**callback_kw), record],
    )
    trainer.fit(module, train_dataloaders=data)
    return record.lrs, {n: p.detach() for n, p in module.named_parameters()}


class _RecordLrs(eg.Listener):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, rec):
        if rec.batch_idx == 0:
            opt = rec.state.opt_state
            lrs = [get_group_hyperparams(opt, "head")["lr"]]
            if not any(n.startswith("backbone.") for n in frozen_names(opt)):
                lrs.append(get_group_hyperparams(opt, "backbone")["lr"])
            self.lrs.append(lrs)


@pytest.mark.parametrize(
    "kw",
    [
        dict(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.0 + e / 4),
        dict(unfreeze_backbone_at_epoch=2, backbone_initial_lr=3e-3, should_align=False),
    ],
)
def test_backbone_finetuning_matches_lightnings(kw):
    """The learning rates of each epoch equal Lightning's BackboneFinetuning's on the same
    module (exactly), and so do the weights (bitwise: both run the fused Adam kernel per
    group)."""
    pytest.importorskip("pytorch_lightning")
    from torch.utils.data import DataLoader, TensorDataset

    epochs = 6
    g = torch.Generator().manual_seed(2)
    ds = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    want_lrs, want = _lightning_run(_net(), DataLoader(ds, batch_size=8), epochs, kw)
    record = _RecordLrs()
    task = eg.Task(_loss, _two_groups())
    trainer = _trainer(max_epochs=epochs, callbacks=[BackboneFinetuning(**kw), record])
    state = trainer.fit(task, task.init(_net(), seed=0), DataLoader(ds, batch_size=8))
    assert record.lrs == want_lrs
    assert len(want_lrs[-1]) == 2 and want_lrs[0] == [1e-2]
    for name, p in want.items():
        assert torch.equal(state.params[name], p), name


def test_train_bn_false_keeps_the_backbones_batchnorm_parameters_frozen():
    task = eg.Task(_loss, _two_groups())
    model = _net(bn=True)
    bn = {n: p.detach().clone() for n, p in model.backbone[2].named_parameters()}
    running = model.backbone[2].running_mean.clone()
    first = model.backbone[0].weight.detach().clone()  # the state borrows the module's storage
    listener = BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=False)
    state = _trainer(max_epochs=3, callbacks=[listener]).fit(
        task, task.init(model, seed=0), _data()
    )
    assert sorted(frozen_names(state.opt_state)) == ["backbone.2.bias", "backbone.2.weight"]
    for n, p in bn.items():
        assert torch.equal(state.params[f"backbone.2.{n}"], p)
    assert not torch.equal(state.params["backbone.0.weight"], first)
    # documented: running statistics go on updating (the step runs the module in train mode)
    assert not torch.equal(state.buffers["backbone.2.running_mean"], running)


# ------------------------------------------------------------------------ resume and replay


class SaveAt(eg.Listener):
    """Saves once: at the first ``event`` of epoch ``epoch``."""

    def __init__(self, event: str, epoch: int, path: Path) -> None:
        self.epoch, self.path, self.saved = epoch, path, False
        setattr(self, event, self._save)

    def _save(self, rec):
        if rec.run.current_epoch == self.epoch and not self.saved:
            self.saved = True
            return eg.Save(self.path)
        return None


def fit(root: Path, listeners=(), ckpt_path=None) -> tuple[eg.Trainer, eg.TrainState]:
    """Five epochs; the backbone unfrozen at epoch 2, its rate doubled at epochs 3 and 4."""
    task = eg.Task(_loss, _two_groups(1e-2))
    trainer = _trainer(
        root,
        max_epochs=5,
        log_every_n_steps=1,
        callbacks=[BackboneFinetuning(2, backbone_initial_ratio_lr=0.1), *listeners],
    )
    state = trainer.fit(task, task.init(_net(), seed=1), _data(), ckpt_path=ckpt_path)
    return trainer, state


@pytest.mark.parametrize(
    "event,epoch",
    [
        ("on_train_epoch_end", 1),  # before the unfreeze
        ("on_train_epoch_start", 3),  # in the event that changes the rate (its re-emission)
        ("on_train_batch_end", 3),  # inside an epoch after the unfreeze
    ],
)
def test_a_fresh_process_resumes_bitwise_before_and_after_the_unfreeze(tmp_path, event, epoch):
    here = str(Path(__file__).parent)
    ckpt = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from pathlib import Path
        from test_finetuning import SaveAt, fit
        saver = SaveAt({event!r}, {epoch}, Path({str(ckpt)!r}))
        _, state = fit(Path({str(tmp_path / "full")!r}), [saver])
        print(state.fingerprint())
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _, resumed = fit(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert resumed.fingerprint() == done.stdout.split()[-1]
    assert frozen_names(resumed.opt_state) == []
    assert get_group_hyperparams(resumed.opt_state, "backbone")["lr"] == pytest.approx(4e-3)


def test_a_finetuning_run_replays_bitwise(tmp_path):
    trainer, _ = fit(tmp_path / "run")
    lines = [x for x in eg.Journal.read(trainer.run_dir) if "transition" in x]
    # frozen at epoch 0, unfrozen at 2, the rate doubled at 3 and 4
    assert [x["step"] for x in lines] == [0, 8, 12, 16]
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical and report.steps == 20, str(report)


# ------------------------------------------------------------------------ bad arguments


def test_bad_arguments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"key -1.*int >= 0 \(got -1\)"):
        Finetuning({-1: ["backbone"]})
    with pytest.raises(ValueError, match=r"unfreeze_backbone_at_epoch.*\(got -2\)"):
        BackboneFinetuning(unfreeze_backbone_at_epoch=-2)
    with pytest.raises(ValueError, match=r"\(got True\)"):
        Finetuning({True: ["backbone"]})
    with pytest.raises(TypeError, match=r"got 3"):
        Finetuning({1: [3]})
    with pytest.raises(ValueError, match=r"'nope' matches no trainable parameter.*'backbone'"):
        freezable(optim.adam(), frozen=["nope"]).init(dict(_net().named_parameters()))
    task = eg.Task(_loss, freezable(optim.adam(1e-2)))
    cases = [
        (task, Finetuning({1: ["bakbone"]}), ValueError, r"'bakbone' matches no trainable"),
        (
            eg.Task(_loss, optim.adam(1e-2)),
            Finetuning({1: ["backbone"]}),
            ValueError,
            r"holds no freezable states; wrap the optimizer once with optim.freezable",
        ),
        (task, BackboneFinetuning(1), ValueError, r"group 'backbone'.*multi_transform"),
    ]
    for t, listener, error, match in cases:
        with pytest.raises(error, match=match):
            _trainer(max_epochs=2, callbacks=[listener]).fit(t, t.init(_net()), _data())


def test_frozen_parameters_are_left_out_of_clipping_as_lightnings_have_no_grad():
    """Lightning clips the gradients that exist: a frozen backbone has none. Here frozen
    parameters get zero gradients without a backward computation for them, so
    gradient_clip_val's global norm is the trainable parameters' alone."""
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(5)
    ]

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    model = net()
    model[0].requires_grad_(False)  # the backbone, frozen for the whole run
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], 0.05, foreach=True
        )
        opt.step()

    tx = optim.freezable(optim.sgd(0.5), frozen=["0"])
    task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
    state = eg.Trainer(max_epochs=1, gradient_clip_val=0.05, barebones=True).fit(
        task, task.init(net()), data
    )
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name
