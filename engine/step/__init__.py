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

The package, bottom up (each module imports only those above it in this list):

* ``_common``: the type aliases (``Batch``, ``Metrics``, ``LossFn``), a loss function's output
  split, metrics detached, the module's mode, the generators a step seeds;
* ``_model_view``: :class:`ModelView`, the stateless view of a module bound to a state's tensors;
* ``_threads``: small CPU graphs called on one thread (a backend around Inductor);
* ``_unfuse_bias``: the post-grad pass that adds a linear layer's bias in Inductor's kernels;
* ``_compile``: compiled cores, :func:`compile_core` and :func:`gathers_in_graph`;
* ``_cores``: the pure pieces step transforms wrap, :class:`Forward`, :func:`grad_core`,
  :func:`update_core`, :data:`GradFn`, :data:`UpdateFn`, :func:`total_norm`;
* ``_blocks``: K optimizer steps in one call (``steps_per_call``): the block core, its
  batches and its stacked metrics (:func:`split_metrics` splits them per micro-batch);
* ``_train``: :class:`TrainStep` and :func:`train_step`;
* ``_custom``: :class:`CustomStep`, a user's own training step;
* ``_infer``: :class:`EvalStep`, :class:`PredictStep`, :func:`eval_step`, :func:`predict_step`.
"""

from __future__ import annotations

# the names outside __all__ (marked ``X as X``) are what other modules import from engine.step
from engine.step._blocks import split_metrics as split_metrics
from engine.step._common import Batch as Batch
from engine.step._common import LossFn as LossFn
from engine.step._common import Metrics as Metrics
from engine.step._compile import compile_core
from engine.step._compile import gathers_in_graph as gathers_in_graph
from engine.step._cores import (
    Forward,
    GradFn,
    UpdateFn,
    grad_core,
    reporting_grad_norm,
    total_norm,
    update_core,
)
from engine.step._cores import PartlyFrozen as PartlyFrozen
from engine.step._custom import CustomStep
from engine.step._infer import EvalStep, PredictStep, eval_step, predict_step
from engine.step._model_view import Bind as Bind
from engine.step._model_view import ModelView
from engine.step._train import UNROLL_LIMIT, TrainStep, train_step

__all__ = [
    "CustomStep",
    "EvalStep",
    "Forward",
    "GradFn",
    "ModelView",
    "PredictStep",
    "TrainStep",
    "UNROLL_LIMIT",
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
