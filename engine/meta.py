"""Meta-learning through the optimizer: MAML's inner loop with engine's own optimizers.

MAML (Finn, Abbeel and Levine, 2017) learns initial parameters from which a few optimizer steps
on a task's *support* set give parameters that do well on the task's *query* set. Its
meta-gradient differentiates the query loss through those inner steps. Here:

* the inner steps are :func:`engine.optim.differentiable_step` of any engine optimizer (plain
  SGD as in the paper, or Adam), on gradients taken with ``create_graph=True``, so autograd
  records them; ``first_order=True`` detaches the inner gradients (first-order MAML);
* the outer step is an ordinary train step: :func:`maml_loss` is a ``loss_fn(model, batch)`` for
  a :class:`~engine.Task`, and the step's ``torch.autograd.grad`` over the state's parameters is
  the meta-gradient, which the Task's own optimizer applies. The Trainer checkpoints, resumes
  and replays such a fit like any other;
* :class:`Sinusoid` is the paper's regression task distribution, generated from a seed (no
  download), one task per index.

The same loss function evaluates (``eval_fn`` defaults to it): under the evaluation step's
``torch.inference_mode()`` the inner steps still take gradients, of their own, first order, and
the reported loss is the query loss after adaptation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from engine import rng
from engine.optim.base import GradientTransformation, differentiable_step
from engine.step import ModelView

__all__ = ["Sinusoid", "adapt", "maml_loss"]

LossFn = Callable[[Any, Any], "Tensor | tuple[Tensor, Mapping[str, Any]]"]


def _loss(out: Any) -> Tensor:
    """The loss of what a loss function returned: a scalar tensor or ``(loss, metrics)``."""
    loss = out[0] if isinstance(out, tuple) and len(out) == 2 else out
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(
            f"the inner loss function must return a scalar loss tensor or (loss, metrics) "
            f"(got {got}); reduce it, e.g. F.mse_loss(model(x), y)"
        )
    return loss


def _check(tx: Any, steps: Any) -> None:
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"the inner optimizer must be an engine.optim GradientTransformation (got "
            f"{type(tx).__name__}), e.g. optim.sgd(0.01)"
        )
    if tx.differentiable is None:
        raise TypeError(
            "the inner optimizer has no differentiable form (see optim.differentiable_step): "
            "use optim.sgd, adam, adamw, rmsprop, adagrad or lion, or a chain of them"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"inner steps must be an int >= 0 (got {steps!r})")


def _split_view(model: Any) -> tuple[dict[str, Tensor], Callable[[dict[str, Tensor]], Any]]:
    """The trainable tensors of a step's model and how to rebuild the model around others."""
    if isinstance(model, ModelView):
        return dict(model.params), lambda p: ModelView(model.module, p, model.buffers)
    if isinstance(model, Mapping):  # a pure-function model: its trainable tensors require grad
        return {k: v for k, v in model.items() if v.requires_grad}, lambda p: {**model, **p}
    raise TypeError(
        f"adapt() needs the model a step passes to its loss function (an engine.ModelView, or "
        f"the dict of a pure-function model's tensors), got {type(model).__name__}"
    )


def _usable(x: Any) -> Any:
    # a tensor made under inference mode cannot be saved for backward: copy it out
    return x.clone() if isinstance(x, Tensor) and x.is_inference() else x


