"""The Trainer's per-step overhead, as ratios, on the tiny MLP of ``benchmarks.step``.

* ``trainer_barebones_vs_hand``: ``Trainer(barebones=True).fit`` against a hand-written loop
  calling the same built step over the same batches (target <= 1.03).
* ``trainer_logged_vs_hand``: the Trainer with a progress bar (rendering to /dev/null) and a
  TensorBoard logger (log_every_n_steps=50) against the same hand loop (target <= 1.10).
* ``trainer_observed_vs_barebones``: the barebones Trainer with a listener on the hooks inside the
  step (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``, doing
  nothing), which splits the step to call them, against the barebones Trainer without it: the
  cost of the split step.
* ``lightning_barebones_vs_raw`` / ``lightning_defaults_vs_raw``: Lightning's own Trainer on the
  same model and data (when pytorch-lightning is installed), against the raw PyTorch loop of
  ``benchmarks.step`` — the figure to compare with ``tiny_engine_eager_ratio``.

Each variant trains one epoch of ``BATCHES`` batches per round; rounds are interleaved and a
variant's figure is the median over rounds of its time over its reference's time in that round.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import engine as eg
from benchmarks.step import SHAPES, batch, loss_fn, mlp, raw_loop
from engine import optim

BATCHES = 1000  # per fit: enough that a fit's set-up and tear-down are not what is measured


def _engine_variants(sizes, data, tmp: str) -> dict[str, Callable[[], None]]:
    task = eg.Task(loss_fn, optim.adamw(1e-3))
    step = task.train_step()
    hand_box = [task.init(mlp(sizes), seed=0)]
    bare_box = [task.init(mlp(sizes), seed=0)]
    logged_box = [task.init(mlp(sizes), seed=0)]
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark

    def hand() -> None:
        state = hand_box[0].replace(epoch=0, batch_idx=0)
        last = len(data) - 1
        for i, b in enumerate(data):
            state, _ = step(state, b, flush=i == last)
        hand_box[0] = state

    def bare() -> None:
        trainer = eg.Trainer(max_epochs=1, barebones=True)
        bare_box[0] = trainer.fit(task, bare_box[0].replace(epoch=0, batch_idx=0), data)

    def logged() -> None:
        from engine.listeners import ProgressBar
        from engine.loggers import TensorBoardLogger

        trainer = eg.Trainer(
            max_epochs=1,
            callbacks=[ProgressBar(file=devnull)],
            logger=TensorBoardLogger(tmp, version=0),
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        logged_box[0] = trainer.fit(task, logged_box[0].replace(epoch=0, batch_idx=0), data)

    observed_box = [task.init(mlp(sizes), seed=0)]

    class StepHooks(eg.Listener):
        def on_before_backward(self, rec: Any) -> None:
            pass

        def on_after_backward(self, rec: Any) -> None:
            pass

        def on_before_optimizer_step(self, rec: Any) -> None:
            pass

    def observed() -> None:
        trainer = eg.Trainer(max_epochs=1, barebones=True, callbacks=[StepHooks()])
        observed_box[0] = trainer.fit(task, observed_box[0].replace(epoch=0, batch_idx=0), data)

    return {
        "hand": hand,
        "trainer_barebones": bare,
        "trainer_logged": logged,
        "trainer_observed": observed,
    }


def _lightning_variants(sizes, data, tmp: str) -> dict[str, Callable[[], None]]:
    try:
        import pytorch_lightning as pl
    except ImportError:
        return {}
    warnings.filterwarnings("ignore")
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(sizes)

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(b[0]), b[1])
            if not self.trainer.barebones:
                self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    raw = raw_loop(sizes, data[0])
    modules = {"bare": Module(), "defaults": Module()}

    def raw_epoch() -> None:
        for _ in data:
            raw()

    def lightning(kind: str) -> Callable[[], None]:
        def run() -> None:
            kwargs: dict[str, Any] = (
                {"barebones": True}
                if kind == "bare"
                else {"default_root_dir": tmp, "enable_checkpointing": False}
            )
            trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, **kwargs)
            with (
                open(os.devnull, "w") as sink,
                contextlib.redirect_stderr(sink),
                contextlib.redirect_stdout(sink),
            ):
                # Lightning reads a plain list as a list of dataloaders: wrap it as one
                trainer.fit(modules[kind], DataLoader(data, batch_size=None))

        return run

    return {
        "raw": raw_epoch,
        "lightning_barebones": lightning("bare"),
        "lightning_defaults": lightning("defaults"),
    }


def _interleave(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    for run in runs.values():
        run()  # warm up (and build any lazy state)
    times: dict[str, list[float]] = {k: [] for k in runs}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for k, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def _ratio(times: dict[str, list[float]], variant: str, reference: str) -> float:
    return statistics.median(t / r for t, r in zip(times[variant], times[reference], strict=True))


class _NullTask(eg.Task):
    """A task whose step does no math: fitting it measures the driver alone."""

    def train_step(self, **kwargs: Any) -> Any:
        loss = torch.zeros(())

        def step(state: eg.TrainState, batch: Any, *, flush: bool = False) -> Any:
            new = state.replace(step=state.step + 1, batch_idx=state.batch_idx + 1)
            return new, {"loss": loss}

        return step


def driver_overhead_us(rounds: int, tmp: str) -> dict[str, float]:
    """Microseconds the Trainer adds per batch, measured with a step that does no math, and
    the milliseconds it adds once per fit.

    Wall-clock ratios on a shared 2-core machine move by +-5% between runs, more than the
    driver costs; timing the driver around a null step isolates its own cost. Each variant fits
    epochs of ``BATCHES`` and of ``3 * BATCHES`` batches: the slope is the per-batch cost, the
    intercept the per-fit cost (the run directory's pickles and start checkpoint, the
    end-of-epoch checkpoint, the logger's files), which a longer run amortises.
    """
    sizes, n = SHAPES["tiny"]
    short, long = [batch(sizes, n)] * BATCHES, [batch(sizes, n)] * (3 * BATCHES)
    task = _NullTask(loss_fn, optim.sgd(0.1))
    null = task.train_step()
    box: dict[str, list[Any]] = {}
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark

    def hand(name: str, data: list[Any]) -> Callable[[], None]:
        box[name] = [task.init(mlp(sizes))]

        def run() -> None:
            state = box[name][0].replace(epoch=0, batch_idx=0)
            last = len(data) - 1
            for i, b in enumerate(data):
                state, _ = null(state, b, flush=i == last)
            box[name][0] = state

        return run

    def bare(name: str, data: list[Any]) -> Callable[[], None]:
        box[name] = [task.init(mlp(sizes))]

        def run() -> None:
            trainer = eg.Trainer(max_epochs=1, barebones=True)
            box[name][0] = trainer.fit(task, box[name][0].replace(epoch=0, batch_idx=0), data)

        return run

    def logged(name: str, data: list[Any]) -> Callable[[], None]:
        from engine.listeners import ProgressBar
        from engine.loggers import TensorBoardLogger

        box[name] = [task.init(mlp(sizes))]

        def run() -> None:
            trainer = eg.Trainer(  # the defaults: checkpoint every epoch, run directory
                max_epochs=1,
                callbacks=[ProgressBar(file=devnull)],
                logger=TensorBoardLogger(tmp, name=name, version=0),
                enable_model_summary=False,
                num_sanity_val_steps=0,
            )
            box[name][0] = trainer.fit(task, box[name][0].replace(epoch=0, batch_idx=0), data)

        return run

    runs = {
        f"{kind}_{length}": make(f"{kind}_{length}", data)
        for kind, make in (("hand", hand), ("bare", bare), ("logged", logged))
        for length, data in (("short", short), ("long", long))
    }
    times = {k: statistics.median(v) for k, v in _interleave(runs, rounds).items()}
    slope = {
        k: (times[f"{k}_long"] - times[f"{k}_short"]) / (2 * BATCHES)
        for k in ("hand", "bare", "logged")
    }
    fixed = {k: times[f"{k}_short"] - slope[k] * BATCHES for k in slope}
    return {
        "driver_barebones_us_per_batch": (slope["bare"] - slope["hand"]) * 1e6,
        "driver_logged_us_per_batch": (slope["logged"] - slope["hand"]) * 1e6,
        "driver_barebones_ms_per_fit": (fixed["bare"] - fixed["hand"]) * 1e3,
        "driver_logged_ms_per_fit": (fixed["logged"] - fixed["hand"]) * 1e3,
    }


def time_trainer(rounds: int) -> dict[str, float]:
    sizes, n = SHAPES["tiny"]
    x, y = batch(sizes, n)
    data = [(x, y)] * BATCHES
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # every round fits into the same logger version on purpose (no directory per round)
        warnings.filterwarnings("ignore", "ModelCheckpoint: the checkpoint directory")
        times = _interleave(_engine_variants(sizes, data, tmp), rounds)
        out["trainer_barebones_vs_hand"] = _ratio(times, "trainer_barebones", "hand")
        out["trainer_logged_vs_hand"] = _ratio(times, "trainer_logged", "hand")
        out["trainer_observed_vs_barebones"] = _ratio(
            times, "trainer_observed", "trainer_barebones"
        )
        hand_us = statistics.median(times["hand"]) / BATCHES * 1e6
        out.update(driver_overhead_us(rounds, tmp))
        # the driver's own cost relative to the step it drives: the stable form of the ratios
        out["trainer_barebones_overhead_fraction"] = out["driver_barebones_us_per_batch"] / hand_us
        out["trainer_logged_overhead_fraction"] = out["driver_logged_us_per_batch"] / hand_us
        lightning = _lightning_variants(sizes, data, tmp)
        if lightning:
            times = _interleave(lightning, max(3, rounds // 2))
            out["lightning_barebones_vs_raw"] = _ratio(times, "lightning_barebones", "raw")
            out["lightning_defaults_vs_raw"] = _ratio(times, "lightning_defaults", "raw")
    return out
