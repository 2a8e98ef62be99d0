"""``accelerator`` / ``devices`` resolution, batch placement and per-device randomness.

The resolution is tested against a machine described by monkeypatching torch's device queries
(this one has only a CPU); what needs a real GPU is marked ``gpu`` and runs in
``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim, transforms
from engine.transforms.devices import resolve_device

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


@pytest.fixture
def machine(monkeypatch):
    """Describe a machine: ``machine(cuda=2, mps=False)``."""

    def describe(cuda: int = 0, mps: bool = False) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    return describe


@pytest.mark.parametrize(
    ("cuda", "mps", "expected"),
    [(0, False, "cpu"), (2, False, "cuda:0"), (0, True, "mps"), (1, True, "cuda:0")],
)
def test_auto_picks_cuda_then_mps_then_the_cpu(machine, cuda, mps, expected):
    machine(cuda=cuda, mps=mps)
    assert str(resolve_device("auto", "auto")) == expected
    assert eg.Trainer(**QUIET).config.device == expected


@pytest.mark.parametrize(
    ("accelerator", "devices", "expected"),
    [
        ("gpu", 1, "cuda:0"),
        ("cuda", [1], "cuda:1"),
        ("cuda", "1,", "cuda:1"),
        ("cuda", "1", "cuda:0"),  # "1" is a count, as Lightning reads it
        ("gpu", (0,), "cuda:0"),
        ("cpu", 1, "cpu"),
        ("cpu", -1, "cpu"),
        ("cpu", [0], "cpu"),
    ],
)
def test_lightnings_device_forms_pick_the_device(machine, accelerator, devices, expected):
    machine(cuda=2)
    assert str(resolve_device(accelerator, devices)) == expected
    trainer = eg.Trainer(accelerator=accelerator, devices=devices, **QUIET)
    assert str(trainer.root_device) == expected and trainer.num_devices == 1


def test_an_absent_gpu_is_named_with_what_the_machine_has(machine):
    machine(cuda=0)
    with pytest.raises(ValueError, match=r"no CUDA GPU is available.*this machine has: cpu"):
        eg.Trainer(accelerator="gpu", **QUIET)
    machine(cuda=2)
    with pytest.raises(ValueError, match=r"no CUDA device 3.*cuda:0 \(Fake GPU 0\), cuda:1"):
        eg.Trainer(accelerator="cuda", devices=[3], **QUIET)
    with pytest.raises(ValueError, match="MPS is not available"):
        eg.Trainer(accelerator="mps", **QUIET)


@pytest.mark.parametrize(
    ("accelerator", "devices", "names"),
    [
        ("cuda", 2, ["cuda:0", "cuda:1"]),
        ("cuda", -1, ["cuda:0", "cuda:1"]),
        ("cuda", [1, 0], ["cuda:1", "cuda:0"]),
        ("cpu", 4, ["cpu"] * 4),
    ],
)
def test_more_than_one_device_is_one_process_each_under_ddp(
    machine, monkeypatch, accelerator, devices, names
):
    from engine.parallel import DDP

    machine(cuda=2)
    trainer = eg.Trainer(accelerator=accelerator, devices=devices, **QUIET)
    assert isinstance(trainer.assembly.strategy, DDP)
    assert trainer.num_devices == len(names) and trainer.world_size == len(names)
    assert str(trainer.root_device) == names[0] and trainer.is_global_zero
    monkeypatch.setenv("LOCAL_RANK", "1")  # as the launcher sets it in the second process
    monkeypatch.setenv("ENGINE_LAUNCHED_BY", "test")
    trainer = eg.Trainer(accelerator=accelerator, devices=devices, **QUIET)
    assert str(trainer.root_device) == names[1] and trainer.global_rank == 1
    assert not trainer.is_global_zero
    with pytest.raises(ValueError, match=r"strategy='single_device'.*pass strategy='ddp'"):
        eg.Trainer(accelerator=accelerator, devices=devices, strategy="single_device", **QUIET)


@pytest.mark.parametrize("name", ["tpu", "hpu", "ipu", "xla"])
def test_accelerators_engine_does_not_run_on_say_what_it_supports(name):
    with pytest.raises(ValueError, match=rf"engine runs on the CPU.*'{name}' is not supported"):
        eg.Trainer(accelerator=name, **QUIET)


class _Pair(NamedTuple):
    x: torch.Tensor
    label: str


class _Movable:
    """A batch type torch's pytrees do not know, with a ``to`` as Lightning's collections have."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device):
        return _Movable(self.t.to(device))


