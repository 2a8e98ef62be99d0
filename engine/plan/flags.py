"""The Trainer's flags as given: one table, :class:`Flags`, with Lightning's names, the types a
caller may pass and the defaults, once.

The Trainer's explicit signature (IDEs and ``jsonargparse`` read it) is checked against this
table by the tests; :func:`engine.driver.resolve.resolve` takes a :class:`Flags` and resolves it
into a :class:`~engine.plan.config.LoopConfig`; the Trainer's read-only flag attributes are
the config's fields. A new flag is a field here, a parameter of ``Trainer.__init__`` and, where
the loop reads it, a field of ``LoopConfig``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs

__all__ = ["Flags"]


@attrs.frozen(kw_only=True)
class Flags:
    """The Trainer's keyword arguments, as given (checked and resolved by
    :func:`engine.driver.resolve.resolve`, not here).

    Example:
        >>> Flags(max_epochs=3).max_epochs, Flags().max_steps
        (3, -1)
        >>> Flags(max_epoch=3)
        Traceback (most recent call last):
        ...
        TypeError: Flags.__init__() got an unexpected keyword argument 'max_epoch'
    """

    accelerator: str = "auto"
    strategy: str = "auto"
    devices: int | str | Sequence[int] = "auto"
    num_nodes: int = 1
    precision: int | str | None = None
    logger: Any = None
    callbacks: Any = None
    fast_dev_run: int | bool = False
    max_epochs: int | None = None
    min_epochs: int | None = None
    max_steps: int = -1
    min_steps: int | None = None
    max_time: str | timedelta | dict[str, int] | None = None
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    overfit_batches: int | float = 0.0
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | None = None
    log_every_n_steps: int | None = None
    enable_checkpointing: bool | None = None
    enable_progress_bar: bool | None = None
    enable_model_summary: bool | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: int | float | None = None
    gradient_clip_algorithm: str | None = None
    deterministic: bool | str | None = None
    benchmark: bool | None = None
    inference_mode: bool = True
    use_distributed_sampler: bool = True
    profiler: str | None = None
    detect_anomaly: bool = False
    barebones: bool = False
    plugins: Any = None
    sync_batchnorm: bool = False
    reload_dataloaders_every_n_epochs: int = 0
    default_root_dir: str | os.PathLike[str] | None = None
    compile: bool | Mapping[str, Any] = False
    steps_per_call: int = 1
    enable_journal: bool | None = None
    enable_autolog_hparams: bool = True
    model_registry: str | None = None
