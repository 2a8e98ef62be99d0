"""Pure step functions: ``train_step``, ``eval_step`` and ``predict_step`` builders.

Each builder takes the user's pure function and returns a step:

* ``train_step(loss_fn, tx)(state, batch) -> (state, metrics)``
* ``eval_step(fn)(state, batch) -> metrics``
* ``predict_step(fn)(state, batch) -> outputs``

The user's function receives a *stateless view* of the model (``model(x)`` runs the state's module
template through :func:`torch.func.functional_call` with the state's tensors) or, for a
pure-function model, the dict of tensors itself. It returns a loss tensor, or ``(loss, metrics)``.

Inside a train step: forward and ``torch.autograd.grad`` over the parameters (cheaper than
``torch.func.grad`` for whole-model gradients, and still pure at the API), gradient accumulation
as state, then the optimizer writes the new parameters in place into the donated tensors. All
randomness comes from :func:`engine.rng.seeded` with a seed derived from
``(state.seed, state.step, state.micro_step)``. Metrics stay tensors: a step never syncs with the
host.
"""

from __future__ import annotations

import itertools
import numbers
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import attrs
import torch
from torch import Tensor, nn
from torch.func import functional_call

from engine import rng
from engine.metrics import is_metric_object
from engine.optim.base import GradientTransformation, apply_updates
from engine.optim.freezing import frozen_reader
from engine.state import TrainState

__all__ = [
    "CustomStep",
    "EvalStep",
    "Forward",
    "GradFn",
    "ModelView",
    "PredictStep",
    "TrainStep",
    "UpdateFn",
    "compile_core",
    "eval_step",
    "grad_core",
    "predict_step",
    "reporting_grad_norm",
    "total_norm",
    "train_step",
    "update_core",
]

Batch = Any
Metrics = dict[str, Tensor]
LossFn = Callable[[Any, Batch], "Tensor | tuple[Tensor, Mapping[str, Any]]"]
Out = TypeVar("Out")


class _Binder:
    """Binds a module's parameter and buffer slots to given tensors for one call.

    ``torch.func.functional_call`` rediscovers the module tree and its tied weights on every call,
    which costs about 100 us on a small MLP, more than its forward. The slots are fixed for a
    module, so the binder finds them once (tied weights included: every slot that held the same
    tensor is bound to its canonical name) and each call is a handful of dict stores.
    """

    __slots__ = ("slots",)

    def __init__(self, module: nn.Module) -> None:
        canonical: dict[int, str] = {}
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            canonical.setdefault(id(t), name)
        self.slots: list[tuple[dict[str, Any], str, str]] = []
        for _, sub in module.named_modules(remove_duplicate=False):
            for store in (sub._parameters, sub._buffers):
                for attr, t in store.items():
                    if t is not None:
                        self.slots.append((store, attr, canonical[id(t)]))

    def call(self, fn: Callable, tensors: Mapping[str, Tensor], args: tuple, kwargs: dict) -> Any:
        """Call ``fn(*args, **kwargs)`` with ``tensors`` bound into the module's slots."""
        saved = []
        try:
            for store, attr, key in self.slots:
                t = tensors.get(key)
                if t is not None:
                    saved.append((store, attr, store[attr]))
                    store[attr] = t
            return fn(*args, **kwargs)
        finally:
            for store, attr, old in saved:
                store[attr] = old


_binders: weakref.WeakKeyDictionary[nn.Module, _Binder] = weakref.WeakKeyDictionary()


def _binder(module: nn.Module) -> _Binder:
    b = _binders.get(module)
    if b is None:
        b = _binders[module] = _Binder(module)
    return b