def test_single_device_moves_tensors_in_containers_and_objects_with_to():
    place = transforms.SingleDevice("meta")
    moved = place.move({"a": [_Pair(torch.ones(2), "x")], "b": _Movable(torch.zeros(1)), "c": 3})
    assert moved["a"][0].x.device.type == "meta" and moved["a"][0].label == "x"
    assert moved["b"].t.device.type == "meta" and moved["c"] == 3


def test_transfer_batch_to_device_replaces_the_walk_for_custom_batches():
    seen = []

    class Batch:
        def __init__(self, x, y):
            self.x, self.y = x, y

    def transfer(batch, device):
        seen.append(device)
        return Batch(batch.x.to(device), batch.y.to(device))

    def loss_fn(model, batch):
        return F.mse_loss(model(batch.x), batch.y)

    task = eg.Task(loss_fn, optim.sgd(0.1), transfer_batch_to_device=transfer)
    data = [Batch(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    trainer = eg.Trainer(max_epochs=1, accelerator="cpu", barebones=True)
    trainer.fit(task, task.init(nn.Linear(3, 1)), data)
    assert seen == [torch.device("cpu")] * 3
    with pytest.raises(TypeError, match="transfer_batch_to_device"):
        eg.Task(loss_fn, optim.sgd(0.1), transfer_batch_to_device="cuda")


def test_the_accelerators_generator_is_seeded_per_step():
    assert transforms.SingleDevice("mps").rng_devices(None) == ("mps",)  # type: ignore[arg-type]
    assert transforms.SingleDevice("cuda:1").rng_devices(None) == (1,)  # type: ignore[arg-type]
    assert transforms.SingleDevice("cpu").rng_devices(None) == ()  # type: ignore[arg-type]


def test_a_placement_and_a_checkpoint_io_plug_in_where_lightning_takes_plugins(tmp_path):
    calls = []

    class Recording(checkpoint.CheckpointIO):
        def save(self, state, path, **kwargs):
            calls.append(("save", os.path.basename(path)))
            return super().save(state, path, **kwargs)

        def load(self, path, template):
            calls.append(("load", os.path.basename(path)))
            return super().load(path, template)

    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    trainer = eg.Trainer(
        max_epochs=1,
        plugins=[Recording(), transforms.SingleDevice("cpu")],
        default_root_dir=tmp_path,
        **QUIET,
    )
    state = trainer.fit(task, task.init(nn.Linear(3, 1)), data)
    trainer.save_checkpoint(tmp_path / "c")
    eg.Trainer(max_epochs=2, plugins=Recording(), default_root_dir=tmp_path, **QUIET).fit(
        task, state, data, ckpt_path=tmp_path / "c"
    )
    assert ("save", "c") in calls and ("load", "c") in calls


def test_deterministic_sets_cublas_workspace_only_for_cuda(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    eg.Trainer(max_epochs=1, deterministic=True, barebones=True).fit(
        task, task.init(nn.Linear(3, 1)), data
    )
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # a CPU run leaves the environment alone


# --------------------------------------------------------------------------- on a GPU


def _mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 4))


def _batches(n: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
        for _ in range(n)
    ]


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.gpu
def test_gpu_fit_places_the_state_once_and_moves_pinned_batches():
    seen = []

    def loss_fn(model, batch):
        seen.append((batch[0].device.type, batch[1].device.type))
        return _ce(model, batch)

    task = eg.Task(loss_fn, optim.adamw(1e-2), eval_fn=_ce)
    trainer = eg.Trainer(max_epochs=1, accelerator="gpu", devices=1, **QUIET)
    state = trainer.fit(task, task.init(_mlp()), _batches())
    assert {p.device.type for p in state.params.values()} == {"cuda"}
    assert set(seen) == {("cuda", "cuda")}
    (metrics,) = trainer.validate(task, state, _batches(2), verbose=False)
    assert metrics["val/loss"] > 0


def _torch_adamw_on_cuda(data, **kwargs):
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)
    for x, y in data:
        opt.zero_grad()
        _ce(model, (x.cuda(), y.cuda())).backward()
        opt.step()
    return model


@pytest.mark.gpu
def test_gpu_fused_adamw_is_torch_fused_bitwise():
    data = _batches(6)
    model = _torch_adamw_on_cuda(data, fused=True)
    task = eg.Task(_ce, optim.adamw(1e-2, fused=True))
    state = eg.Trainer(max_epochs=1, accelerator="cuda", barebones=True).fit(
        task, task.init(_mlp()), data
    )
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


