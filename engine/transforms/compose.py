"""``compose``: the one place the order of the step transforms is declared.

::

    placement -> precision -> observe -> strategy -> privacy -> clip -> detect_anomaly -> compile

Earlier is closer to the outside world: ``prepare`` and ``move`` run in this order (place the
state and the batch on the device, then cast them there, then shard), and each ``wrap_*`` hook
of an earlier transform wraps those of the later ones. So the precision's loss scaling wraps the
gradient computation; the strategy's all-reduce, inside it and inside Lightning's step hooks,
reduces the scaled gradients right after backward, as DDP's hooks do, so that
``on_after_backward`` and every rank's finite check see the same gradients; the precision's
``wrap_update`` unscales and checks the gradients before the ``gradients`` chain clips them
(``torch.amp.GradScaler``'s order: unscale, clip, step); Lightning's step hooks (``observe``)
see the loss and the gradients inside the precision, as Lightning's do (scaled after backward,
unscaled before the optimizer step, before clipping); anomaly detection wraps the compiled core,
never the reverse. A privacy transform (:class:`engine.privacy.DPSGD`) computes the gradients
itself, from per-example ones, so it is the innermost ``wrap_grad``: what the transforms
outside it do to the gradients (the step hooks, the strategy's reduction, the clip) they do to
its private gradients, and a precision that wraps the forward pass is refused with it (its
per-example losses would run outside the autocast or the loss scale).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from engine.optim.base import GradientTransformation, chain
from engine.state import TrainState
from engine.step import (
    EvalStep,
    GradFn,
    LossFn,
    PredictStep,
    TrainStep,
    UpdateFn,
    grad_core,
    reporting_grad_norm,
    update_core,
)
from engine.step._infer import _call_model
from engine.transforms.base import Strategy, Transform
from engine.transforms.common import (
    Clip,
    Compile,
    DetectAnomaly,
    Float32,
    SingleDevice,
    SingleProcess,
)

__all__ = ["Pipeline", "compose"]


def compose(
    *,
    placement: Transform | None = None,
    precision: Transform | None = None,
    observe: Transform | None = None,
    strategy: Strategy | None = None,
    privacy: Transform | None = None,
    clip: GradientTransformation | Transform | None = None,
    accumulate: int = 1,
    compile: bool | Mapping[str, Any] | Transform = False,
    detect_anomaly: bool | Transform = False,
) -> Pipeline:
    """The step transforms of a run, in the one order (see the module's docstring).

    Args:
        placement: where the state lives and batches go; default :class:`SingleDevice` (the
            CPU).
        precision: the precision policy; default :class:`Float32`.
        observe: callbacks inside the step (an :class:`Observe`): Lightning's
            ``on_before_backward`` / ``on_after_backward`` / ``on_before_optimizer_step``.
        strategy: how the work is spread over processes, a :class:`Strategy`; default
            :class:`SingleProcess` (data parallel, ``engine.parallel.DDP``: an all-reduce in
            ``reduce``, once per optimizer step; fully sharded: ``prepare``).
        privacy: a transform that computes the gradients itself (its ``wrap_grad`` does not
            call the one it wraps): :class:`engine.privacy.DPSGD`, per-example clipping and
            Gaussian noise. One process only, in float32 or a true precision.
        clip: a stateless gradient transformation run before the optimizer (the Trainer's
            ``gradient_clip_val``: ``optim.clip_by_global_norm(v)``), or a :class:`Clip`.
        accumulate: micro-batches per optimizer step (``accumulate_grad_batches``).
        compile: ``True`` or ``torch.compile`` options: compile each pure core.
        detect_anomaly: run the cores under ``torch.autograd.detect_anomaly()``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim, transforms
        >>> tx = optim.adam(1e-2)
        >>> pipeline = transforms.compose(clip=optim.clip_by_global_norm(1.0), accumulate=2)
        >>> [type(t).__name__ for t in pipeline.transforms]
        ['SingleDevice', 'Float32', 'SingleProcess', 'Clip']
        >>> state = pipeline.prepare(eg.TrainState.create(torch.nn.Linear(3, 1), tx))
        >>> step = pipeline.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]), tx)
        >>> for _ in range(4):
        ...     batch = pipeline.move((torch.randn(4, 3), torch.randn(4, 1)))
        ...     state, metrics = step(state, batch)
        >>> state.step
        2
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"compose(accumulate={accumulate!r}): pass an int >= 1")
    stages: list[Transform | None] = [  # THE ORDER
        placement if placement is not None else SingleDevice(),
        precision if precision is not None else Float32(),
        observe,
        strategy if strategy is not None else SingleProcess(),
        privacy,
        clip if isinstance(clip, Transform) or clip is None else Clip(clip),
        detect_anomaly
        if isinstance(detect_anomaly, Transform)
        else _flag(DetectAnomaly, detect_anomaly),
        compile if isinstance(compile, Transform) else _compile(compile),
    ]
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(
            f"compose(strategy={strategy!r}): pass an engine.transforms.Strategy, such as "
            "engine.parallel.DDP()"
        )
    for t in stages:
        if t is not None and not isinstance(t, Transform):
            raise TypeError(f"compose(): {t!r} is not an engine.transforms.Transform")
    if privacy is not None:
        _check_privacy(privacy, stages)
    if stages[-1] is not None and strategy is not None and strategy.not_compilable:
        raise ValueError(f"compose(compile=...) with {strategy!r}: {strategy.not_compilable}")
    return Pipeline(tuple(t for t in stages if t is not None), accumulate)


