"""DP-SGD as composable pieces: per-example clipping, Gaussian noise, and the transform that
puts them into a train step.

DP-SGD (Abadi et al., 2016) trains on a private estimate of the gradient: each example's whole
gradient is clipped to the L2 norm ``max_grad_norm`` (C), the clipped gradients are summed,
Gaussian noise ``N(0, (noise_multiplier * C)^2)`` is added once per optimizer step, and the sum
is divided by the *expected* batch size (a batch's actual size would leak information when
batches are sampled at random).

The pieces, each usable alone in a custom step:

* :func:`engine.per_example.per_example_grads`: ``{name: tensor[B, ...]}``;
* :func:`per_example_norms`, :func:`clip_and_sum`: each example's norm, the clipped sum;
* :func:`gaussian_noise`: noise shaped like the gradients, drawn from the step's generator.

:class:`DPSGD` is the step transform that does all of it inside the engine's train step, in a
custom loop (``transforms.compose(privacy=DPSGD(...))``) or under the Trainer
(``Trainer(plugins=[DPSGD(...)])``). Its numbers are state: :meth:`DPSGD.prepare` writes them
into ``state.extra["dpsgd"]``, each step reads them there, a checkpoint carries them, and a
listener's :class:`~engine.events.Transition` changes them with :func:`set_hyperparams` (which
records the change for the accountant). The noise is drawn inside the step's seeded generator,
``(seed, step, micro_step)``, so a resumed run and a replay add the same noise, bitwise.

:func:`epsilon` gives the privacy spent, for a ``delta``, through Opacus's RDP accountant
(``pip install opacus``; an optional dependency).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from engine.per_example import check_per_example_module, chunks, vmapped_grads
from engine.state import TrainState
from engine.step import Forward, GradFn, PartlyFrozen
from engine.transforms.base import Transform

__all__ = [
    "DPSGD",
    "KEY",
    "clip_and_sum",
    "epsilon",
    "gaussian_noise",
    "hyperparams",
    "per_example_norms",
    "set_hyperparams",
]

#: where a state keeps DP-SGD's numbers: ``state.extra[KEY]``
KEY = "dpsgd"
_NUMBERS = ("max_grad_norm", "noise_multiplier", "sample_rate", "expected_batch_size")


def per_example_norms(grads: Mapping[str, Tensor]) -> Tensor:
    """Each example's whole-gradient L2 norm: over every parameter's ``tensor[B, ...]``.

    Example:
        >>> import torch
        >>> per_example_norms({"w": torch.tensor([[3.0], [0.0]]), "b": torch.tensor([4.0, 1.0])})
        tensor([5., 1.])
    """
    if not grads:
        raise ValueError("per_example_norms: no gradients given")
    per_param = [g.reshape(g.shape[0], -1).norm(2, dim=-1) for g in grads.values()]
    return torch.stack(per_param, dim=1).norm(2, dim=1)


def clip_and_sum(grads: Mapping[str, Tensor], max_grad_norm: float) -> dict[str, Tensor]:
    """Each example's gradient scaled to norm at most ``max_grad_norm``, summed over examples.

    An example of norm ``n`` is multiplied by ``min(1, max_grad_norm / (n + 1e-6))``: the
    factor ``torch.nn.utils.clip_grad_norm_`` and Opacus use.

    Args:
        grads: per-example gradients, ``{name: tensor[B, *shape]}``.
        max_grad_norm: the clipping norm C, a positive number.

    Returns:
        ``{name: tensor[*shape]}``: the sum of the clipped gradients.

    Example:
        >>> import torch
        >>> clip_and_sum({"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}, 1.0)["w"]
        tensor([0.9000, 1.2000])
    """
    _check_positive("clip_and_sum(max_grad_norm=...)", max_grad_norm)
    norms = per_example_norms(grads)
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("i,i...", factor.to(g.dtype), g) for k, g in grads.items()}


def gaussian_noise(like: Mapping[str, Tensor], std: float) -> dict[str, Tensor]:
    """Gaussian noise ``N(0, std^2)`` shaped like each tensor of ``like`` (same dtype and
    device), drawn from the default generator: inside a step, the one seeded from
    ``(seed, step, micro_step)``.

    Example:
        >>> import torch
        >>> noise = gaussian_noise({"w": torch.zeros(10_000)}, 2.0)
        >>> 1.9 < noise["w"].std().item() < 2.1
        True
    """
    if not (isinstance(std, numbers.Real) and math.isfinite(std) and std >= 0):
        raise ValueError(f"gaussian_noise: std must be a finite number >= 0 (got {std!r})")
    return {
        k: torch.normal(0.0, float(std), t.shape, dtype=t.dtype, device=t.device)
        for k, t in like.items()
    }


def _check_positive(what: str, value: Any, *, zero: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{what}: must be a finite number {bound} (got {value!r})")


def _check(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        what = f"DPSGD {name}={value!r}"
        if name == "max_grad_norm":
            _check_positive(f"{what}: the clipping norm", value)
        elif name == "noise_multiplier":
            _check_positive(f"{what}: the noise's std over the clipping norm", value, zero=True)
        elif name == "sample_rate":
            _check_positive(f"{what}: the chance an example is in a batch", value)
            if value > 1:
                raise ValueError(
                    f"{what}: the chance an example is in a batch is at most 1 "
                    "(batch size / dataset size)"
                )
        elif name == "expected_batch_size":
            _check_positive(f"{what}: the examples an optimizer step expects", value)
        else:
            raise TypeError(
                f"DPSGD has no hyperparameter {name!r}; its hyperparameters are "
                f"{', '.join(_NUMBERS)}"
            )


class DPSGD(Transform):
    """DP-SGD in a train step: per-example gradients, clipped, summed, noised, averaged.

    The gradient of each micro-batch becomes ``(sum_i clip(g_i, C) + noise) / E``: ``g_i`` is
    example ``i``'s gradient (``torch.func.vmap`` over ``torch.func.grad`` of the step's own
    loss function on that example alone, :mod:`engine.per_example`), ``clip`` scales it to norm
    at most ``C = max_grad_norm``, ``noise ~ N(0, (noise_multiplier * C)^2)`` is added on the
    first micro-batch of each optimizer step only (so an accumulation window of k
    micro-batches, even one that an epoch's end cuts short, gets the noise once), and
    ``E = expected_batch_size`` is the number of examples an optimizer step expects (sample
    rate times dataset size; with accumulation, of the whole window). This is Opacus's
    ``DPOptimizer`` with ``loss_reduction="mean"``. The reported loss (and each metric of the
    loss function) is the mean over the micro-batch's examples.

    The numbers are the initial values of state: :meth:`prepare` writes them into
    ``state.extra["dpsgd"]`` of a state that has none, each step reads them from there, a
    checkpoint carries them (a resumed run goes on with the checkpoint's, whatever this
    transform was built with), and :func:`set_hyperparams` changes them (in a listener's
    :class:`~engine.events.Transition`). :func:`epsilon` reads them to account for the privacy
    spent.

    It is the transform in the ``privacy`` slot of :func:`engine.transforms.compose`, or a
    Trainer plugin; the step's gradient computation is replaced, so it runs in float32 (or a
    true precision) in one process, with a module without batch norm. Samplers: the accountant
    assumes each example joins a batch independently with probability ``sample_rate``
    (Poisson sampling, Opacus's ``DPDataLoader``); shuffled fixed-size batches, the usual
    approximation, are the user's choice.

    Args:
        max_grad_norm: the per-example clipping norm C.
        noise_multiplier: the noise's standard deviation over C (0: clipping only, no privacy).
        sample_rate: the probability that an example is in a batch (batch size / dataset size).
        expected_batch_size: the examples an optimizer step expects (sample rate times
            dataset size).
        chunk_size: examples whose per-example gradients are computed, clipped and summed at
            a time, so that at most ``chunk_size`` copies of the gradients exist at once
            (``None``: the whole micro-batch at once). The sum's order of additions changes
            with it, hence its last bits.

    Raises:
        ValueError: a number out of range, named with its value.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim, transforms
        >>> from engine.privacy import DPSGD
        >>> tx = optim.sgd(0.1)
        >>> dp = DPSGD(max_grad_norm=1.0, noise_multiplier=1.1, sample_rate=0.01,
        ...            expected_batch_size=8)
        >>> pipeline = transforms.compose(privacy=dp)
        >>> state = pipeline.prepare(eg.TrainState.create(torch.nn.Linear(3, 2), tx))
        >>> step = pipeline.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
        >>> state, metrics = step(state, (torch.randn(8, 3), torch.randint(0, 2, (8,))))
        >>> eg.privacy.hyperparams(state)["noise_multiplier"], state.step
        (1.1, 1)
    """

    plugin_kind = "privacy"

    reads_extra = (KEY,)

    def __init__(
        self,
        max_grad_norm: float,
        noise_multiplier: float,
        *,
        sample_rate: float,
        expected_batch_size: float,
        chunk_size: int | None = None,
    ) -> None:
        numbers_ = {
            "max_grad_norm": max_grad_norm,
            "noise_multiplier": noise_multiplier,
            "sample_rate": sample_rate,
            "expected_batch_size": expected_batch_size,
        }
        _check(numbers_)
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"DPSGD chunk_size={chunk_size!r}: pass a positive int or None")
        self.max_grad_norm = float(max_grad_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.chunk_size = chunk_size

    def prepare(self, state: TrainState) -> TrainState:
        """The state with DP-SGD's numbers in ``state.extra["dpsgd"]`` (kept if it has them:
        a restored checkpoint's win); its module checked for batch norm."""
        check_per_example_module(state.module)
        if KEY in state.extra:
            return state
        held = {name: getattr(self, name) for name in _NUMBERS}
        held["history"] = [[self.noise_multiplier, self.sample_rate, state.step]]
        return state.replace(extra={**state.extra, KEY: held})

    def wrap_grad(self, grad_fn: GradFn) -> GradFn:
        """The private gradient computation, in place of ``grad_fn`` (which it does not call:
        it must be the innermost ``wrap_grad``, as ``compose`` makes it)."""
        chunk_size = self.chunk_size

        def private(forward, params, accumulate, precision):
            if not isinstance(forward, Forward):
                raise TypeError(
                    "DPSGD computes per-example gradients from the step's loss function, but "
                    f"the forward pass reached it wrapped by an outer transform ({forward!r:.80}: "
                    "autocast, a loss scale or an on_before_backward hook), which they would "
                    "skip; run DP-SGD in float32 or a true precision, without listeners of "
                    "on_before_backward"
                )
            held = forward.extra.get(KEY)
            if held is None:
                raise ValueError(
                    "DPSGD: the state has no DP-SGD numbers (state.extra['dpsgd']); prepare it "
                    "with the pipeline first: state = pipeline.prepare(state)"
                )
            names = list(forward.params)
            frozen = {
                k: p
                for k, p in zip(names, params, strict=True)
                if isinstance(params, PartlyFrozen) and not p.requires_grad
            }
            trainable = {k: p for k, p in zip(names, params, strict=True) if k not in frozen}
            summed, losses, aux = _clipped_sum(
                forward, trainable, frozen, held["max_grad_norm"], chunk_size
            )
            with torch.no_grad():
                if forward.first and held["noise_multiplier"] > 0:
                    std = held["noise_multiplier"] * held["max_grad_norm"]
                    torch._foreach_add_(
                        list(summed.values()), list(gaussian_noise(summed, std).values())
                    )
                torch._foreach_div_(list(summed.values()), float(held["expected_batch_size"]))
                out = tuple(
                    summed[k] if k in summed else torch.zeros_like(p)
                    for k, p in zip(names, params, strict=True)
                )
            return out, losses.mean(), {k: v.mean() for k, v in aux.items()}

        return private


def _clipped_sum(
    forward: Forward,
    trainable: dict[str, Tensor],
    frozen: dict[str, Tensor],
    max_grad_norm: float,
    chunk_size: int | None,
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
    """The micro-batch's per-example gradients clipped and summed, ``chunk_size`` examples at
    a time (a chunk's per-example gradients are freed once summed), with each example's loss
    and metrics."""
    parts = [forward.batch] if chunk_size is None else chunks(forward.batch, chunk_size)
    summed: dict[str, Tensor] = {}
    losses, metrics = [], []
    for part in parts:
        grads, part_losses, aux = vmapped_grads(forward.at, trainable, part, frozen=frozen)
        with torch.no_grad():
            clipped = clip_and_sum(grads, max_grad_norm)
            if summed:
                torch._foreach_add_(list(summed.values()), list(clipped.values()))
            else:
                summed = clipped
        del grads
        losses.append(part_losses)
        metrics.append(aux)
    return summed, torch.cat(losses), {k: torch.cat([m[k] for m in metrics]) for k in metrics[0]}


def _held(state: TrainState, what: str) -> Mapping[str, Any]:
    held = state.extra.get(KEY) if isinstance(state, TrainState) else None
    if held is None:
        raise ValueError(
            f"{what}: the state has no DP-SGD numbers (state.extra['dpsgd']); a state gets "
            "them from DPSGD.prepare (pipeline.prepare(state), or a fit with the DPSGD plugin)"
        )
    return held


def hyperparams(state: TrainState) -> dict[str, float]:
    """DP-SGD's numbers in ``state``: ``max_grad_norm``, ``noise_multiplier``,
    ``sample_rate``, ``expected_batch_size``.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.privacy import DPSGD, hyperparams
        >>> dp = DPSGD(1.0, 0.5, sample_rate=0.1, expected_batch_size=4)
        >>> state = dp.prepare(eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1)))
        >>> hyperparams(state)["sample_rate"]
        0.1
    """
    held = _held(state, "privacy.hyperparams")
    return {name: held[name] for name in _NUMBERS}


def set_hyperparams(state: TrainState, **values: float) -> TrainState:
    """``state`` with some of DP-SGD's numbers changed (a pure function: use it in a
    listener's :class:`~engine.events.Transition`); a new noise multiplier or sample rate
    starts a new segment of the history :func:`epsilon` accounts for, at ``state.step``.

    Raises:
        TypeError: an unknown name. ValueError: a value out of range, or a state without
            DP-SGD's numbers.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.privacy import DPSGD, hyperparams, set_hyperparams
        >>> dp = DPSGD(1.0, 0.5, sample_rate=0.1, expected_batch_size=4)
        >>> state = dp.prepare(eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1)))
        >>> hyperparams(set_hyperparams(state, noise_multiplier=2.0))["noise_multiplier"]
        2.0
    """
    held = dict(_held(state, "privacy.set_hyperparams"))
    _check(values)
    held.update({k: float(v) for k, v in values.items()})
    history = [list(h) for h in held["history"]]
    now = [held["noise_multiplier"], held["sample_rate"], state.step]
    if history[-1][:2] != now[:2]:
        if history[-1][2] == state.step:
            history[-1] = now  # changed again before any step ran under the previous values
        else:
            history.append(now)
    held["history"] = history
    return state.replace(extra={**state.extra, KEY: held})


def epsilon(state: TrainState, delta: float, *, accountant: str = "rdp") -> float:
    """The privacy spent by the optimizer steps a state has taken under DP-SGD: epsilon of
    (epsilon, ``delta``)-differential privacy, from Opacus's accountant (``"rdp"``, ``"prv"``
    or ``"gdp"``) over the history of noise multipliers and sample rates in the state. Opacus
    is an optional dependency (``pip install opacus``).

    Returns:
        epsilon; ``0.0`` before any step, ``inf`` if a step ran with no noise.

    Raises:
        ImportError: Opacus is not installed. ValueError: ``delta`` outside (0, 1), or a
            state without DP-SGD's numbers.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.privacy import DPSGD, epsilon
        >>> dp = DPSGD(1.0, 1.0, sample_rate=0.01, expected_batch_size=64)
        >>> state = dp.prepare(eg.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1)))
        >>> epsilon(state.replace(step=1000), delta=1e-5) > epsilon(state.replace(step=100),
        ...                                                          delta=1e-5) > 0
        True
    """
    if not (isinstance(delta, numbers.Real) and 0 < delta < 1):
        raise ValueError(f"privacy.epsilon: delta must be in (0, 1) (got {delta!r})")
    history = _held(state, "privacy.epsilon")["history"]
    ends = [h[2] for h in history[1:]] + [state.step]
    segments = [(h[0], h[1], end - h[2]) for h, end in zip(history, ends, strict=True)]
    segments = [s for s in segments if s[2] > 0]
    if not segments:
        return 0.0
    if any(noise == 0 for noise, _, _ in segments):
        return math.inf
    try:
        from opacus.accountants import create_accountant
    except ImportError as e:
        raise ImportError(
            "privacy.epsilon uses Opacus's accountants, an optional dependency: pip install opacus"
        ) from e
    acc = create_accountant(accountant)
    acc.history = [(float(n), float(q), int(s)) for n, q, s in segments]
    return float(acc.get_epsilon(delta))
