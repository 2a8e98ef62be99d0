"""Validation and resolution of the Trainer's Lightning-style flags (private).

Every flag is checked at construction; an error names the flag, the value and what is accepted.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch

__all__: list[str] = []


def run_config(trainer: Any) -> dict[str, Any]:
    """The Trainer's resolved flags as JSON values (for checkpoints and the run directory)."""
    keep = (int, float, str, bool, type(None))
    config: dict[str, Any] = {
        k: v for k, v in vars(trainer).items() if not k.startswith("_") and isinstance(v, keep)
    }
    if isinstance(trainer.compile, dict):
        config["compile"] = dict(trainer.compile)
    config["torch_version"] = torch.__version__
    return config


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


def check_choice(name: str, value: Any, choices: tuple[Any, ...], later: str = "") -> Any:
    # a bool is not an int here: devices=True must not pass as devices=1
    if not any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in choices):
        shown = ", ".join(repr(c) for c in choices)
        hint = f" ({later})" if later else ""
        raise ValueError(f"Trainer({name}={value!r}): accepted values are {shown}{hint}")
    return value


_LATER = "not supported yet: other values arrive with the device/precision/distributed work"
_FLAG = (None, True, False)

# the values each flag accepts now, and why others are refused (empty: they are wrong)
CHOICES: dict[str, tuple[tuple[Any, ...], str]] = {
    "accelerator": (("auto", "cpu"), _LATER),
    "strategy": (("auto", "single_device"), _LATER),
    "devices": (("auto", 1, "1", -1, "-1", [0], (0,)), _LATER),
    "num_nodes": ((1,), _LATER),
    "precision": ((None, 32, "32", "32-true"), _LATER),
    "plugins": ((None, []), _LATER),
    "sync_batchnorm": ((False,), _LATER),
    "use_distributed_sampler": ((True, False), ""),
    "inference_mode": ((True, False), ""),
    "detect_anomaly": ((True, False), ""),
    "barebones": ((True, False), ""),
    "enable_checkpointing": (_FLAG, ""),
    "enable_progress_bar": (_FLAG, ""),
    "enable_model_summary": (_FLAG, ""),
    "enable_journal": (_FLAG, ""),
    "deterministic": ((None, True, False, "warn"), ""),
    "benchmark": (_FLAG, ""),
    "profiler": ((None, "simple", "pytorch"), ""),
    "gradient_clip_algorithm": ((None, "norm", "value"), ""),
}


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
    from engine.listeners.timer import parse_duration

    try:
        return parse_duration(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Trainer(max_time={value!r}): {e}") from None


def check_val_check_interval(value: Any) -> int | float:
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
    raise ValueError(
        f"Trainer(val_check_interval={value!r}): pass a float in (0.0, 1.0] (a fraction of the "
        "epoch) or an int >= 1 (every N training batches)"
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