def _check_privacy(privacy: Transform, stages: list[Transform | None]) -> None:
    """A privacy transform replaces the gradient computation: nothing inside it may wrap the
    gradient computation (it would be skipped), nothing outside it may wrap the forward pass
    (its per-example losses do not run through that forward), and it runs in one process
    (:func:`one_process_only` says why)."""
    if not isinstance(privacy, Transform):
        raise TypeError(
            f"compose(privacy={privacy!r}): pass an engine.transforms.Transform such as "
            "engine.privacy.DPSGD(...)"
        )
    at = stages.index(privacy)
    inner = [t for t in stages[at + 1 :] if t is not None and t.overrides("wrap_grad")]
    if inner:
        raise ValueError(
            f"compose(privacy={privacy!r}): {inner[0]!r} wraps the gradient computation "
            "inside it, which the privacy transform replaces; pass that transform elsewhere"
        )
    precision = stages[1]
    if precision is not None and precision.overrides("wrap_grad"):
        raise ValueError(
            f"compose(privacy={privacy!r}, precision={precision!r}): the precision wraps the "
            "forward pass (autocast, loss scaling), which per-example gradients do not run "
            "through; use float32 or a true precision ('64-true', 'bf16-true', '16-true')"
        )
    strategy = stages[3]
    if isinstance(strategy, Strategy) and strategy.world_size > 1:
        raise ValueError(
            f"compose(privacy={privacy!r}, strategy={strategy!r}): "
            + one_process_only(strategy.world_size)
        )


def one_process_only(world: int) -> str:
    """Why DP-SGD refuses a run of ``world`` > 1 processes, and what to do instead."""
    return (
        f"DP-SGD runs in one process and this run has {world}: each rank would add the full "
        "noise N(0, (noise_multiplier * max_grad_norm)^2) to its own clipped sum (a draw of "
        "its own), so the ranks' averaged gradient would carry sqrt(world_size) = "
        f"sqrt({world}) times the noise DP-SGD calibrates for the global batch, and "
        "engine.privacy.epsilon() would account for a mechanism that never ran. Train it on "
        "one process (devices=1, strategy='auto'); for a larger batch per "
        "optimizer step use accumulate_grad_batches (the noise is added once per step, "
        "expected_batch_size is the whole window's) and DPSGD(chunk_size=...) to bound the "
        "memory of the per-example gradients"
    )


