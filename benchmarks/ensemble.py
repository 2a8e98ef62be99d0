"""An ensemble of E MLPs in one vmapped step against E sequential steps of the same model.

    python -m benchmarks.ensemble            # one JSON object
    python -m benchmarks.ensemble --quick    # fewer rounds

For E = 8 and 32 (the tiny MLP of ``benchmarks.step``, 32-64-64-10, batch 64, AdamW), three
steps are timed *interleaved*, round by round in one process, so drift in machine load hits them
alike:

* ``sequential``: E states, each stepped by ``eg.train_step(loss_fn, optim.adamw(1e-3))`` (the
  project's ordinary path: ``torch.autograd.grad``, the fused AdamW kernel in place), one after
  the other: what E separate runs cost per step;
* ``vmapped``: one ensemble state of the same E members stepped by
  ``ensemble.ensemble_step(loss_fn, tx)`` (``torch.func.grad_and_value`` under ``torch.func.vmap``,
  the fused kernel once over every member's tensors);
* ``sweep``: a learning-rate sweep of E rates (``inject_hyperparams(adamw)``), whose fused kernel
  runs once per member (each its own rate).

A figure is the median over rounds of (its time / the sequential time in that round): below 1.0
the vmapped step is faster than E separate steps. ``grad_share`` is the part of the vmapped
step spent computing the gradients (``vmap(grad_and_value)`` timed alone, as a ratio to the
whole vmapped step). The garbage collector is off while timing, as ``timeit`` does.
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
import torch.nn.functional as F

import engine as eg
from benchmarks.step import batch, mlp
from engine import ensemble, optim
from engine.step._model_view import _view

SIZES = (32, 64, 64, 10)
BATCH = 64


def loss_fn(model: Any, b: Any) -> torch.Tensor:
    x, y = b
    return F.cross_entropy(model(x), y)


def _variants(e: int) -> dict[str, Callable[[], None]]:
    b = batch(SIZES, BATCH)
    tx = optim.adamw(1e-3)
    members = [eg.TrainState.create(mlp(SIZES, seed=s), tx, seed=s) for s in range(e)]
    holder: dict[str, Any] = {"states": [m.copy() for m in members]}
    step = eg.train_step(loss_fn, tx)

    def sequential() -> None:
        holder["states"] = [step(s, b)[0] for s in holder["states"]]

    holder["ensemble"] = ensemble.stack(members)
    estep = ensemble.ensemble_step(loss_fn, tx)

    def vmapped() -> None:
        holder["ensemble"] = estep(holder["ensemble"], b)[0]

    stx = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
    rates = [1e-4 * 1.3**i for i in range(e)]
    holder["sweep"] = ensemble.sweep(eg.TrainState.create(mlp(SIZES), stx), lr=rates)
    sstep = ensemble.ensemble_step(loss_fn, stx)

    def sweep() -> None:
        holder["sweep"] = sstep(holder["sweep"], b)[0]

    ens = holder["ensemble"]
    module = ens.module

    def grads_only() -> None:
        def one(p: Any) -> Any:
            return torch.func.grad_and_value(lambda q: loss_fn(_view(module, q, {}), b))(p)

        torch.func.vmap(one)(holder["ensemble"].params)

    return {"sequential": sequential, "vmapped": vmapped, "sweep": sweep, "grads": grads_only}


def measure(e: int, rounds: int, steps: int) -> dict[str, Any]:
    variants = _variants(e)
    for fn in variants.values():  # warm up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                times[name].append((time.perf_counter() - start) / steps)
    finally:
        gc.enable()
    seq = times["sequential"]

    def ratio(name: str, to: list[float] = seq) -> float:
        return round(statistics.median(t / s for t, s in zip(times[name], to, strict=True)), 3)

    return {
        "members": e,
        "sequential_ms": round(statistics.median(seq) * 1e3, 3),
        "vmapped_ms": round(statistics.median(times["vmapped"]) * 1e3, 3),
        "vmapped_vs_sequential": ratio("vmapped"),
        "sweep_vs_sequential": ratio("sweep"),
        "grad_share": ratio("grads", times["vmapped"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 5 if args.quick else 11
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "model": f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, AdamW",
        "rounds": rounds,
    }
    for e, steps in ((8, 10), (32, 4)):
        out[f"E={e}"] = measure(e, rounds, steps)
    json.dump(out, sys.stdout, indent=2)
    print()
    return out


if __name__ == "__main__":
    main()
