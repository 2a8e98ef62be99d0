"""Small compiled graphs run on one thread (private): :func:`compile_small_on_one_thread`.

Inductor decides per kernel whether its own loops are worth splitting over threads (not below
``cpp.min_chunk_size`` elements a thread), but the matrix products and convolutions it calls out
to ATen follow the process's thread count, and MKL splits even a 64x64x64 product over them.
On a small graph the fork and join of every such call, and of every kernel just above the
chunk size, cost more than the work: the tiny benchmark MLP's 8-step block (tensors of at most
4,096 elements) took 85 us a step on 2 threads and 70 us on one, while a 256-wide layer on a
batch of 128 is 1.16x slower on one (``benchmarks/README.md``). So a CPU graph whose every
tensor holds at most :data:`SMALL` elements runs with ``torch.set_num_threads(1)`` around each
call (0.2 us), the thread's count restored after; any other graph runs as compiled.

The choice is made once, from the shapes Dynamo traced, so it is the same in every process that
compiles the same step: a resumed or replayed run computes with the same threads, and the same
bits. The count is the calling thread's (ATen sets OpenMP's and MKL's per-thread settings), so
other threads of the process keep theirs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["SMALL", "compile_small_on_one_thread", "is_small_cpu_graph"]

# 8,192 float32 elements are 32 KiB, a core's L1 data cache: a product of two such matrices is
# at most ~740k multiply-adds, ~10 us on one core. Measured break-even on 2 cores: 64-wide
# layers at batch 64 gain 15% on one thread; 128-wide ones (16,384-element weights) are even.
SMALL = 8192


def is_small_cpu_graph(gm: torch.fx.GraphModule, limit: int = SMALL) -> bool:
    """Whether every tensor ``gm`` computes, and every tensor its operations read (an input
    read only by indexing aside), is on the CPU with at most ``limit`` elements (static sizes:
    a symbolic size counts as large)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        values = [node.meta.get("example_value")]
        if node.target is not operator.getitem:  # indexing only picks (a stacked micro-batch)
            values += [a.meta.get("example_value") for a in node.all_input_nodes]
        for value in pytree.tree_leaves(values):
            if not isinstance(value, Tensor):
                continue
            numel = value.numel()
            if value.device.type != "cpu" or not isinstance(numel, int) or numel > limit:
                return False
    return True


def _on_one_thread(compiled: Callable) -> Callable:
    # ATen's thread count is the calling thread's (OpenMP's and MKL's per-thread settings), so
    # each call sets and restores its own thread's: two threads calling at once do not meet
    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        threads = torch.get_num_threads()
        if threads == 1:
            return compiled(*args)
        torch.set_num_threads(1)
        try:
            return compiled(*args)
        finally:
            torch.set_num_threads(threads)

    return run


class _Backend:
    """Inductor (torch.compile's own wrapper of it, with the caller's mode and options), its
    compiled small CPU graphs called on one thread."""

    compiler_name = "inductor"

    def __init__(self, inductor: Any) -> None:
        self.inductor = inductor

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        small = is_small_cpu_graph(gm)  # before Inductor, which owns and may change gm
        compiled = self.inductor(gm, example_inputs, **kwargs)
        return _on_one_thread(compiled) if small else compiled

    def get_compiler_config(self) -> Any:
        return self.inductor.get_compiler_config()

    def reset(self) -> None:
        self.inductor.reset()


def compile_small_on_one_thread(fn: Callable, options: Mapping[str, Any]) -> Callable:
    """``torch.compile(fn, **options)``, with Inductor's small CPU graphs run on one thread
    (module docstring). Another backend, AOTInductor, or a mode together with options (which
    torch.compile refuses, with its message) compile as ``torch.compile`` would."""
    kwargs = dict(options)
    backend = kwargs.pop("backend", "inductor")
    mode = kwargs.pop("mode", None)
    inductor_options = kwargs.pop("options", None)
    wrapper: Any = getattr(torch, "_TorchCompileInductorWrapper", None)
    plain = (
        backend != "inductor"
        or wrapper is None
        or (mode is not None and inductor_options is not None)
        or (inductor_options or {}).get("use_aoti", False)
    )
    if plain:
        return torch.compile(fn, **options)
    inductor_options = dict(inductor_options or {})
    guard_filter_fn = inductor_options.pop("guard_filter_fn", None)
    default = mode is None and not inductor_options
    inductor = wrapper(
        "default" if default else mode,
        inductor_options or None,
        kwargs.get("dynamic"),
        kwargs.pop("name", None),
    )
    if guard_filter_fn is not None:
        kwargs["options"] = {"guard_filter_fn": guard_filter_fn}
    return torch.compile(fn, backend=_Backend(inductor), **kwargs)
