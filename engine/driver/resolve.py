"""The Trainer's flags, checked and resolved once into a frozen :class:`LoopConfig`.

:func:`resolve` takes the Trainer's keyword arguments (same names, defaults and meanings) and does
everything the flags imply before a run starts: each flag is checked (``engine.driver._checks``: an
error names the flag, the value and what is accepted), Lightning's defaults are filled in
(``max_epochs``, ``num_sanity_val_steps``, ``min_epochs`` with ``min_steps``), and
``overfit_batches``, ``fast_dev_run`` and ``barebones`` are applied to the flags they override.
What comes out is plain values: the loop and the listeners read it, nothing writes it.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any

import attrs

from engine.driver import _checks as cfg
from engine.plan.config import LoopConfig
from engine.plan.flags import Flags
from engine.transforms import canonical_precision, precision_transform
from engine.transforms.devices import resolve_devices

__all__ = ["resolve"]

# turned off by barebones; None (the default) means on
_ENABLE = ("enable_checkpointing", "enable_progress_bar", "enable_model_summary")


def resolve(given: Flags | None = None, /, **kwargs: Any) -> LoopConfig:
    """Check the Trainer's flags (a :class:`~engine.plan.flags.Flags`, or its fields as keyword
    arguments) and resolve them into a :class:`LoopConfig` (with the Trainer's defaults;
    ``logger``, ``callbacks`` and ``plugins`` are checked only).

    Raises:
        ValueError: naming the first flag with a value it does not accept.

    Example:
        >>> from engine.driver.resolve import resolve
        >>> config = resolve(max_steps=100, num_sanity_val_steps=-1)
        >>> config.max_epochs, config.num_sanity_val_steps, config.limit_train_batches
        (-1, inf, 1.0)
        >>> quick = resolve(fast_dev_run=3)
        >>> quick.max_steps, quick.max_epochs, quick.limit_val_batches, quick.enable_journal
        (3, 1, 3, False)
        >>> resolve(barebones=True).enable_progress_bar
        False
        >>> resolve(max_epochs=-2)
        Traceback (most recent call last):
        ...
        ValueError: Trainer(max_epochs=-2): max_epochs must be an int >= -1 or None
    """
    if given is None:
        given = Flags(**kwargs)
    flags = attrs.asdict(given, recurse=False)
    # -- flags with a fixed set of values (placement and scale-out: single-process CPU until
    # their own issues land; _config.CHOICES)
    cfg.check_choices(**{name: flags[name] for name in cfg.CHOICES})
    here = resolve_devices(given.accelerator, given.devices)
    world = cfg.check_strategy(given.strategy, len(here), given.num_nodes)
    # a strategy's own config (DeepSpeed's) may set precision, clipping and accumulation
    flags.update(cfg.strategy_flags(given.strategy, flags, world))
    plugged = cfg.check_plugins(
        given.plugins, flags["precision"], given.detect_anomaly, world=world
    )
    precision_name = _precision(flags["precision"], plugged)
    device = here[_local_rank(len(here))] if world > 1 else here[0]
    cfg.check_compile(given.compile)
    cfg.check_clip_val(flags["gradient_clip_val"])
    cfg.check_loggers(given.logger)
    cfg.check_callbacks(given.callbacks)
    resolved = _loop_limits(flags)
    resolved.update(_fast_dev_run(given.fast_dev_run))
    resolved.update({name: flags[name] is not False for name in _ENABLE})
    if given.barebones:  # the bare loop: what costs per step is refused, the rest turned off
        _check_barebones(flags)
        resolved.update(dict.fromkeys(_ENABLE, False), num_sanity_val_steps=0)
    return LoopConfig(
        accelerator=given.accelerator,
        strategy=given.strategy
        if isinstance(given.strategy, str)
        else type(given.strategy).__name__,
        devices=given.devices if isinstance(given.devices, (int, str)) else tuple(given.devices),
        device=str(_placed(plugged) or device),
        num_nodes=given.num_nodes,
        precision=precision_name,
        sync_batchnorm=given.sync_batchnorm,
        use_distributed_sampler=given.use_distributed_sampler,
        barebones=given.barebones,
        log_every_n_steps=given.log_every_n_steps if given.log_every_n_steps is not None else 50,
        # fast_dev_run is a smoke test: like its loggers and checkpoints, no journal
        enable_journal=given.enable_journal is not False
        and not (given.barebones or resolved["fast_dev_run"]),
        enable_autolog_hparams=given.enable_autolog_hparams,
        gradient_clip_val=flags["gradient_clip_val"],
        gradient_clip_algorithm=given.gradient_clip_algorithm or "norm",
        deterministic=given.deterministic,
        benchmark=given.benchmark,
        inference_mode=given.inference_mode,
        detect_anomaly=given.detect_anomaly,
        profiler=given.profiler,
        compile=given.compile
        if isinstance(given.compile, bool)
        else MappingProxyType(dict(given.compile)),
        default_root_dir=cfg.root_dir(given.default_root_dir),
        **resolved,
    )


def _precision(flag: Any, plugins: tuple[Any, ...]) -> str:
    """The precision's canonical name (Lightning's ``trainer.precision``): the flag's, or the
    plugin's when it is one of engine's with its defaults, else its repr."""
    plugged = [p for p in plugins if cfg.plugin_kind(p) == "precision"]
    if not plugged:
        name = canonical_precision(flag)
        precision_transform(name)  # refuses transformer-engine when it is not installed
        return name
    for name in ("64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"):
        if repr(precision_transform(name)) == repr(plugged[0]):
            return name
    return repr(plugged[0])


def _local_rank(processes: int) -> int:
    """This process's index among this node's ``processes`` (``LOCAL_RANK``, which torchrun,
    SLURM's launcher or the Trainer's own set; 0 in the process that launches the others)."""

    text = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    try:
        rank = int(text)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={text!r} is not an int: it is set by the launcher") from None
    if not 0 <= rank < processes:
        raise ValueError(
            f"LOCAL_RANK={rank} is outside range(devices={processes}): the launcher started "
            f"more processes on this node than Trainer(devices=...) names; pass devices="
            f"{rank + 1} or more, or launch {processes} per node"
        )
    return rank


def _placed(plugins: tuple[Any, ...]) -> Any:
    return next((p.device for p in plugins if cfg.plugin_kind(p) == "placement"), None)


def _loop_limits(flags: dict[str, Any]) -> dict[str, Any]:
    """Limits and the validation schedule, checked in the flags' order, with Lightning's
    defaults filled in."""
    out: dict[str, Any] = {}
    out["max_steps"] = cfg.check_int("max_steps", flags["max_steps"], minimum=-1)
    out["min_steps"] = cfg.check_int("min_steps", flags["min_steps"], minimum=0, allow_none=True)
    out["min_epochs"] = cfg.check_int("min_epochs", flags["min_epochs"], minimum=0, allow_none=True)
    if out["min_epochs"] is None and out["min_steps"] is not None:
        # Lightning's _parse_loop_limits: with min_steps, a stop request still completes the
        # first epoch
        out["min_epochs"] = 1
    max_epochs = cfg.check_int("max_epochs", flags["max_epochs"], minimum=-1, allow_none=True)
    out["max_time"] = cfg.parse_max_time(flags["max_time"])
    if max_epochs is None:
        max_epochs = 1000 if out["max_steps"] == -1 and out["max_time"] is None else -1
    out["max_epochs"] = max_epochs
    for kind in ("train", "val", "test", "predict"):
        name = f"limit_{kind}_batches"
        out[name] = cfg.check_limit(name, flags[name])
    out["overfit_batches"] = cfg.check_limit("overfit_batches", flags["overfit_batches"])
    if out["overfit_batches"] > 0:
        out["limit_train_batches"] = out["limit_val_batches"] = out["overfit_batches"]
    every = flags["check_val_every_n_epoch"]
    out["val_check_interval"] = cfg.check_val_check_interval(flags["val_check_interval"], every)
    out["check_val_every_n_epoch"] = cfg.check_int(
        "check_val_every_n_epoch", every, minimum=1, allow_none=True
    )
    out["num_sanity_val_steps"] = cfg.sanity_steps(flags["num_sanity_val_steps"])
    out["accumulate_grad_batches"] = cfg.check_int(
        "accumulate_grad_batches", flags["accumulate_grad_batches"], minimum=1
    )
    out["steps_per_call"] = cfg.check_int("steps_per_call", flags["steps_per_call"], minimum=1)
    out["reload_dataloaders_every_n_epochs"] = cfg.check_int(
        "reload_dataloaders_every_n_epochs",
        flags["reload_dataloaders_every_n_epochs"],
        minimum=0,
    )
    if flags["log_every_n_steps"] is not None:
        cfg.check_int("log_every_n_steps", flags["log_every_n_steps"], minimum=1)
    return out


def _fast_dev_run(value: Any) -> dict[str, Any]:
    """``fast_dev_run``: n batches of everything, once, no loggers (Lightning's meaning)."""
    if not isinstance(value, bool):
        cfg.check_int("fast_dev_run", value, minimum=0)
    n = int(value)
    if not n:
        return {"fast_dev_run": 0}
    return {
        "fast_dev_run": n,
        **{f"limit_{kind}_batches": n for kind in ("train", "val", "test", "predict")},
        "max_steps": n,
        "max_epochs": 1,
        "num_sanity_val_steps": 0,
        "val_check_interval": 1.0,
        "check_val_every_n_epoch": 1,
    }


def _check_barebones(flags: dict[str, Any]) -> None:
    """``barebones`` refuses every flag with a per-step cost."""
    cfg.check_barebones(
        logger=flags["logger"] not in (None, False),
        enable_checkpointing=bool(flags["enable_checkpointing"]),
        enable_progress_bar=bool(flags["enable_progress_bar"]),
        enable_model_summary=bool(flags["enable_model_summary"]),
        enable_journal=bool(flags["enable_journal"]),
        log_every_n_steps=flags["log_every_n_steps"] is not None,
        detect_anomaly=flags["detect_anomaly"],
        profiler=flags["profiler"] is not None,
        # Lightning also turns these off in barebones mode
        num_sanity_val_steps=flags["num_sanity_val_steps"] not in (None, 0),
        fast_dev_run=bool(flags["fast_dev_run"]),
    )
