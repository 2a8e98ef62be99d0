"""What surrounds every stage of a :class:`~engine.driver.run.Run`: :func:`running`, the
context a fit, validate, test or predict runs in (signals, determinism flags, the profiler,
the run's pipeline, a checkpoint restored, the saves landed and the ranks met at the end, the
``setup`` / ``teardown`` / ``on_exception`` events and the loggers finalized)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from engine import checkpoint
from engine.data import teardown_datamodule
from engine.driver import restore as restoring
from engine.driver.assembly import pipeline
from engine.driver.run import Run
from engine.driver.services import observer
from engine.events import Event
from engine.state import TrainState
from engine.task import Task

__all__ = ["running"]


@contextlib.contextmanager
def running(
    run: Run,
    profiler: Any,
    task: Task,
    state: TrainState,
    ckpt_path: str | os.PathLike[str] | None,
    datamodule: Any = None,
) -> Iterator[None]:
    """Run ``run``'s stage with ``task`` from ``state`` (or the checkpoint ``ckpt_path``)."""
    stage = run.stage
    assert stage is not None
    if not isinstance(task, Task):
        raise TypeError(f"task must be an engine.Task (got {type(task).__name__})")
    if not isinstance(state, TrainState):
        raise TypeError(
            f"state must be an engine.TrainState (got {type(state).__name__}); build one "
            "with task.init(model, seed=...)"
        )
    state.check_alive(f"Trainer.{stage}()")
    run.begin(task, state)
    zero = run.is_global_zero
    config = run.config
    stack = contextlib.ExitStack()
    stack.callback(run.unshard)
    if stage == "fit":
        stack.enter_context(run.signals.catching())
    device = run.assembly.placement_now().device
    if config.deterministic and device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (set before its first use)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if config.deterministic is not None:
        previous = torch.are_deterministic_algorithms_enabled()
        previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(
            bool(config.deterministic), warn_only=config.deterministic == "warn"
        )
        stack.callback(torch.use_deterministic_algorithms, previous, warn_only=previous_warn)
    benchmark = config.benchmark
    if benchmark is None and config.deterministic:
        benchmark = False  # as Lightning: cudnn's autotuner picks kernels by timing
    if benchmark is not None:
        previous_bm = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = benchmark
        stack.callback(setattr, torch.backends.cudnn, "benchmark", previous_bm)
    stack.enter_context(profiler.run(stage, run.log_dir or config.default_root_dir))
    # asynchronous saves land before the run returns (and then delete what they replace);
    # the host copy they keep for the next snapshot (one state's worth of memory) is not
    # kept past the run
    stack.callback(checkpoint.release_buffers)
    stack.push(run.checkpointer.reap_at_exit)
    stack.callback(checkpoint.wait)
    with stack:
        run.announce(Event.SETUP)
        try:
            # the run's step transforms; the state placed and cast once, before a
            # checkpoint is restored into it (so it is read straight into that form)
            observe = observer(run) if stage == "fit" else None
            steps = pipeline(run.assembly, config, run.task, observe)
            run.use(steps, steps.prepare(state, task.tx))
            if ckpt_path is not None:
                assert run.state is not None
                restoring.restore(run, ckpt_path, run.state)
            yield
            # the run's last check: an asynchronous save that failed fails the run
            run.checkpointer.reap(wait=True)
            # no rank returns (or exits) while rank 0 still writes the run's last files
            run.barrier()
        except BaseException as e:
            run.announce(Event.ON_EXCEPTION, exception=e)
            for lg in run.loggers if zero else ():
                if callable(getattr(lg, "finalize", None)):
                    lg.finalize("failed" if not isinstance(e, KeyboardInterrupt) else "interrupted")
            raise
        if datamodule is not None:  # Lightning: the datamodule's, then the listeners'
            teardown_datamodule(datamodule, stage)
        run.announce(Event.TEARDOWN)
        for lg in run.loggers if zero else ():
            if callable(getattr(lg, "finalize", None)):
                lg.finalize("success")
