"""What the differentiable optimizer step costs against the in-place one.

    python -m benchmarks.meta            # a table
    python -m benchmarks.meta --json     # one JSON object
    python -m benchmarks.meta --quick    # fewer rounds

One optimizer step (``optim.sgd``, ``optim.adam`` and ``optim.adam(fused=False)``, whose
in-place path is torch.optim's foreach sequence) on the parameters of two MLPs (the MAML
sinusoid model 1-40-40-1 and the step benchmark's medium 784-1024-1024-10), three ways:

* ``in_place``: ``optim.apply_gradients`` (donated: the foreach kernels, or Adam's fused
  kernel, write the parameters and the state in place), the train step's path;
* ``out_of_place``: ``optim.differentiable_step`` under ``torch.no_grad`` (new parameters and a
  new state every step, nothing recorded);
* ``recorded``: ``optim.differentiable_step`` on parameters and gradients that require grad,
  as in MAML's inner loop (autograd records the step; the graph is dropped after each call).

Each figure is the median over interleaved rounds of a variant's time divided by
``in_place``'s in the same round. ``new_bytes`` is what one differentiable step allocates and
returns (parameters and optimizer state), in units of the parameters' bytes; ``in_place``
allocates none of it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from engine import optim

SHAPES = {"maml": (1, 40, 40, 1), "medium": (784, 1024, 1024, 10)}
OPTIMIZERS: dict[str, Callable[[], optim.GradientTransformation]] = {
    "sgd": lambda: optim.sgd(0.01),
    "adam": lambda: optim.adam(1e-3),  # in place: torch._fused_adam_, one kernel
    "adam_foreach": lambda: optim.adam(1e-3, fused=False),  # in place: torch.optim's foreach ops
}


FIELDS = ("in_place_us", "out_of_place_ratio", "recorded_ratio", "new_bytes")


def _params(sizes: tuple[int, ...]) -> dict[str, Tensor]:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(sizes)]
    return {k: v.detach().clone() for k, v in nn.Sequential(*layers).named_parameters()}


def variants(shape: str, opt: str) -> dict[str, Callable[[], None]]:
    sizes = SHAPES[shape]
    make = OPTIMIZERS[opt]
    grads = {k: torch.randn_like(p) * 1e-3 for k, p in _params(sizes).items()}
    runs: dict[str, Callable[[], None]] = {}

    tx, params = make(), _params(sizes)
    live = {"params": params, "state": tx.init(params), "step": 0}

    def in_place() -> None:
        live["params"], live["state"] = optim.apply_gradients(
            tx, grads, live["state"], live["params"], live["step"]
        )
        live["step"] += 1

    runs["in_place"] = in_place

    tx2, params2 = make(), _params(sizes)
    pure = {"params": params2, "state": tx2.init(params2), "step": 0}

    def out_of_place() -> None:
        with torch.no_grad():
            pure["params"], pure["state"] = optim.differentiable_step(
                tx2, grads, pure["state"], pure["params"], pure["step"]
            )
        pure["step"] += 1

    runs["out_of_place"] = out_of_place

    tx3 = make()
    leaves = {k: p.requires_grad_() for k, p in _params(sizes).items()}
    leaf_grads = {k: g.clone().requires_grad_() for k, g in grads.items()}
    state0 = tx3.init(leaves)

    def recorded() -> None:
        new, _ = optim.differentiable_step(tx3, leaf_grads, state0, leaves, 0)
        assert next(iter(new.values())).grad_fn is not None

    runs["recorded"] = recorded
    return runs


def new_bytes(shape: str, opt: str) -> float:
    """Bytes of the new tensors one differentiable step returns, over the parameters' bytes."""
    tx, params = OPTIMIZERS[opt](), _params(SHAPES[shape])
    grads = {k: torch.ones_like(p) for k, p in params.items()}
    new, state = optim.differentiable_step(tx, grads, tx.init(params), params, 0)
    size = sum(p.numel() * p.element_size() for p in params.values())
    out = [t for t in pytree.tree_leaves((new, state)) if isinstance(t, Tensor)]
    return sum(t.numel() * t.element_size() for t in out) / size


def measure(rounds: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for shape, opt in itertools.product(SHAPES, OPTIMIZERS):
        runs = variants(shape, opt)
        steps = 100 if shape == "maml" else 3
        for run in runs.values():  # warm up
            for _ in range(3):
                run()
        times: dict[str, list[float]] = {k: [] for k in runs}
        gc.collect()
        gc.disable()
        try:
            for _ in range(rounds):
                for k, run in runs.items():
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        run()
                    times[k].append((time.perf_counter() - t0) / steps)
        finally:
            gc.enable()
        base = times["in_place"]
        out[f"{shape}_{opt}_in_place_us"] = statistics.median(base) * 1e6
        for k in ("out_of_place", "recorded"):
            ratios = [t / b for t, b in zip(times[k], base, strict=True)]
            out[f"{shape}_{opt}_{k}_ratio"] = statistics.median(ratios)
        out[f"{shape}_{opt}_new_bytes"] = new_bytes(shape, opt)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    figures = measure(3 if args.quick else 9)
    if args.json:
        print(json.dumps({"torch": torch.__version__, **figures}, indent=1))
        return
    print(f"torch {torch.__version__}, one optimizer step; ratios to in_place (median of rounds)")
    print(f"{'model / optimizer':<22}{'in_place':>12}{'out_of_place':>14}{'recorded':>10}"
          f"{'new bytes':>11}")  # fmt: skip
    for shape, opt in itertools.product(SHAPES, OPTIMIZERS):
        f = {k: figures[f"{shape}_{opt}_{k}"] for k in FIELDS}
        print(f"{shape + ' / ' + opt:<22}{f['in_place_us']:>10.1f}us"
              f"{f['out_of_place_ratio']:>14.2f}{f['recorded_ratio']:>10.2f}"
              f"{f['new_bytes']:>10.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