def _reducing(update_fn: UpdateFn, reducers: tuple[Callable[[Any], Any], ...]) -> UpdateFn:
    """``update_fn`` after the strategies' ``reduce``: once per optimizer step, on the window's
    gradients, before every ``wrap_update`` (the precision's finite check sees the same
    gradients on every rank, so every rank skips the same steps; the clip sees the global
    gradient, as Lightning's does under DDP)."""

    def update(grads, params, opt_state, precision, step):
        for reduce in reducers:
            grads = reduce(grads)
        return update_fn(grads, params, opt_state, precision, step)

    return update


def _declared(t: Transform) -> frozenset[str]:
    """Which of ``tx`` (the optimizer) and ``param_dtype`` ``t.prepare`` declares."""
    try:
        names = inspect.signature(t.prepare).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(n for n in ("tx", "param_dtype") if n in names)


def _flag(kind: Callable[[], Transform], on: bool) -> Transform | None:
    if not isinstance(on, bool):
        raise TypeError(f"compose(): expected True or False (got {on!r})")
    return kind() if on else None


def _compile(value: bool | Mapping[str, Any]) -> Transform | None:
    if value is False:
        return None
    if value is True:
        return Compile()
    if isinstance(value, Mapping):
        return Compile(value)
    raise TypeError(f"compose(compile={value!r}): pass True, False or torch.compile options")