class ModelView:
    """A callable, stateless view of a module bound to a state's tensors.

    ``view(*args, **kwargs)`` runs the module with the state's tensors in place of its own (the
    semantics of :func:`torch.func.functional_call`); the module's own parameters are never read.
    ``view.params`` / ``view.buffers`` expose the tensors and ``view.module`` the template.
    """

    __slots__ = ("buffers", "module", "params", "prebound")

    def __init__(
        self,
        module: nn.Module,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        prebound: bool = False,
    ) -> None:
        self.module = module
        self.params = params
        self.buffers = buffers
        self.prebound = prebound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.prebound:
            # A compiled step bound these tensors into the module's slots around the whole
            # compiled call, so the graph reads them as ordinary module parameters.
            return self.module(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Dynamo traces functional_call natively; the binder's dict stores would be
            # side effects it has to replay.
            tensors = (self.params, self.buffers) if self.buffers else self.params
            return functional_call(self.module, tensors, args, kwargs, strict=False)  # type: ignore[arg-type]
        tensors = {**self.params, **self.buffers} if self.buffers else self.params
        return _binder(self.module).call(self.module, tensors, args, kwargs)


@attrs.frozen
class _Prebound:
    """Marks a module whose slots hold the state's tensors for the duration of a compiled call."""

    module: nn.Module


#: a transform's view of the parameters, ``bind(module, params) -> params`` (Transform.bind)
Bind = Callable[[Any, Any], Any]


def _view(
    module: nn.Module | _Prebound | None,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    bind: Bind | None = None,
) -> Any:
    if bind is not None:
        # a transform's view of the parameters (a sharding strategy's gathered shards): the
        # forward reads what it returns, and the gradients flow back through it to ``params``
        template = module.module if isinstance(module, _Prebound) else module
        params = bind(template, params)
        module = template  # a compiled core binds the returned tensors, not the slots
    if module is None:
        return {**params, **buffers} if buffers else params
    if isinstance(module, _Prebound):
        return ModelView(module.module, params, buffers, prebound=True)
    return ModelView(module, params, buffers)


def _split(out: Any, where: str) -> tuple[Tensor, Mapping[str, Any]]:
    if isinstance(out, Tensor):
        return out, {}
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], Tensor)
        and isinstance(out[1], Mapping)
    ):
        return out
    raise TypeError(
        f"{where} must return a scalar loss tensor or a (loss, metrics_dict) pair "
        f"(got {type(out).__name__}); e.g. `return F.cross_entropy(logits, y), {{'acc': acc}}`"
    )


def _detached(values: Mapping[str, Any]) -> Metrics:
    """Metrics as tensors cut from the graph (plain numbers become tensors; a metric object,
    such as a torchmetrics ``Metric``, passes as it is). Anything else cannot be logged and is
    named."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, Tensor):
            if v.numel() != 1 or v.is_complex():
                what = "complex" if v.is_complex() else f"of shape {tuple(v.shape)}"
                raise ValueError(
                    f"metric {k!r} is a tensor {what}; a logged metric is one real number: "
                    f"reduce it ({k}.mean()), or return a torchmetrics Metric for a "
                    "dataset-level value"
                )
            out[k] = v.detach()
        elif isinstance(v, numbers.Real):  # bools and numpy scalars too, as Lightning logs them
            out[k] = torch.as_tensor(float(v))
        elif is_metric_object(v):
            if callable(getattr(v, "keys", None)):  # a torchmetrics MetricCollection
                raise TypeError(
                    f"metric {k!r} is a collection of metrics; return each under its own name "
                    f"(`{{**collection}}` in the returned dict), as Lightning's log_dict does"
                )
            out[k] = v  # a metric object (torchmetrics): computed and reset per epoch
        else:
            raise TypeError(
                f"metric {k!r} is a {type(v).__name__} ({v!r:.60}), which cannot be logged: "
                "return numbers, one-element tensors or torchmetrics Metric objects"
            )
    return out


def _metrics(loss: Tensor, aux: Mapping[str, Any]) -> Metrics:
    return {"loss": loss.detach(), **_detached(aux)}


def _set_mode(module: nn.Module | None, training: bool) -> None:
    if module is not None and module.training != training:
        module.train(training)


def _cuda_devices(state: TrainState) -> tuple[int | str, ...]:
    """The accelerator generators a step on this state seeds besides the CPU's."""
    for p in state.params.values():
        return (p.get_device(),) if p.is_cuda else ("mps",) if p.is_mps else ()
    return ()


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
        self.options = {"fullgraph": True, **options}
        self.tuned = "mode" not in options and "options" not in options
        self.by_module: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()
        self.pure: Callable | None = None
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

        def bound(*args: Any) -> Any:
            return core(target, *args)

        # Dynamo keeps its compiled graphs, and counts recompilations against a limit of 8, per
        # code object: with one code object for every step built, the ninth compiled step of a
        # process would fail. Each step gets a code object of its own.
        code = bound.__code__.replace(co_name=f"compiled_step_{next(_COMPILED_IDS)}")
        bound = types.FunctionType(code, bound.__globals__, code.co_name, None, bound.__closure__)
        options = dict(self.options)
        if self.tuned:
            # Per-call overhead dominates small steps. Inductor re-checks every input's size and
            # stride before each call, which Dynamo's guards already did (~30 us a step on the
            # tiny benchmark MLP); on CPU its C++ wrapper saves another ~10 us and compiles no
            # slower than the Python one.
            # A sharded model's graph holds all-gathers, whose arguments the C++ wrapper does
            # not take (see gathers_in_graph).
            on_cpu = all(t.device.type == "cpu" for t in params.values())
            gathers = module in _GATHERING if module is not None else bool(_GATHERING_PURE)
            options["options"] = {"size_asserts": False, "cpp_wrapper": on_cpu and not gathers}
        return torch.compile(bound, **options)

    def __call__(
        self,
        module: nn.Module | None,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        *args: Any,
    ) -> Any:
        if module is None:
            if self.pure is None:
                self.pure = self._build(None, params)
            return self.pure(params, buffers, *args)
        fn = self.by_module.get(module)
        if fn is None:
            fn = self.by_module[module] = self._build(module, params)
        tensors = {**params, **buffers} if buffers else params
        return _binder(module).call(fn, tensors, (params, buffers, *args), {})


