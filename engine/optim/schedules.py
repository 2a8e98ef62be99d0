"""Learning-rate schedules: pure functions ``step -> lr`` matching torch.optim.lr_scheduler.

``step`` is the number of optimizer steps already taken, so ``schedule(n)`` is the learning rate
used by the ``n``-th call (0-based) -- what ``optimizer.param_groups[0]["lr"]`` holds before the
``n``-th ``optimizer.step()`` when the torch scheduler is stepped after every step.

The step may be a symbolic int under ``torch.compile``: the functions use ``torch.sym_min`` /
``torch.sym_max`` and 0/1 integer indicators instead of Python branches on the step, so a traced
schedule does not specialise on (and recompile for) each step value. (``torch.sym_ite`` would be
the natural tool, but Inductor cannot lower it in torch 2.13.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

Schedule = Callable[[int], float]

_min, _max = torch.sym_min, torch.sym_max


def _at_most(step: int, k: int) -> int:
    """1 if ``step <= k`` else 0, for ints, without a branch on ``step``."""
    return _max(_min(k - step + 1, 1), 0)


def _select(flag: int, a: float, b: float) -> float:
    """``a`` if ``flag`` (0 or 1) else ``b``, exactly: ``a * 1 + b * 0`` is ``a`` bit for bit."""
    return flag * a + (1 - flag) * b


def _nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"'{name}' must be a non-negative float (got {value!r})")
    return float(value)


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"'{name}' must be a positive float (got {value!r})")
    return float(value)


def _count(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"'{name}' must be {what} (got {value!r})")
    return value


class AutoLength:
    """A schedule whose length is the run's: what ``total_steps="auto"`` (``decay_steps="auto"``
    for :func:`cosine_decay`) returns.

    The Trainer resolves it when a fit starts, to ``trainer.estimated_stepping_batches`` (the
    optimizer steps the run will take: ``ceil(batches / accumulate_grad_batches) *
    max_epochs``, capped by ``max_steps``, as Lightning computes it), in an optimizer built by
    :mod:`engine.optim` (its recorded arguments are rebuilt with the resolved schedule; see
    :func:`engine.optim.resolve_total_steps`). A resumed fit resolves it again under its own
    flags, so raising ``max_epochs`` lengthens the schedule, as Lightning's
    ``estimated_stepping_batches`` does. Called unresolved (outside a Trainer) it raises.

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.warmup_cosine(1.0, warmup_steps=2, total_steps="auto")
        >>> s
        warmup_cosine(peak=1.0, warmup_steps=2, init=0.0, end=0.0, total_steps='auto')
        >>> [round(s.resolve_total_steps(6)(n), 4) for n in range(7)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0]
    """

    def __init__(self, factory: Callable[..., Schedule], key: str, **arguments: float) -> None:
        self.factory, self.key, self.arguments = factory, key, arguments
        factory(**arguments, **{key: 2**40})  # the other arguments are checked now

    def resolve_total_steps(self, total_steps: int) -> Schedule:
        """The schedule for a run of ``total_steps`` optimizer steps."""
        try:
            return self.factory(**self.arguments, **{self.key: total_steps})
        except ValueError as e:
            raise ValueError(
                f"{self!r}: the run takes {total_steps} optimizer steps "
                f"(trainer.estimated_stepping_batches), too few for this schedule: {e}"
            ) from None

    def __call__(self, step: int) -> float:
        raise RuntimeError(
            f"{self!r} is resolved when a Trainer's fit starts, to the run's optimizer steps "
            "(trainer.estimated_stepping_batches), for an optimizer built by engine.optim "
            "(optim.adamw(schedule), optim.chain(...), optim.inject_hyperparams(...)); this one "
            f"was called unresolved: outside a Trainer pass {self.key}=N, or resolve the "
            "optimizer with optim.resolve_total_steps(tx, N)"
        )

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"{self.factory.__name__}({shown}, {self.key}='auto')"


def _auto(value: object) -> bool:
    return isinstance(value, str) and value == "auto"


def constant(value: float) -> Schedule:
    """Always ``value``.

    Example:
        >>> from engine.optim import schedules
        >>> schedules.constant(0.1)(1000)
        0.1
    """
    value = _nonneg("value", value)
    return lambda step: value


def linear(init: float, end: float, steps: int) -> Schedule:
    """Linear from ``init`` at step 0 to ``end`` at ``steps``, then constant.

    torch's ``LinearLR(start_factor=init / base, end_factor=end / base, total_iters=steps)``.

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.linear(0.0, 1.0, 4)
        >>> [s(n) for n in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    init, end = _nonneg("init", init), _nonneg("end", end)
    steps = _count("steps", steps)
    return lambda step: init + (end - init) * _min(step, steps) / steps


def step_lr(init: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``init * gamma ** (step // step_size)``, torch's ``StepLR``.

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.step_lr(1.0, step_size=2, gamma=0.5)
        >>> [s(n) for n in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    init, gamma = _nonneg("init", init), _nonneg("gamma", gamma)
    step_size = _count("step_size", step_size)
    return lambda step: init * gamma ** (step // step_size)


def multistep_lr(init: float, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    """``init`` times ``gamma`` once for every milestone reached, torch's ``MultiStepLR``.

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.multistep_lr(1.0, [2, 3], gamma=0.5)
        >>> [s(n) for n in range(5)]
        [1.0, 1.0, 0.5, 0.25, 0.25]
    """
    init, gamma = _nonneg("init", init), _nonneg("gamma", gamma)
    milestones = sorted(_count("milestones[i]", m, 0) for m in milestones)

    def schedule(step: int) -> float:
        return init * gamma ** sum(1 - _at_most(step, m - 1) for m in milestones)

    return schedule


def exponential(init: float, gamma: float) -> Schedule:
    """``init * gamma ** step``, torch's ``ExponentialLR``.

    Example:
        >>> from engine.optim import schedules
        >>> schedules.exponential(1.0, 0.5)(3)
        0.125
    """
    init, gamma = _nonneg("init", init), _nonneg("gamma", gamma)
    return lambda step: init * gamma**step


def cosine_decay(init: float, decay_steps: int | str, eta_min: float = 0.0) -> Schedule:
    """Half a cosine from ``init`` at step 0 to ``eta_min`` at ``decay_steps``, then constant.

    torch's ``CosineAnnealingLR(T_max=decay_steps, eta_min=eta_min)`` up to ``decay_steps``
    (torch's keeps going round the cosine after that; this one stays at ``eta_min``).

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.cosine_decay(1.0, 4)
        >>> [round(s(n), 4) for n in range(6)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    if _auto(decay_steps):  # the run's length, resolved by the Trainer (AutoLength)
        return AutoLength(cosine_decay, "decay_steps", init=init, eta_min=eta_min)
    init, eta_min = _nonneg("init", init), _nonneg("eta_min", eta_min)
    decay_steps = _count("decay_steps", decay_steps)  # type: ignore[arg-type]

    def schedule(step: int) -> float:
        t = _min(step, decay_steps)
        return eta_min + (init - eta_min) * (1 + math.cos(math.pi * t / decay_steps)) / 2

    return schedule


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int | str, init: float = 0.0, end: float = 0.0
) -> Schedule:
    """Linear warm-up from ``init`` to ``peak`` over ``warmup_steps``, then cosine to ``end`` at
    ``total_steps`` (constant after).

    torch's ``SequentialLR([LinearLR(init / peak, 1.0, warmup_steps),
    CosineAnnealingLR(total_steps - warmup_steps, end)], milestones=[warmup_steps])``.

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.warmup_cosine(1.0, warmup_steps=2, total_steps=6)
        >>> [round(s(n), 4) for n in range(7)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0]
    """
    if _auto(total_steps):  # the run's length, resolved by the Trainer (AutoLength)
        return AutoLength(
            warmup_cosine, "total_steps", peak=peak, warmup_steps=warmup_steps, init=init, end=end
        )
    peak, init, end = _nonneg("peak", peak), _nonneg("init", init), _nonneg("end", end)
    warmup_steps = _count("warmup_steps", warmup_steps, 0)
    total_steps = _count("total_steps", total_steps)  # type: ignore[arg-type]
    if total_steps <= warmup_steps:
        raise ValueError(
            f"'total_steps' ({total_steps}) must be greater than 'warmup_steps' ({warmup_steps})"
        )
    decay_steps = total_steps - warmup_steps
    warm_div = max(warmup_steps, 1)  # a constant, so this max is not a branch on the step

    def schedule(step: int) -> float:
        warm = init + (peak - init) * _min(step, warmup_steps) / warm_div
        t = _min(_max(step - warmup_steps, 0), decay_steps)
        decay = end + (peak - end) * (1 + math.cos(math.pi * t / decay_steps)) / 2
        return _select(_at_most(step, warmup_steps - 1), warm, decay)

    return schedule


def one_cycle(
    max_lr: float,
    total_steps: int | str,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle policy, torch's ``OneCycleLR`` (learning rate only; it does not cycle momentum).

    From ``max_lr / div_factor`` up to ``max_lr`` over the first ``pct_start`` of the steps, then
    down to ``max_lr / div_factor / final_div_factor`` at ``total_steps - 1`` (with
    ``three_phase``, back to the initial value first). Constant after ``total_steps - 1``.

    Example:
        >>> from engine.optim import schedules
        >>> s = schedules.one_cycle(1.0, total_steps=10)
        >>> round(s(0), 4), round(s(2), 4), s(9)
        (0.04, 1.0, 4e-06)
    """
    if _auto(total_steps):  # the run's length, resolved by the Trainer (AutoLength)
        return AutoLength(
            one_cycle,
            "total_steps",
            max_lr=max_lr,
            pct_start=pct_start,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            anneal=anneal,  # type: ignore[arg-type]
            three_phase=three_phase,
        )
    max_lr = _nonneg("max_lr", max_lr)
    total_steps = _count("total_steps", total_steps)  # type: ignore[arg-type]
    if (
        isinstance(pct_start, bool)
        or not isinstance(pct_start, (int, float))
        or not (0 <= pct_start <= 1)
    ):
        raise ValueError(f"'pct_start' must be a float in [0, 1] (got {pct_start!r})")
    div_factor = _positive("div_factor", div_factor)
    final_div_factor = _positive("final_div_factor", final_div_factor)
    if anneal not in ("cos", "linear"):
        raise ValueError(f"'anneal' must be 'cos' or 'linear' (got {anneal!r})")

    initial = max_lr / div_factor
    minimum = initial / final_div_factor
    if three_phase:
        phases = [
            (float(pct_start * total_steps) - 1, initial, max_lr),
            (float(2 * pct_start * total_steps) - 2, max_lr, initial),
            (total_steps - 1, initial, minimum),
        ]
    else:
        phases = [
            (float(pct_start * total_steps) - 1, initial, max_lr),
            (total_steps - 1, max_lr, minimum),
        ]
    # (start_step, length, end_step, start_lr, end_lr) per phase, as torch computes them.
    spans, start = [], 0.0
    for end_step, lo, hi in phases:
        spans.append((start, end_step - start, end_step, lo, hi))
        start = end_step

    def anneal_fn(a: float, b: float, pct: float) -> float:
        if anneal == "cos":
            return b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (b - a) * pct + a

    def schedule(step: int) -> float:
        step = _min(step, total_steps - 1)
        lrs = [anneal_fn(a, b, (step - s) / d if d != 0 else 0.0) for s, d, _, a, b in spans]
        lr = lrs[-1]
        for (_, _, end_step, _, _), phase_lr in zip(spans[-2::-1], lrs[-2::-1], strict=True):
            # step <= end_step  <=>  step <= floor(end_step), as step is an int
            lr = _select(_at_most(step, math.floor(end_step)), phase_lr, lr)
        return lr

    return schedule
