"""engine's deterministic data path against a plain ``DataLoader`` over the same dataset and
workers: what seeding the order, seeding each batch's randomness, sharding by rank and resuming
mid-epoch cost per batch.

    python -m benchmarks.data            # one JSON object
    python -m benchmarks.data --quick    # fewer rounds and samples

The dataset is map-style, MNIST-sized (784 float32 features and a label a sample, held in
memory) with a random augmentation drawn from torch's global generator in ``__getitem__`` (noise
of the sample's size): what a real dataset with augmentation does, at the cheap end of loading,
so the wrappers' share is as large as it gets. Batches of 128, ``persistent_workers`` when there
are workers (the steady state of a fit's epochs, not the pool's start). Each case pairs engine's
loader (a ``DataLoader`` wrapped as the Trainer wraps a training loader: :func:`seed_shuffle`,
:func:`seed_batches`, :func:`position_loader` at the epoch's start, and :func:`shard_loader` for
ranks) with the plain one it stands for:

* ``shuffle_w{0,2,4}``: ``DataLoader(shuffle=True, num_workers=w)``; engine's draws the order
  from ``(seed, epoch)`` and each batch's augmentation from ``(seed, epoch, batch)``;
* ``shard_w{0,2}``: rank 0 of 2: a plain loader over ``DistributedSampler(shuffle=True)``;
  engine's is the Trainer's data-parallel shard (Lightning's order) with the same seeding;
* ``resumed_w{0,2}``: an epoch resumed at its middle: engine's skips the first half of rank 0's
  batches without loading them (:func:`position_loader`); the plain one reads a sampler that
  draws the epoch's order from its seed and yields the rest of it (until 2026-12-07 a list of
  the remaining indices made once, outside the timing: engine's pass drew its order in it);
* ``control_w2``: the control, a plain ``DataLoader(shuffle=True, num_workers=2)`` against
  another one: no engine code in either, so its figure is what a worker case reads when
  nothing differs (it is left out of the worst case).

Every variant is built once, then all are run *interleaved*, round by round (the order of the
cases rotated; within a case three passes of each loader, alternating, the fastest of each
kept), so drift in machine load hits them alike; a pass takes the batches one at a time, as a
training loop does; the garbage collector is off while timing, as ``timeit`` does. A figure is
the median over rounds of (engine's time per batch / the plain loader's in that round);
``data_engine_vs_plain`` is the worst case's. Workers hand batches over with the
``file_system`` sharing strategy unless ``--sharing`` says otherwise: Linux's default,
``file_descriptor``, passes each batch's descriptor over a socket, which on a 2-core machine
costs ~0.8 ms a batch and scatters single rounds of a worker case over 0.84-1.33 whoever's
loader it is. Run it alone: worker processes share the cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from engine.data import (
    position_loader,
    restore_loader,
    seed_batches,
    seed_shuffle,
    shard_loader,
)

BATCH = 128
SEED = 0


class Augmented(Dataset):
    """MNIST-sized samples in memory, each returned with noise from torch's global generator."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 784, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(784), self.y[i]


class RestOfEpoch(Sampler[int]):
    """The plain loader's resumed epoch: the epoch's order drawn again from its seed (a resume
    has nothing else to go by), from index ``start`` on."""

    def __init__(self, n: int, start: int) -> None:
        self.n, self.start = n, start

    def __iter__(self):
        g = torch.Generator().manual_seed(SEED)
        return iter(torch.randperm(self.n, generator=g).tolist()[self.start :])

    def __len__(self) -> int:
        return self.n - self.start


def _loader(ds: Dataset, workers: int, **kwargs: Any) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=BATCH,
        num_workers=workers,
        persistent_workers=workers > 0,
        **kwargs,
    )


def _engine(loader: DataLoader, *, rank: int | None = None, skip: int = 0) -> DataLoader:
    """``loader`` wrapped as the Trainer wraps a training loader at epoch 0."""
    if rank is not None:
        assert shard_loader(loader, rank, 2, pad=True, shuffle=True)
    seed_shuffle(loader, SEED, 0)
    seed_batches(loader, SEED, 0)
    position_loader(loader, 0, skip)
    return loader


