"""Checks of the Trainer's Lightning-style flags (private).

Every flag is checked at construction (by :func:`engine.driver.resolve.resolve`); an error names
the flag, the value and what is accepted.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from engine.events import Event, check_listener
from engine.plan._duration import parse_duration

__all__: list[str] = []


def check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        accepted = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"Trainer({name}={value!r}): {name} must be {accepted}")
    return value


def check_limit(name: str, value: Any) -> int | float:
    """``limit_*_batches`` / ``overfit_batches``: an int >= 0 or a float in [0.0, 1.0]."""
    if value is None:
        return 1.0
    if isinstance(value, bool):
        raise ValueError(f"Trainer({name}={value!r}): use an int >= 0 or a float in [0.0, 1.0]")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"Trainer({name}={value!r}): an int number of batches must be >= 0")
        return value
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"Trainer({name}={value!r}): a fraction must lie in [0.0, 1.0]; pass an int for "
                "a number of batches"
            )
        return value
    raise ValueError(
        f"Trainer({name}={value!r}): expected an int >= 0 or a float in [0.0, 1.0], got "
        f"{type(value).__name__}"
    )


def _same(value: Any, choice: Any) -> bool:
    """``value == choice`` with the type kept: a bool is not an int (devices=True is not 1), a
    float is not an int (precision=32.0), a tuple is not a list, elementwise."""
    if isinstance(choice, (list, tuple)):
        return (
            isinstance(value, type(choice))
            and len(value) == len(choice)
            and all(_same(v, c) for v, c in zip(value, choice, strict=True))
        )
    if choice is None or isinstance(choice, bool):
        return value is choice
    return isinstance(value, type(choice)) and not isinstance(value, bool) and value == choice


def check_choice(name: str, value: Any, choices: tuple[Any, ...], later: str = "") -> Any:
    if not any(_same(value, c) for c in choices):
        shown = ", ".join(repr(c) for c in choices)
        hint = f" ({later})" if later else ""
        raise ValueError(f"Trainer({name}={value!r}): accepted values are {shown}{hint}")
    return value


_FLAG = (None, True, False)

# the values each flag accepts now, and why others are refused (empty: they are wrong)
CHOICES: dict[str, tuple[tuple[Any, ...], str]] = {
    "sync_batchnorm": ((True, False), ""),
    "use_distributed_sampler": ((True, False), ""),
    "inference_mode": ((True, False), ""),
    "detect_anomaly": ((True, False), ""),
    "barebones": ((True, False), ""),
    "enable_checkpointing": (_FLAG, ""),
    "enable_progress_bar": (_FLAG, ""),
    "enable_model_summary": (_FLAG, ""),
    "enable_journal": (_FLAG, ""),
    "enable_autolog_hparams": ((True, False), ""),
    "model_registry": (
        (None,),
        "uploading to Lightning AI's model registry is not supported: write the weights with "
        "engine.checkpoint.export(path, 'model.pt') and upload them with your registry's tool",
    ),
    "deterministic": ((None, True, False, "warn"), ""),
    "benchmark": (_FLAG, ""),
    "profiler": ((None, "simple", "pytorch"), ""),
    "gradient_clip_algorithm": ((None, "norm", "value"), ""),
}


_OTHER_STRATEGIES = {
    "deepspeed_stage_3_offload_nvme": (
        "NVMe offload has no FSDP2 equivalent (DeepSpeed's stages run as FSDP2 here); use "
        "'deepspeed_stage_3_offload' (CPU offload) or 'deepspeed_stage_3'"
    ),
    "dp": "Lightning removed DataParallel; use strategy='ddp'",
    "xla": "engine runs on the CPU, CUDA and MPS only",
    "xla_fsdp": "engine runs on the CPU, CUDA and MPS only; use strategy='fsdp'",
}


def check_strategy(value: Any, processes: int, num_nodes: Any) -> int:
    """``strategy`` and ``num_nodes`` against ``processes`` devices on each node; returns the
    world size (processes x nodes). A Strategy object (``engine.parallel.DDP(...)``) is taken as
    it is."""
    from engine.parallel.select import STRATEGIES
    from engine.transforms.base import Strategy

    nodes = check_int("num_nodes", num_nodes, minimum=1)
    world = processes * nodes
    if isinstance(value, Strategy):
        return world
    if not isinstance(value, str) or value not in STRATEGIES:
        why = _OTHER_STRATEGIES.get(value) if isinstance(value, str) else None
        shown = ", ".join(repr(k) for k in STRATEGIES)
        raise ValueError(
            f"Trainer(strategy={value!r}): "
            + (
                why
                if why
                else f"accepted values are {shown}, or an engine.parallel.DDP(...), FSDP(...) "
                "or DeepSpeedStrategy(...)"
            )
        )
    if value == "single_device" and world > 1:
        raise ValueError(
            f"Trainer(strategy='single_device', devices x num_nodes = {world}): one process "
            "runs on one device; pass strategy='ddp' for several, or devices=1, num_nodes=1"
        )
    if value in ("ddp_fork", "ddp_notebook"):
        import multiprocessing

        if "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"Trainer(strategy={value!r}): this platform cannot fork; use 'ddp' or 'ddp_spawn'"
            )
    return world


def strategy_flags(strategy: Any, flags: Mapping[str, Any], world: int) -> dict[str, Any]:
    """The Trainer flags a strategy object's own config sets (a DeepSpeed config's
    ``precision``, ``gradient_clip_val``, ``accumulate_grad_batches``), checked against the
    flags given (``flags``: the Trainer's keyword arguments; ``world``: devices x nodes)."""
    from engine.transforms.base import Strategy

    return strategy.resolve_flags(flags, world) if isinstance(strategy, Strategy) else {}


def check_choices(**flags: Any) -> None:
    """Each flag against :data:`CHOICES`."""
    for name, value in flags.items():
        choices, why = CHOICES[name]
        check_choice(name, value, choices, why)


def check_barebones(**flags: Any) -> None:
    """``barebones=True`` refuses every flag with a per-step cost (given as ``name=is_on``)."""
    for flag, on in flags.items():
        if on:
            raise ValueError(
                f"`Trainer(barebones=True)` doesn't support `{flag}`; barebones turns off "
                f"everything with per-step cost. Drop `{flag}=...` or set barebones=False."
            )


def parse_max_time(value: Any) -> timedelta | None:
    """``max_time`` as Lightning takes it: "DD:HH:MM:SS", a timedelta, or a dict of timedelta
    keyword arguments (the Timer listener's parser, with the flag named in the error)."""
    if isinstance(value, Mapping) and any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in value.values()
    ):
        raise ValueError(
            f"Trainer(max_time={value!r}): the dict's values must be numbers, like {{'hours': 12}}"
        )
    try:
        return parse_duration(value)
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: inf, or too long
        raise ValueError(f"Trainer(max_time={value!r}): {e}") from None


