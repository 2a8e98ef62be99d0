"""DeepSpeed's strategy names and config on FSDP2: :class:`DeepSpeedStrategy`, an
:class:`~engine.parallel.FSDP` that takes Lightning's ``DeepSpeedStrategy`` arguments and a
DeepSpeed config.

engine does not run DeepSpeed: each ZeRO stage runs as its FSDP2 equivalent, and it says so
once at the start of the run (:meth:`DeepSpeedStrategy.describe`, warned on rank 0 when the
Trainer selects it):

* stage 3 (parameters, gradients and optimizer state sharded) is ``FULL_SHARD``: each unit's
  parameters are gathered for its forward, freed after it and gathered again in backward;
* stage 2 (gradients and optimizer state sharded) is ``SHARD_GRAD_OP``: the gathered
  parameters are kept from the forward to the backward; unlike DeepSpeed's, the parameters are
  sharded between steps too (less memory, the same arithmetic);
* stage 1 (optimizer state sharded) is also ``SHARD_GRAD_OP``: FSDP2 has no mode that shards the
  optimizer state alone;
* an offload (``offload_optimizer`` / ``offload_param`` to ``"cpu"``) is FSDP2's CPU offload,
  which keeps the parameter shards, their gradients and the optimizer state on the CPU (the
  optimizer steps there): DeepSpeed's ``offload_optimizer`` alone keeps the parameters on the
  device. NVMe offload has no equivalent and is refused.

A config's keys with an equivalent set the Trainer's flags (``precision``,
``gradient_clip_val``, ``accumulate_grad_batches``: :meth:`DeepSpeedStrategy.trainer_flags`,
read when the flags are resolved) or are checked (``train_micro_batch_size_per_gpu`` against
the train loader); every other key is refused by name, with what to do instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from engine.parallel.fsdp import FSDP

__all__ = ["DeepSpeedStrategy"]

# Lightning's DeepSpeedStrategy arguments that have no equivalent, and what to do instead
_LIGHTNING_ARGS = {
    "remote_device": "NVMe and remote parameter placement have no FSDP2 equivalent",
    "nvme_path": "NVMe offload has no FSDP2 equivalent",
    "zero_optimization": "pass stage=1, 2 or 3 (ZeRO off is strategy='ddp')",
    "logging_batch_size_per_gpu": "engine logs through the Trainer's loggers; drop it",
    "logging_level": "engine logs through the Trainer's loggers; drop it",
    "loss_scale": "pass Trainer(precision='16-mixed') (a dynamic loss scale)",
    "initial_scale_power": "pass a MixedPrecision plugin with DynamicLossScale(init_scale=...)",
    "loss_scale_window": "pass a MixedPrecision plugin with DynamicLossScale(growth_interval=..)",
    "hysteresis": "engine's dynamic loss scale backs off at the first overflow; drop it",
    "min_loss_scale": "engine's dynamic loss scale has no floor; drop it",
    "partition_activations": "wrap the model's blocks in torch.utils.checkpoint instead",
    "cpu_checkpointing": "wrap the model's blocks in torch.utils.checkpoint instead",
    "contiguous_memory_optimization": "FSDP2 needs no such option; drop it",
    "synchronize_checkpoint_boundary": "FSDP2 needs no such option; drop it",
    "load_full_weights": "engine's checkpoints load on any world size (sharded or full)",
    "exclude_frozen_parameters": "every parameter is saved; drop it",
    "zero_allow_untested_optimizer": "engine's optimizers all run on sharded state; drop it",
}


class DeepSpeedStrategy(FSDP):
    """DeepSpeed's ZeRO stages as their FSDP2 equivalents (Lightning's ``DeepSpeedStrategy``
    and its ``strategy="deepspeed_stage_*"`` names).

    Args:
        config: a DeepSpeed config: a dict, or the path of a JSON file. Its
            ``zero_optimization.stage`` / ``offload_optimizer.device`` / ``offload_param.device``
            choose the sharding; ``gradient_clipping``, ``gradient_accumulation_steps``,
            ``bf16.enabled`` / ``fp16.enabled`` set the Trainer's ``gradient_clip_val``,
            ``accumulate_grad_batches``, ``precision`` (a flag given explicitly with another
            value is an error naming both); ``train_micro_batch_size_per_gpu`` /
            ``train_batch_size`` are checked against the train loader's ``batch_size``; every
            other key is refused by name. ``"auto"`` values leave the Trainer's flag as it is.
        stage: the ZeRO stage, 1, 2 or 3 (default 2, as Lightning's; the config's when it has
            one: both given and different is an error).
        offload_optimizer, offload_parameters: offload to the CPU (FSDP2's CPU offload, which
            keeps parameters, gradients and optimizer state there: see the module's docstring).
        offload_optimizer_device, offload_params_device: ``"cpu"`` only (``"nvme"`` is refused).
        auto_wrap_policy, state_dict_type: :class:`~engine.parallel.FSDP`'s.
        **kwargs: :class:`~engine.parallel.DDP`'s ``environment``, ``backend``, ``timeout``,
            ``start_method``, ``devices``, ``sync_batchnorm``, ``broadcast_buffers``.

    Raises:
        ValueError: a config key or value with no equivalent (each named, with what to do), a
            stage other than 1, 2, 3, an NVMe offload, or a Lightning argument with no
            equivalent.
        TypeError: a config that is not a dict or a path.
        FileNotFoundError: a config path that does not exist.

    Example:
        >>> s = DeepSpeedStrategy({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0})
        >>> s.stage, s.sharding_strategy, s.trainer_flags
        (3, 'FULL_SHARD', {'gradient_clip_val': 1.0})
        >>> DeepSpeedStrategy(stage=4)
        Traceback (most recent call last):
        ...
        ValueError: DeepSpeedStrategy(stage=4): pass 1, 2 or 3 (ZeRO stage 0, no sharding, ...
    """

    def __init__(
        self,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        stage: int | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_optimizer_device: str = "cpu",
        offload_params_device: str = "cpu",
        auto_wrap_policy: Iterable[type[nn.Module]] | Any = None,
        state_dict_type: str = "sharded",
        **kwargs: Any,
    ) -> None:
        for name in kwargs:
            if name in _LIGHTNING_ARGS:
                raise ValueError(
                    f"DeepSpeedStrategy({name}=...): no equivalent here: {_LIGHTNING_ARGS[name]}"
                )
        if stage is not None and (isinstance(stage, bool) or stage not in (1, 2, 3)):
            raise ValueError(
                f"DeepSpeedStrategy(stage={stage!r}): pass 1, 2 or 3 (ZeRO stage 0, no "
                "sharding, is strategy='ddp')"
            )
        for name, value in (
            ("offload_optimizer", offload_optimizer),
            ("offload_parameters", offload_parameters),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"DeepSpeedStrategy({name}={value!r}): pass True or False")
        for name, device in (
            ("offload_optimizer_device", offload_optimizer_device),
            ("offload_params_device", offload_params_device),
        ):
            if device != "cpu":
                raise ValueError(
                    f"DeepSpeedStrategy({name}={device!r}): only 'cpu' has an FSDP2 equivalent "
                    "(its CPU offload); NVMe offload is not available"
                )
        plan = _parse(_load(config))
        if stage is not None and plan.stage is not None and stage != plan.stage:
            raise ValueError(
                f"DeepSpeedStrategy(stage={stage}, config's zero_optimization.stage="
                f"{plan.stage}): they differ; pass one of them"
            )
        #: the ZeRO stage this runs the FSDP2 equivalent of
        self.stage: int = plan.stage or stage or 2
        #: the config as given (a dict; ``{}`` when none)
        self.config: dict[str, Any] = plan.config
        self._plan = plan
        offload = offload_optimizer or offload_parameters or plan.offload
        super().__init__(
            auto_wrap_policy=auto_wrap_policy,
            sharding_strategy="FULL_SHARD" if self.stage == 3 else "SHARD_GRAD_OP",
            cpu_offload=offload,
            state_dict_type=state_dict_type,
            **kwargs,
        )
        #: the per-rank batch size the train loader must have (the config's
        #: ``train_micro_batch_size_per_gpu``, or derived from ``train_batch_size`` when the
        #: Trainer's flags are resolved); ``None``: not checked
        self.micro_batch_size: int | None = plan.micro_batch

    @property
    def trainer_flags(self) -> dict[str, Any]:
        """The Trainer flags the config sets (``precision``, ``gradient_clip_val``,
        ``accumulate_grad_batches``; only those it names with a value other than ``"auto"``)."""
        return dict(self._plan.flags)

    def describe(self) -> str:
        """What this runs instead of DeepSpeed, said once when the Trainer selects it."""
        what = {
            1: "SHARD_GRAD_OP: FSDP2 has no mode that shards the optimizer state alone, so the "
            "gradients and the parameters between steps are sharded too (less memory, the "
            "same updates)",
            2: "SHARD_GRAD_OP: gradients and optimizer state sharded, each unit's gathered "
            "parameters kept from its forward to the backward; unlike DeepSpeed's, the "
            "parameters are sharded between steps too (less memory, the same updates)",
            3: "FULL_SHARD: parameters, gradients and optimizer state sharded, each unit's "
            "parameters gathered for its forward, freed after it and gathered again in backward",
        }[self.stage]
        out = f"DeepSpeed ZeRO stage {self.stage} runs as FSDP2's {what}"
        if self.cpu_offload:
            out += (
                "; the offload is FSDP2's CPU offload: parameter shards, gradients and optimizer "
                "state on the CPU, the optimizer stepping there"
            )
        return out + ". DeepSpeed itself is not used."

    def resolve_flags(self, flags: Mapping[str, Any], world: int) -> dict[str, Any]:
        """The Trainer's ``precision``, ``gradient_clip_val``, ``gradient_clip_algorithm``,
        ``accumulate_grad_batches`` with the config's values (``flags``: the Trainer's, as
        given; ``world``: devices x nodes), checking the batch-size keys; records the per-rank
        batch the train loader must have in :attr:`micro_batch_size`.

        Raises:
            ValueError: a flag given explicitly (not its default) with a value other than the
                config's (naming both), or a batch-size key that cannot be checked or does not
                add up.
        """
        out, micro = _resolve_flags(self._plan, flags, world)
        self.micro_batch_size = micro
        return out

    def shard(self, loader: Any, stage: str) -> Any:
        """DDP's shard of ``loader``; the train loader's ``batch_size`` checked first against
        the config's per-rank batch size."""
        if stage == "train" and self.micro_batch_size is not None:
            size = getattr(loader, "batch_size", None)
            if size is None:
                raise ValueError(
                    f"DeepSpeedStrategy: the config's per-rank batch size "
                    f"{self.micro_batch_size} cannot be checked against the train loader "
                    f"{type(loader).__name__} (no batch_size); drop "
                    "train_micro_batch_size_per_gpu / train_batch_size from the config"
                )
            if size != self.micro_batch_size:
                raise ValueError(
                    f"DeepSpeedStrategy: the config's per-rank batch size is "
                    f"{self.micro_batch_size} (train_micro_batch_size_per_gpu, or train_batch_size"
                    f" / (accumulation x world size)) and the train loader's batch_size is {size}:"
                    " the loader's batch is the per-rank micro batch; make them agree"
                )
        return super().shard(loader, stage)

    def __repr__(self) -> str:
        return (
            f"DeepSpeedStrategy(stage={self.stage}, sharding_strategy={self.sharding_strategy!r}, "
            f"cpu_offload={self.cpu_offload}, world_size={self.world_size})"
        )


# ---------------------------------------------------------------------- the config

_NO_EQUIVALENT = "no equivalent in engine; drop it"
_COLLECTIVES = (
    "FSDP2 sizes and schedules its own collectives (one all-gather and one reduce-scatter per "
    "unit); drop it"
)
_UNITS = "FSDP2 gathers per unit: choose the units with auto_wrap_policy; drop it"
_LOGS = "engine reports through the Trainer's logger= and profiler=; drop it"

# top-level keys with no equivalent, and what to do instead
_REFUSED: dict[str, str] = {
    "optimizer": "pass the optimizer as the Task's tx (engine.optim.adamw(lr, ...))",
    "scheduler": "give the Task's optimizer a schedule as its learning rate (engine.optim)",
    "amp": "pass Trainer(precision='16-mixed') or 'bf16-mixed'",
    "zero_allow_untested_optimizer": "every engine optimizer runs on sharded state; drop it",
    "zero_force_ds_cpu_optimizer": "every engine optimizer runs on sharded state; drop it",
    "prescale_gradients": "the gradients are averaged once per optimizer step; drop it",
    "gradient_predivide_factor": "the gradients are averaged once per optimizer step; drop it",
    "communication_data_type": "the reduction runs in the gradients' dtype; drop it",
    "sparse_gradients": "gradients are dense; drop it",
    "activation_checkpointing": "wrap the model's blocks in torch.utils.checkpoint; drop it",
    "elasticity": "no elastic world size: a sharded checkpoint resumes on another one instead",
    "aio": "NVMe offload is not available; drop it",
    "checkpoint": "the Trainer's checkpoints (FSDP(state_dict_type=...)) replace it; drop it",
    "data_types": "gradients accumulate in the parameters' dtype (the precision's); drop it",
    "compile": "pass Trainer(compile=True)",
    "pipeline": "pipeline parallelism is not built; drop it",
    "tensor_parallel": "tensor parallelism is not built; drop it",
    **{
        k: _LOGS
        for k in (
            "steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "monitor_config",
            "comms_logger",
            "flops_profiler",
        )
    },
    **{
        k: _NO_EQUIVALENT
        for k in (
            "compression_training",
            "data_efficiency",
            "autotuning",
            "curriculum_learning",
            "quantize_training",
            "hybrid_engine",
            "sparse_attention",
            "eigenvalue",
            "progressive_layer_drop",
            "weight_quantization",
            "nebula",
        )
    },
}

# zero_optimization's keys with no equivalent
_ZERO_REFUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "allgather_bucket_size",
            "reduce_bucket_size",
            "overlap_comm",
            "contiguous_gradients",
            "round_robin_gradients",
            "sub_group_size",
        ),
        _COLLECTIVES,
    ),
    **dict.fromkeys(
        (
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_prefetch_bucket_size",
            "stage3_model_persistence_threshold",
        ),
        _UNITS,
    ),
    "stage3_gather_16bit_weights_on_model_save": (
        "engine.checkpoint.export gathers one full checkpoint; drop it"
    ),
    "ignore_unused_parameters": "a parameter unused by the loss gets a zero gradient; drop it",
    "cpu_offload": "use offload_optimizer: {'device': 'cpu'}",
    **dict.fromkeys(
        (
            "elastic_checkpoint",
            "load_from_fp32_weights",
            "zero_hpz_partition_size",
            "zero_quantized_weights",
            "zero_quantized_gradients",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "memory_efficient_linear",
            "legacy_stage1",
            "use_multi_rank_bucket_allreduce",
        ),
        _NO_EQUIVALENT,
    ),
}

