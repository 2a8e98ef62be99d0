"""Compiled cores (private): ``_Compiled`` compiles a pure core once per module, with the module
closed over and its slots bound around each call; :func:`compile_core` and
:func:`gathers_in_graph` are its public handles.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from engine.step._isa_probe import probe_cpu_in_background, wants_probe
from engine.step._model_view import _binder, _Prebound
from engine.step._threads import compile_small_on_one_thread
from engine.step._unfuse_bias import unfuse_bias_pass

_COMPILED_IDS = itertools.count()

# modules whose compiled steps gather their parameters inside the graph (a sharding strategy)
_GATHERING: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_GATHERING_PURE: list[bool] = []


def gathers_in_graph(module: nn.Module | None) -> None:
    """Mark ``module``'s compiled steps (``None``: pure-function models') as holding
    collectives Inductor's C++ wrapper does not take: they are compiled with the Python one."""
    if module is None:
        _GATHERING_PURE[:] = [True]
    else:
        _GATHERING.add(module)


class _Compiled:
    """Compiles ``core(module, *args)`` once per module, with the module closed over.

    Passing the module as an argument would make Dynamo guard its whole structure on every call
    (about 40 us a step on the tiny benchmark MLP); a closure is checked by identity.
    """

    def __init__(self, core: Callable, options: Mapping[str, Any]) -> None:
        self.core = core
        inductor = options.get("backend", "inductor") == "inductor"
        # engine's Inductor options, where the user chose neither Inductor's nor another backend
        self.tuned = inductor and "mode" not in options and "options" not in options
        # the core's own Inductor options: the tuned ones carry them (_build), else the user's
        theirs = inductor and not self.tuned
        self.options = {
            "fullgraph": True,
            **(_with_core_options(options, core) if theirs else options),
        }
        self.by_module: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()
        self.pure: Callable | None = None
        # the argument (after the module) that counts steps: traced as a symbolic int from the
        # first call (_STEP_SOURCE), not specialised to its first value and then recompiled
        # (~1.8 s of a cold compile of the tiny benchmark's 8-step block)
        self.step_arg: int | None = getattr(core, "step_arg", None)
        if self.step_arg is not None:
            _count_steps_symbolically()
        # Dynamo traces torch.autograd.grad only with this flag, and reads it only while
        # tracing. It is set for the process rather than scoped to each call: changing Dynamo's
        # config between calls costs about 100 us a step (the cache lookup re-checks it).
        torch._dynamo.config.trace_autograd_ops = True

    def _build(self, module: nn.Module | None, params: Mapping[str, Tensor]) -> Callable:
        core = self.core
        # The module's slots are bound to the state's tensors around each call (see __call__),
        # so the traced code calls the module directly: tracing functional_call instead adds
        # ~350 guards and costs ~40 us a step on the tiny benchmark MLP.
        target = None if module is None else _Prebound(module)

        at = self.step_arg

        def plain(*args: Any) -> Any:
            return core(target, *args)

        def counted(*args: Any, engine_step_counter: int) -> Any:
            return core(target, *args[:at], engine_step_counter, *args[at:])

        bound: Callable[..., Any] = plain if at is None else counted

        # Dynamo keeps its compiled graphs, and counts recompilations against a limit of 8, per
        # code object: with one code object for every step built, the ninth compiled step of a
        # process would fail. Each step gets a code object of its own.
        code = bound.__code__.replace(co_name=f"compiled_step_{next(_COMPILED_IDS)}")
        bound = types.FunctionType(code, bound.__globals__, code.co_name, None, bound.__closure__)
        options = dict(self.options)
        on_cpu = all(t.device.type == "cpu" for t in params.values())
        if on_cpu and wants_probe(options):
            probe_cpu_in_background()  # beside the trace, not after it (see _isa_probe)
        if self.tuned:
            # Per-call overhead dominates small steps. Inductor re-checks every input's size and
            # stride before each call, which Dynamo's guards already did (~30 us a step on the
            # tiny benchmark MLP); on CPU its C++ wrapper saves another ~10 us and compiles no
            # slower than the Python one.
            # A sharded model's graph holds all-gathers, whose arguments the C++ wrapper does
            # not take (see gathers_in_graph).
            gathers = module in _GATHERING if module is not None else bool(_GATHERING_PURE)
            wrapper = on_cpu and not gathers
            tuned: dict[str, Any] = {
                "size_asserts": False,
                "cpp_wrapper": wrapper,
                **getattr(core, "inductor_options", {}),
            }
            if wrapper:
                # the wrapper (glue: buffer handling, library calls) built at -O1, its kernels
                # at -O3 in a file of their own: a cold 8-step block compiles in 23-25 s
                # against 30-32 s with both in one -O3 file, and runs within 1-3%
                tuned["cpp_wrapper_build_separate"] = True
            # F.linear's addmm as mm plus an add Inductor fuses (see _unfuse_bias), unless the
            # user set a post-grad pass of their own (read with a default: a config that
            # unittest.mock or pytest's monkeypatch deleted on undo reads as missing)
            theirs = getattr(torch._inductor.config, "post_grad_custom_post_pass", None)
            if on_cpu and theirs is None:
                tuned["post_grad_custom_post_pass"] = unfuse_bias_pass()
            options["options"] = tuned
        return compile_small_on_one_thread(bound, options)

    def __call__(
        self,
        module: nn.Module | None,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        *args: Any,
    ) -> Any:
        kwargs: dict[str, Any] = {}
        at = self.step_arg
        if at is not None:  # passed by name: Dynamo marks it dynamic by its source's name
            every = (params, buffers, *args)
            kwargs["engine_step_counter"] = every[at]
            params, buffers, args = every[0], every[1], every[2:at] + every[at + 1 :]
        if module is None:
            if self.pure is None:
                self.pure = self._build(None, params)
            return self.pure(params, buffers, *args, **kwargs)
        fn = self.by_module.get(module)
        if fn is None:
            fn = self.by_module[module] = self._build(module, params)
        tensors = {**params, **buffers} if buffers else params
        return _binder(module).call(fn, tensors, (params, buffers, *args), kwargs)


