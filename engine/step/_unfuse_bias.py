"""A bias added by Inductor's own kernels, not by ATen's ``addmm``, on the CPU (private).

``F.linear`` with a bias lowers to ``aten.addmm(bias, x, w.T)``, which Inductor on the CPU
calls out to ATen as is. ATen's CPU ``addmm`` first broadcasts the bias into the output
(``expand`` and ``copy_``, each through the dispatcher), then runs the GEMM onto it: on the
tiny benchmark MLP that copy took more time than the 64x64 product itself (py-spy, 17% of an
8-step block). Inductor already rewrites ``addmm`` into ``mm`` plus a pointwise add on GPUs,
where the add fuses into the kernel that consumes the product; :func:`unfuse_bias_pass` does
the same for float32 and float64 CPU graphs (half precisions keep ``addmm``, which adds the bias
before rounding). Measured in one process, interleaved: the tiny block 0.148 -> 0.136 of the
raw loop, the medium one 0.864 -> 0.845.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["unfuse_bias_pass"]

_DTYPES = (torch.float32, torch.float64)


@functools.cache
def unfuse_bias_pass() -> Any:
    """The post-grad graph pass (an Inductor ``CustomGraphPass``, for
    ``post_grad_custom_post_pass``), built on first use: importing Inductor's pattern matcher
    takes about a second, which ``import engine`` does not pay."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.pattern_matcher import (
        Arg,
        CallFunction,
        KeywordArg,
        Match,
        PatternMatcherPass,
        register_graph_pattern,
    )

    aten = torch.ops.aten
    patterns = PatternMatcherPass(pass_name="engine_unfuse_bias")

    def on_cpu_in_full_precision(match: Match) -> bool:
        bias = match.kwargs["inp"]
        if not isinstance(bias, torch.fx.Node):
            return False
        value = bias.meta.get("val")
        return (
            isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
            and value.dtype in _DTYPES
            and all(
                isinstance(a, torch.fx.Node) and a.meta["val"].dtype == value.dtype
                for a in match.args
            )
        )

    @register_graph_pattern(
        CallFunction(
            aten.addmm,
            KeywordArg("inp"),
            Arg(),
            Arg(),
            beta=KeywordArg("beta"),
            alpha=KeywordArg("alpha"),
        ),
        pass_dict=patterns,
        extra_check=on_cpu_in_full_precision,
    )
    def unfuse(match: Match, mat1: Any, mat2: Any, *, inp: Any, alpha: Any, beta: Any) -> None:
        def product_plus_bias(inp, mat1, mat2, alpha, beta):
            out = mat1 @ mat2
            if alpha != 1:
                out = alpha * out
            if beta != 1:
                inp = beta * inp
            return inp + out

        match.replace_by_example(product_plus_bias, [inp, mat1, mat2, alpha, beta])

    class UnfuseBias(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            patterns.apply(graph)

        def uuid(self) -> str:  # part of Inductor's cache key
            return "engine.unfuse_bias.v1"

    return UnfuseBias()
