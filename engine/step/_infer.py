"""Steps without gradients (private): :class:`EvalStep` and :class:`PredictStep`, and their
builders :func:`eval_step` and :func:`predict_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import torch

from engine import rng
from engine.state import TrainState
from engine.step._common import (
    Batch,
    Metrics,
    _cuda_devices,
    _detached,
    _metrics,
    _set_mode,
    _split,
)
from engine.step._compile import _maybe_compile
from engine.step._model_view import Bind, _view

Out = TypeVar("Out")


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