def cases(n: int) -> dict[str, tuple[Callable[[], int], Callable[[], int]]]:
    """Each case: (engine's pass, the plain loader's pass), as callables that build the pass."""
    ds = Augmented(n)
    out: dict[str, tuple[Callable[[], int], Callable[[], int]]] = {}
    for w in (0, 2, 4):
        ours, plain = _loader(ds, w, shuffle=True), _loader(ds, w, shuffle=True)
        out[f"shuffle_w{w}"] = (_repeat(lambda o=ours: _engine(o)), _repeat(lambda p=plain: p))
    for w in (0, 2):
        ours = _loader(ds, w, shuffle=True)
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=SEED)
        plain = _loader(ds, w, sampler=sampler)
        out[f"shard_w{w}"] = (
            _repeat(lambda o=ours: _engine(o, rank=0)),
            _repeat(lambda p=plain: p),
        )
    for w in (0, 2):
        ours = _loader(ds, w, shuffle=True)
        half = n // BATCH // 2
        plain = _loader(ds, w, sampler=RestOfEpoch(n, half * BATCH))
        out[f"resumed_w{w}"] = (
            _repeat(lambda o=ours, h=half: _engine(o, skip=h)),
            _repeat(lambda p=plain: p),
        )
    # the control: a plain loader against another one like it, no engine code in either; what
    # the worker cases' medians scatter by when nothing differs (not in the worst case)
    a, b = _loader(ds, 2, shuffle=True), _loader(ds, 2, shuffle=True)
    out[CONTROL] = (_repeat(lambda a=a: a), _repeat(lambda b=b: b))
    return out


CONTROL = "control_w2"


def _repeat(make: Callable[[], DataLoader]) -> Callable[[], int]:
    def one_pass() -> int:
        """One pass over the loader as a training loop takes it, a batch at a time (each
        dropped before the next: a list of them all would be freed in the next pass's
        timing); the number of batches."""
        loader, n = make(), 0
        try:
            for _ in loader:
                n += 1
            return n
        finally:
            restore_loader(loader)

    return one_pass


def measure(n: int, rounds: int, passes: int = 3) -> dict[str, Any]:
    built = cases(n)
    for ours, plain in built.values():  # warm up: worker pools started, first pass paid
        ours(), plain()
    ratios: dict[str, list[float]] = {k: [] for k in built}
    per_batch: dict[str, list[float]] = {k: [] for k in built}
    names = list(built)
    gc.disable()  # as timeit: a collection landing in one pass and not the other is noise
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                ours, plain = built[name]
                best = {ours: float("inf"), plain: float("inf")}
                pair = (ours, plain) if r % 2 == 0 else (plain, ours)
                for run in pair * passes:
                    t0 = time.perf_counter()
                    batches = run()
                    best[run] = min(best[run], (time.perf_counter() - t0) / batches)
                ratios[name].append(best[ours] / best[plain])
                per_batch[name].append(best[plain])
    finally:
        gc.enable()
    figures = {
        name: {
            "engine_vs_plain": statistics.median(ratios[name]),
            "plain_ms_per_batch": 1e3 * statistics.median(per_batch[name]),
            "rounds": [round(x, 3) for x in ratios[name]],
        }
        for name in built
    }
    worst = max((k for k in figures if k != CONTROL), key=lambda k: figures[k]["engine_vs_plain"])
    return {
        "samples": n,
        "passes": passes,
        "batch_size": BATCH,
        "cases": figures,
        "data_engine_vs_plain": figures[worst]["engine_vs_plain"],
        "worst_case": worst,
        "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and samples")
    p.add_argument("--passes", type=int, default=3, help="passes of each loader a round")
    p.add_argument(
        "--sharing",
        choices=torch.multiprocessing.get_all_sharing_strategies(),
        default="file_system",
        help="how workers hand batches over (torch.multiprocessing.set_sharing_strategy); "
        "file_system by default: Linux's default, file_descriptor, passes each tensor's "
        "descriptor over a socket, which here scatters the worker cases by 10%% a pass",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.multiprocessing.set_sharing_strategy(args.sharing)
    out = measure(
        n=4096 if args.quick else 16384, rounds=5 if args.quick else 21, passes=args.passes
    )
    json.dump(out, sys.stdout, indent=2)
    print()
    return out


if __name__ == "__main__":
    main()