@attrs.frozen
class Pipeline:
    """Step transforms composed in their order (outermost first); built by :func:`compose`.

    ``prepare`` the state once, ``move`` each batch, and build the steps with
    :meth:`train_step` / :meth:`eval_step` / :meth:`predict_step`: the Trainer does exactly
    this with the pipeline its flags describe, so a custom loop that does the same gets the
    Trainer's results bitwise.
    """

    transforms: tuple[Transform, ...]
    accumulate: int = 1
    _movers: tuple[Callable[[Any], Any], ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        movers = tuple(t.move for t in self.transforms if t.overrides("move"))
        object.__setattr__(self, "_movers", movers)

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        return f"Pipeline({inner}, accumulate={self.accumulate})"

    def prepare(self, state: TrainState, tx: GradientTransformation | None = None) -> TrainState:
        """The state made ready for the steps: each transform's ``prepare``, in order, those
        that take one given the run's optimizer ``tx`` (a sharding strategy shards its state as
        it shards the parameters) and the pipeline's :attr:`param_dtype` (it gathers the
        parameters in it)."""
        given: dict[str, Any] = {"tx": tx, "param_dtype": self.param_dtype}
        for t in self.transforms:
            state = t.prepare(state, **{k: given[k] for k in _declared(t)})
        return state

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype the forward may read the parameters in, as a transform (the precision)
        declares it (:attr:`Transform.param_dtype`); ``None`` when none does."""
        return next((t.param_dtype for t in self.transforms if t.param_dtype is not None), None)

    def bind_fn(self) -> Callable[[Any, dict[str, Tensor]], dict[str, Tensor]] | None:
        """Every ``bind``, outermost last (``None`` when no transform binds)."""
        binders = [t.bind for t in self.transforms if t.overrides("bind")]
        if not binders:
            return None
        if len(binders) == 1:
            return binders[0]

        def bind(module: Any, params: dict[str, Tensor]) -> dict[str, Tensor]:
            for b in reversed(binders):
                params = b(module, params)
            return params

        return bind

    def move(self, batch: Any) -> Any:
        """A batch made ready for a step: each transform's ``move``, in order."""
        for move in self._movers:
            batch = move(batch)
        return batch

    def grad_fn(self) -> GradFn:
        """:func:`engine.step.grad_core` wrapped by every ``wrap_grad``."""
        fn: GradFn = grad_core
        for t in reversed(self.transforms):
            fn = t.wrap_grad(fn)
        return fn

    def update_fn(self, tx: GradientTransformation, *, grad_norm: bool = False) -> UpdateFn:
        """``tx`` after the ``gradients`` chain, wrapped by every ``wrap_update``; with
        ``grad_norm``, reporting the gradients' norm where they reach the chain (unscaled,
        before clipping)."""
        parts = [g for t in self.transforms if (g := t.gradients()) is not None]
        gradients = None if not parts else parts[0] if len(parts) == 1 else chain(*parts)
        fn = update_core(tx, gradients)
        if grad_norm:
            fn = reporting_grad_norm(fn)
        for t in reversed(self.transforms):
            fn = t.wrap_update(fn)
        reducers = tuple(t.reduce for t in self.transforms if t.overrides("reduce"))
        if reducers:
            fn = _reducing(fn, reducers)
        return fn

    def wrap_core(self, core: Callable) -> Callable:
        """A pure core wrapped by every ``wrap_core`` (compiled, under anomaly detection)."""
        for t in reversed(self.transforms):
            core = t.wrap_core(core)
        return core

    @property
    def strategy(self) -> Strategy:
        """The pipeline's strategy (:class:`SingleProcess` unless one was given)."""
        return next(t for t in self.transforms if isinstance(t, Strategy))

    def rng_devices(self, state: TrainState) -> tuple[int | str, ...]:
        """The CUDA devices whose generators a step seeds besides the CPU's."""
        for t in self.transforms:
            devices = getattr(t, "rng_devices", None)
            if devices is not None:
                return tuple(devices(state))
        return ()

    def train_step(
        self,
        loss_fn: LossFn,
        tx: GradientTransformation,
        *,
        donate: bool = True,
        grad_norm: bool = False,
        steps_per_call: int = 1,
    ) -> TrainStep:
        """The training step of ``loss_fn`` and ``tx`` under these transforms (see
        :func:`engine.train_step` for ``donate``, ``grad_norm`` and ``steps_per_call``)."""
        return TrainStep(
            loss_fn,
            tx,
            accumulate=self.accumulate,
            donate=donate,
            grad_fn=self.grad_fn(),
            update_fn=self.update_fn(tx, grad_norm=grad_norm),
            wrap_core=self.wrap_core,
            rng_devices=self.rng_devices,
            rank=self.strategy.global_rank,
            bind=self.bind_fn(),
            extra_keys=tuple(dict.fromkeys(k for t in self.transforms for k in t.reads_extra)),
            steps_per_call=steps_per_call,
            fuse=any(isinstance(t, Compile) for t in self.transforms),
            static_state=any(
                isinstance(t, Compile) and t.options.get("mode") == "reduce-overhead"
                for t in self.transforms
            ),
        )

    def eval_step(self, fn: Callable[[Any, Any], Any], *, inference_mode: bool = True) -> EvalStep:
        """The evaluation step of ``fn`` under these transforms (:func:`engine.eval_step`)."""
        return EvalStep(
            self._eval_fn(fn),
            inference_mode=inference_mode,
            wrap_core=self.wrap_core,
            rng_devices=self.rng_devices,
            rank=self.strategy.global_rank,
            bind=self.bind_fn(),
        )

    def predict_step(
        self, fn: Callable[[Any, Any], Any] | None = None, *, inference_mode: bool = True
    ) -> PredictStep:
        """The prediction step of ``fn`` (default ``model(batch)``) under these transforms."""
        return PredictStep(
            self._eval_fn(fn or _call_model),
            inference_mode=inference_mode,
            wrap_core=self.wrap_core,
            rng_devices=self.rng_devices,
            rank=self.strategy.global_rank,
            bind=self.bind_fn(),
        )

    def _eval_fn(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        for t in reversed(self.transforms):
            fn = t.wrap_eval(fn)
        return fn
