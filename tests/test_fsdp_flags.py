"""The fully sharded strategy flags: ``strategy="fsdp"`` / ``"fsdp_cpu_offload"``, DeepSpeed's
Lightning names run as their FSDP2 equivalents (checked against Lightning's own registry), and
:class:`engine.parallel.DeepSpeedStrategy`'s config: the keys honoured set the Trainer's flags,
the rest are refused by name, wrong values are errors naming the value."""

from __future__ import annotations

import inspect
import json
import warnings

import _procs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine.driver import _checks as cfg
from engine.parallel import DeepSpeedStrategy
from engine.parallel.fsdp import FSDP
from engine.parallel.select import STRATEGIES, select_strategy

pl = pytest.importorskip("pytorch_lightning")
from pytorch_lightning.strategies import StrategyRegistry  # noqa: E402

CPU2 = (torch.device("cpu"), torch.device("cpu"))
SHARDED = [n for n in StrategyRegistry.available_strategies() if "fsdp" in n or "deepspeed" in n]


def _select(name: str) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return select_strategy(name, processes=2, num_nodes=1, devices=CPU2)


def _trainer(**flags: object) -> eg.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eg.Trainer(accelerator="cpu", enable_progress_bar=False, **flags)


# ---------------------------------------------------------------------- names


def test_every_lightning_fsdp_and_deepspeed_name_is_taken_or_refused_with_a_reason():
    assert {"fsdp", "fsdp_cpu_offload", "deepspeed_stage_3"} <= set(SHARDED)
    for name in SHARDED:
        if name == "deepspeed_stage_3_offload_nvme":
            assert name not in STRATEGIES
            with pytest.raises(ValueError, match="NVMe offload has no FSDP2 equivalent"):
                cfg.check_strategy(name, 2, 1)
        else:
            assert name in STRATEGIES, name
            assert cfg.check_strategy(name, 2, 1) == 2


@pytest.mark.parametrize(
    "name", [n for n in SHARDED if n.startswith("deepspeed") and "nvme" not in n]
)
def test_deepspeed_names_run_lightnings_stage_and_offload(name):
    params = StrategyRegistry[name]["init_params"]
    default_stage = inspect.signature(pl.strategies.DeepSpeedStrategy).parameters["stage"].default
    stage = params.get("stage", default_stage)
    strategy = _select(name)
    assert isinstance(strategy, DeepSpeedStrategy) and isinstance(strategy, FSDP)
    assert strategy.stage == stage
    # stage 3: parameters resharded after forward; 1 and 2: kept gathered forward -> backward
    assert strategy.sharding_strategy == ("FULL_SHARD" if stage == 3 else "SHARD_GRAD_OP")
    assert strategy.reshard_after_forward is (stage == 3)
    offload = params.get("offload_optimizer", False) or params.get("offload_parameters", False)
    assert strategy.cpu_offload is offload
    assert strategy.start_method == "popen" and strategy.world_size == 2


@pytest.mark.parametrize("name", ["fsdp", "fsdp_cpu_offload"])
def test_fsdp_names_are_lightnings_defaults(name):
    params = StrategyRegistry[name]["init_params"]
    strategy = _select(name)
    assert type(strategy) is FSDP
    # Lightning's FSDPStrategy defaults to FULL_SHARD
    lightning = inspect.signature(pl.strategies.FSDPStrategy).parameters
    assert strategy.sharding_strategy == lightning["sharding_strategy"].default == "FULL_SHARD"
    assert strategy.cpu_offload is bool(params.get("cpu_offload", False))
    assert strategy.start_method == "popen"


def test_fsdp_on_one_process_is_still_fsdp_as_lightning_runs_it():
    trainer = _trainer(strategy="fsdp", devices=1)
    assert type(trainer.assembly.strategy) is FSDP and trainer.world_size == 1
    assert trainer.config.strategy == "fsdp"


