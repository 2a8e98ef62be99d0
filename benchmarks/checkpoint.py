"""Checkpoint save/load time against plain ``torch.save`` + fsync / ``torch.load``.

    python -m benchmarks.checkpoint [--json] [--rounds N]

A 201 MB state (an MLP 4096-2048-4096 with AdamW: parameters and two moments) is saved and
loaded, each variant into a fresh directory, in two places: the working directory's disk, and
``/dev/shm`` (a tmpfs, where fsync costs nothing). The tmpfs figures are the code's own cost; the
disk figures add what the device does on fsync, which on shared machines swings more than the
code costs. Figures, per place:

* ``save_vs_torch``: ``engine.checkpoint.save`` (checksum, fsyncs, rename) over ``torch.save`` of
  the same tensors to a file + fsync (target <= 1.10); ``save_vs_torch_nocrc`` over the same
  ``torch.save`` without the zip CRC-32s, which ``checkpoint.save`` skips (its SHA-256s cover
  every byte): what the engine adds over the cheapest plain save;
* ``load_vs_torch``: ``engine.checkpoint.load`` (checksum verification included) over
  ``torch.load(weights_only=True)`` of that file (target <= 1.10);
* ``async_blocked_vs_sync``: the time ``save_async`` blocks the caller (the snapshot) over a
  synchronous save, ``checkpoint.save`` (target <= 0.10); ``async_blocked_vs_torch_save`` over
  the plain synchronous save, ``torch.save`` + fsync; ``async_blocked_vs_copy`` over one
  ``copy_`` of every tensor into buffers allocated beforehand: the least a snapshot in host
  memory can cost, so this one says how close to it ``save_async`` comes. The first
  asynchronous save, which allocates the buffers later ones reuse, is reported apart
  (``async_first_blocked_ms``).
* ``trainer_async_blocked_vs_sync``: the same inside a fit with the Trainer's defaults (the
  journal on): how long a listener's ``eg.Save(path, asynchronous=True)`` holds the loop (from
  the request to the next batch: ``on_save_checkpoint`` to every listener, their states, the
  snapshot) over ``eg.Save(path)``, one of each per round after a first pair that allocates;
  ``trainer_async_blocked_vs_torch_save`` over the same place's ``torch.save`` + fsync.

Every round runs all variants back to back, alternating their order; a ratio is the median over
rounds of the per-round ratio (with its interquartile range), so that drift in machine load and
disk latency hits both sides of a ratio alike. One unrecorded round warms up.
``other_processes_cores`` is how many cores other processes kept busy meanwhile: the engine's
save and load hash on a second core, so on a 2-core machine another busy process moves the
ratios up more than it moves plain ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import _files


def _state() -> eg.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 2048), nn.ReLU(), nn.Linear(2048, 4096))  # 16.8M
    state = eg.TrainState.create(model, optim.adamw(1e-3))
    return state  # moments are zeros until a step; their bytes are written all the same


def _torch_save(tensors: dict[str, torch.Tensor], path: Path, crc32: bool = True) -> None:
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc32)
    try:
        with open(path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
    finally:
        torch.serialization.set_crc32_options(previous)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def _busy_s() -> float | None:
    """CPU seconds all processes have run (from /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def places() -> dict[str, Path]:
    """Where to measure: the working directory's disk, and /dev/shm where there is one."""
    out = {"disk": Path(os.getcwd())}
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        out["tmpfs"] = shm
    return out


def _round(
    state: eg.TrainState, root: Path, order: int, buffers: list[torch.Tensor]
) -> dict[str, float]:
    """One round: every variant once, into fresh files under ``root``; seconds by variant."""
    tensors, _ = _files._flatten(state)
    ours, theirs, nocrc, later = root / "ours", root / "theirs.pt", root / "nocrc.pt", root / "a"
    times: dict[str, float] = {}
    saves: list[tuple[str, Callable[[], Any]]] = [
        ("save", lambda: checkpoint.save(state, ours)),
        ("torch_save", lambda: _torch_save(tensors, theirs)),
        ("torch_save_nocrc", lambda: _torch_save(tensors, nocrc, crc32=False)),
    ]
    loads: list[tuple[str, Callable[[], Any]]] = [
        ("load", lambda: checkpoint.load(ours, state)),
        ("torch_load", lambda: torch.load(theirs, map_location="cpu", weights_only=True)),
    ]
    for group in (saves, loads):
        for k, fn in group if order % 2 else group[::-1]:
            times[k] = _timed(fn)
    future: list[Any] = []

    def snapshot() -> None:
        times["async_blocked"] = _timed(lambda: future.append(checkpoint.save_async(state, later)))
        future[0].result()  # the write ends before anything else is timed

    def copy() -> None:
        pairs = zip(buffers, tensors.values(), strict=True)
        times["copy"] = _timed(lambda: [b.copy_(t) for b, t in pairs])

    for fn in (snapshot, copy) if order % 2 else (copy, snapshot):
        fn()
    for p in (ours, theirs, nocrc, later):
        _remove(p)
    return times


def measure(state: eg.TrainState, where: Path, rounds: int) -> dict[str, Any]:
    """Time the variants in ``rounds`` interleaved rounds (after one warm-up) under ``where``."""
    times: dict[str, list[float]] = {}
    busy0, own0, wall0 = _busy_s(), time.process_time(), time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="engine-bench-", dir=where))
    checkpoint.release_buffers()  # the warm-up's asynchronous save allocates them
    buffers = [torch.empty_like(t).fill_(0) for t in _files._flatten(state)[0].values()]
    try:
        first_async = _round(state, root, 0, buffers)["async_blocked"]
        for r in range(rounds):
            for k, t in _round(state, root, r, buffers).items():
                times.setdefault(k, []).append(t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    busy1, own1, wall1 = _busy_s(), time.process_time(), time.perf_counter()

    def ratio(num: str, den: str) -> tuple[float, list[float]]:
        per_round = [a / b for a, b in zip(times[num], times[den], strict=True)]
        if len(per_round) < 2:
            return per_round[0], [per_round[0], per_round[0]]
        q1, _, q3 = statistics.quantiles(per_round, n=4)
        return statistics.median(per_round), [q1, q3]

    out: dict[str, Any] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
    out["async_first_blocked_ms"] = first_async * 1e3
    for name, num, den in (
        ("save_vs_torch", "save", "torch_save"),
        ("save_vs_torch_nocrc", "save", "torch_save_nocrc"),
        ("load_vs_torch", "load", "torch_load"),
        ("async_blocked_vs_sync", "async_blocked", "save"),
        ("async_blocked_vs_torch_save", "async_blocked", "torch_save"),
        ("async_blocked_vs_copy", "async_blocked", "copy"),
    ):
        out[name], out[f"{name}_iqr"] = ratio(num, den)
    if busy0 is not None and busy1 is not None:
        # cores other processes kept busy meanwhile (0 on an idle machine): noise to expect
        out["other_processes_cores"] = max(0.0, (busy1 - busy0 - (own1 - own0)) / (wall1 - wall0))
    return out


class _SaveTimer(eg.Listener):
    """Asks for a checkpoint after each training batch, synchronously and asynchronously by
    turns, and times how long the driver held the loop for it: from the request (returned by
    ``on_train_batch_end``) to the next batch's start. The write of an asynchronous save is then
    waited for, untimed, so that saves never overlap."""

    def __init__(self, root: Path) -> None:
        self.root, self.times = root, {"trainer_save": [], "trainer_async_blocked": []}
        self.asked: tuple[Path, bool, float] | None = None
        self.future: Any = None

    def on_train_batch_end(self, rec: Any) -> eg.Save:
        asynchronous = rec.state.step % 2 == 0
        path = self.root / f"s{rec.state.step}"
        self.asked = (path, asynchronous, time.perf_counter())
        return eg.Save(path, asynchronous=asynchronous)

    def on_save_checkpoint(self, rec: Any) -> None:
        self.future = rec.checkpoint_future  # None for a synchronous save

    def on_train_batch_start(self, rec: Any) -> None:
        if self.asked is None:
            return
        elapsed = time.perf_counter() - self.asked[2]
        path, asynchronous, _ = self.asked
        if self.future is not None:
            self.future.result()
        self.times["trainer_async_blocked" if asynchronous else "trainer_save"].append(elapsed)
        _remove(path)
        self.asked = self.future = None


def measure_trainer(where: Path, rounds: int) -> dict[str, Any]:
    """Inside a fit with the Trainer's defaults (journal on): how long a checkpoint a listener
    asks for blocks the loop, asynchronous over synchronous, one pair of saves per round."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 2048), nn.ReLU(), nn.Linear(2048, 4096))
    task = eg.Task(lambda m, b: (m(b) - b).pow(2).mean(), optim.adamw(1e-3))
    data = [torch.randn(8, 4096)] * (2 * rounds + 3)  # the last save is not timed
    root = Path(tempfile.mkdtemp(prefix="engine-bench-", dir=where))
    timer = _SaveTimer(root)
    try:
        trainer = eg.Trainer(
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=root,
            callbacks=[timer],
        )
        trainer.fit(task, task.init(model), data)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync, blocked = timer.times["trainer_save"][1:], timer.times["trainer_async_blocked"][1:]
    per_round = [a / b for a, b in zip(blocked, sync, strict=False)]
    return {
        "trainer_save_ms": statistics.median(sync) * 1e3,
        "trainer_async_blocked_ms": statistics.median(blocked) * 1e3,
        "trainer_async_blocked_vs_sync": statistics.median(per_round),
    }


def run(rounds: int) -> dict[str, Any]:
    """Every figure, in every place; ``{"state_mb": ..., "disk": {...}, "tmpfs": {...}}``."""
    state = _state()
    tensors, _ = _files._flatten(state)
    out: dict[str, Any] = {
        "state_mb": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
        "rounds": rounds,
    }
    for name, where in places().items():
        out[name] = measure(state, where, rounds)
        trainer = measure_trainer(where, rounds)
        trainer["trainer_async_blocked_vs_torch_save"] = (
            trainer["trainer_async_blocked_ms"] / out[name]["torch_save_ms"]
        )
        out[name].update(trainer)
    checkpoint.release_buffers()
    return out


def flat(results: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``, for a table."""
    out: dict[str, Any] = {}
    for k, v in results.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def show(key: str, v: Any) -> str:
    if isinstance(v, float):
        return f"{key:40s} {v:.3f}"
    if isinstance(v, list):
        return f"{key:40s} " + "-".join(f"{x:.3f}" for x in v)
    return f"{key:40s} {v}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    out = run(args.rounds)
    print(
        json.dumps(out, indent=2)
        if args.json
        else "\n".join(show(k, v) for k, v in flat(out).items())
    )


if __name__ == "__main__":
    main()