def compile_core(core: Callable, options: Mapping[str, Any] | None = None) -> Callable:
    """``core(module, params, buffers, *args)`` compiled with ``torch.compile`` (``options``),
    the module closed over and its slots bound to the given tensors around each call: how a
    step compiles its pure cores (:class:`engine.transforms.Compile`)."""
    return _Compiled(core, options or {})


def _maybe_compile(fn: Callable, compile: bool | Mapping[str, Any]) -> Callable:
    if compile is False:
        return fn
    return _Compiled(fn, compile if isinstance(compile, Mapping) else {})


class Forward:
    """One micro-batch's forward pass, as a gradient computation (:data:`GradFn`) receives it.

    ``forward()`` runs the loss function on the step's parameters and batch and returns
    ``(loss, aux)``: all :func:`grad_core` needs. A gradient computation that needs more than
    the batch's loss, such as per-example gradients (:class:`engine.privacy.DPSGD`), reads what
    the call closes over:

    * ``params``: the step's parameters by name (the order of the list ``grad_fn`` is given);
    * ``batch``: the micro-batch;
    * ``at(params, batch)``: the same loss function, with the state's module and buffers, on
      other parameters (a dict, by name) or another batch: ``(loss, aux)``;
    * ``extra``: the entries of ``TrainState.extra`` that the pipeline's transforms read
      (:attr:`engine.transforms.Transform.reads_extra`), so their numbers are state;
    * ``first``: whether this micro-batch opens an accumulation window (always, without
      accumulation): what happens once per optimizer step happens here.

    A transform that wraps the forward pass (autocast, a loss scale, ``on_before_backward``)
    passes a plain function inward, which has none of these: a gradient computation that needs
    them must be the innermost ``wrap_grad`` and refuse such a function.

    Example:
        >>> import torch
        >>> params = {"w": torch.tensor(2.0)}
        >>> f = Forward(lambda p, b: ((p["w"] * b).sum(), {}), params, torch.ones(3))
        >>> f()[0].item(), f.at({"w": torch.tensor(1.0)}, torch.ones(2))[0].item(), f.first
        (6.0, 2.0, True)
    """

    __slots__ = ("_run", "batch", "extra", "first", "params")

    def __init__(
        self,
        run: Callable[[Mapping[str, Tensor], Any], tuple[Tensor, Mapping[str, Any]]],
        params: Mapping[str, Tensor],
        batch: Any,
        *,
        extra: Mapping[str, Any] | None = None,
        first: bool = True,
    ) -> None:
        self._run = run
        self.params = params
        self.batch = batch
        self.extra = extra if extra is not None else {}
        self.first = first

    def __call__(self) -> tuple[Tensor, Mapping[str, Any]]:
        return self._run(self.params, self.batch)

    def at(self, params: Mapping[str, Tensor], batch: Any) -> tuple[Tensor, Mapping[str, Any]]:
        """``(loss, aux)`` of the loss function on ``params`` and ``batch``."""
        return self._run(params, batch)