def test_trainer_takes_fsdp_on_two_devices_with_sync_batchnorm():
    trainer = _trainer(strategy="fsdp", devices=2, sync_batchnorm=True)
    assert isinstance(trainer.assembly.strategy, FSDP) and trainer.world_size == 2
    assert trainer.assembly.strategy.sync_batchnorm and trainer.assembly.strategy.devices == CPU2


@pytest.mark.parametrize("name", ["dp", "xla", "xla_fsdp"])
def test_other_strategies_stay_refused(name):
    with pytest.raises(ValueError, match=rf"Trainer\(strategy='{name}'\)"):
        _trainer(strategy=name)


def test_an_unknown_name_lists_the_sharded_ones():
    with pytest.raises(ValueError, match=r"'fsdp'.*'deepspeed_stage_3'.*DeepSpeedStrategy"):
        _trainer(strategy="fsdp2")


@pytest.mark.parametrize("devices", [0, -2, "x", 2.5])
def test_fsdp_with_wrong_devices_names_the_value(devices):
    with pytest.raises((ValueError, TypeError), match=rf"devices={devices!r}"):
        _trainer(strategy="fsdp", devices=devices)


# ---------------------------------------------------------------------- saying so once


def test_a_deepspeed_name_says_once_what_it_runs_instead():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _ = eg.Trainer(accelerator="cpu", strategy="deepspeed_stage_1", devices=2)
    said = [str(w.message) for w in seen if str(w.message).startswith("DeepSpeed ZeRO stage")]
    assert len(said) == 1
    assert "SHARD_GRAD_OP" in said[0] and "no mode that shards the optimizer state alone" in said[0]


@pytest.mark.parametrize(
    "name, words",
    [
        ("deepspeed_stage_2", ["SHARD_GRAD_OP", "kept from its forward to the backward"]),
        ("deepspeed_stage_3_offload", ["FULL_SHARD", "freed after it", "CPU offload"]),
    ],
)
def test_the_announcement_names_the_fsdp2_equivalent_and_what_differs(name, words):
    with pytest.warns(UserWarning) as seen:
        select_strategy(name, processes=2, num_nodes=1, devices=CPU2)
    assert len(seen) == 1 and all(w in str(seen[0].message) for w in words)


def test_fsdp_itself_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_strategy("fsdp", processes=2, num_nodes=1, devices=CPU2)


def test_other_ranks_do_not_repeat_it(monkeypatch):
    for k, v in dict(
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        TORCHELASTIC_RUN_ID="x",
    ).items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = select_strategy("deepspeed_stage_3", processes=2, num_nodes=1, devices=CPU2)
    assert strategy.global_rank == 1


def test_a_strategy_object_is_announced_at_selection_too():
    strategy = DeepSpeedStrategy(stage=3)
    with pytest.warns(UserWarning, match="FULL_SHARD"):
        select_strategy(strategy, processes=2, num_nodes=1, devices=CPU2)


# ---------------------------------------------------------------------- the config


def test_config_keys_with_an_equivalent_set_the_trainers_flags():
    config = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}},
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
    }
    strategy = DeepSpeedStrategy(config)
    assert (strategy.stage, strategy.sharding_strategy, strategy.cpu_offload) == (
        3,
        "FULL_SHARD",
        True,
    )
    trainer = _trainer(strategy=strategy, devices=2)
    assert trainer.precision == "bf16-mixed"
    assert trainer.gradient_clip_val == 0.5 and trainer.gradient_clip_algorithm == "norm"
    assert trainer.accumulate_grad_batches == 4
    assert trainer.config.strategy == "DeepSpeedStrategy"
    assert type(trainer.assembly.precision).__name__ == "MixedPrecision"
    assert trainer.assembly.precision.dtype == torch.bfloat16


def test_fp16_is_16_mixed_and_auto_leaves_the_flag():
    assert (
        _trainer(
            strategy=DeepSpeedStrategy({"fp16": {"enabled": True, "loss_scale": 0}}), devices=2
        ).precision
        == "16-mixed"
    )
    auto = DeepSpeedStrategy(
        {
            "bf16": {"enabled": "auto"},
            "gradient_clipping": "auto",
            "gradient_accumulation_steps": "auto",
        }
    )
    trainer = _trainer(
        strategy=auto,
        devices=2,
        precision="16-mixed",
        gradient_clip_val=3.0,
        accumulate_grad_batches=2,
    )
    assert (trainer.precision, trainer.gradient_clip_val, trainer.accumulate_grad_batches) == (
        "16-mixed",
        3.0,
        2,
    )


