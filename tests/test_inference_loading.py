"""Checkpoints for people who are not resuming: weights into a module or a dict without an
optimizer template (``load_weights``), the run's hyperparameters (``read_hparams``), a plain
state-dict file for users without engine (``export``) and Lightning ``.ckpt`` weights to start
training from (``from_lightning``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import CheckpointError, IncompatibleKeys, _read
from engine.checkpoint import _weights as weights_module

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def _net(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 1))


def _frozen_net(seed: int = 0) -> nn.Module:
    """With a frozen parameter: the state keeps it among its buffers."""
    net = _net(seed)
    net[0].bias.requires_grad_(False)
    return net


def _data(n: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _task(**kwargs) -> eg.Task:
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2), **kwargs)


def _trained(net: nn.Module | None = None) -> eg.TrainState:
    task = _task()
    state = task.init(_frozen_net() if net is None else net, seed=1)
    step = task.train_step()
    for batch in _data():
        state, _ = step(state, batch)
    return state


def _bits(t: torch.Tensor) -> tuple:
    t = t.detach().cpu().contiguous()
    return t.dtype, tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy())


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(_bits(a[k]) == _bits(b[k]) for k in a)


def _weights(state: eg.TrainState) -> dict[str, torch.Tensor]:
    return {**state.params, **state.buffers}


def _module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


# --------------------------------------------------------------------------- load_weights


@pytest.mark.parametrize("weights_only", [False, True])
def test_load_weights_into_a_module_and_a_dict_is_bitwise(tmp_path, weights_only):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c", weights_only=weights_only)
    model = _frozen_net(seed=5)  # other values, same structure
    assert checkpoint.load_weights(path, model) == IncompatibleKeys([], [])
    assert _same_bits(_module_tensors(model), _weights(state))
    assert not model[0].bias.requires_grad and model[0].weight.requires_grad  # left as they were

    template = {k: torch.zeros_like(v) for k, v in _weights(state).items()}
    loaded = checkpoint.load_weights(path, template, device="cpu")
    assert _same_bits(loaded, _weights(state))
    assert all(not t.requires_grad for t in loaded.values())
    assert all(not torch.equal(template[k], loaded[k]) for k in ("0.weight", "3.weight"))

    x = torch.randn(5, 3)
    expected = torch.func.functional_call(_frozen_net().eval(), _weights(state), (x,))
    assert torch.equal(model.eval()(x), expected)


def test_load_weights_casts_to_the_modules_dtype_like_load_state_dict(tmp_path):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    model = _frozen_net().to(torch.float64)
    checkpoint.load_weights(path, model)
    assert model[0].weight.dtype == torch.float64
    assert torch.equal(model[0].weight, state.params["0.weight"].double())


def test_load_weights_names_missing_unexpected_and_mis_shaped_keys(tmp_path):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    with pytest.raises(
        CheckpointError,
        match=r"mis-shaped: \[0\.bias \(checkpoint 8, model 4\), 0\.weight \(checkpoint 8x3, m",
    ):
        checkpoint.load_weights(path, _net(width=4))
    with pytest.raises(CheckpointError, match=r"shape mismatch is refused even with strict=False"):
        checkpoint.load_weights(path, _net(width=4), strict=False)

    bigger = nn.Sequential(*_frozen_net(), nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match=r"missing: \[4\.bias, 4\.weight\].*strict=False"):
        checkpoint.load_weights(path, bigger)
    before = bigger[4].weight.detach().clone()
    result = checkpoint.load_weights(path, bigger, strict=False)
    assert result == IncompatibleKeys(missing_keys=["4.bias", "4.weight"], unexpected_keys=[])
    assert torch.equal(bigger[4].weight, before)  # left alone, as load_state_dict leaves it
    assert torch.equal(bigger[0].weight, state.params["0.weight"])

    smaller = nn.Sequential(nn.Linear(3, 8))
    with pytest.raises(CheckpointError, match=r"unexpected: \[1\.bias, 1\.num_batches_tracked"):
        checkpoint.load_weights(path, smaller)
    result = checkpoint.load_weights(path, smaller, strict=False)  # 0.bias: frozen, a buffer
    assert result.missing_keys == [] and result.unexpected_keys[:2] == [
        "1.bias",
        "1.num_batches_tracked",
    ]
    assert torch.equal(smaller[0].bias, state.buffers["0.bias"])


def test_load_weights_into_a_dict_non_strict_warns_and_keeps_the_missing(tmp_path):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    template = {"0.weight": torch.zeros(8, 3), "extra": torch.ones(2)}
    with pytest.warns(UserWarning, match=r"missing \(kept from `into`\): \[extra\]; unexpected"):
        got = checkpoint.load_weights(path, template, strict=False)
    assert torch.equal(got["0.weight"], state.params["0.weight"])
    assert torch.equal(got["extra"], torch.ones(2)) and sorted(got) == ["0.weight", "extra"]
    with pytest.raises(TypeError, match=r"str -> Tensor; entry 'w' holds a float"):
        checkpoint.load_weights(path, {"w": 1.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"use checkpoint\.load"):
        checkpoint.load_weights(path, state)  # type: ignore[call-overload]


def test_a_damaged_checkpoint_is_refused_before_anything_is_loaded(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    f = path / "tensors.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    model = _frozen_net(seed=5)
    before = {k: v.detach().clone() for k, v in _module_tensors(model).items()}
    with pytest.raises(CheckpointError, match=r"tensors\.pt: checksum check failed"):
        checkpoint.load_weights(path, model)
    assert _same_bits(_module_tensors(model), before)
    with pytest.raises(CheckpointError, match=r"checksum check failed"):
        checkpoint.export(path, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_load_weights_copies_only_the_weights_out_of_the_file(tmp_path, monkeypatch):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    materialized: list[str] = []
    real = _read._materialize

    def spy(mapped, devices):
        materialized.extend(mapped)
        return real(mapped, devices)

    for module in (_read, weights_module):  # where the reads look it up
        monkeypatch.setattr(module, "_materialize", spy)
    model = _frozen_net(seed=5)
    checkpoint.load_weights(path, model, device="cpu")  # copied straight from the mapped file
    assert materialized == [] and _same_bits(_module_tensors(model), _weights(state))
    checkpoint.load_weights(path, dict(_weights(state)))
    assert sorted(materialized) == sorted(
        [*(f"params/{k}" for k in state.params), *(f"buffers/{k}" for k in state.buffers)]
    )


# --------------------------------------------------------------------------- export


def test_export_loads_in_a_process_without_engine(tmp_path):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    out = checkpoint.export(path, tmp_path / "out" / "model.pt")
    assert out == tmp_path / "out" / "model.pt"
    assert sorted(os.listdir(out.parent)) == ["model.pt"]  # nothing left beside it
    x = torch.randn(5, 3)
    model = _frozen_net(seed=9).eval()
    checkpoint.load_weights(path, model)
    torch.save({"x": x, "y": model(x)}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from torch import nn
        net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        sd = torch.load({str(out)!r}, weights_only=True)
        assert type(sd) is dict and all(type(v) is torch.Tensor for v in sd.values()), sd
        assert all(v.is_contiguous() and v.device.type == "cpu" for v in sd.values())
        print(net.load_state_dict(sd))
        io = torch.load({str(tmp_path / "io.pt")!r}, weights_only=True)
        print(torch.equal(net.eval()(io["x"]), io["y"]))
        print(sorted(m for m in sys.modules if m == "engine" or m.startswith("engine.")))
        """
    )
    done = subprocess.run(  # cold: a fork of the test's server has engine imported already
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["<All keys matched successfully>", "True", "[]"]


def test_export_casts_floating_tensors_and_refuses_bad_targets(tmp_path):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    out = checkpoint.export(path, tmp_path / "bf16.pt", dtype=torch.bfloat16)
    sd = torch.load(out, weights_only=True)
    assert sd["0.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["0.weight"], state.params["0.weight"].bfloat16())
    assert sd["1.num_batches_tracked"].dtype == torch.int64
    plain = torch.load(checkpoint.export(path, out), weights_only=True)  # replaces the file
    assert _same_bits(plain, _weights(state))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in plain.values())
    with pytest.raises(CheckpointError, match=r"lies inside the checkpoint"):
        checkpoint.export(path, path / "tensors.pt")
    with pytest.raises(CheckpointError, match=r"is a directory; name the file"):
        checkpoint.export(path, tmp_path)
    with pytest.raises(ValueError, match=r"floating-point torch\.dtype \(got torch\.int8\)"):
        checkpoint.export(path, tmp_path / "x.pt", dtype=torch.int8)
    assert checkpoint.inspect(path)["verified"]


# --------------------------------------------------------------------------- hyperparameters

HPARAMS = {"lr": 0.01, "width": 8, "betas": (0.9, 0.99), "model": {"act": "relu", "dropout": None}}
SAVED = {"lr": 0.01, "width": 8, "betas": [0.9, 0.99], "model": {"act": "relu", "dropout": None}}


def test_a_fits_checkpoints_record_the_tasks_hparams_and_a_resume_keeps_them(tmp_path):
    task = _task(hparams=HPARAMS)
    trainer = eg.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    trainer.fit(task, task.init(_net(), seed=0), _data())
    during = next((tmp_path / "checkpoints").iterdir())  # the default ModelCheckpoint's
    assert checkpoint.read_hparams(during) == SAVED
    after = trainer.save_checkpoint(tmp_path / "after")
    assert checkpoint.read_hparams(after) == SAVED
    assert checkpoint.inspect(after)["hparams"] == SAVED
    light = trainer.save_checkpoint(tmp_path / "light", weights_only=True)
    assert checkpoint.read_hparams(light) == SAVED

    resumed = eg.Trainer(max_epochs=2, default_root_dir=tmp_path / "r", **QUIET)
    state = resumed.fit(task, task.init(_net(seed=3)), _data(), ckpt_path=after)
    assert state.step == 12
    assert checkpoint.read_hparams(resumed.save_checkpoint(tmp_path / "resumed")) == SAVED
    assert all(
        checkpoint.read_hparams(p) == SAVED for p in (tmp_path / "r" / "checkpoints").iterdir()
    )


def test_without_hparams_nothing_is_recorded(tmp_path):
    task = _task()
    trainer = eg.Trainer(
        max_epochs=1, enable_checkpointing=False, default_root_dir=tmp_path, **QUIET
    )
    trainer.fit(task, task.init(_net()), _data())
    path = trainer.save_checkpoint(tmp_path / "c")
    assert checkpoint.read_hparams(path) == {} and checkpoint.inspect(path)["hparams"] == {}
    assert "hparams" not in checkpoint.read_meta(path)["extra"]


def test_non_finite_and_numpy_hparams_round_trip():
    np = pytest.importorskip("numpy")
    doc = checkpoint._hparams_doc({"clip": float("inf"), "n": np.int64(3), "p": np.float32(0.5)})
    assert doc == {"clip": {"$float": "inf"}, "n": 3, "p": 0.5}


@pytest.mark.parametrize(
    "hparams, where",
    [
        ({"act": nn.ReLU}, r"hparams\['act'\] is a type \(<class 'torch\.nn"),
        ({"opt": {"betas": [0.9, object()]}}, r"hparams\['opt'\]\['betas'\]\[1\] is a object"),
        ({"layers": {1: 8}}, r"hparams\['layers'\]: key 1 is a int; .* use str keys"),
        ({"x": {"$float": "1"}}, r"hparams\['x'\]: a dict whose only key is '\$float'"),
    ],
)
def test_a_value_json_cannot_hold_is_named_when_fit_starts(tmp_path, hparams, where):
    task = _task(hparams=hparams)
    for flags in ({}, {"enable_checkpointing": False, "enable_journal": False}):
        seen = []
        probe = eg.on(eg.Event.ON_TRAIN_BATCH_START, lambda rec, seen=seen: seen.append(1))
        trainer = eg.Trainer(
            max_epochs=1, default_root_dir=tmp_path, callbacks=[probe], **{**QUIET, **flags}
        )
        with pytest.raises(CheckpointError, match=where):  # up front, not at the first save
            trainer.fit(task, task.init(_net()), _data(2))
        assert seen == []
    assert not list(tmp_path.glob("**/meta.json"))


# --------------------------------------------------------------------------- from Lightning


def _lightning_checkpoint(tmp_path: Path) -> tuple[Path, nn.Module]:
    """A Lightning checkpoint of a module holding ``_net()`` as ``self.net``, trained one epoch
    by Lightning's Trainer; and the module."""
    pl = pytest.importorskip("pytorch_lightning")

    class Regressor(pl.LightningModule):
        def __init__(self, width: int = 8, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = _net(seed=0, width=width)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    warnings.filterwarnings("ignore")
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    module = Regressor()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    path = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(path)
    return path, module


def test_a_real_lightning_checkpoint_starts_an_engine_fit(tmp_path):
    path, lit = _lightning_checkpoint(tmp_path)
    expected = {k: v.detach().clone() for k, v in lit.net.state_dict().items()}
    assert not _same_bits(expected, _net(seed=0).state_dict())  # Lightning trained it
    task = _task()

    state = checkpoint.from_lightning(path, task.init(_net(seed=7), seed=0))  # prefix found
    assert _same_bits(_weights(state), expected)
    assert state.step == 0 and state.epoch == 0
    module = checkpoint.from_lightning(path, _net(seed=7), prefix="net.")
    assert _same_bits(module.state_dict(), expected)

    # the fit continues from those weights exactly as from the weights put in by hand
    by_hand = _net(seed=7)
    by_hand.load_state_dict(expected)
    runs = []
    for start in (state, task.init(by_hand, seed=0)):
        trainer = eg.Trainer(max_epochs=2, default_root_dir=tmp_path / "engine", **QUIET)
        runs.append(trainer.fit(task, start, _data()))
    assert runs[0].step == 12 and runs[0].fingerprint() == runs[1].fingerprint()
    assert not _same_bits(_weights(runs[0]), expected)


def test_from_lightning_needs_a_fresh_state_and_a_fitting_model(tmp_path):
    path, _ = _lightning_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"has trained \(step 6.*task\.init\(model\)"):
        checkpoint.from_lightning(path, _trained(_net()))
    with pytest.raises(CheckpointError, match=r"mis-shaped.*prefix 'net\.' stripped.*\[net\.\]"):
        checkpoint.from_lightning(path, _net(width=4))
    with pytest.raises(CheckpointError, match=r"missing: \[0\.bias.*no prefix stripped"):
        checkpoint.from_lightning(path, _net(), prefix="")
    with pytest.raises(CheckpointError, match=r"is a directory: an engine checkpoint"):
        checkpoint.from_lightning(checkpoint.save(_trained(), tmp_path / "c"), _net())
    with pytest.raises(CheckpointError, match=r"no such file"):
        checkpoint.from_lightning(tmp_path / "nothing.ckpt", _net())


class _Pickled:
    pass


def test_from_lightning_never_runs_code_and_reads_plain_state_dicts(tmp_path):
    net = _net(seed=2)
    torch.save({"state_dict": net.state_dict(), "obj": _Pickled()}, tmp_path / "unsafe.ckpt")
    with pytest.raises(CheckpointError, match=r"refused by torch\.load\(weights_only=True\)"):
        checkpoint.from_lightning(tmp_path / "unsafe.ckpt", _net())
    torch.save(net.state_dict(), tmp_path / "plain.pt")
    assert _same_bits(
        checkpoint.from_lightning(tmp_path / "plain.pt", _net()).state_dict(), net.state_dict()
    )
    torch.save({"epoch": 1}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match=r"no 'state_dict' in it \(keys: \[epoch\]\)"):
        checkpoint.from_lightning(tmp_path / "other.ckpt", _net())


def test_from_lightning_with_other_attributes_needs_the_prefix(tmp_path):
    net, head = _net(seed=2), nn.Linear(1, 1)
    saved = {f"model.{k}": v for k, v in net.state_dict().items()}
    saved.update({f"head.{k}": v for k, v in head.state_dict().items()})
    torch.save({"state_dict": saved}, tmp_path / "two.ckpt")
    with pytest.raises(CheckpointError, match=r"begin with \[head\., model\.\]: pass prefix="):
        checkpoint.from_lightning(tmp_path / "two.ckpt", _net())
    got = checkpoint.from_lightning(tmp_path / "two.ckpt", _net(), prefix="model.")
    assert _same_bits(got.state_dict(), net.state_dict())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def test_from_lightning_handles_tied_weights_and_non_persistent_buffers(tmp_path):
    torch.manual_seed(4)
    source = _Tied()
    torch.save({"state_dict": {f"model.{k}": v for k, v in source.state_dict().items()}},
               tmp_path / "tied.ckpt")  # fmt: skip
    target = _Tied()
    target.cache.fill_(7.0)
    state = checkpoint.from_lightning(
        tmp_path / "tied.ckpt", eg.TrainState.create(target, optim.sgd(0.1))
    )
    assert sorted(state.params) == ["embed.weight"]
    assert torch.equal(state.params["embed.weight"], source.embed.weight)
    assert torch.equal(state.buffers["cache"], torch.full((3,), 7.0))  # not in a state_dict: kept


def test_fit_from_a_lightning_ckpt_file_points_to_from_lightning(tmp_path):
    path, _ = _lightning_checkpoint(tmp_path)
    task = _task()
    trainer = eg.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    with pytest.raises(CheckpointError, match=r"is a file.*checkpoint\.from_lightning"):
        trainer.fit(task, task.init(_net()), _data(2), ckpt_path=path)


def test_a_damaged_lightning_ckpt_is_refused(tmp_path):
    import zipfile

    path, _ = _lightning_checkpoint(tmp_path)
    with zipfile.ZipFile(path) as archive:
        entry = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 8)
    raw = bytearray(path.read_bytes())
    local = entry.header_offset  # the local header's own name and extra lengths (torch pads)
    name_len = int.from_bytes(raw[local + 26 : local + 28], "little")
    extra_len = int.from_bytes(raw[local + 28 : local + 30], "little")
    at = local + 30 + name_len + extra_len
    raw[at + entry.file_size // 2] ^= 0x10  # one bit inside the tensor's bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="fails its CRC-32"):
        checkpoint.from_lightning(path, _net())