def adapt(
    loss_fn: LossFn,
    model: Any,
    batch: Any,
    tx: GradientTransformation,
    steps: int,
    *,
    first_order: bool = False,
) -> Any:
    """The model after ``steps`` steps of ``tx`` on ``loss_fn(model, batch)`` (MAML's inner loop).

    Each step takes ``torch.autograd.grad`` of the loss at the current parameters and applies
    ``tx`` with :func:`~engine.optim.differentiable_step`, starting from ``tx.init``. Where
    gradients are being recorded (a train step), the inner gradients are taken with
    ``create_graph=True``, so a loss of the adapted model differentiates through the steps to
    ``model``'s parameters, second derivatives included; ``first_order=True`` detaches them
    (first-order MAML: the adapted parameters move with the initial ones as ``p + constant``).
    Under ``torch.no_grad`` / ``inference_mode`` (an evaluation step) the steps take gradients
    of their own and the adapted parameters are detached.

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``, a Task's form.
        model: the model a step passes to its loss function (an :class:`~engine.ModelView`,
            or a pure-function model's dict, whose tensors that require grad are adapted).
        batch: what ``loss_fn`` takes: one task's support set.
        tx: the inner optimizer, with a differentiable form (``optim.sgd(0.01)``).
        steps: inner steps (0 gives ``model`` back).
        first_order: detach the inner gradients.

    Returns:
        A model of the same kind as ``model`` with the adapted parameters (buffers shared).

    Raises:
        TypeError: if ``tx`` has no differentiable form or ``model`` is not a step's model.
        ValueError: if ``steps`` is not an int >= 0.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from engine import meta, optim
        >>> w = torch.tensor([0.0], requires_grad=True)
        >>> loss_fn = lambda m, b: F.mse_loss(m["w"] * b[0], b[1])
        >>> x, y = torch.tensor([1.0]), torch.tensor([2.0])
        >>> fast = meta.adapt(loss_fn, {"w": w}, (x, y), optim.sgd(0.25), steps=1)
        >>> fast["w"]                          # 0 - 0.25 * 2 * (0 - 2)
        tensor([1.], grad_fn=<...>)
        >>> torch.autograd.grad(fast["w"].sum(), w)[0]   # d/dw (w - 0.25 * 2 * (w - 2))
        tensor([0.5000])
    """
    _check(tx, steps)
    params, rebuild = _split_view(model)
    if steps == 0:
        return model
    if not torch.is_grad_enabled():  # an evaluation step (inference_mode turns grad mode off)
        with torch.inference_mode(False), torch.enable_grad():
            params = {k: p.detach().requires_grad_() for k, p in params.items()}
            batch = pytree.tree_map(_usable, batch)
            fast = _steps(loss_fn, rebuild, params, batch, tx, steps, create_graph=False)
        return rebuild({k: p.detach() for k, p in fast.items()})
    create_graph = not first_order
    return rebuild(_steps(loss_fn, rebuild, params, batch, tx, steps, create_graph=create_graph))


def _steps(
    loss_fn: LossFn,
    rebuild: Callable[[dict[str, Tensor]], Any],
    params: dict[str, Tensor],
    batch: Any,
    tx: GradientTransformation,
    steps: int,
    *,
    create_graph: bool,
) -> dict[str, Tensor]:
    opt_state = tx.init(params)
    for k in range(steps):
        loss = _loss(loss_fn(rebuild(params), batch))
        grads = torch.autograd.grad(
            loss, list(params.values()), create_graph=create_graph, materialize_grads=True
        )
        named = dict(zip(params, grads, strict=True))
        params, opt_state = differentiable_step(tx, named, opt_state, params, k)
    return params


def _tasks(batch: Any, where: str) -> int:
    """The number of tasks in a stacked support or query set: the leading size of its tensors."""
    sizes = {x.shape[0] for x in pytree.tree_leaves(batch) if isinstance(x, Tensor) and x.ndim}
    if len(sizes) != 1:
        raise ValueError(
            f"the {where} set must hold tensors stacked over tasks, all with the same leading "
            f"size (got leading sizes {sorted(sizes)}); a DataLoader over a task dataset such "
            "as meta.Sinusoid stacks them"
        )
    return sizes.pop()


def maml_loss(
    loss_fn: LossFn,
    inner_tx: GradientTransformation,
    inner_steps: int,
    *,
    first_order: bool = False,
) -> Callable[[Any, Any], tuple[Tensor, dict[str, Tensor]]]:
    """MAML's objective as a :class:`~engine.Task` loss function.

    The returned ``meta_loss(model, batch)`` takes a batch of tasks ``(support, query)``, each a
    batch of ``loss_fn`` (any pytree of tensors) stacked over tasks on a leading dimension, as a
    ``DataLoader`` over a task dataset such as :class:`Sinusoid` gives it. For each task it
    adapts ``model`` on the support set (:func:`adapt`: ``inner_steps`` steps of ``inner_tx``)
    and evaluates ``loss_fn`` on the query set with the adapted parameters; it returns the mean
    query loss over the tasks, and as the metric ``"support_loss"`` the mean support loss before
    adaptation. A train step's ``torch.autograd.grad`` of it over the state's parameters is
    MAML's meta-gradient (second order; first order with ``first_order=True``), which the
    Task's optimizer applies: the outer loop is an ordinary engine step.

    Args:
        loss_fn: the per-task loss, ``loss_fn(model, batch) -> loss`` or ``(loss, metrics)``.
        inner_tx: the inner optimizer, with a differentiable form (``optim.sgd(0.01)``).
        inner_steps: inner steps per task (>= 1).
        first_order: first-order MAML (the inner gradients detached).

    Returns:
        ``meta_loss(model, batch) -> (loss, {"support_loss": ...})``.

    Raises:
        TypeError: if ``loss_fn`` is not callable or ``inner_tx`` has no differentiable form.
        ValueError: if ``inner_steps`` is not a positive int.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import meta, optim
        >>> mse = lambda m, b: F.mse_loss(m(b[0]), b[1])
        >>> task = eg.Task(meta.maml_loss(mse, optim.sgd(0.01), inner_steps=1), optim.adam(1e-3))
        >>> loader = torch.utils.data.DataLoader(meta.Sinusoid(8, shots=5, seed=0), batch_size=4)
        >>> nn = torch.nn
        >>> state = task.init(nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)), seed=0)
        >>> state, metrics = task.train_step()(state, next(iter(loader)))
        >>> state.step, sorted(metrics)
        (1, ['loss', 'support_loss'])
    """
    if not callable(loss_fn):
        raise TypeError(f"maml_loss: loss_fn must be callable (got {type(loss_fn).__name__})")
    _check(inner_tx, inner_steps)
    if inner_steps < 1:
        raise ValueError(f"maml_loss: inner_steps must be >= 1 (got {inner_steps})")

    def meta_loss(model: Any, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"a MAML batch is a pair (support, query) of task-stacked batches (got "
                f"{type(batch).__name__}); a DataLoader over meta.Sinusoid gives one"
            )
        support, query = batch
        n = _tasks(support, "support")
        if _tasks(query, "query") != n:
            raise ValueError(
                f"the support set has {n} tasks but the query set "
                f"{_tasks(query, 'query')}; pass the same tasks in both"
            )
        losses, before = [], []
        for t in range(n):
            s = pytree.tree_map(lambda x, t=t: x[t], support)
            q = pytree.tree_map(lambda x, t=t: x[t], query)
            first = _FirstLoss(loss_fn)
            fast = adapt(first, model, s, inner_tx, inner_steps, first_order=first_order)
            losses.append(_loss(loss_fn(fast, q)))
            before.append(cast(Tensor, first.value))
        return torch.stack(losses).mean(), {"support_loss": torch.stack(before).mean()}

    return meta_loss


