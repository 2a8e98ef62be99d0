"""Step time and peak memory on a GPU: engine's steps against raw PyTorch loops, in float32 and
bf16-mixed.

    python -m benchmarks.gpu --json gpu_bench.json       # on cuda (under three minutes on an H200)
    python -m benchmarks.gpu --device cpu --quick        # a smoke run with tiny sizes

Two models: an MLP 784-1024-1024-10 (batch 256) and a small causal language model (token
embedding, ``nn.TransformerEncoder`` with d_model 256, 4 layers, 4 heads, sequence 128, batch
32, LM head, cross-entropy). Per model and per precision, the variants are:

* ``raw``: ``zero_grad(set_to_none=True)``, forward (under ``torch.autocast(..., bfloat16)`` for
  bf16-mixed), ``backward()``, ``torch.optim.AdamW`` step (``fused=True`` on CUDA);
* ``raw_compiled``: the same loop over ``torch.compile(model)``, for orientation;
* ``engine_eager``: ``transforms.compose(placement=SingleDevice(dev), precision=...)`` and
  ``pipeline.train_step(loss_fn, optim.adamw(1e-3))``;
* ``engine_compiled``: the same with ``compile=True``;
* ``engine_cudagraphs`` (CUDA only): the same with ``compile={"mode": "reduce-overhead"}``, the
  whole donated step replayed as a CUDA graph;
* ``engine_multistep`` (CUDA only): ``steps_per_call=8`` compiled, eight optimizer steps per
  call in one graph (timed per optimizer step).

engine's AdamW is ``optim.adamw(1e-3, fused=True)`` on CUDA, the raw loop's kernel.

Compiling dominates the run time, so by default only bf16-mixed gets compiled variants (two per
model, four on CUDA); ``--compile-float32`` adds float32's, ``--skip-compile`` drops them all,
and a compiled variant that would start after ``--budget-s`` seconds is skipped (and listed as
such).

Speed: variants are built and warmed up, then run interleaved, round by round, with the device
synchronized around each timed block; a variant's ``ratio_to_raw`` is the median over rounds of
its time over the raw loop's (same precision) in that round, and ``bf16_vs_float32`` the same
for a variant's bf16-mixed time over its float32 time. Every model's eager variants are timed
first; then, model by model, the compiled ones are built and all of that model's variants timed
again together. Peak memory: after a variant's warm-up, ``torch.cuda.reset_peak_memory_stats()``,
a few steps, ``max_memory_allocated()`` less what was allocated before the variant was built
(null off CUDA). With ``--json PATH`` the JSON is rewritten at each stage, so a run stopped by a
timeout leaves what it had measured (``"complete": false``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim, transforms

PRECISIONS = ("float32", "bf16-mixed")
KINDS = (
    "raw",
    "raw_compiled",
    "engine_eager",
    "engine_compiled",
    "engine_cudagraphs",
    "engine_multistep",
)
REDUCE_OVERHEAD = {"mode": "reduce-overhead"}
Run = Callable[[], None]
LossFn = Callable[[Any, Any], torch.Tensor]


# ------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class MLPShape:
    sizes: tuple[int, ...]
    batch: int


@dataclass(frozen=True)
class LMShape:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int


@dataclass(frozen=True)
class Schedule:
    """How long a model is timed: warm-up steps, then ``rounds`` of ``steps`` per variant."""

    warmup: int
    rounds: int
    steps: int
    memory_steps: int


FULL: dict[str, tuple[MLPShape | LMShape, Schedule]] = {
    "mlp": (MLPShape((784, 1024, 1024, 10), 256), Schedule(10, 15, 50, 3)),
    "transformer": (LMShape(4096, 256, 4, 4, 128, 32), Schedule(5, 11, 10, 3)),
}
QUICK: dict[str, tuple[MLPShape | LMShape, Schedule]] = {
    "mlp": (MLPShape((32, 64, 64, 10), 16), Schedule(2, 3, 3, 2)),
    "transformer": (LMShape(64, 32, 2, 2, 16, 4), Schedule(2, 3, 3, 2)),
}


class TinyLM(nn.Module):
    """Token embedding, learned positions, a causal ``nn.TransformerEncoder`` (pre-norm), LM
    head."""

    def __init__(self, s: LMShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Parameter(torch.randn(s.seq, s.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            s.d_model, s.heads, 4 * s.d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(s.seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def make_model(shape: MLPShape | LMShape) -> nn.Module:
    torch.manual_seed(0)
    if isinstance(shape, LMShape):
        return TinyLM(shape)
    layers: list[nn.Module] = []
    for i in range(len(shape.sizes) - 1):
        layers.append(nn.Linear(shape.sizes[i], shape.sizes[i + 1]))
        if i < len(shape.sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_batch(shape: MLPShape | LMShape, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    if isinstance(shape, LMShape):
        tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        x = torch.randn(shape.batch, shape.sizes[0], generator=g)
        y = torch.randint(0, shape.sizes[-1], (shape.batch,), generator=g)
    return x.to(device), y.to(device)


def loss_fn(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ------------------------------------------------------------------------------ variants


def raw_variant(
    shape: MLPShape | LMShape, batch: Any, precision: str, device: torch.device, compile: bool
) -> Run:
    model = make_model(shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda" or None)
    forward: Any = torch.compile(model) if compile else model
    mixed = precision == "bf16-mixed"

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        if mixed:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(forward, batch)
        else:
            loss = loss_fn(forward, batch)
        loss.backward()
        opt.step()

    return run


def engine_precision(precision: str) -> transforms.Transform:
    """The engine's transform for ``"float32"`` (Lightning's ``"32-true"``) or
    ``"bf16-mixed"``."""
    return transforms.precision_transform("32-true" if precision == "float32" else precision)


def engine_variant(
    shape: MLPShape | LMShape,
    batch: Any,
    precision: str,
    device: torch.device,
    compile: bool | dict[str, str],
    steps_per_call: int = 1,
) -> Run:
    """engine's step under the transforms; with ``steps_per_call`` K > 1 one call is K optimizer
    steps (``run.per_call``: the timing divides by the steps, not the calls)."""
    pipeline = transforms.compose(
        placement=transforms.SingleDevice(device),
        precision=engine_precision(precision),
        compile=compile,
    )
    tx = optim.adamw(1e-3, fused=device.type == "cuda" or None)
    box = [pipeline.prepare(eg.TrainState.create(make_model(shape), tx, seed=0))]
    step = pipeline.train_step(loss_fn, tx, steps_per_call=steps_per_call)
    moved = pipeline.move(batch)
    if steps_per_call > 1:
        moved = [moved] * steps_per_call

    def run() -> None:
        box[0], _ = step(box[0], moved)

    run.per_call = steps_per_call  # type: ignore[attr-defined]
    return run


MULTISTEP_K = 8


def multistep_variant(
    shape: MLPShape | LMShape,
    batch: Any,
    precision: str,
    device: torch.device,
    compile: bool | dict[str, str],
) -> Run:
    """``steps_per_call=MULTISTEP_K`` compiled (:func:`engine_variant`)."""
    return engine_variant(shape, batch, precision, device, compile, MULTISTEP_K)


BUILDERS: dict[str, tuple[Callable[..., Run], bool | dict[str, str]]] = {
    "raw": (raw_variant, False),
    "raw_compiled": (raw_variant, True),
    "engine_eager": (engine_variant, False),
    "engine_compiled": (engine_variant, True),
    "engine_cudagraphs": (engine_variant, REDUCE_OVERHEAD),
    "engine_multistep": (multistep_variant, True),
}


# ------------------------------------------------------------------------------ measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" at {Path(last[0].filename).name}:{last[0].lineno}" if last else ""
    return f"{type(e).__name__}: {e}{where}"[:600]


def _build(
    kind: str,
    precision: str,
    shape: MLPShape | LMShape,
    batch: Any,
    device: torch.device,
    schedule: Schedule,
) -> tuple[Run, dict[str, Any]]:
    """A variant built, warmed up (compiled) and measured for peak memory."""
    make, compile = BUILDERS[kind]
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        _sync(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    run = make(shape, batch, precision, device, compile)
    for _ in range(schedule.warmup):
        run()
    _sync(device)
    info: dict[str, Any] = {"warmup_s": time.perf_counter() - t0, "peak_mem_mb": None}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(schedule.memory_steps):
            run()
        _sync(device)
        info["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return run, info


def _interleave(
    runs: dict[tuple[str, str], Run], schedule: Schedule, device: torch.device
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], str]]:
    """Seconds per step, by variant and round; a variant that raises is dropped (its error)."""
    times: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    errors: dict[tuple[str, str], str] = {}
    gc.collect()
    gc.disable()  # as timeit does
    try:
        for _ in range(schedule.rounds):
            for key, run in runs.items():
                if key in errors:
                    continue
                per_call = getattr(run, "per_call", 1)  # optimizer steps per call
                calls = max(schedule.steps // per_call, 1)
                try:
                    _sync(device)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        run()
                    _sync(device)
                except Exception as e:
                    errors[key] = _error(e)
                    continue
                times[key].append((time.perf_counter() - t0) / (calls * per_call))
    finally:
        gc.enable()
    return {k: v for k, v in times.items() if k not in errors}, errors


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


class ModelBench:
    """One model's variants: each built, warmed up and measured for memory as it is added;
    :meth:`time` runs all of those built so far interleaved and refreshes every figure."""

    def __init__(
        self, name: str, shape: MLPShape | LMShape, schedule: Schedule, device: torch.device
    ) -> None:
        self.name, self.shape, self.schedule, self.device = name, shape, schedule, device
        self.batch = make_batch(shape, device)
        self.runs: dict[tuple[str, str], Run] = {}
        self.out: dict[str, Any] = {
            "shape": asdict(shape),
            "schedule": asdict(schedule),
            "params": sum(p.numel() for p in make_model(shape).parameters()),
            "variants": {p: {} for p in PRECISIONS},
            "bf16_vs_float32": {},
            "skipped": {},
            "errors": {},
        }

    def add(self, kind: str, precision: str) -> None:
        label = f"{kind}/{precision}"
        try:
            run, info = _build(kind, precision, self.shape, self.batch, self.device, self.schedule)
        except Exception as e:
            self.out["errors"][label] = _error(e)
            return
        self.runs[kind, precision] = run
        self.out["variants"][precision][kind] = info
        print(f"  {self.name} {label}: built in {info['warmup_s']:.1f} s", file=sys.stderr)

    def time(self) -> None:
        times, errors = _interleave(self.runs, self.schedule, self.device)
        variants = self.out["variants"]
        for (kind, precision), message in errors.items():
            self.out["errors"][f"{kind}/{precision}"] = message
            variants[precision].pop(kind, None)
            del self.runs[kind, precision]
        for (kind, precision), ts in times.items():
            info = variants[precision][kind]
            step_s = statistics.median(ts)
            info["step_ms"] = step_s * 1e3
            info["steps_per_s"] = 1 / step_s
            raw = times.get(("raw", precision))
            info["ratio_to_raw"] = _median_ratio(ts, raw) if raw else None
            raw_mem = variants[precision].get("raw", {}).get("peak_mem_mb")
            mem = info["peak_mem_mb"]
            info["mem_ratio_to_raw"] = mem / raw_mem if mem is not None and raw_mem else None
        self.out["bf16_vs_float32"] = {
            kind: _median_ratio(times[kind, "bf16-mixed"], times[kind, "float32"])
            for kind in KINDS
            if (kind, "bf16-mixed") in times and (kind, "float32") in times
        }


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["device_memory_gb"] = props.total_memory / 1e9
        env["capability"] = list(torch.cuda.get_device_capability(device))
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def _write(path: str | None, results: dict[str, Any]) -> None:
    if path is None or path == "-":
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)


def run(
    device: torch.device,
    *,
    quick: bool = False,
    compile: bool = True,
    compile_float32: bool = False,
    models: tuple[str, ...] = ("mlp", "transformer"),
    budget_s: float = 150.0,
    json_path: str | None = None,
) -> dict[str, Any]:
    """Every model's figures (see the module's docstring), written to ``json_path`` as they
    come: first every model's eager variants, timed; then, model by model, the compiled ones,
    after which all of that model's variants are timed again together."""
    start = time.monotonic()
    sizes = QUICK if quick else FULL
    compiled = () if not compile else PRECISIONS if compile_float32 else ("bf16-mixed",)
    results: dict[str, Any] = {
        "env": environment(device),
        "quick": quick,
        "compiled_precisions": list(compiled),
        "budget_s": budget_s,
        "models": {},
        "complete": False,
    }

    def write() -> None:
        results["elapsed_s"] = time.monotonic() - start
        _write(json_path, results)

    write()
    benches: dict[str, ModelBench] = {}
    for name in models:
        shape, schedule = sizes[name]
        print(f"{name}: {shape}", file=sys.stderr)
        bench = benches[name] = ModelBench(name, shape, schedule, device)
        results["models"][name] = bench.out
        for kind in ("raw", "engine_eager"):
            for precision in PRECISIONS:
                bench.add(kind, precision)
        bench.time()
        write()
    for bench in benches.values():
        added = False
        kinds = ["raw_compiled", "engine_compiled"]
        if device.type == "cuda":
            kinds += ["engine_cudagraphs", "engine_multistep"]
        for kind in kinds:
            for precision in compiled:
                if time.monotonic() - start > budget_s:
                    bench.out["skipped"][f"{kind}/{precision}"] = (
                        f"not started: the {budget_s:.0f} s budget was spent"
                    )
                    continue
                bench.add(kind, precision)
                added = True
                write()
        if added:
            bench.time()
            write()
    results["complete"] = True
    write()
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"{'variant':40} {'steps/s':>9} {'x raw':>6} {'peak MB':>8} {'warm-up s':>9}"]
    for name, m in results["models"].items():
        for precision, variants in m["variants"].items():
            for kind, v in variants.items():
                if "step_ms" not in v:
                    continue
                ratio = "" if v["ratio_to_raw"] is None else f"{v['ratio_to_raw']:.2f}"
                mem = "" if v["peak_mem_mb"] is None else f"{v['peak_mem_mb']:.0f}"
                lines.append(
                    f"{name + ' ' + precision + ' ' + kind:40} {v['steps_per_s']:9.1f} "
                    f"{ratio:>6} {mem:>8} {v['warmup_s']:9.1f}"
                )
        for kind, r in m.get("bf16_vs_float32", {}).items():
            lines.append(f"{name} bf16-mixed / float32, {kind}: {r:.2f}")
        for label, why in {**m["skipped"], **m["errors"]}.items():
            lines.append(f"{name} {label}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print one JSON object; with PATH, also write it there (after each model)",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps")
    p.add_argument("--skip-compile", action="store_true", help="no compiled variants")
    p.add_argument(
        "--compile-float32", action="store_true", help="compiled variants in float32 too"
    )
    p.add_argument("--models", default="mlp,transformer", help="comma-separated")
    p.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="seconds after which no further compiled variant is started",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; pass --device cpu (with --quick) for a smoke run")
    models = tuple(m for m in args.models.split(",") if m)
    unknown = set(models) - set(FULL)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {sorted(FULL)}")
    results = run(
        device,
        quick=args.quick,
        compile=not args.skip_compile,
        compile_float32=args.compile_float32,
        models=models,
        budget_s=args.budget_s,
        json_path=args.json,
    )
    if args.json is not None:
        print(json.dumps(results, indent=2))
    else:
        print(table(results))


if __name__ == "__main__":
    main()