GradFn = Callable[
    [Callable[[], "tuple[Tensor, Mapping[str, Any]]"], "list[Tensor]", int, Any],
    "tuple[tuple[Tensor, ...], Tensor, Mapping[str, Any]]",
]
UpdateFn = Callable[
    [dict[str, Tensor], dict[str, Tensor], Any, Any, int], "tuple[Any, Any, Mapping[str, Tensor]]"
]


def grad_core(
    forward: Callable[[], tuple[Tensor, Mapping[str, Any]]],
    params: list[Tensor],
    accumulate: int,
    precision: Any,
) -> tuple[tuple[Tensor, ...], Tensor, Mapping[str, Any]]:
    """The gradient computation every train step starts from: ``forward()`` gives
    ``(loss, aux)``; the gradients are those of ``loss / accumulate``. Step transforms wrap it
    (``wrap_grad``): autocast around ``forward``, or a loss scale (read from ``precision``, the
    state's precision state, which this function does not use) applied to the loss that
    ``forward`` returns and taken off the one this returns."""
    loss, aux = forward()
    if loss.ndim != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss (got shape {tuple(loss.shape)}); "
            "reduce it, e.g. with .mean()"
        )
    objective = loss / accumulate if accumulate > 1 else loss
    if not isinstance(params, PartlyFrozen):
        return torch.autograd.grad(objective, params, materialize_grads=True), loss, aux
    # frozen parameters (optim.freezable) are left out of backward: no weight gradient is
    # computed for them, and they count as zeros (for clipping, as Lightning's have no .grad)
    wanted = [p for p in params if p.requires_grad]
    computed = iter(torch.autograd.grad(objective, wanted, materialize_grads=True))
    grads = tuple(next(computed) if p.requires_grad else torch.zeros_like(p) for p in params)
    return grads, loss, aux


class PartlyFrozen(list):
    """The parameters a step differentiates, some frozen: those are detached (``requires_grad``
    false), and :func:`grad_core` gives them zero gradients without computing any."""

    __slots__ = ()


def total_norm(grads: Mapping[str, Tensor]) -> Tensor:
    """The gradients' total 2-norm: Lightning's ``grad_norm(..., norm_type=2)``'s
    ``"grad_2.0_norm_total"``."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads.values()))))


def reporting_grad_norm(update_fn: UpdateFn) -> UpdateFn:
    """``update_fn`` reporting the total norm of the gradients it receives as ``"grad_norm"``:
    placed innermost in a pipeline's update, it measures them unscaled and before clipping."""

    def update(grads, params, opt_state, precision, step):
        norm = total_norm(grads)
        opt_state, precision, metrics = update_fn(grads, params, opt_state, precision, step)
        return opt_state, precision, {**metrics, "grad_norm": norm}

    return update


def update_core(
    tx: GradientTransformation, gradients: GradientTransformation | None = None
) -> UpdateFn:
    """The optimizer application every train step ends with:
    ``update(grads, params, opt_state, precision, step) -> (opt_state, precision, metrics)``,
    running the stateless ``gradients`` chain (clipping, later an all-reduce) before ``tx`` and
    writing the parameters in place. Step transforms wrap it (``wrap_update``): a loss scale's
    unscale, finite check and skipped step, with its state in ``precision`` and the skip in
    ``metrics`` (which this function leaves empty: the step's metrics are merged with them)."""

    def update(grads, params, opt_state, precision, step):
        if gradients is not None:
            grads, _ = gradients.update(grads, (), params, step)
        if tx.apply is not None:
            return tx.apply(grads, opt_state, params, step), precision, {}
        updates, opt_state = tx.update(grads, opt_state, params, step)
        apply_updates(params, updates)
        return opt_state, precision, {}

    return update


