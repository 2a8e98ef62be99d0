"""Ensembles and sweeps (``engine.ensemble``): E members trained in one vmapped step equal E
separate runs of the ordinary ``train_step`` (the reference: the project's normal path, one run
per member), members come out as ordinary states that checkpoint and continue alone, and the
Trainer logs each member's metrics under its own name."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import checkpoint, ensemble, optim

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _mlp(seed: int, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 3),
    )  # fmt: skip


def _loss(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits, batch[1]), {
        "acc": (logits.argmax(-1) == batch[1]).float().mean()
    }


def _batches(n: int, seed: int = 1, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def _separate(state: eg.TrainState, tx, batches) -> tuple[eg.TrainState, list[float]]:
    """The reference: one member trained alone by the ordinary ``train_step``."""
    step = eg.train_step(_loss, tx)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def _assert_same(alone: eg.TrainState, member: eg.TrainState) -> None:
    for k in alone.params:  # the contract: within 1e-6
        torch.testing.assert_close(member.params[k], alone.params[k], atol=1e-6, rtol=0)
    # and bitwise on this CPU: params, optimizer state, counters and seed
    assert member.fingerprint() == alone.fingerprint()


def test_four_adamw_mlps_in_one_vmapped_step_equal_four_separate_runs():
    tx = optim.adamw(1e-2)  # the default: the fused kernel
    batches = _batches(20)
    members = [eg.TrainState.create(_mlp(s), tx, seed=s) for s in range(4)]
    state = ensemble.stack([m.copy() for m in members])
    step = ensemble.ensemble_step(_loss, tx)
    logged: list[dict[str, float]] = []
    for b in batches:
        state, metrics = step(state, b)
        logged.append({k: float(v) for k, v in metrics.items()})
    assert state.step == 20 and state.batch_idx == 20
    for i, start in enumerate(members):
        alone, losses = _separate(start, tx, batches)
        _assert_same(alone, ensemble.member(state, i))
        mine = [row[f"loss/member_{i}"] for row in logged]
        torch.testing.assert_close(mine, losses, atol=1e-6, rtol=0)
    assert logged[-1]["loss"] == pytest.approx(
        sum(logged[-1][f"loss/member_{i}"] for i in range(4)) / 4, abs=1e-6
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.adam(1e-2, fused=False)),
        lambda: optim.rmsprop(1e-2, centered=True),
        lambda: optim.lion(1e-3, weight_decay=0.1),
    ],
    ids=["sgd-nesterov", "clip-adam-foreach", "rmsprop", "lion"],
)
def test_other_optimizers_and_a_global_norm_clip_equal_separate_runs(make):
    tx = make()
    batches = _batches(6)
    members = [eg.TrainState.create(_mlp(s), tx, seed=s) for s in range(3)]
    state = ensemble.stack([m.copy() for m in members])
    step = ensemble.ensemble_step(_loss, tx)
    for b in batches:
        state, _ = step(state, b)
    for i, start in enumerate(members):
        _assert_same(_separate(start, tx, batches)[0], ensemble.member(state, i))


def test_a_learning_rate_sweep_equals_separate_runs_with_those_rates():
    lrs = [1e-3, 3e-3, 1e-2, 3e-2]
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3, weight_decay=0.05)
    start = eg.TrainState.create(_mlp(0), tx, seed=7)
    state = ensemble.sweep(start, lr=lrs)
    assert optim.get_hyperparams(start.opt_state) == {"lr": 1e-3, "weight_decay": 0.05}  # read
    names = ensemble.member_names(state, "lr")
    assert names == ["lr=0.001", "lr=0.003", "lr=0.01", "lr=0.03"]
    step = ensemble.ensemble_step(_loss, tx, names=names)
    batches = _batches(15)
    for b in batches:
        state, metrics = step(state, b)
    assert sorted(k for k in metrics if k.startswith("loss/")) == sorted(f"loss/{n}" for n in names)
    finals = []
    for i, lr in enumerate(lrs):
        ref_tx = optim.adamw(lr, weight_decay=0.05)  # the plain optimizer with that rate
        alone, _ = _separate(eg.TrainState.create(_mlp(0), ref_tx, seed=7), ref_tx, batches)
        mine = ensemble.member(state, i)
        assert optim.get_hyperparams(mine.opt_state) == {"lr": lr, "weight_decay": 0.05}
        for k in alone.params:
            assert torch.equal(mine.params[k], alone.params[k]), (lr, k)  # bitwise
        finals.append(mine.params["5.weight"])
    assert not torch.equal(finals[0], finals[-1])  # the rates made a difference


@pytest.mark.parametrize("name", ["sgd", "adamw", "rmsprop", "lion"])
def test_a_float64_tensor_learning_rate_trains_bitwise_as_the_float(name):
    # what a sweep's members hold (torch.optim takes a tensor lr too)
    make = getattr(optim, name)
    ends = []
    for lr in (0.01, torch.tensor(0.01, dtype=torch.float64)):
        tx = make(lr)
        ends.append(_separate(eg.TrainState.create(_mlp(0), tx), tx, _batches(3))[0])
    assert ends[0].fingerprint() == ends[1].fingerprint()
    with pytest.raises(ValueError, match="0-d floating point tensor"):
        make(torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="non-negative"):
        make(torch.tensor(-0.1))


def test_an_sgd_sweep_takes_each_rate_through_the_update_alpha():
    # SGD's last kernel takes the rate as a number (alpha=-lr): one call per member
    lrs = [0.01, 0.1, 0.5]
    tx = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9)
    state = ensemble.sweep(eg.TrainState.create(_mlp(2), tx, seed=0), lr=lrs)
    step = ensemble.ensemble_step(_loss, tx)
    batches = _batches(5)
    for b in batches:
        state, _ = step(state, b)
    for i, lr in enumerate(lrs):
        ref_tx = optim.sgd(lr, momentum=0.9)
        alone, _ = _separate(eg.TrainState.create(_mlp(2), ref_tx, seed=0), ref_tx, batches)
        for k in alone.params:
            assert torch.equal(ensemble.member(state, i).params[k], alone.params[k])


def test_a_member_round_trips_a_checkpoint_and_continues_as_the_ensembles_member(tmp_path):
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
    state = ensemble.sweep(eg.TrainState.create(_mlp(3), tx, seed=11), lr=[1e-3, 2e-2, 5e-2])
    step = ensemble.ensemble_step(_loss, tx)
    first, then = _batches(5, seed=2), _batches(5, seed=3)
    for b in first:
        state, _ = step(state, b)
    path = checkpoint.save(ensemble.member(state, 1), tmp_path / "member1")
    # an ordinary template: a fresh model and the optimizer as built, lr=1e-3
    loaded = checkpoint.load(path, eg.TrainState.create(_mlp(0), tx))
    assert (loaded.step, loaded.seed) == (5, 11)
    assert optim.get_hyperparams(loaded.opt_state)["lr"] == 2e-2
    assert loaded.fingerprint() == ensemble.member(state, 1).fingerprint()
    alone, _ = _separate(loaded, tx, then)
    for b in then:
        state, _ = step(state, b)
    assert alone.fingerprint() == ensemble.member(state, 1).fingerprint()


def test_the_ensemble_state_checkpoints_whole_and_members_keep_their_seeds(tmp_path):
    tx = optim.adamw(1e-2)
    state = ensemble.stack([eg.TrainState.create(_mlp(s), tx, seed=10 + s) for s in range(3)])
    state, _ = ensemble.ensemble_step(_loss, tx)(state, _batches(1)[0])
    path = checkpoint.save(state, tmp_path / "ensemble")
    template = ensemble.stack([eg.TrainState.create(_mlp(0), tx) for _ in range(3)])
    back = checkpoint.load(path, template)
    assert back.fingerprint() == state.fingerprint()
    assert [m.seed for m in ensemble.unstack(back)] == [10, 11, 12] and back.seed == 10


@pytest.mark.filterwarnings("ignore:ModelCheckpoint.*written with dirpath")
def test_a_sweep_resumed_by_the_trainer_from_its_checkpoint_is_the_uninterrupted_run(tmp_path):
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
    task = eg.Task(step_fn=ensemble.ensemble_step(_loss, tx))
    data = _batches(4)

    def fit(root: Path, epochs: int, ckpt_path: Path | None = None) -> eg.TrainState:
        state = ensemble.sweep(eg.TrainState.create(_mlp(6), tx, seed=1), lr=[1e-3, 1e-2])
        trainer = eg.Trainer(
            default_root_dir=root,
            max_epochs=epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        return trainer.fit(task, state, data, ckpt_path=ckpt_path)

    full = fit(tmp_path / "full", 2)
    fit(tmp_path / "half", 1)
    (ckpt,) = (tmp_path / "half").rglob("epoch=0-step=4")
    resumed = fit(tmp_path / "resumed", 2, ckpt)  # the swept rates come back as they were
    assert resumed.step == 8 and resumed.fingerprint() == full.fingerprint()
    assert optim.get_hyperparams(resumed.opt_state)["lr"].tolist() == [1e-3, 1e-2]


def test_per_member_batches_map_over_the_member_axis():
    tx = optim.sgd(0.1)
    members = [eg.TrainState.create(_mlp(s), tx, seed=s) for s in range(3)]
    own = [_batches(4, seed=20 + i) for i in range(3)]  # member i's batches
    stacked = [
        (
            torch.stack([own[i][t][0] for i in range(3)]),
            torch.stack([own[i][t][1] for i in range(3)]),
        )
        for t in range(4)
    ]
    state = ensemble.stack([m.copy() for m in members])
    step = ensemble.ensemble_step(_loss, tx, in_dims=0)
    for b in stacked:
        state, _ = step(state, b)
    for i, start in enumerate(members):
        _assert_same(_separate(start, tx, own[i])[0], ensemble.member(state, i))


def test_batch_norm_keeps_running_statistics_per_member():
    def bn_mlp(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    tx = optim.sgd(0.1, momentum=0.9)
    members = [eg.TrainState.create(bn_mlp(s), tx, seed=s) for s in range(3)]
    state = ensemble.stack([m.copy() for m in members])
    batches = _batches(5)
    step = ensemble.ensemble_step(_loss, tx)
    for b in batches:
        state, _ = step(state, b)
    for i, start in enumerate(members):
        alone, _ = _separate(start, tx, batches)
        mine = ensemble.member(state, i)
        # batch norm's batched kernels round differently from its unbatched ones: 1e-6, not bits
        for group in ("params", "buffers"):
            for k, v in getattr(alone, group).items():
                torch.testing.assert_close(getattr(mine, group)[k], v, atol=1e-6, rtol=0)
    assert int(state.buffers["1.num_batches_tracked"][0]) == 5


def test_dropout_same_draws_match_a_sweeps_separate_runs_and_different_draws_are_seeded():
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-2)
    start = eg.TrainState.create(_mlp(4, dropout=0.5), tx, seed=9)
    batches = _batches(4)
    # "same": every member draws the unbatched call's mask, a separate run's with this seed
    state = ensemble.sweep(start, lr=[1e-2, 1e-1])
    step = ensemble.ensemble_step(_loss, tx, randomness="same")
    for b in batches:
        state, _ = step(state, b)
    ref_tx = optim.adamw(1e-1)
    alone, _ = _separate(
        eg.TrainState.create(_mlp(4, dropout=0.5), ref_tx, seed=9), ref_tx, batches
    )
    assert all(torch.equal(ensemble.member(state, 1).params[k], v) for k, v in alone.params.items())

    # "different": a mask per member from the ensemble's (seed, step): two runs agree
    def run() -> tuple[eg.TrainState, dict]:
        s = ensemble.sweep(start, lr=[1e-2, 1e-2])  # two identical members
        step = ensemble.ensemble_step(_loss, tx, randomness="different")
        for b in batches:
            s, m = step(s, b)
        return s, m

    (a, ma), (b, _) = run(), run()
    assert a.fingerprint() == b.fingerprint()
    assert float(ma["loss/member_0"]) != float(ma["loss/member_1"])  # their masks differ
    with pytest.raises(RuntimeError, match="randomness"):
        ensemble.ensemble_step(_loss, tx, randomness="error")(
            ensemble.sweep(start, lr=[0.1]), batches[0]
        )


def test_the_trainer_logs_each_members_metrics_under_its_own_name(tmp_path):
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
    state = ensemble.sweep(eg.TrainState.create(_mlp(5), tx, seed=3), lr=[1e-3, 1e-2, 1e-1])
    names = ensemble.member_names(state, "lr")
    task = eg.Task(
        step_fn=ensemble.ensemble_step(_loss, tx, names=names),
        eval_fn=ensemble.ensemble_eval(_loss, names=names),
    )
    x, y = torch.cat([b[0] for b in _batches(4)]), torch.cat([b[1] for b in _batches(4)])
    data = TensorDataset(x, y)
    trainer = eg.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        logger=eg.CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    state = trainer.fit(
        task, state, DataLoader(data, batch_size=16), DataLoader(data, batch_size=64)
    )
    assert state.step == 8
    (path,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(path.open()))
    for kind in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert {f"{kind}/{n}" for n in names} <= set(rows[0]), kind
    train = [r for r in rows if r["train/loss/lr=0.1"]]
    assert len(train) == 8
    # each member's validation loss is that of the member taken out and evaluated alone
    last = [r for r in rows if r["val/loss/lr=0.1"]][-1]
    evaluate = eg.eval_step(_loss)
    for i, n in enumerate(names):
        alone = evaluate(ensemble.member(state, i), (x, y))
        assert float(last[f"val/loss/{n}"]) == pytest.approx(float(alone["loss"]), abs=1e-6)
        assert float(last[f"val/acc/{n}"]) == pytest.approx(float(alone["acc"]), abs=1e-6)
    assert float(last["val/loss/lr=0.1"]) < float(last["val/loss/lr=0.001"])  # rates differ


def test_stack_refuses_members_that_do_not_match_and_names_what_differs():
    tx = optim.adamw(1e-3)
    a = eg.TrainState.create(nn.Linear(3, 2), tx)
    with pytest.raises(ValueError, match=r"params\['weight'\] is \(2, 4\).*member 0's \(2, 3\)"):
        ensemble.stack([a, eg.TrainState.create(nn.Linear(4, 2), tx)])
    with pytest.raises(
        ValueError, match=r"member 1's params are not member 0's \(missing: \['bias'\]"
    ):
        ensemble.stack([a, eg.TrainState.create(nn.Linear(3, 2, bias=False), tx)])
    with pytest.raises(ValueError, match="optimizer state has another structure"):
        ensemble.stack([a, eg.TrainState.create(nn.Linear(3, 2), optim.sgd(0.1, momentum=0.9))])
    with pytest.raises(ValueError, match=r"the members' step differ \(\[0, 1\]\)"):
        b = eg.TrainState.create(nn.Linear(3, 2), tx)
        b, _ = eg.train_step(lambda m, x: m(x).sum(), tx)(b, torch.ones(1, 3))
        ensemble.stack([a, b])
    with pytest.raises(ValueError, match=r"params\['weight'\] is \(2, 3\) torch.float64"):
        ensemble.stack([a, eg.TrainState.create(nn.Linear(3, 2).double(), tx)])
    with pytest.raises(ValueError, match="at least one"):
        ensemble.stack([])
    with pytest.raises(TypeError, match="member 1 is a dict"):
        ensemble.stack([a, {}])
    both = ensemble.stack([a, a])
    with pytest.raises(ValueError, match="already an ensemble state"):
        ensemble.stack([both, both])
    with pytest.raises(IndexError, match="member 2 of an ensemble of 2"):
        ensemble.member(both, 2)
    with pytest.raises(ValueError, match="not an ensemble state"):
        ensemble.member(a, 0)
    with pytest.raises(ValueError, match=r"extra\[.tag.\] differ"):
        ensemble.stack([a.replace(extra={"tag": "x"}), a.replace(extra={"tag": "y"})])
    # hyperparameters that are not injected cannot differ: they are not in the state
    with pytest.raises(ValueError, match="inject"):
        ensemble.sweep(a, lr=[0.1, 0.2])
    with pytest.raises(ValueError, match="as many values"):
        ensemble.sweep(
            eg.TrainState.create(
                nn.Linear(3, 2), optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.5)
            ),
            lr=[0.1],
            momentum=[0.1, 0.2],
        )


def test_an_ensemble_step_consumes_its_input_and_checks_its_names():
    tx = optim.sgd(0.1)
    state = ensemble.stack([eg.TrainState.create(_mlp(s), tx) for s in range(2)])
    step = ensemble.ensemble_step(_loss, tx)
    new, _ = step(state, _batches(1)[0])
    with pytest.raises(eg.ConsumedStateError):
        step(state, _batches(1)[0])
    with pytest.raises(ValueError, match="3 names for an ensemble of 2"):
        ensemble.ensemble_step(_loss, tx, names=["a", "b", "c"])(new, _batches(1)[0])
    with pytest.raises(ValueError, match="randomness must be one of"):
        ensemble.ensemble_step(_loss, tx, randomness="sometimes")
    with pytest.raises(ValueError, match="one number per member"):
        ensemble.ensemble_step(lambda m, b: (m(b[0]).mean(), {"logits": m(b[0])}), tx)(
            new, _batches(1)[0]
        )


def _example():
    spec = importlib.util.spec_from_file_location("ensemble_sweep", EXAMPLES / "ensemble_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def test_the_sweep_example_trains_eight_rates_on_digits_and_the_best_beats_chance(tmp_path, capsys):
    results = _example().main(["--epochs", "2", "--root", str(tmp_path)])
    assert len(results) == 8
    accuracies = list(results.values())
    assert max(accuracies) > 0.5  # chance is 0.1 on ten digits
    assert max(accuracies) - min(accuracies) > 0.05  # the rates made a difference
    assert "lr=" in capsys.readouterr().out