def check_val_check_interval(value: Any, check_val_every_n_epoch: int | None) -> int | float:
    if isinstance(value, float) and check_val_every_n_epoch is None:
        # as Lightning: a fraction of an epoch needs epochs to count in
        raise ValueError(
            f"Trainer(val_check_interval={value!r}): with check_val_every_n_epoch=None pass an "
            "int (every N training batches, counted across epochs)"
        )
    if value is None:
        return 1.0
    if isinstance(value, bool):
        raise ValueError(f"Trainer(val_check_interval={value!r}): use an int or a float")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(
                f"Trainer(val_check_interval={value!r}): an int counts training batches and must "
                "be >= 1"
            )
        return value
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    later = (
        "; a time-based interval is not supported yet"
        if isinstance(value, (str, timedelta, Mapping))
        else ""
    )
    raise ValueError(
        f"Trainer(val_check_interval={value!r}): pass a float in (0.0, 1.0] (a fraction of the "
        f"epoch) or an int >= 1 (every N training batches){later}"
    )


def sanity_steps(value: Any) -> float:
    if value is None:
        return 2
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(
            f"Trainer(num_sanity_val_steps={value!r}): num_sanity_val_steps must be an int >= 0, "
            "-1 (all validation batches) or None (2)"
        )
    return math.inf if value == -1 else value