class TrainStep:
    """``(state, batch) -> (state, metrics)``: one micro-batch of training.

    Built by :func:`train_step` (see there for the arguments) or, with step transforms, by
    :meth:`engine.transforms.Pipeline.train_step`: ``grad_fn`` (default :func:`grad_core`)
    computes the gradients, ``update_fn`` (default :func:`update_core` of ``tx`` and ``clip``)
    applies them, and ``wrap_core`` wraps each of the two pure cores below (compilation).
    ``extra_keys`` names the ``TrainState.extra`` entries the gradient computation reads: each
    step passes them to it as :attr:`Forward.extra` (a transform's numbers kept as state, such
    as DP-SGD's noise multiplier).
    """

    def __init__(
        self,
        loss_fn: LossFn,
        tx: GradientTransformation,
        *,
        accumulate: int,
        donate: bool,
        compile: bool | Mapping[str, Any] = False,
        clip: GradientTransformation | None = None,
        grad_norm: bool = False,
        grad_fn: GradFn | None = None,
        update_fn: UpdateFn | None = None,
        wrap_core: Callable[[Callable], Callable] | None = None,
        rng_devices: Callable[[TrainState], tuple[int | str, ...]] | None = None,
        rank: int = 0,
        bind: Bind | None = None,
        extra_keys: tuple[str, ...] = (),
    ) -> None:
        self.loss_fn = loss_fn
        self._bind = bind  # the transforms' view of the parameters (Transform.bind)
        # the TrainState.extra entries the gradient computation reads (Forward.extra)
        self._extra_keys = extra_keys
        self._rank = rank  # the data-parallel rank: its own random numbers (rng.derive_seed)
        self.tx = tx
        self.clip = clip
        self.grad_norm = grad_norm
        self.accumulate = accumulate
        self.donate = donate
        self.compile = compile
        self._grad_fn = grad_fn or grad_core
        self._update_fn = update_fn or update_core(tx, clip)
        self._rng_devices = rng_devices or _cuda_devices
        wrap = wrap_core or (lambda core: _maybe_compile(core, compile))
        self._update = wrap(self._update_core)
        self._accumulate = wrap(self._accumulate_core) if accumulate > 1 else self._accumulate_core

    _reader: Any = ()  # () until the first step looks for a frozen set in the optimizer state

    def _frozen(self, opt_state: Any) -> tuple[str, ...] | None:
        """The parameters an ``optim.freezable`` optimizer freezes now, sorted (``None``
        without one: a constant, so a compiled core is not re-specialised)."""
        if self._reader == ():
            self._reader = frozen_reader(opt_state)
        if self._reader is None:
            return None
        return tuple(sorted(self._reader(opt_state))) or None

    # The two pure cores (tensors in, tensors out, buffers donated). Kept free of Python
    # branches on values so torch.compile captures each as one graph.

    def _grads(self, module, params, buffers, precision, batch, frozen, extra, first):
        def run(tensors, batch):
            view = _view(module, tensors, buffers, self._bind)
            return _split(self.loss_fn(view, batch), "loss_fn")

        forward = Forward(run, params, batch, extra=extra, first=first)
        if frozen:
            params_list: list[Tensor] = PartlyFrozen(
                p.detach() if k in frozen else p for k, p in params.items()
            )
        else:
            params_list = list(params.values())
        grads, loss, aux = self._grad_fn(forward, params_list, self.accumulate, precision)
        return grads, _metrics(loss, aux)

    def _update_core(
        self, module, params, buffers, opt_state, precision, grad_accum, step, batch, frozen, extra
    ):
        first = grad_accum is None
        grads, metrics = self._grads(
            module, params, buffers, precision, batch, frozen, extra, first
        )
        with torch.no_grad():
            if grad_accum is not None:
                torch._foreach_add_(grads, list(grad_accum.values()))
            grads = dict(zip(params, grads, strict=True))
            if self.grad_norm:
                metrics["grad_norm"] = total_norm(grads)
            opt_state, precision, reported = self._update_fn(
                grads, params, opt_state, precision, step
            )
        if reported:
            metrics.update(reported)
        return opt_state, precision, metrics

    def _accumulate_core(
        self, module, params, buffers, precision, grad_accum, batch, frozen, extra
    ):
        first = grad_accum is None
        grads, metrics = self._grads(
            module, params, buffers, precision, batch, frozen, extra, first
        )
        if grad_accum is None:
            return dict(zip(params, grads, strict=True)), metrics
        with torch.no_grad():
            torch._foreach_add_(list(grad_accum.values()), grads)
        return grad_accum, metrics

    def __call__(
        self, state: TrainState, batch: Batch, *, flush: bool = False
    ) -> tuple[TrainState, Metrics]:
        """Train on one micro-batch.

        Args:
            state: the current state; consumed unless the step was built with ``donate=False``.
            batch: whatever ``loss_fn`` takes.
            flush: step the optimizer after this micro-batch even if the accumulation window is
                not full (Lightning does this on the last batch of an epoch).

        Returns:
            The new state and the metrics of this micro-batch (``"loss"`` plus the loss
            function's own), as tensors.
        """
        if self.donate:
            state._consume("train_step")
        else:
            state = state.copy()
        _set_mode(state.module, True)
        micro = state.micro_step
        apply = flush or micro + 1 >= self.accumulate
        frozen = self._frozen(state.opt_state)
        extra = (
            {k: state.extra[k] for k in self._extra_keys if k in state.extra}
            if self._extra_keys
            else None
        )
        seed = rng.derive_seed(state.seed, state.step, micro, rank=self._rank)
        with rng.seeded(seed, self._rng_devices(state)):
            if apply:
                opt_state, precision, metrics = self._update(
                    state.module,
                    state.params,
                    state.buffers,
                    state.opt_state,
                    state.precision,
                    state.grad_accum,
                    state.step,
                    batch,
                    frozen,
                    extra,
                )
            else:
                grad_accum, metrics = self._accumulate(
                    state.module,
                    state.params,
                    state.buffers,
                    state.precision,
                    state.grad_accum,
                    batch,
                    frozen,
                    extra,
                )
        if apply:
            new = state.replace(
                opt_state=opt_state,
                precision=precision,
                grad_accum=None,
                step=state.step + 1,
                micro_step=0,
                batch_idx=state.batch_idx + 1,
                _ownership=type(state._ownership)(),
            )
        else:
            new = state.replace(
                grad_accum=grad_accum,
                micro_step=micro + 1,
                batch_idx=state.batch_idx + 1,
                _ownership=type(state._ownership)(),
            )
        return new, metrics