def test_a_config_read_from_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1}))
    strategy = DeepSpeedStrategy(str(path))
    assert strategy.stage == 1 and strategy.trainer_flags == {"gradient_clip_val": 1.0}
    assert DeepSpeedStrategy(path).config == {
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1,
    }


@pytest.mark.parametrize(
    "config, flags, names",
    [
        (
            {"gradient_clipping": 1.0},
            {"gradient_clip_val": 2.0},
            ["gradient_clip_val=2.0", "gradient_clipping=1.0"],
        ),
        (
            {"gradient_accumulation_steps": 4},
            {"accumulate_grad_batches": 2},
            ["accumulate_grad_batches=2", "gradient_accumulation_steps=4"],
        ),
        (
            {"bf16": {"enabled": True}},
            {"precision": "16-mixed"},
            ["precision='16-mixed'", "bf16.enabled=True"],
        ),
        (
            {"gradient_clipping": 1.0},
            {"gradient_clip_algorithm": "value"},
            ["gradient_clip_algorithm='value'", "gradient_clipping=1.0"],
        ),
    ],
)
def test_a_config_value_against_a_flag_given_explicitly_names_both(config, flags, names):
    with pytest.raises(ValueError) as e:
        _trainer(strategy=DeepSpeedStrategy(config), devices=2, **flags)
    for name in names:
        assert name in str(e.value)


def test_the_same_value_in_both_places_is_fine():
    trainer = _trainer(
        strategy=DeepSpeedStrategy({"gradient_clipping": 1, "bf16": {"enabled": True}}),
        devices=2,
        gradient_clip_val=1.0,
        precision="bf16",
    )
    assert trainer.gradient_clip_val == 1.0 and trainer.precision == "bf16-mixed"