# the keys an fp16 section may have beside "enabled", and what to do instead
_FP16_REFUSED = {
    "initial_scale_power": (
        "pass plugins=MixedPrecision(torch.float16, loss_scale=DynamicLossScale(init_scale=2**N))"
    ),
    "loss_scale_window": (
        "pass plugins=MixedPrecision(torch.float16, loss_scale=DynamicLossScale(growth_interval=N))"
    ),
    "hysteresis": "engine's loss scale backs off at the first overflow; drop it",
    "consecutive_hysteresis": "engine's loss scale backs off at the first overflow; drop it",
    "min_loss_scale": "engine's loss scale has no floor; drop it",
    "auto_cast": "the forward runs under torch.autocast under '16-mixed'; drop it",
    "fp16_master_weights_and_grads": "parameters and gradients stay float32; drop it",
}

_HONOURED = (
    "zero_optimization",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "bf16",
    "bfloat16",
    "fp16",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a DeepSpeed config asks for, in engine's terms."""

    config: dict[str, Any]
    stage: int | None = None
    offload: bool = False
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)  # the Trainer's flags
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # flag -> "key=value"
    micro_batch: int | None = None
    train_batch: int | None = None


def _load(config: Any) -> dict[str, Any]:
    """The config as a dict: ``None`` is ``{}``, a path is read as JSON."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a copy, and only JSON's types
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"DeepSpeedStrategy(config={config!r}): a {type(config).__name__}; pass a dict or "
            "the path of a DeepSpeed JSON config"
        )
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(
            f"DeepSpeedStrategy(config={str(config)!r}): no such file; pass a dict or the path "
            "of a DeepSpeed JSON config"
        )
    try:
        loaded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"DeepSpeedStrategy(config={str(config)!r}): not JSON: {e}") from None
    if not isinstance(loaded, dict):
        raise TypeError(
            f"DeepSpeedStrategy(config={str(config)!r}) holds a {type(loaded).__name__}, not a "
            "JSON object of DeepSpeed's keys"
        )
    return loaded


def _count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _parse(config: dict[str, Any]) -> _Plan:
    """Every key of ``config`` honoured or refused (all refusals in one error)."""
    wrong: list[str] = []  # "key: why" for each key refused
    flags: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def sets(flag: str, value: Any, key: str, raw: Any) -> None:
        flags[flag], sources[flag] = value, f"{key}={raw!r}"

    for key in config:
        if key in _REFUSED:
            wrong.append(f"{key}: {_REFUSED[key]}")
        elif key not in _HONOURED:
            wrong.append(f"{key}: not a DeepSpeed config key engine knows (a misspelling?)")
    stage, offload = _zero(config.get("zero_optimization", {}), wrong)
    clip = config.get("gradient_clipping", "auto")
    if clip != "auto":
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            wrong.append(f"gradient_clipping={clip!r}: pass a norm >= 0 (0: no clipping)")
        else:  # DeepSpeed clips by the global norm, as gradient_clip_algorithm='norm'
            sets("gradient_clip_val", float(clip) if clip > 0 else None, "gradient_clipping", clip)
    sizes: dict[str, int | None] = {}
    for key in (
        "gradient_accumulation_steps",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
    ):
        value = config.get(key, "auto")
        sizes[key] = None
        if value != "auto" and not _count(value, 1):
            wrong.append(f"{key}={value!r}: pass an int >= 1 (or 'auto')")
        elif value != "auto":
            sizes[key] = value
    if sizes["gradient_accumulation_steps"] is not None:
        steps = sizes["gradient_accumulation_steps"]
        sets("accumulate_grad_batches", steps, "gradient_accumulation_steps", steps)
    enabled = _precision(config, wrong)
    if len(enabled) > 1:
        wrong.append("bf16.enabled and fp16.enabled are both true: enable one of them")
    elif enabled:
        name = enabled[0]
        sets("precision", "bf16-mixed" if name != "fp16" else "16-mixed", f"{name}.enabled", True)
    if wrong:
        raise ValueError(
            "DeepSpeedStrategy(config=...): these keys have no equivalent in engine or wrong "
            "values, and are refused:\n  " + "\n  ".join(wrong)
        )
    return _Plan(
        config,
        stage,
        offload,
        flags,
        sources,
        sizes["train_micro_batch_size_per_gpu"],
        sizes["train_batch_size"],
    )


def _zero(section: Any, wrong: list[str]) -> tuple[int | None, bool]:
    """``zero_optimization``: its stage and whether anything is offloaded to the CPU."""
    if not isinstance(section, Mapping):
        wrong.append(f"zero_optimization={section!r}: pass a dict, such as {{'stage': 2}}")
        return None, False
    stage = section.get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in (1, 2, 3)):
        wrong.append(
            f"zero_optimization.stage={stage!r}: "
            + ("stage 0 shards nothing: use strategy='ddp'" if stage == 0 else "pass 1, 2 or 3")
        )
        stage = None
    offload = False
    for key, value in section.items():
        where = f"zero_optimization.{key}"
        if key in ("offload_optimizer", "offload_param"):
            offload = _offload(where, value, wrong) or offload
            if key == "offload_param" and offload and stage is not None and stage < 3:
                wrong.append(f"{where}: DeepSpeed offloads parameters at stage 3 only")
        elif key in ("reduce_scatter", "allgather_partitions"):
            if value is not True:
                wrong.append(f"{where}={value!r}: FSDP2 always does it; drop it")
        elif key in _ZERO_REFUSED:
            wrong.append(f"{where}: {_ZERO_REFUSED[key]}")
        elif key != "stage":
            wrong.append(f"{where}: not a zero_optimization key engine knows (a misspelling?)")
    return stage, offload


def _offload(where: str, value: Any, wrong: list[str]) -> bool:
    """An ``offload_optimizer`` / ``offload_param`` section: whether it offloads to the CPU."""
    if value is None:
        return False
    if not isinstance(value, Mapping):
        wrong.append(f"{where}={value!r}: pass a dict, such as {{'device': 'cpu'}}")
        return False
    device = value.get("device", "none")
    if device not in ("cpu", "none"):
        wrong.append(
            f"{where}.device={device!r}: only 'cpu' has an FSDP2 equivalent (its CPU offload)"
            + ("; NVMe offload is not available" if device == "nvme" else "")
        )
    for key, sub in value.items():
        if key == "pin_memory" and sub is True:
            continue  # FSDP2's CPU offload pins its CPU tensors (CPUOffloadPolicy's default)
        if key != "device":
            wrong.append(f"{where}.{key}={sub!r}: FSDP2's CPU offload has no such option; drop it")
    return device == "cpu"


def _precision(config: dict[str, Any], wrong: list[str]) -> list[str]:
    """The names of the precision sections (``bf16``/``bfloat16``, ``fp16``) enabled."""
    enabled: list[str] = []
    for name in ("bf16", "bfloat16", "fp16"):
        if name not in config:
            continue
        section = config[name]
        if not isinstance(section, Mapping):
            wrong.append(f"{name}={section!r}: pass a dict, such as {{'enabled': True}}")
            continue
        on = section.get("enabled", False)
        if on not in (True, False, "auto"):
            wrong.append(f"{name}.enabled={on!r}: pass true, false or 'auto'")
        elif on is True:
            enabled.append(name)
        for key, value in section.items():
            if key == "enabled" or (name == "fp16" and key == "loss_scale" and value == 0):
                continue  # loss_scale 0: dynamic, as engine's '16-mixed'
            why = _FP16_REFUSED.get(key) if name == "fp16" else None
            if name == "fp16" and key == "loss_scale":
                why = "a static loss scale: engine's '16-mixed' scale is dynamic (0); drop it"
            wrong.append(f"{name}.{key}={value!r}: {why or _NO_EQUIVALENT}")
    return enabled


# the Trainer's defaults for the flags a config sets: a flag at its default is not "given"
_DEFAULTS: dict[str, Any] = {
    "precision": None,
    "gradient_clip_val": None,
    "accumulate_grad_batches": 1,
}


def _resolve_flags(
    plan: _Plan, flags: Mapping[str, Any], world: int
) -> tuple[dict[str, Any], int | None]:
    """The flags the config sets (checked against the Trainer's), and the per-rank batch the
    train loader must have."""
    from engine.transforms import canonical_precision

    out: dict[str, Any] = {}
    for name, value in plan.flags.items():
        given, default = flags.get(name, _DEFAULTS[name]), _DEFAULTS[name]
        explicit = given is not default and not (type(given) is type(default) and given == default)
        if explicit:
            same = (
                canonical_precision(given) == value
                if name == "precision"
                else given == value and not isinstance(given, bool)
            )
            if not same:
                raise ValueError(
                    f"Trainer({name}={given!r}) and the DeepSpeed config's "
                    f"{plan.sources[name]} (which sets {name}={value!r}) differ: set it in one "
                    "place"
                )
        out[name] = value
    if "gradient_clip_val" in plan.flags and flags.get("gradient_clip_algorithm") == "value":
        raise ValueError(
            f"Trainer(gradient_clip_algorithm='value') and the DeepSpeed config's "
            f"{plan.sources['gradient_clip_val']}: DeepSpeed clips by the global norm; drop one"
        )
    accumulate = out.get("accumulate_grad_batches", flags.get("accumulate_grad_batches", 1))
    micro, total = plan.micro_batch, plan.train_batch
    if total is not None and _count(accumulate, 1):
        per_step = accumulate * world
        if micro is not None and micro * per_step != total:
            raise ValueError(
                f"DeepSpeed config: train_batch_size={total} is not train_micro_batch_size_per_gpu"
                f"={micro} x accumulate_grad_batches={accumulate} x world size {world} "
                f"(= {micro * per_step}); make them agree or drop train_batch_size"
            )
        if micro is None:
            if total % per_step:
                raise ValueError(
                    f"DeepSpeed config: train_batch_size={total} is not divisible by "
                    f"accumulate_grad_batches={accumulate} x world size {world}: no per-rank "
                    "batch size gives it"
                )
            micro = total // per_step
    if micro is not None and (world == 1 or flags.get("use_distributed_sampler") is False):
        key = "train_micro_batch_size_per_gpu" if plan.micro_batch else "train_batch_size"
        raise ValueError(
            f"DeepSpeed config: {key} cannot be checked here: the train loader's batch size is "
            "checked where the Trainer shards the loaders (devices x num_nodes > 1 and "
            f"use_distributed_sampler=True; this run: world size {world}, "
            f"use_distributed_sampler={flags.get('use_distributed_sampler', True)}). Drop it: "
            "the loader's batch_size is the per-rank micro batch"
        )
    return out, micro