def train_step(
    loss_fn: LossFn,
    tx: GradientTransformation,
    *,
    accumulate: int = 1,
    donate: bool = True,
    compile: bool | Mapping[str, Any] = False,
    clip: GradientTransformation | None = None,
    grad_norm: bool = False,
) -> TrainStep:
    """Build a pure training step ``(state, batch) -> (state, metrics)``.

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``-> (loss, metrics)``. ``model`` is a
            stateless view of the state's module (call it like the module) or, for a
            pure-function model, the dict of the state's tensors.
        tx: the optimizer (the same one the state was created with).
        accumulate: micro-batches per optimizer step. Gradients of ``loss / accumulate`` are
            summed in ``state.grad_accum``; the optimizer steps on every ``accumulate``-th call,
            so k equal micro-batches equal one k-times-larger batch.
        donate: consume the input state and update its tensors in place (fast, lean). With
            ``False`` the input state is left bitwise unchanged and the step works on a copy.
        compile: ``True`` (or a dict of ``torch.compile`` options) compiles forward, backward
            and optimizer update into one graph.
        clip: a *stateless* transformation applied to the (accumulated) gradients before the
            optimizer, such as ``optim.clip_by_global_norm(1.0)``; the Trainer's
            ``gradient_clip_val`` goes here, so the optimizer state keeps its shape.
        grad_norm: report the total 2-norm of the gradients (before clipping) as the metric
            ``"grad_norm"`` on the calls that step the optimizer.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> model = torch.nn.Linear(4, 2)
        >>> tx = optim.sgd(0.1)
        >>> state = eg.TrainState.create(model, tx, seed=0)
        >>> step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
        >>> batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
        >>> state, metrics = step(state, batch)
        >>> state.step, sorted(metrics)
        (1, ['loss'])
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (got {type(loss_fn).__name__})")
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"tx must be an engine.optim.GradientTransformation (got {type(tx).__name__})"
        )
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int (got {accumulate!r})")
    if clip is not None and (
        not isinstance(clip, GradientTransformation) or clip.init({}) not in ((), None)
    ):
        raise TypeError(
            f"clip must be a stateless GradientTransformation such as "
            f"optim.clip_by_global_norm(1.0) (got {clip!r}); put stateful transforms in tx"
        )
    return TrainStep(
        loss_fn,
        tx,
        accumulate=accumulate,
        donate=donate,
        compile=compile,
        clip=clip,
        grad_norm=grad_norm,
    )


class CustomStep:
    """A user's own pure training step, ``fn(state, batch) -> (state, metrics)``, run the way
    the driver runs a :class:`TrainStep`: randomness seeded from ``(seed, step, micro_step)``,
    the module in training mode, the batch counter advanced, the input state consumed.

    ``fn`` does whatever one batch needs (several optimizers, as a GAN's generator and
    discriminator; Lightning's manual optimization) with engine's pure pieces: a
    :class:`ModelView` of the state, ``torch.autograd.grad``, ``optim.apply_gradients``. It
    returns the new state, with ``step`` advanced by the optimizer steps it took (``micro_step``
    is its own affair), and a dict of tensor metrics (``"loss"`` is the one the journal records).
    ``batch_idx`` is advanced here unless ``fn`` did.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> tx = optim.sgd(0.1)
        >>> def step_fn(state, batch):
        ...     params = state.params
        ...     loss = (eg.ModelView(state.module, params, state.buffers)(batch) ** 2).mean()
        ...     grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        ...     _, opt = optim.apply_gradients(tx, grads, state.opt_state, params, state.step)
        ...     return state.replace(opt_state=opt, step=state.step + 1), {"loss": loss.detach()}
        >>> state = eg.TrainState.create(torch.nn.Linear(2, 1), tx)
        >>> state, metrics = CustomStep(step_fn)(state, torch.ones(4, 2))
        >>> state.step, state.batch_idx
        (1, 1)
    """

    def __init__(
        self,
        fn: Callable[[TrainState, Batch], tuple[TrainState, Mapping[str, Any]]],
        *,
        rng_devices: Callable[[TrainState], tuple[int | str, ...]] | None = None,
        rank: int = 0,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a custom train step must be callable (got {type(fn).__name__})")
        self.fn = fn
        self._rng_devices = rng_devices or _cuda_devices
        self._rank = rank

    def __call__(
        self, state: TrainState, batch: Batch, *, flush: bool = False
    ) -> tuple[TrainState, Metrics]:
        state.check_alive("train_step")
        _set_mode(state.module, True)
        seed = rng.derive_seed(state.seed, state.step, state.micro_step, rank=self._rank)
        with rng.seeded(seed, self._rng_devices(state)):
            out = self.fn(state, batch)
        name = getattr(self.fn, "__name__", repr(self.fn))
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TrainState)):
            raise TypeError(
                f"the train step {name} must return (state, metrics), a TrainState and a dict "
                f"(got {type(out).__name__})"
            )
        new, metrics = out
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"the train step {name} returned metrics of type {type(metrics).__name__}; "
                "return a dict of tensors"
            )
        if new.step < state.step or new.batch_idx not in (state.batch_idx, state.batch_idx + 1):
            raise ValueError(
                f"the train step {name} returned step {new.step}, batch_idx {new.batch_idx} from "
                f"step {state.step}, batch_idx {state.batch_idx}: advance step by the optimizer "
                "steps taken and leave batch_idx to the driver"
            )
        # the new state owns the tensors from here: the input state is consumed (its tensors
        # may hold the new values)
        new = new.replace(batch_idx=state.batch_idx + 1, _ownership=type(state._ownership)())
        state._consume("train_step")
        return new, _detached(metrics)


class _InferenceStep(Generic[Out]):
    stream: int
    training = False

    def __init__(
        self,
        fn: Callable[[Any, Batch], Any],
        *,
        inference_mode: bool,
        compile: bool | Mapping[str, Any] = False,
        wrap_core: Callable[[Callable], Callable] | None = None,
        rng_devices: Callable[[TrainState], tuple[int | str, ...]] | None = None,
        rank: int = 0,
        bind: Bind | None = None,
    ) -> None:
        self.fn = fn
        self._bind = bind
        self.inference_mode = inference_mode
        self._rng_devices = rng_devices or _cuda_devices
        self._rank = rank
        self._core = (wrap_core or (lambda core: _maybe_compile(core, compile)))(self._run)

    def _run(self, module, params, buffers, batch):
        return self._finish(self.fn(_view(module, params, buffers, self._bind), batch))

    def _finish(self, out: Any) -> Any:
        return out

    def __call__(self, state: TrainState, batch: Batch) -> Out:
        state.check_alive(type(self).__name__)
        _set_mode(state.module, False)
        grad_mode = torch.inference_mode() if self.inference_mode else torch.no_grad()
        seed = rng.derive_seed(state.seed, state.step, state.batch_idx, self.stream, self._rank)
        with grad_mode, rng.seeded(seed, self._rng_devices(state)):
            return self._core(state.module, state.params, state.buffers, batch)


class EvalStep(_InferenceStep[Metrics]):
    """``(state, batch) -> metrics`` without gradients. Built by :func:`eval_step`."""

    stream = rng.EVAL

    def _finish(self, out: Any) -> Metrics:
        if isinstance(out, Mapping):
            return _detached(out)
        return _metrics(*_split(out, "the eval function"))


class PredictStep(_InferenceStep[Any]):
    """``(state, batch) -> outputs`` without gradients. Built by :func:`predict_step`."""

    stream = rng.PREDICT


def eval_step(
    fn: Callable[[Any, Batch], Any],
    *,
    inference_mode: bool = True,
    compile: bool | Mapping[str, Any] = False,
) -> EvalStep:
    """Build an evaluation step ``(state, batch) -> metrics``.

    ``fn(model, batch)`` returns a loss tensor, a ``(loss, metrics)`` pair (reported as
    ``{"loss": ..., **metrics}``) or a dict of metrics. The module runs in eval mode under
    ``torch.inference_mode()`` (or ``no_grad`` with ``inference_mode=False``); the state is read,
    never consumed.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> state = eg.TrainState.create(torch.nn.Linear(4, 2), optim.sgd(0.1))
        >>> evaluate = eg.eval_step(lambda m, b: {"mse": F.mse_loss(m(b[0]), b[1])})
        >>> sorted(evaluate(state, (torch.randn(8, 4), torch.randn(8, 2))))
        ['mse']
    """
    return EvalStep(fn, inference_mode=inference_mode, compile=compile)


def predict_step(
    fn: Callable[[Any, Batch], Any] | None = None,
    *,
    inference_mode: bool = True,
    compile: bool | Mapping[str, Any] = False,
) -> PredictStep:
    """Build a prediction step ``(state, batch) -> outputs``; ``fn`` defaults to ``model(batch)``.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> state = eg.TrainState.create(torch.nn.Linear(4, 2), optim.sgd(0.1))
        >>> eg.predict_step()(state, torch.randn(3, 4)).shape
        torch.Size([3, 2])
    """
    return PredictStep(fn or _call_model, inference_mode=inference_mode, compile=compile)


def _call_model(model: Any, batch: Batch) -> Any:
    return model(batch)