def _with_core_options(options: Mapping[str, Any], core: Callable) -> dict[str, Any]:
    """The user's Inductor ``options`` (a ``mode`` or ``options``) with the ones ``core`` asks
    for (its ``inductor_options``) under theirs: merged into their ``options``, or a ``mode``
    spelled as its options (torch takes one of the two)."""
    asked: Mapping[str, Any] = getattr(core, "inductor_options", {})
    if not asked:
        return dict(options)
    out = dict(options)
    mode = out.pop("mode", None)
    theirs = dict(out.get("options") or {})
    if mode is not None:
        theirs = {**torch._inductor.list_mode_options(mode), **theirs}
    out["options"] = {**asked, **theirs}
    return out


_STEP_SOURCE = r"L\['engine_step_counter'\]$"  # a regex: Dynamo matches sources with re.match


def _count_steps_symbolically() -> None:
    """Add the step counter's source to Dynamo's dynamic sources, once, for the process (a
    name no other code's local has; changing Dynamo's config between calls would cost more
    than the recompile it saves)."""
    config = torch.compiler.config
    sources = [s for s in config.dynamic_sources.split(",") if s]
    if _STEP_SOURCE not in sources:
        config.dynamic_sources = ",".join([*sources, _STEP_SOURCE])


def compile_core(core: Callable, options: Mapping[str, Any] | None = None) -> Callable:
    """``core(module, params, buffers, *args)`` compiled with ``torch.compile`` (``options``),
    the module closed over and its slots bound to the given tensors around each call: how a
    step compiles its pure cores (:class:`engine.transforms.Compile`)."""
    return _Compiled(core, options or {})


def _maybe_compile(fn: Callable, compile: bool | Mapping[str, Any]) -> Callable:
    if compile is False:
        return fn
    return _Compiled(fn, compile if isinstance(compile, Mapping) else {})