class _FirstLoss:
    """``loss_fn`` that keeps the first loss it computes (the support loss before adaptation)."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.value: Tensor | None = None

    def __call__(self, model: Any, batch: Any) -> Any:
        out = self.loss_fn(model, batch)
        if self.value is None:
            self.value = _loss(out).detach()
        return out


class Sinusoid(torch.utils.data.Dataset):
    """MAML's sinusoid regression tasks, generated from a seed: task ``i`` is a pure function
    of ``(seed, i)``, so any sampler order (the Trainer's seeded shuffle) resumes bitwise.

    Task ``i`` draws an amplitude in ``[0.1, 5]``, a phase in ``[0, pi]`` and
    ``shots + query_shots`` inputs ``x`` in ``[-5, 5]``, all uniform, and is
    ``((x_support, y_support), (x_query, y_query))`` with ``y = amplitude * sin(x - phase)``,
    each of shape ``(n, 1)``, as in Finn et al. (2017), section 5.1.

    Args:
        num_tasks: the dataset's length.
        shots: support points per task (K).
        query_shots: query points per task (default ``shots``).
        seed: the seed every task derives from.

    Example:
        >>> from engine import meta
        >>> tasks = meta.Sinusoid(100, shots=10, seed=0)
        >>> (xs, ys), (xq, yq) = tasks[3]
        >>> xs.shape, xq.shape, len(tasks)
        (torch.Size([10, 1]), torch.Size([10, 1]), 100)
        >>> bool((tasks[3][0][0] == xs).all())   # the same task every time
        True
    """

    def __init__(
        self, num_tasks: int, shots: int, query_shots: int | None = None, seed: int = 0
    ) -> None:
        for name, value in (("num_tasks", num_tasks), ("shots", shots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Sinusoid: {name} must be a positive int (got {value!r})")
        if query_shots is not None and (
            isinstance(query_shots, bool) or not isinstance(query_shots, int) or query_shots < 1
        ):
            raise ValueError(f"Sinusoid: query_shots must be a positive int (got {query_shots!r})")
        self.num_tasks = num_tasks
        self.shots = shots
        self.query_shots = shots if query_shots is None else query_shots
        self.seed = seed

    def __len__(self) -> int:
        return self.num_tasks

    def task(self, index: int) -> tuple[float, float]:
        """Task ``index``'s ``(amplitude, phase)``."""
        return self._draw(index)[:2]

    def _draw(self, index: int) -> tuple[float, float, Tensor]:
        if not -self.num_tasks <= index < self.num_tasks:
            raise IndexError(f"Sinusoid has {self.num_tasks} tasks (got index {index})")
        g = torch.Generator().manual_seed(rng.derive_seed(self.seed, index % self.num_tasks))
        amplitude, phase = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        x = torch.rand(self.shots + self.query_shots, 1, generator=g) * 10 - 5
        return 0.1 + 4.9 * amplitude, math.pi * phase, x

    def __getitem__(self, index: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        amplitude, phase, x = self._draw(index)
        y = amplitude * torch.sin(x - phase)
        k = self.shots
        return (x[:k], y[:k]), (x[k:], y[k:])
