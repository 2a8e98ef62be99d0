"""The Trainer's flags as resolved: the frozen :class:`LoopConfig`.

:func:`engine.driver.resolve.resolve` checks the flags and builds it once; the loop and the
listeners (through ``rec.run.config``) read it, nothing writes it. This module imports nothing
of engine's, so any layer may name the type.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import attrs
import torch

__all__ = ["LoopConfig"]


@attrs.frozen(kw_only=True)
class LoopConfig:
    """Every Trainer flag as resolved (see :func:`resolve`); ``logger`` and ``callbacks`` are
    objects, built by the Trainer, and not part of it.

    Resolved values differ from the flags as given where Lightning's do: ``max_epochs`` is
    1000 (or -1, no limit, with ``max_steps`` or ``max_time``) when not given;
    ``num_sanity_val_steps`` is 2 when not given and ``inf`` for -1; limits are 1.0 when not
    given; ``val_check_interval`` is 1.0 when not given; ``log_every_n_steps`` is 50;
    ``gradient_clip_algorithm`` is ``"norm"``; the ``enable_*`` flags are bools;
    ``precision`` is Lightning's canonical name (``16`` -> ``"16-mixed"``, ``None`` ->
    ``"32-true"``); ``device`` is the one device ``accelerator`` and ``devices`` resolve to
    (``"cpu"``, ``"cuda:0"``, ``"mps"``);
    ``fast_dev_run`` is an int (0: off) and, like ``barebones``, has already overridden the
    flags it implies.
    """

    # placement, precision and scale-out (single-process until DDP/FSDP land)
    accelerator: str = "auto"
    strategy: str = "auto"
    devices: int | str | tuple[int, ...] = "auto"
    device: str = "cpu"
    num_nodes: int = 1
    precision: str = "32-true"
    sync_batchnorm: bool = False
    use_distributed_sampler: bool = True
    # loop limits
    max_epochs: int = 1000
    min_epochs: int | None = None
    max_steps: int = -1
    min_steps: int | None = None
    max_time: timedelta | None = None
    limit_train_batches: int | float = 1.0
    limit_val_batches: int | float = 1.0
    limit_test_batches: int | float = 1.0
    limit_predict_batches: int | float = 1.0
    overfit_batches: int | float = 0.0
    # the validation schedule
    val_check_interval: int | float = 1.0
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | float = 2
    reload_dataloaders_every_n_epochs: int = 0
    # the step
    accumulate_grad_batches: int = 1
    gradient_clip_val: int | float | None = None
    gradient_clip_algorithm: str = "norm"
    compile: bool | Mapping[str, Any] = False
    steps_per_call: int = 1
    inference_mode: bool = True
    deterministic: bool | str | None = None
    benchmark: bool | None = None
    detect_anomaly: bool = False
    # what runs around the loop
    fast_dev_run: int = 0
    barebones: bool = False
    log_every_n_steps: int = 50
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_journal: bool = True
    enable_autolog_hparams: bool = True
    profiler: str | None = None
    default_root_dir: str = attrs.field(factory=os.getcwd)

    def to_json(self) -> dict[str, Any]:
        """The flags as JSON values, with ``torch_version`` and ``threads`` (this thread's
        ``torch.get_num_threads()``: a CPU reduction sums per-thread parts, so its bits depend
        on it): what checkpoints record as ``extra.config`` and a run directory as
        ``config.json``. ``max_time`` is in seconds.

        Example:
            >>> from engine.driver.resolve import resolve
            >>> config = resolve(max_steps=10, compile={"mode": "max-autotune"}).to_json()
            >>> config["max_epochs"], config["max_steps"], config["compile"]
            (-1, 10, {'mode': 'max-autotune'})
            >>> "torch_version" in config and "should_stop" not in config
            True
        """
        out: dict[str, Any] = {}
        for field in attrs.fields(LoopConfig):
            value = getattr(self, field.name)
            if isinstance(value, timedelta):
                value = value.total_seconds()
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        out["torch_version"] = torch.__version__
        out["threads"] = torch.get_num_threads()
        return out
