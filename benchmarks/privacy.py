"""Per-example gradients three ways, and a DP-SGD step two ways, on an MLP and a small CNN.

    python -m benchmarks.privacy               # one JSON object
    python -m benchmarks.privacy --rounds 5    # quicker

Per-example gradients of a batch of ``BATCH`` examples (cross-entropy, the model's every
parameter), each method on the same model and batch:

* ``vmap``: ``engine.per_example_grads`` (``torch.func.vmap`` over ``torch.func.grad`` of the
  loss of one example), the reference of every ratio;
* ``loop``: a Python loop over the examples, ``torch.autograd.grad`` of each one's loss,
  stacked;
* ``opacus``: Opacus's ``GradSampleModule`` (forward and backward hooks that compute
  ``grad_sample`` from each layer's activations and output gradients), a forward and a
  ``backward()`` of the batch's mean loss, then ``zero_grad`` (which drops the samples).

And one DP-SGD optimizer step (per-example gradients, clipping, noise, SGD):

* ``dpsgd_engine``: ``transforms.compose(privacy=DPSGD(...)).train_step(loss_fn, optim.sgd)``;
* ``dpsgd_opacus``: ``GradSampleModule`` + ``DPOptimizer(torch.optim.SGD)``, as
  ``PrivacyEngine.make_private`` builds them: ``zero_grad``, forward, ``backward()``, ``step()``.

Every method is warmed up, then the methods run interleaved, round by round (``REPEATS`` calls
each per round, the order reversed every other round), with the garbage collector off; a
figure is the median over rounds of the method's time over the reference's in the same round
(per-example: over ``vmap``; DP-SGD step: ``dpsgd_opacus`` over ``dpsgd_engine``). ``ms`` gives
each method's median time per call, ``max_abs_diff`` each method's largest difference from
``vmap``'s gradients, and ``other_processes_cores`` how many cores other processes kept busy
meanwhile.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import engine as eg
from benchmarks.checkpoint import _busy_s
from engine import optim, transforms
from engine.privacy import DPSGD

BATCH = 64
REPEATS = 2
ROUNDS = 7


def mlp() -> nn.Module:
    """256-128-128-10 on 16x16 images (flattened)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )  # fmt: skip


def cnn() -> nn.Module:
    """Two 3x3 convolutions (16, 32 channels), each with 2x2 max pooling, and a linear head, on
    16x16 images."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
    )  # fmt: skip


MODELS = {"mlp": mlp, "cnn": cnn}


def loss_fn(model: Any, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _methods(kind: str, batch: tuple[Tensor, Tensor]) -> dict[str, Callable[[], Any]]:
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = MODELS[kind]()
    state = eg.TrainState.create(copy.deepcopy(model), optim.sgd(0.1))
    plain = copy.deepcopy(model)
    params = list(plain.parameters())
    names = [n for n, _ in plain.named_parameters()]
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    x, y = batch

    def vmap() -> dict[str, Tensor]:
        return eg.per_example_grads(loss_fn, state, batch)

    def loop() -> dict[str, Tensor]:
        each = [
            torch.autograd.grad(loss_fn(plain, (x[i : i + 1], y[i : i + 1])), params)
            for i in range(len(x))
        ]
        return {n: torch.stack([g[j] for g in each]) for j, n in enumerate(names)}

    def hooks() -> dict[str, Tensor]:
        gsm.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        return {n.removeprefix("_module."): p.grad_sample for n, p in gsm.named_parameters()}

    return {"vmap": vmap, "loop": loop, "opacus": hooks}


def _dp_steps(kind: str, batch: tuple[Tensor, Tensor]) -> dict[str, Callable[[], Any]]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    model = MODELS[kind]()
    numbers = {"max_grad_norm": 1.0, "noise_multiplier": 1.0}
    tx = optim.sgd(0.05)
    pipe = transforms.compose(
        privacy=DPSGD(**numbers, sample_rate=BATCH / 60_000, expected_batch_size=BATCH)
    )
    box = [pipe.prepare(eg.TrainState.create(copy.deepcopy(model), tx))]
    step = pipe.train_step(loss_fn, tx)
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.05), **numbers, expected_batch_size=BATCH
    )

    def engine_step() -> None:
        box[0], _ = step(box[0], batch)

    def opacus_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(batch[0]), batch[1]).backward()
        opt.step()

    return {"dpsgd_engine": engine_step, "dpsgd_opacus": opacus_step}


def _timed(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():  # warm up: functorch's first vmap, Opacus's hooks
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    gc.disable()
    try:
        names = list(fns)
        for r in range(rounds):  # alternating order: drift within a round hits both ends
            for name in names if r % 2 == 0 else names[::-1]:
                fn = fns[name]
                start = time.perf_counter()
                for _ in range(REPEATS):
                    fn()
                times[name].append((time.perf_counter() - start) / REPEATS)
    finally:
        gc.enable()
    return times


def _ratio(times: dict[str, list[float]], name: str, ref: str) -> float:
    return round(statistics.median(a / b for a, b in zip(times[name], times[ref], strict=True)), 3)


def measure(rounds: int = ROUNDS) -> dict[str, Any]:
    """Every figure of the module's docstring, as one dict."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 1, 16, 16, generator=g)
    batch = (x, torch.randint(0, 10, (BATCH,), generator=g))
    busy0, cpu0, wall0 = _busy_s(), time.process_time(), time.perf_counter()
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": BATCH,
        "rounds": rounds,
    }
    for kind in MODELS:
        fns = _methods(kind, batch)
        reference = fns["vmap"]()
        diffs = {
            name: max(float((fn()[k] - reference[k]).abs().max()) for k in reference)
            for name, fn in fns.items()
            if name != "vmap"
        }
        times = _timed(fns, rounds)
        steps = _timed(_dp_steps(kind, batch), rounds)
        out[kind] = {
            "parameters": sum(p.numel() for p in MODELS[kind]().parameters()),
            "loop_vs_vmap": _ratio(times, "loop", "vmap"),
            "opacus_vs_vmap": _ratio(times, "opacus", "vmap"),
            "dpsgd_step_opacus_vs_engine": _ratio(steps, "dpsgd_opacus", "dpsgd_engine"),
            "ms": {
                name: round(1e3 * statistics.median(t), 3) for name, t in {**times, **steps}.items()
            },
            "max_abs_diff": diffs,
        }
    busy1, cpu1, wall1 = _busy_s(), time.process_time(), time.perf_counter()
    if busy0 is not None and busy1 is not None:  # the machine's busy time less this process's
        out["other_processes_cores"] = round((busy1 - busy0 - (cpu1 - cpu0)) / (wall1 - wall0), 2)
    out["seconds"] = round(wall1 - wall0, 1)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=ROUNDS)
    args = p.parse_args(argv)
    result = measure(args.rounds)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
