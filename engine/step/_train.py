"""The training step (private): :class:`TrainStep`, one micro-batch of training from the pure
cores (gradient accumulation as state, frozen parameters, seeded randomness), and its builder
:func:`train_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from engine import rng
from engine.optim.base import GradientTransformation
from engine.optim.freezing import frozen_reader
from engine.state import TrainState
from engine.step._blocks import STORE_EACH_STEP, block_core, micro_batches, pick, stack_metrics
from engine.step._common import (
    Batch,
    LossFn,
    Metrics,
    _cuda_devices,
    _metrics,
    _set_mode,
    _split,
)
from engine.step._compile import _maybe_compile
from engine.step._cores import (
    Forward,
    GradFn,
    PartlyFrozen,
    UpdateFn,
    grad_core,
    total_norm,
    update_core,
)
from engine.step._model_view import Bind, _view

UNROLL_LIMIT = 2**18
"""The most parameter elements a compiled block unrolls into one graph on the CPU; a larger
model's block runs as single compiled steps, one call each. What a block saves is the call's
overhead, about 100 us a step; what it costs on the CPU grows with the state: each of its steps
writes the parameters and optimizer state into new buffers (only the last into the state
itself), which malloc returns to the system at the end of the call and page-faults back in on
the next. Measured on 2 cores, one process, interleaved (K=8 against K=1 compiled): 110k
parameters 0.62, 400k 1.02, 1.9M 1.11 (about 1,500 page faults a step)."""


class TrainStep:
    """``(state, batch) -> (state, metrics)``: one micro-batch of training (with
    ``steps_per_call`` K > 1, ``(state, batches)``: K optimizer steps, see :meth:`__call__`).

    Built by :func:`train_step` (see there for the arguments) or, with step transforms, by
    :meth:`engine.transforms.Pipeline.train_step`: ``grad_fn`` (default :func:`grad_core`)
    computes the gradients, ``update_fn`` (default :func:`update_core` of ``tx`` and ``clip``)
    applies them, and ``wrap_core`` wraps each of the two pure cores below (compilation).
    ``extra_keys`` names the ``TrainState.extra`` entries the gradient computation reads: each
    step passes them to it as :attr:`Forward.extra` (a transform's numbers kept as state, such
    as DP-SGD's noise multiplier). ``fuse``: a call of ``steps_per_call`` whole windows may run
    as one block core, wrapped as the two others (one graph when compiled), which it does unless
    the parameters are on the CPU and hold more than :data:`UNROLL_LIMIT` elements; otherwise
    as single steps (default: when ``compile`` is set).
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
        steps_per_call: int = 1,
        fuse: bool | None = None,
        static_state: bool | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.steps_per_call = _check_steps_per_call(steps_per_call)
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
        if fuse is None:
            fuse = compile is not False  # eager, a block is its single steps
        self._fuse: bool | None = None if fuse else False  # None: decided at the first block
        self._wrap = wrap
        self._block: Callable | None = None  # the block core, wrapped at the first block
        # CUDA graphs (compile mode "reduce-overhead") replay a graph whose inputs keep their
        # addresses; a donated step updates the state's tensors in place, so they do: marked
        # static, the graph mutates them where they are, instead of being skipped by Inductor
        # for "mutated inputs" (the batch is not marked: it is new every call)
        if static_state is None:
            static_state = isinstance(compile, Mapping) and compile.get("mode") == "reduce-overhead"
        self._static = static_state

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

    _update_core.step_arg = 5  # type: ignore[attr-defined]  # step (after the module)
    _update_core.inductor_options = STORE_EACH_STEP  # type: ignore[attr-defined]  # as a block's

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

    _accumulate_core.inductor_options = STORE_EACH_STEP  # type: ignore[attr-defined]

    def __call__(
        self, state: TrainState, batch: Batch, *, flush: bool = False, stacked: bool = False
    ) -> tuple[TrainState, Metrics]:
        """Train on one micro-batch, or (``steps_per_call`` > 1, or ``stacked``) on several.

        Args:
            state: the current state; consumed unless the step was built with ``donate=False``.
            batch: whatever ``loss_fn`` takes. With ``steps_per_call`` K > 1: a list or tuple of
                such batches, one per micro-batch (K * ``accumulate`` for K optimizer steps), or
                with ``stacked=True`` one batch whose tensors stack them along their first
                dimension.
            flush: step the optimizer after the (last) micro-batch even if the accumulation
                window is not full (Lightning does this on the last batch of an epoch).
            stacked: ``batch`` stacks the micro-batches along its tensors' first dimension.

        Returns:
            The new state and the metrics of this micro-batch (``"loss"`` plus the loss
            function's own), as tensors. Of several: each metric stacked along a new first
            dimension (per micro-batch; per optimizer step for what only a step reports, such
            as ``grad_norm``).

        A call of exactly K whole windows, from a state between windows, runs as one block:
        with ``compile``, one graph for the K optimizer steps, its random numbers seeded once
        for the block (equal to K single compiled steps within compile's tolerance where the
        loss is not random). Any other call runs single steps, bitwise a loop of them.
        """
        if self.steps_per_call == 1 and not stacked:  # the hot path: no call on the way
            if self.donate:
                state._consume("train_step")
            else:
                state = state.copy()
            return self._one(state, batch, flush)
        return self.steps(state, batch, flush=flush, stacked=stacked)

    def _own(self, state: TrainState) -> TrainState:
        if self.donate:
            state._consume("train_step")
            return state
        return state.copy()

    def one(
        self, state: TrainState, batch: Batch, *, flush: bool = False
    ) -> tuple[TrainState, Metrics]:
        """One micro-batch, whatever ``steps_per_call`` is (the Trainer's calls between
        blocks)."""
        return self._one(self._own(state), batch, flush)

    def steps(
        self, state: TrainState, batches: Any, *, flush: bool = False, stacked: bool = False
    ) -> tuple[TrainState, Metrics]:
        """Several micro-batches, their metrics stacked (see :meth:`__call__`): one block when
        they are ``steps_per_call`` whole windows from a state between windows."""
        batches, n = micro_batches(batches, stacked=stacked)  # refused before it is consumed
        state = self._own(state)
        windows, partial = divmod(n, self.accumulate)
        if (
            self._fuses(state)
            and not partial
            and windows == self.steps_per_call
            and state.micro_step == 0
            and state.grad_accum is None
        ):
            return self._run_block(state, batches, n, windows, stacked)
        records = []
        for i in range(n):
            state, metrics = self._one(
                state, pick(batches, i, stacked=stacked), flush and i == n - 1
            )
            records.append(metrics)
        return state, stack_metrics(records)

    def _fuses(self, state: TrainState) -> bool:
        """Whether a call of whole windows runs as one block (decided at the first, from
        ``fuse`` or from the parameters, see :data:`UNROLL_LIMIT`)."""
        if self._fuse is None:
            params = list(state.params.values())
            on_cpu = all(p.device.type == "cpu" for p in params)
            self._fuse = not (on_cpu and sum(p.numel() for p in params) > UNROLL_LIMIT)
        return self._fuse

    def _frozen_and_extra(self, state: TrainState) -> tuple[Any, Any]:
        frozen = self._frozen(state.opt_state)
        extra = (
            {k: state.extra[k] for k in self._extra_keys if k in state.extra}
            if self._extra_keys
            else None
        )
        return frozen, extra

    def _run_block(
        self, state: TrainState, batches: Any, n: int, windows: int, stacked: bool
    ) -> tuple[TrainState, Metrics]:
        """``windows`` optimizer steps over ``n`` micro-batches in one call of the block core
        (``state`` is the step's own)."""
        if self._block is None:
            self._block = self._wrap(block_core(self))
        _set_mode(state.module, True)
        if self._static:
            _mark_static(state)
        frozen, extra = self._frozen_and_extra(state)
        seed = rng.derive_seed(state.seed, state.step, 0, rank=self._rank)
        with rng.seeded(seed, self._rng_devices(state)):
            opt_state, precision, metrics = self._block(
                state.module,
                state.params,
                state.buffers,
                state.opt_state,
                state.precision,
                state.step,
                batches,
                windows,
                stacked,
                frozen,
                extra,
            )
        new = state.replace(
            opt_state=opt_state,
            precision=precision,
            step=state.step + windows,
            batch_idx=state.batch_idx + n,
            _ownership=type(state._ownership)(),
        )
        return new, metrics

    def _one(self, state: TrainState, batch: Batch, flush: bool) -> tuple[TrainState, Metrics]:
        """One micro-batch (``state`` is the step's own: consumed or copied by the caller)."""
        _set_mode(state.module, True)
        if self._static:
            _mark_static(state)
        micro = state.micro_step
        apply = flush or micro + 1 >= self.accumulate
        frozen, extra = self._frozen_and_extra(state)
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
    steps_per_call: int = 1,
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
        steps_per_call: K optimizer steps per call (Keras's ``steps_per_execution``): the
            step takes a list of K * ``accumulate`` batches (or one stacked batch with
            ``stacked=True``) and returns each metric stacked per micro-batch. With ``compile``
            the K steps are one graph: one Python call and one set of guards for K steps,
            which is what a small model's compiled step spends most of its time on. On the
            CPU a model of more than :data:`UNROLL_LIMIT` parameter elements runs them as K
            single compiled steps instead (there an unrolled graph costs more than the calls
            it saves). Eager, it is bitwise K single steps.

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

        Four optimizer steps per call:

        >>> steps = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx, steps_per_call=4)
        >>> state, metrics = steps(state, [batch] * 4)
        >>> state.step, metrics["loss"].shape
        (5, torch.Size([4]))
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
        steps_per_call=steps_per_call,
    )


def _mark_static(state: TrainState) -> None:
    """Mark the state's tensors as compiled-graph inputs whose address stays across calls
    (``torch._dynamo.mark_static_address``, unguarded: a tensor that moved, say after a
    checkpoint load, makes CUDA graphs record again rather than replay stale addresses)."""
    tree = (state.params, state.buffers, state.opt_state, state.precision, state.grad_accum)
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, Tensor) and getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t)


def _check_steps_per_call(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"steps_per_call must be a positive int, the optimizer steps one call makes "
            f"(got {value!r}); 1 is a step per call"
        )
    return value