def check_clip_val(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(
            f"Trainer(gradient_clip_val={value!r}): pass a finite number >= 0 or None (no clipping)"
        )


def check_compile(value: Any) -> None:
    """``compile``: a bool, or a dict of ``torch.compile`` keyword arguments."""
    if isinstance(value, bool):
        return
    if not isinstance(value, Mapping):
        raise ValueError(
            f"Trainer(compile={value!r}): pass True, False or a dict of torch.compile options"
        )
    import torch._dynamo  # the names of torch's modes and backends (binds torch locally)
    import torch._inductor

    keywords = [k for k in inspect.signature(torch.compile).parameters if k != "model"]
    for key in value:
        if key not in keywords:
            raise ValueError(
                f"Trainer(compile={value!r}): {key!r} is not a torch.compile option; the dict's "
                f"keys are among {', '.join(keywords)}"
            )
    # the values torch would refuse only when the first step is traced, seconds later
    mode, backend = value.get("mode"), value.get("backend", "inductor")
    if mode is not None:
        modes = list(torch._inductor.list_mode_options())
        if not isinstance(mode, str) or mode not in modes:
            raise ValueError(
                f"Trainer(compile={value!r}): mode={mode!r} is not a torch.compile mode; pass "
                f"one of {', '.join(map(repr, modes))} or leave it out"
            )
    if isinstance(backend, str):
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ValueError(
                f"Trainer(compile={value!r}): backend={backend!r} is not a torch.compile "
                f"backend here; pass one of {', '.join(map(repr, backends))} or a callable"
            )
    elif not callable(backend):
        raise ValueError(
            f"Trainer(compile={value!r}): backend={backend!r} must be a backend's name or a "
            "callable"
        )
    for key in ("fullgraph", "disable"):
        if key in value and not isinstance(value[key], bool):
            raise ValueError(
                f"Trainer(compile={value!r}): {key}={value[key]!r} must be True or False"
            )
    if (
        "dynamic" in value
        and value["dynamic"] is not None
        and not isinstance(value["dynamic"], bool)
    ):
        raise ValueError(
            f"Trainer(compile={value!r}): dynamic={value['dynamic']!r} must be True, False or None"
        )


def _instance(name: str, value: Any, item: Any) -> None:
    if isinstance(item, type):
        raise ValueError(
            f"Trainer({name}={value!r}): pass {item.__name__}(...) (an instance), not the class"
        )


def check_loggers(value: Any) -> None:
    """``logger``: True / None (a TensorBoardLogger), False, a logger or a list/tuple of them."""
    if value is None or isinstance(value, bool):
        return
    for lg in value if isinstance(value, (list, tuple)) else [value]:
        _instance("logger", value, lg)
        if not callable(getattr(lg, "log_metrics", None)):
            raise ValueError(
                f"Trainer(logger={value!r}): {lg!r} has no log_metrics(metrics, step) method; "
                "pass an engine.loggers logger (TensorBoardLogger, CSVLogger), a list of them, "
                "True (a TensorBoardLogger) or False"
            )


def check_plugins(
    value: Any, precision: Any, detect_anomaly: bool = False, *, world: int = 1
) -> tuple[Any, ...]:
    """``plugins``: None, or engine's own objects where Lightning takes its plugins, alone or in
    a list: a precision (an :class:`engine.transforms.Transform`, used in the precision slot),
    :class:`engine.transforms.SingleDevice` (placement), :class:`engine.transforms.DetectAnomaly`,
    :class:`engine.privacy.DPSGD` (the privacy slot) and a
    :class:`engine.checkpoint.CheckpointIO`. At most one of each kind; a precision plugin
    and a ``precision`` flag together are refused, as Lightning refuses them, and so is DP-SGD
    in a run of ``world`` > 1 processes."""
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    seen: dict[str, Any] = {}
    for item in items:
        _instance("plugins", value, item)
        kind = plugin_kind(item)
        if kind == "strategy":
            raise ValueError(
                f"Trainer(plugins={value!r}): {item!r} is a strategy; pass it as "
                f"Trainer(strategy={item!r})"
            )
        if kind is None:
            raise ValueError(
                f"Trainer(plugins={value!r}): {item!r} is not one of engine's plugins; pass a "
                "precision transform (engine.transforms.MixedPrecision(torch.bfloat16), "
                "TruePrecision(...)), engine.transforms.SingleDevice(...), "
                "engine.transforms.DetectAnomaly(...), engine.privacy.DPSGD(...) or an "
                "engine.checkpoint.CheckpointIO. "
                "Lightning's own plugins do not plug into engine"
            )
        if kind in seen:
            raise ValueError(
                f"Trainer(plugins={value!r}): two {kind} plugins ({seen[kind]!r} and {item!r}); "
                "pass one"
            )
        seen[kind] = item
    if "placement" in seen:
        from engine.transforms.devices import check_device

        check_device(seen["placement"].device, f"Trainer(plugins=[{seen['placement']!r}])")
    if "anomaly detection" in seen and detect_anomaly:
        raise ValueError(
            f"Trainer(detect_anomaly=True, plugins=[{seen['anomaly detection']!r}]): both turn "
            "on anomaly detection; pass one"
        )
    if "precision" in seen and precision is not None:
        raise ValueError(
            f"Trainer(precision={precision!r}, plugins=[{seen['precision']!r}]): both set the "
            "precision; pass one"
        )
    if "privacy" in seen and world > 1:
        from engine.transforms.compose import one_process_only

        raise ValueError(
            f"Trainer(plugins=[{seen['privacy']!r}], devices x num_nodes = {world}): "
            + one_process_only(world)
        )
    return items


PLUGIN_KINDS = (
    "precision",
    "placement",
    "anomaly detection",
    "privacy",
    "checkpoint IO",
    "cluster environment",
    "strategy",
)


def plugin_kind(item: Any) -> str | None:
    """The kind of plugin ``item`` declares (its class's ``plugin_kind``: engine's transforms,
    :class:`~engine.checkpoint.CheckpointIO`, cluster environments), or ``None`` for anything
    else (a class, or one of Lightning's plugins)."""
    if isinstance(item, type):
        return None
    kind = getattr(type(item), "plugin_kind", None)
    return kind if kind in PLUGIN_KINDS else None


def plugins_by_kind(value: Any) -> dict[str, Any]:
    """``plugins`` (checked by :func:`check_plugins`) by the kind each declares."""
    items = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return {kind: item for item in items if (kind := plugin_kind(item)) is not None}


def check_callbacks(value: Any) -> None:
    """``callbacks``: None, a listener or a list/tuple of them; a listener is an instance with
    a method named after an :class:`~engine.events.Event` (what the Emitter dispatches to), and
    no public ``on_*`` method named after none (:func:`~engine.events.check_listener`: a
    misspelt handler is named, with the event it resembles, before "not a listener" hides it)."""
    if value is None:
        return
    for x in value if isinstance(value, (list, tuple)) else [value]:
        _instance("callbacks", value, x)
        _not_lightnings(value, x)
        check_listener(x)
        if not any(callable(getattr(x, event.value, None)) for event in Event):
            raise ValueError(
                f"Trainer(callbacks={value!r}): {x!r} is not a listener (it has no method named "
                "after an engine.Event, such as on_train_batch_end); pass listener instances "
                "such as EarlyStopping(...), a list of them, or wrap a function with "
                "engine.on(Event..., fn)"
            )


# Lightning's callbacks and what replaces each in engine
_LIGHTNING_CALLBACKS = {
    "ModelCheckpoint": "engine.listeners.ModelCheckpoint (the same arguments)",
    "EarlyStopping": "engine.listeners.EarlyStopping (the same arguments)",
    "LearningRateMonitor": "engine.listeners.LearningRateMonitor",
    "Timer": "engine.listeners.Timer, or Trainer(max_time=...)",
    "ModelSummary": "engine.listeners.ModelSummary, or Trainer(enable_model_summary=True)",
    "RichModelSummary": "engine.listeners.ModelSummary",
    "TQDMProgressBar": "engine.listeners.ProgressBar",
    "RichProgressBar": "engine.listeners.ProgressBar",
    "LambdaCallback": "engine.on(engine.Event.ON_..., fn) for each hook",
    "GradientAccumulationScheduler": "Trainer(accumulate_grad_batches=...)",
    "StochasticWeightAveraging": "engine.listeners.StochasticWeightAveraging (the same "
    "arguments; the optimizer built with optim.inject_hyperparams)",
    "EMAWeightAveraging": "engine.listeners.EMAWeightAveraging, with "
    "tx=optim.ema_weights(optim.adamw(...), decay=...)",
    "BackboneFinetuning": "engine.listeners.BackboneFinetuning, with tx=optim.freezable(...)",
    "BaseFinetuning": "engine.listeners.Finetuning (override finetune_function), with "
    "tx=optim.freezable(...)",
    "LearningRateFinder": "engine.listeners.LearningRateFinder (the same arguments; with "
    "update_attr=True, the optimizer built with optim.inject_hyperparams)",
    "BatchSizeFinder": "engine.listeners.BatchSizeFinder (the same arguments)",
}


def _not_lightnings(value: Any, x: Any) -> None:
    """A Lightning ``Callback`` is refused, naming what replaces it: its hooks take
    ``(trainer, pl_module, ...)`` and change the trainer; a listener's take one record."""
    lightning = [
        c
        for c in type(x).__mro__
        if c.__name__ == "Callback"
        and c.__module__.split(".")[0] in ("pytorch_lightning", "lightning")
    ]
    if not lightning:
        return
    name = next(
        (c.__name__ for c in type(x).__mro__ if c.__name__ in _LIGHTNING_CALLBACKS),
        type(x).__name__,
    )
    use = _LIGHTNING_CALLBACKS.get(name)
    instead = (
        f"use {use}"
        if use
        else "write an engine listener: subclass engine.Listener with the same hook names, "
        "each taking one record (`def on_train_batch_end(self, rec)`: rec.state, rec.outputs, "
        "rec.batch_idx, rec.run for what the trainer held) and returning a request "
        "(engine.Stop(), engine.Save(path), engine.Log({...}), engine.Transition(fn)) instead "
        "of changing the trainer"
    )
    raise ValueError(
        f"Trainer(callbacks=...): {type(x).__name__} is a Lightning Callback, whose hooks take "
        f"(trainer, pl_module, ...); {instead}"
    )


def root_dir(value: Any) -> str:
    """``default_root_dir``: a str or os.PathLike path; None or "" for the working directory."""
    if value is None:
        return os.getcwd()
    try:
        path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise ValueError(
            f"Trainer(default_root_dir={value!r}): pass a directory as a str or os.PathLike "
            "(pathlib.Path), or None for the working directory"
        )
    return path or os.getcwd()


def warn_hyperparams_in_dtype(tx: Any, opt_state: Any, params: Mapping[str, Any], why: str) -> None:
    """Warn, by name, about each optimizer ``eps`` (the guard of a denominator) that is not
    zero but rounds to zero in the parameters' dtype (``eps=1e-8`` in float16: where a
    gradient is zero, Adam's update is 0 / 0 = NaN, as ``torch.optim.AdamW`` on a ``.half()``
    model gives). The values are the optimizers' recorded arguments (``tx.recipe``) and the
    injected ones in ``opt_state``; ``why`` says where the dtype comes from (the precision
    flag)."""
    import warnings

    from engine.optim import get_hyperparams, recipes

    dtypes = sorted({p.dtype for p in params.values() if torch.is_floating_point(p)}, key=str)
    found: list[tuple[str, str, float]] = []
    for recipe in recipes(tx) if tx is not None else []:
        found += [(recipe.name, k, v) for k, v in recipe.arguments.items()]
    with contextlib.suppress(ValueError):  # an injected value may have changed since
        found += [("inject_hyperparams", k, v) for k, v in get_hyperparams(opt_state).items()]
    seen = set()
    for name, key, value in found:
        # a denominator's guard keeps x / (sqrt(v) + eps) finite where v is 0: rounded to zero
        # it turns that into 0 / 0 (the other hyperparameters scale values; not checked)
        if "eps" not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value == 0:
            continue
        for dtype in dtypes:
            if torch.tensor(float(value), dtype=dtype).item() != 0.0 or (key, value) in seen:
                continue
            seen.add((key, value))
            tiny = torch.finfo(dtype).tiny
            effect = (
                "where a gradient is zero the update is 0 / 0 = NaN on the foreach path "
                "(torch.optim's default and optim's, compile=True), as "
                "torch.optim on a model cast with .half() gives"
            )
            warnings.warn(
                f"optim.{name}({key}={value!r}): {value!r} is 0 in {dtype} ({why}): {effect}. "
                f"Pass a value of {key} that {dtype} holds (at least torch.finfo({dtype}).tiny = "
                f"{tiny:.3g}, e.g. {key}={_suggest(tiny)}), or keep float32 parameters with "
                "a mixed precision ('16-mixed', 'bf16-mixed')",
                RuntimeWarning,
                stacklevel=4,
            )


def _suggest(tiny: float) -> str:
    """A round value above ``tiny``: 1e-4 for float16."""
    return f"{10 ** math.ceil(math.log10(tiny)):g}"