@pytest.mark.parametrize(
    "config, said",
    [
        ({"optimizer": {"type": "AdamW"}}, "optimizer: pass the optimizer as the Task's tx"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler: give the Task's optimizer a schedule"),
        (
            {"zero_optimization": {"stage": 2, "overlap_comm": True}},
            "zero_optimization.overlap_comm: FSDP2 sizes and schedules its own collectives",
        ),
        ({"zero_optimization": {"stage3_prefetch_bucket_size": 5}}, "auto_wrap_policy"),
        (
            {"fp16": {"enabled": True, "initial_scale_power": 12}},
            "fp16.initial_scale_power=12: pass plugins=MixedPrecision",
        ),
        ({"steps_per_print": 10}, "steps_per_print: engine reports through"),
        ({"optimiser": {}}, "optimiser: not a DeepSpeed config key engine knows"),
        ({"zero_optimization": {"stag": 2}}, "zero_optimization.stag: not a zero_optimization key"),
    ],
)
def test_keys_without_an_equivalent_are_refused_by_name(config, said):
    with pytest.raises(ValueError, match="refused") as e:
        DeepSpeedStrategy(config)
    assert said in str(e.value)


def test_every_refused_key_is_named_in_one_error():
    with pytest.raises(ValueError) as e:
        DeepSpeedStrategy(
            {
                "optimizer": {},
                "wall_clock_breakdown": True,
                "foo": 1,
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
            }
        )
    for key in ("optimizer", "wall_clock_breakdown", "foo", "zero_optimization.reduce_bucket_size"):
        assert f"\n  {key}" in str(e.value)


@pytest.mark.parametrize(
    "make, error, said",
    [
        (lambda: DeepSpeedStrategy(stage=4), ValueError, "stage=4"),
        (lambda: DeepSpeedStrategy(stage=0), ValueError, "strategy='ddp'"),
        (
            lambda: DeepSpeedStrategy({"zero_optimization": {"stage": 4}}),
            ValueError,
            "zero_optimization.stage=4: pass 1, 2 or 3",
        ),
        (
            lambda: DeepSpeedStrategy({"zero_optimization": {"stage": 0}}),
            ValueError,
            "stage 0 shards nothing",
        ),
        (
            lambda: DeepSpeedStrategy(
                {
                    "zero_optimization": {
                        "stage": 3,
                        "offload_param": {"device": "nvme", "nvme_path": "/x"},
                    }
                }
            ),
            ValueError,
            "offload_param.device='nvme'",
        ),
        (
            lambda: DeepSpeedStrategy(offload_optimizer=True, offload_optimizer_device="nvme"),
            ValueError,
            "offload_optimizer_device='nvme'",
        ),
        (
            lambda: DeepSpeedStrategy({"zero_optimization": {"stage": 2}}, stage=3),
            ValueError,
            "stage=3, config's zero_optimization.stage=2",
        ),
        (
            lambda: DeepSpeedStrategy(
                {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
            ),
            ValueError,
            "stage 3 only",
        ),
        (lambda: DeepSpeedStrategy({"gradient_clipping": -1}), ValueError, "gradient_clipping=-1"),
        (
            lambda: DeepSpeedStrategy({"gradient_accumulation_steps": 0}),
            ValueError,
            "gradient_accumulation_steps=0",
        ),
        (
            lambda: DeepSpeedStrategy({"bf16": {"enabled": True}, "fp16": {"enabled": True}}),
            ValueError,
            "both true",
        ),
        (lambda: DeepSpeedStrategy({"bf16": True}), ValueError, "bf16=True: pass a dict"),
        (lambda: DeepSpeedStrategy([("zero_optimization", {})]), TypeError, "a list"),
        (lambda: DeepSpeedStrategy(3), TypeError, "config=3"),
        (
            lambda: DeepSpeedStrategy("/no/such/ds_config.json"),
            FileNotFoundError,
            "/no/such/ds_config.json",
        ),
        (lambda: DeepSpeedStrategy(nvme_path="/local_nvme"), ValueError, "nvme_path"),
        (lambda: DeepSpeedStrategy(sharding_strategy="FULL_SHARD"), TypeError, "sharding"),
    ],
)
def test_wrong_values_are_errors_naming_the_value(make, error, said):
    with pytest.raises(error) as e:
        make()
    assert said in str(e.value)


def test_a_json_file_that_is_not_an_object_or_not_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 2")
    with pytest.raises(ValueError, match="not JSON"):
        DeepSpeedStrategy(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(TypeError, match="holds a list"):
        DeepSpeedStrategy(bad)
    with pytest.raises(FileNotFoundError, match="no such file"):
        DeepSpeedStrategy(tmp_path)  # a directory


@pytest.mark.parametrize("sharding", ["HYBRID_SHARD", "NO_SHARD", "full_shard", 3])
def test_fsdp_refuses_an_unknown_sharding_strategy_naming_it(sharding):
    with pytest.raises(ValueError, match=rf"sharding_strategy={sharding!r}"):
        FSDP(sharding_strategy=sharding)


# ---------------------------------------------------------------------- the batch size


def _loader(batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(32, 2)), batch_size=batch_size)


def test_micro_batch_is_checked_against_the_train_loader():
    strategy = DeepSpeedStrategy({"train_micro_batch_size_per_gpu": 4})
    _trainer(strategy=strategy, devices=2)
    assert strategy.micro_batch_size == 4
    with pytest.raises(ValueError, match=r"per-rank batch size is 4.*batch_size is 8"):
        strategy.shard(_loader(8), "train")
    strategy.shard(_loader(4), "train")
    strategy.shard(_loader(8), "validate")  # the evaluation loaders are not the micro batch


def test_train_batch_size_gives_the_micro_batch_by_accumulation_and_world():
    strategy = DeepSpeedStrategy({"train_batch_size": 16, "gradient_accumulation_steps": 2})
    _trainer(strategy=strategy, devices=2)
    assert strategy.micro_batch_size == 4  # 16 / (2 x 2)
    derived = DeepSpeedStrategy({"train_batch_size": 24})
    _trainer(strategy=derived, devices=2, accumulate_grad_batches=3)
    assert derived.micro_batch_size == 4
    with pytest.raises(ValueError, match="train_batch_size=16 is not train_micro_batch_size"):
        _trainer(
            strategy=DeepSpeedStrategy(
                {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}
            ),
            devices=2,
        )
    with pytest.raises(ValueError, match="not divisible"):
        _trainer(
            strategy=DeepSpeedStrategy({"train_batch_size": 10}),
            devices=2,
            accumulate_grad_batches=3,
        )


@pytest.mark.parametrize(
    "flags", [{"devices": 1}, {"devices": 2, "use_distributed_sampler": False}]
)
def test_a_micro_batch_that_cannot_be_checked_is_refused_saying_so(flags):
    with pytest.raises(ValueError, match="cannot be checked here"):
        _trainer(strategy=DeepSpeedStrategy({"train_micro_batch_size_per_gpu": 4}), **flags)


def test_a_loader_without_batch_size_cannot_be_checked():
    strategy = DeepSpeedStrategy({"train_micro_batch_size_per_gpu": 4})
    _trainer(strategy=strategy, devices=2)
    loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=None)
    with pytest.raises(ValueError, match="cannot be checked against the train loader"):
        strategy.shard(loader, "train")


# ---------------------------------------------------------------------- a run on 2 ranks

SCRIPT = """
import json, sys
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import engine as eg
from engine import optim
from engine.parallel import DeepSpeedStrategy

args = json.loads(sys.argv[1])
torch.set_num_threads(1)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
loader = DataLoader(ds, batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2, weight_decay=0.01))
strategy = DeepSpeedStrategy(args["config"]) if "config" in args else args["strategy"]
trainer = eg.Trainer(accelerator="cpu", strategy=strategy, devices=2, max_steps=6,
                     enable_progress_bar=False, enable_checkpointing=False, logger=False,
                     enable_model_summary=False, enable_journal=False,
                     default_root_dir=args["dir"], **args.get("flags", {}))
state = trainer.fit(task, task.init(model, seed=0), loader)
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.params.items()}
if trainer.is_global_zero:
    torch.save(full, args["out"])
"""


def _run_two_ranks(tmp_path, name: str, args: dict) -> dict:
    """The parameters after 6 optimizer steps of a Trainer on 2 gloo ranks it launches itself
    (a process group of its own, killed whole if it outlives the timeout)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ds_run.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "PYTHONUNBUFFERED",
    ):
        env.pop(k, None)
    args = {**args, "dir": str(tmp_path / name), "out": str(out)}
    proc = _procs.Popen(
        [sys.executable, str(script), json.dumps(args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=55)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise AssertionError(f"{name}: no result within 55 s:\n{text[-3000:]}") from None
    assert proc.returncode == 0, text[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_a_config_run_trains_as_ddp_with_the_same_flags(tmp_path):
    """ZeRO-3 from a config (clip 0.05, accumulation 2, micro batch 4) on 2 ranks against
    Trainer(strategy='ddp') given those flags: the same parameters; without the config's clip
    and accumulation (the name alone) they differ, so the config's keys did reach the run."""
    config = {
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.05,
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 4,
    }
    sharded = _run_two_ranks(tmp_path, "ds", {"config": config})
    ddp = _run_two_ranks(
        tmp_path,
        "ddp",
        {"strategy": "ddp", "flags": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}},
    )
    plain = _run_two_ranks(tmp_path, "plain", {"strategy": "deepspeed_stage_3"})
    assert sharded.keys() == ddp.keys()
    for k in ddp:
        torch.testing.assert_close(sharded[k], ddp[k], atol=1e-6, rtol=0)
    assert max(float((plain[k] - ddp[k]).abs().max()) for k in ddp) > 1e-3
