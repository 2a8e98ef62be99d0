"""Small compiled graphs run on one thread (private): :func:`compile_small_on_one_thread`.

Inductor decides per kernel whether its own loops are worth splitting over threads (not below
``cpp.min_chunk_size`` elements a thread), but the matrix products and convolutions it calls out
to ATen follow the process's thread count, and MKL splits even a 64x64x64 product over them.
On a small graph the fork and join of every such call, and of every kernel just above the
chunk size, cost more than the work: the tiny benchmark MLP's 8-step block (tensors of at most
4,096 elements) took 85 us a step on 2 threads and 70 us on one, while a 256-wide layer on a
batch of 128 is 1.16x slower on one (``benchmarks/README.md``). So a CPU graph whose every
tensor holds at most :data:`SMALL` elements runs with ``torch.set_num_threads(1)`` around each
call (0.2 us), the count restored after; any other graph runs as compiled.

The choice is made once, from the shapes Dynamo traced, so it is the same in every process that
compiles the same step: a resumed or replayed run computes with the same threads, and the same
bits. While a small graph runs, other threads of the process that run torch ops see one thread
too (the count is the process's).
"""

from __future__ import annotations

import functools
import operator
import threading
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

# consumers that only pick a part of their input (a micro-batch from a stacked block)
_PICKS = frozenset({operator.getitem})


def is_small_cpu_graph(gm: torch.fx.GraphModule, limit: int = SMALL) -> bool:
    """Whether every tensor ``gm`` computes, and every tensor its operations read (an input
    read only by indexing aside), is on the CPU with at most ``limit`` elements (static sizes:
    a symbolic size counts as large)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        values = [node.meta.get("example_value")]
        if node.target not in _PICKS:
            values += [a.meta.get("example_value") for a in node.all_input_nodes]
        for value in pytree.tree_leaves(values):
            if not isinstance(value, Tensor):
                continue
            numel = value.numel()
            if value.device.type != "cpu" or not isinstance(numel, int) or numel > limit:
                return False
    return True


class _OneThread:
    """Sets the process's thread count to 1 while any small graph runs, and back after the
    last one leaves (a count, under a lock, so two threads calling small graphs at once do not
    restore each other's one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._restore = 1

    def enter(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._restore = torch.get_num_threads()
                if self._restore != 1:
                    torch.set_num_threads(1)
            self._inside += 1

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._restore != 1:
                torch.set_num_threads(self._restore)


_ONE_THREAD = _OneThread()


def _on_one_thread(compiled: Callable) -> Callable:
    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        _ONE_THREAD.enter()
        try:
            return compiled(*args)
        finally:
            _ONE_THREAD.leave()

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
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
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