@pytest.mark.gpu
@pytest.mark.parametrize(("torch_cls", "ours"), [("Adam", "adam"), ("AdamW", "adamw")])
def test_gpu_default_adam_is_torch_default_path_bitwise(torch_cls, ours):
    """torch's default CUDA Adam/AdamW (foreach, counters on the host, corrections as Python
    floats, ending in ``_foreach_addcdiv_``) and engine's default give the same bits; the ops
    and scalars are also compared on the meta device by tests/test_optim_host_counters.py."""
    data = _batches(6)
    model = _mlp().cuda()
    opt = getattr(torch.optim, torch_cls)(model.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        _ce(model, (x.cuda(), y.cuda())).backward()
        opt.step()
    task = eg.Task(_ce, getattr(optim, ours)(1e-2, weight_decay=0.01))
    state = eg.Trainer(max_epochs=1, accelerator="cuda", barebones=True).fit(
        task, task.init(_mlp()), data
    )
    (adam,) = [s for s in state.opt_state if hasattr(s, "step")]
    assert {t.device.type for t in adam.step.values()} == {"cpu"}
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


@pytest.mark.gpu
def test_gpu_16_mixed_matches_grad_scaler_bitwise_with_an_overflow():
    data = _batches(8)
    data[3] = (torch.full_like(data[3][0], float("inf")), data[3][1])
    model = _mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = _ce(model, (x.cuda(), y.cuda()))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    precision = transforms.MixedPrecision(
        torch.float16, loss_scale=transforms.DynamicLossScale(2.0**10, growth_interval=2)
    )
    task = eg.Task(_ce, optim.sgd(0.1))
    trainer = eg.Trainer(max_epochs=1, accelerator="cuda", plugins=[precision], barebones=True)
    state = trainer.fit(task, task.init(_mlp()), data)
    assert float(state.precision["scale"]) == scaler.get_scale()
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]
)
def test_gpu_every_precision_trains_resumes_and_replays_bitwise(tmp_path, precision):
    """A checkpoint saved mid-epoch (asynchronously: pinned host copies of CUDA tensors)
    continues to the uninterrupted run's bits."""
    task = eg.Task(_ce, optim.adamw(1e-2, eps=1e-4), eval_fn=_ce)  # eps float16 holds
    data = _batches(12)
    flags = dict(accelerator="cuda", precision=precision, accumulate_grad_batches=3, **QUIET)
    flags["enable_checkpointing"] = True
    every = eg.listeners.ModelCheckpoint(
        dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=1, asynchronous=True
    )
    whole = eg.Trainer(max_epochs=2, default_root_dir=tmp_path / "a", callbacks=[every], **flags)
    final = whole.fit(task, task.init(_mlp(dropout=0.2)), data)
    (mid,) = (tmp_path / "ck").glob("*step=6*")  # epoch 1, batch 6 of 12: mid-epoch
    resumed = eg.Trainer(max_epochs=2, default_root_dir=tmp_path / "c", **flags).fit(
        task, task.init(_mlp(seed=7, dropout=0.2)), data, ckpt_path=mid
    )
    assert (resumed.step, resumed.epoch) == (final.step, final.epoch) == (8, 2)
    assert resumed.fingerprint() == final.fingerprint()
    report = eg.replay(whole.run_dir, trust_code=True)
    assert report.divergence is None, report


@pytest.mark.gpu
def test_gpu_compile_reduce_overhead_trains_like_eager():
    task = eg.Task(_ce, optim.adamw(1e-2))
    states = {}
    for compile in (False, {"mode": "reduce-overhead"}):
        trainer = eg.Trainer(max_epochs=2, accelerator="cuda", compile=compile, barebones=True)
        states[bool(compile)] = trainer.fit(task, task.init(_mlp()), _batches())
    for name, p in states[False].params.items():
        torch.testing.assert_close(states[True].params[name], p, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_deterministic_sets_the_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    task = eg.Task(_ce, optim.sgd(0.1))
    eg.Trainer(max_epochs=1, accelerator="cuda", deterministic=True, barebones=True).fit(
        task, task.init(_mlp()), _batches(2)
    )
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("device", ["cuda:3", "meta", "cpu:1", "mps"])
def test_a_placement_plugin_the_machine_lacks_is_refused_at_construction(machine, device):
    machine(cuda=1)
    with pytest.raises(ValueError, match=rf"plugins=.*no device '{device}'; it has"):
        eg.Trainer(plugins=[transforms.SingleDevice(device)], **QUIET)


def test_devices_zero_as_a_string_is_refused_and_anomaly_detection_is_set_once():
    with pytest.raises(ValueError, match=r"Trainer\(devices='0'\)"):
        eg.Trainer(devices="0", **QUIET)
    with pytest.raises(ValueError, match="both turn on anomaly detection"):
        eg.Trainer(detect_anomaly=True, plugins=[transforms.DetectAnomaly()], **QUIET)
