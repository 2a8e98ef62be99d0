"""The strategy a Trainer's ``strategy`` / ``devices`` / ``num_nodes`` / ``plugins`` flags
describe, with its cluster environment and, where no launcher started the processes, its
launcher."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from engine.parallel.ddp import DDP
from engine.parallel.environments import select_environment
from engine.transforms.base import Strategy
from engine.transforms.common import SingleProcess

__all__ = ["STRATEGIES", "select_strategy"]

# Lightning's strategy names and the DDP options each stands for
_DDP: dict[str, dict[str, Any]] = {
    "ddp": {"start_method": "popen"},
    "ddp_spawn": {"start_method": "spawn"},
    "ddp_fork": {"start_method": "fork"},
    "ddp_notebook": {"start_method": "fork"},
    "ddp_find_unused_parameters_true": {"start_method": "popen", "find_unused_parameters": True},
    "ddp_find_unused_parameters_false": {"start_method": "popen"},
    "ddp_spawn_find_unused_parameters_true": {
        "start_method": "spawn",
        "find_unused_parameters": True,
    },
}


# Lightning's fully sharded names and the FSDP options each stands for
_FSDP: dict[str, dict[str, Any]] = {
    "fsdp": {},
    "fsdp_cpu_offload": {"cpu_offload": True},
}

# Lightning's DeepSpeed names (its StrategyRegistry) and the DeepSpeedStrategy options of each,
# run as their FSDP2 equivalents; "deepspeed_stage_3_offload_nvme" is refused by check_strategy
_DEEPSPEED: dict[str, dict[str, Any]] = {
    "deepspeed": {},  # Lightning's DeepSpeedStrategy default: stage 2
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_1_offload": {"stage": 1, "offload_optimizer": True},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_3_offload": {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
    },
}

#: the strategy names a Trainer takes
STRATEGIES = ("auto", "single_device", *_DDP, *_FSDP, *_DEEPSPEED)


def select_strategy(
    flag: str | Strategy,
    *,
    processes: int,
    num_nodes: int,
    devices: tuple[torch.device, ...],
    plugins: tuple[Any, ...] = (),
    sync_batchnorm: bool = False,
) -> Strategy:
    """The strategy of a run with ``processes`` devices on each of ``num_nodes`` nodes, this
    node's processes on ``devices`` (the flags were checked by
    ``engine.driver._checks.check_strategy``).

    ``"auto"`` is :class:`DDP` for more than one process, else one process; a ``"ddp*"`` name
    is :class:`DDP` with its options, even for one process (as Lightning runs it), ``"fsdp"``
    / ``"fsdp_cpu_offload"`` :class:`~engine.parallel.FSDP`, a ``"deepspeed*"`` name
    :class:`~engine.parallel.DeepSpeedStrategy` (its ZeRO stage's FSDP2 equivalent, said once
    on rank 0 as a warning); a Strategy object is used as given (its environment filled in
    when it has none).

    Example:
        >>> select_strategy("auto", processes=1, num_nodes=1, devices=(torch.device("cpu"),))
        SingleProcess()
    """
    world = processes * num_nodes
    if isinstance(flag, Strategy):
        if isinstance(flag, DDP) and flag.environment is None:
            flag.environment = select_environment(plugins, devices=processes, num_nodes=num_nodes)
            if flag.devices is None:
                flag.devices = devices
            flag.sync_batchnorm = flag.sync_batchnorm or sync_batchnorm
        _announce(flag)
        return flag
    if flag == "single_device" or (flag == "auto" and world == 1):
        return SingleProcess()  # sync_batchnorm: one process's statistics are the run's
    environment = select_environment(plugins, devices=processes, num_nodes=num_nodes)
    given: dict[str, Any] = {
        "environment": environment,
        "devices": devices,
        "sync_batchnorm": sync_batchnorm,
    }
    if flag in _FSDP:
        from engine.parallel.fsdp import FSDP

        return FSDP(start_method="popen", **given, **_FSDP[flag])
    if flag in _DEEPSPEED:
        from engine.parallel.deepspeed import DeepSpeedStrategy

        chosen = DeepSpeedStrategy(start_method="popen", **given, **_DEEPSPEED[flag])
        _announce(chosen)
        return chosen
    options = _DDP.get(flag, {"start_method": "popen"})
    return DDP(**given, **options)


def _announce(strategy: Strategy) -> None:
    """Say once, on rank 0, what a DeepSpeed strategy runs instead (its FSDP2 equivalent)."""
    from engine.parallel.deepspeed import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy) and strategy.global_rank == 0:
        warnings.warn(strategy.describe(), stacklevel=3)
