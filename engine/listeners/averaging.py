"""Weight averaging as pure state transitions: Lightning's ``EMAWeightAveraging`` and
``StochasticWeightAveraging``.

Both change the state only through :class:`~engine.events.Transition` s, which the journal
records and :func:`engine.replay` applies again, and both keep what they average in the state,
which checkpoints carry, so a resumed or replayed run is bitwise the uninterrupted one.

* :class:`EMAWeightAveraging` reads the moving average that
  :func:`engine.optim.averaging.ema_weights` keeps in the optimizer state (updated inside every
  optimizer step, so it costs no event), swaps it into ``params`` for each validation and puts
  it there at the end of training.
* :class:`StochasticWeightAveraging` averages the weights once an epoch into
  ``state.extra["swa"]``, anneals the learning rate held by
  :func:`engine.optim.inject_hyperparams` (torch's ``SWALR``), and at the end of training puts
  the average into ``params`` and recomputes the BatchNorm statistics with one pass over the
  training data (torch's ``update_bn``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from engine import rng
from engine.data import position_loader, restore_loader, seed_batches, seed_shuffle
from engine.events import EventRecord, Listener, Transition
from engine.optim.averaging import find_ema
from engine.optim.inject import get_hyperparams, set_hyperparams
from engine.state import TrainState
from engine.step import ModelView

__all__ = ["EMAWeightAveraging", "StochasticWeightAveraging", "swalr"]

SWA_KEY = "swa"  # state.extra[SWA_KEY]: {"average": {name: tensor}, "n_averaged": tensor, "epoch"}
_UPDATE_BN = 0x5741  # derive_seed stream of the BatchNorm pass's randomness (dropout)


# ----------------------------------------------------------------------------- EMA


def _swap_ema(state: TrainState) -> TrainState:
    """Exchange the values of ``params`` and the optimizer state's moving average (in place:
    the tensors keep their identity, so compiled steps and fused-kernel plans stay valid)."""
    found = find_ema(state.opt_state)
    assert found is not None
    keys = list(state.params)
    params = [state.params[k].detach() for k in keys]
    ema = [found.ema[k] for k in keys]
    with torch.no_grad():
        held = [p.clone() for p in params]
        torch._foreach_copy_(params, ema)
        torch._foreach_copy_(ema, held)
    return state.replace()


def _ema_into_params(state: TrainState) -> TrainState:
    """Copy the moving average into ``params`` (the end of training)."""
    found = find_ema(state.opt_state)
    assert found is not None
    keys = list(state.params)
    with torch.no_grad():
        torch._foreach_copy_([state.params[k].detach() for k in keys], [found.ema[k] for k in keys])
    return state.replace()


class EMAWeightAveraging(Listener):
    """Validate with the exponential moving average of the weights, and end ``fit`` with it.

    Lightning's ``EMAWeightAveraging`` with the average kept in the optimizer state: build the
    optimizer with :func:`engine.optim.averaging.ema_weights` (its ``decay``), which updates the
    average in every optimizer step. This listener returns a transition at
    ``on_validation_start`` that swaps ``params`` with the average (so validation, the sanity
    check included, evaluates the average), one at ``on_validation_end`` that swaps them back,
    and one at ``on_train_end`` that copies the average into ``params`` (what ``fit`` returns).
    Checkpoints hold the training weights in ``params`` and the average in the optimizer state
    (one saved during a validation holds them swapped, and this listener's state says so).

    Unlike Lightning's default (``use_buffers=True``) only parameters are averaged; buffers
    such as BatchNorm statistics are the model's own (torch's ``AveragedModel`` default).

    Raises:
        ValueError: at ``on_fit_start``, if the optimizer state holds no average.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.optim.averaging import ema_weights
        >>> from engine.listeners.averaging import EMAWeightAveraging
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]),
        ...                ema_weights(optim.adamw(1e-2), decay=0.9))
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
        >>> trainer = eg.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False,
        ...                      enable_journal=False, callbacks=[EMAWeightAveraging()])
        >>> state = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data, data)
    """

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    def __init__(self) -> None:
        self._swapped = False  # params hold the average (between the two validation swaps)

    def setup(self, rec: EventRecord) -> None:
        self._swapped = False  # a checkpoint's state, if any, is restored after this

    def on_fit_start(self, rec: EventRecord) -> None:
        if rec.state is not None and find_ema(rec.state.opt_state) is None:
            raise ValueError(
                "EMAWeightAveraging: the optimizer state holds no moving average of the "
                "weights; build the task's optimizer with ema_weights, e.g. "
                "tx=optim.ema_weights(optim.adamw(1e-3), decay=0.999)"
            )

    def on_validation_start(self, rec: EventRecord) -> Transition | None:
        if rec.stage not in ("fit", "sanity_check") or self._swapped:
            return None  # trainer.validate() evaluates the state it is given
        self._swapped = True
        return Transition(_swap_ema, name="ema: average in")

    def on_validation_end(self, rec: EventRecord) -> Transition | None:
        if not self._swapped:
            return None
        self._swapped = False
        return Transition(_swap_ema, name="ema: average out")

    def on_train_end(self, rec: EventRecord) -> Transition:
        return Transition(_ema_into_params, name="ema: final weights")

    def state_dict(self) -> dict[str, Any]:
        return {"swapped": self._swapped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._swapped = bool(state.get("swapped", False))


# ----------------------------------------------------------------------------- SWA


def swalr(
    lr: float,
    swa_lr: float,
    step: int,
    anneal_epochs: int,
    strategy: Literal["cos", "linear"] = "cos",
) -> float:
    """The learning rate torch's ``SWALR`` sets at its ``step``-th ``step()`` from the current
    ``lr`` (it recovers the rate it anneals from out of the current one, so the value is a
    function of these arguments alone; same float operations, bitwise the same value).

    Example:
        >>> from engine.listeners.averaging import swalr
        >>> swalr(0.1, 0.01, 1, 2, "linear"), swalr(0.055, 0.01, 2, 2, "linear")
        (0.055, 0.01)
    """

    def anneal(t: float) -> float:
        return (1 - math.cos(math.pi * t)) / 2 if strategy == "cos" else t

    if anneal_epochs == 0:
        step = max(1, step)
    prev_alpha = anneal(max(0, min(1, (step - 1) / max(1, anneal_epochs))))
    start = swa_lr if prev_alpha == 1 else (lr - prev_alpha * swa_lr) / (1 - prev_alpha)
    alpha = anneal(max(0, min(1, step / max(1, anneal_epochs))))
    return swa_lr * alpha + start * (1 - alpha)


def _mean(average: Tensor, param: Tensor, n_averaged: Tensor) -> Tensor:
    """The running mean: ``average + (param - average) / (n_averaged + 1)``."""
    return average + (param - average) / (n_averaged + 1)


@attrs.frozen
class _Average:
    """The transition of an averaging epoch: fold ``params`` into ``state.extra["swa"]``."""

    avg_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None
    device: torch.device | None
    epoch: int

    def __call__(self, state: TrainState) -> TrainState:
        held = state.extra.get(SWA_KEY)
        with torch.no_grad():
            if held is None:  # the first: a copy
                average = {
                    k: p.detach().to(self.device or p.device, copy=True)
                    for k, p in state.params.items()
                }
                first = next(iter(average.values()), None)
                where = first.device if first is not None else self.device
                n = torch.ones((), dtype=torch.long, device=where)
            else:
                fn = self.avg_fn or _mean
                average = {}
                for k, p in state.params.items():
                    device = self.device or p.device
                    n_here = held["n_averaged"].to(device)
                    before = held["average"][k].to(device)
                    average[k] = fn(before, p.detach().to(device), n_here).to(before.dtype)
                n = held["n_averaged"] + 1
        swa = {"average": average, "n_averaged": n, "epoch": self.epoch}
        return state.replace(extra={**state.extra, SWA_KEY: swa})


@attrs.frozen
class _SetLr:
    """The transition of an annealing epoch's end: the optimizer's ``lr`` becomes ``lr``."""

    lr: float

    def __call__(self, state: TrainState) -> TrainState:
        return state.replace(opt_state=set_hyperparams(state.opt_state, lr=self.lr))


@attrs.frozen
class _Finish:
    """The transition at the end of training: the average into ``params``, and the BatchNorm
    statistics recomputed with it (computed by the listener: ``statistics``) into ``buffers``."""

    statistics: dict[str, Tensor] | None

    def __call__(self, state: TrainState) -> TrainState:
        average = state.extra[SWA_KEY]["average"]
        keys = list(state.params)
        with torch.no_grad():
            for k in keys:
                p = state.params[k]
                p.detach().copy_(average[k].to(device=p.device, dtype=p.dtype))
            for k, v in (self.statistics or {}).items():
                state.buffers[k].copy_(v.to(state.buffers[k].device))
        return state.replace()


def _batch_norms(module: nn.Module | None) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    if module is None:
        return []
    return [
        (f"{name}." if name else "", m)
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


def _like(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``batch`` on ``device``, its floating tensors in ``dtype`` (a true precision's)."""

    def move(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if dtype is not None and x.is_floating_point() and x.dtype != dtype:
            return x.to(device=device, dtype=dtype)
        return x.to(device)

    return pytree.tree_map(move, batch)


def _check_swa_lrs(value: Any) -> float:
    lrs = value if isinstance(value, (list, tuple)) else [value]
    ok = len(lrs) == 1 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in lrs
    )
    if not ok:
        raise ValueError(
            f"StochasticWeightAveraging(swa_lrs={value!r}): pass a positive float (or a list "
            "of one: the optimizer has one injected learning rate), e.g. swa_lrs=0.05"
        )
    return float(lrs[0])


class StochasticWeightAveraging(Listener):
    """Stochastic weight averaging with Lightning's arguments, epochs and learning rates.

    From epoch ``swa_start`` on, at each ``on_train_epoch_start`` (as Lightning) a transition
    folds the current weights into a running average kept in ``state.extra["swa"]``
    (``{"average": {name: tensor}, "n_averaged": tensor, "epoch": int}``); the first copies.
    At each of those epochs' ends, once all its batches ran, a transition sets the optimizer's
    learning rate to what torch's ``SWALR`` gives (annealing from the rate it had to
    ``swa_lrs`` over ``annealing_epochs``). When the last epoch has run, ``on_train_end`` puts
    the average into ``params`` and, if the model has BatchNorm layers, their running
    statistics recomputed with it: one pass over the training loader in train mode, without
    gradients, with a cumulative average (torch's ``update_bn``; Lightning's extra epoch). As in
    Lightning, the average holds the weights at the start of epochs ``swa_start`` to
    ``max_epochs - 1``, and a fit stopped early keeps its own weights.

    The learning rate must be optimizer state: build the optimizer with
    :func:`engine.optim.inject_hyperparams`, e.g.
    ``optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9)``.

    Args:
        swa_lrs: the learning rate to anneal to (a positive float, or a list of one).
        swa_epoch_start: the epoch averaging starts at: an int ``k >= 1`` means epoch
            ``k - 1`` (0-based), a float in ``[0, 1]`` ``int(swa_epoch_start * max_epochs)``
            the same way.
        annealing_epochs: epochs the annealing takes (an int >= 0).
        annealing_strategy: ``"cos"`` or ``"linear"``.
        avg_fn: ``avg_fn(average, param, n_averaged) -> tensor`` (default: the mean).
        device: where the average lives (``None``: with the parameters).

    Raises:
        ValueError: for an argument out of range (the message names it); at ``on_fit_start``,
            for an optimizer without an injected ``lr`` or a float ``swa_epoch_start`` with
            ``max_epochs=-1``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.listeners.averaging import StochasticWeightAveraging
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]),
        ...                optim.inject_hyperparams(optim.sgd)(lr=0.1))
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
        >>> trainer = eg.Trainer(max_epochs=4, logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False,
        ...                      enable_journal=False,
        ...                      callbacks=[StochasticWeightAveraging(0.01, swa_epoch_start=2,
        ...                                                       annealing_epochs=1)])
        >>> state = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
        >>> int(state.extra["swa"]["n_averaged"]), optim.get_hyperparams(state.opt_state)["lr"]
        (3, 0.01)
    """

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: Literal["cos", "linear"] = "cos",
        avg_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
        device: torch.device | str | None = "cpu",
    ) -> None:
        start = swa_epoch_start
        if isinstance(start, bool) or not (
            (isinstance(start, int) and start >= 1)
            or (isinstance(start, float) and 0 <= start <= 1)
        ):
            raise ValueError(
                f"StochasticWeightAveraging(swa_epoch_start={start!r}): pass an int >= 1 (the "
                "epoch, counted from 1) or a float in [0, 1] (a fraction of max_epochs)"
            )
        if (
            isinstance(annealing_epochs, bool)
            or not isinstance(annealing_epochs, int)
            or annealing_epochs < 0
        ):
            raise ValueError(
                f"StochasticWeightAveraging(annealing_epochs={annealing_epochs!r}): pass an "
                "int >= 0"
            )
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}): pass "
                "'cos' or 'linear'"
            )
        if avg_fn is not None and not callable(avg_fn):
            raise ValueError(
                f"StochasticWeightAveraging(avg_fn={avg_fn!r}): pass a function "
                "(average, param, n_averaged) -> tensor, or None for the mean"
            )
        if device is not None and not isinstance(device, (torch.device, str)):
            raise ValueError(
                f"StochasticWeightAveraging(device={device!r}): pass a torch.device, a str "
                "such as 'cpu', or None (with the parameters)"
            )
        self.swa_lr = _check_swa_lrs(swa_lrs)
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy: Literal["cos", "linear"] = annealing_strategy
        self.avg_fn = avg_fn
        self.device = torch.device(device) if device is not None else None
        self._start = 0  # the first averaging epoch, 0-based (set at on_fit_start)
        self._max_epochs = -1

    # ----------------------------------------------------------------- schedule

    @property
    def swa_start(self) -> int:
        """The first epoch averaged at the start of, 0-based (known from ``on_fit_start``)."""
        return self._start

    @property
    def swa_end(self) -> float:
        """The last epoch averaged at the start of, 0-based (``inf`` for ``max_epochs=-1``)."""
        return math.inf if self._max_epochs == -1 else self._max_epochs - 1

    def on_fit_start(self, rec: EventRecord) -> None:
        config = rec.run.config
        self._max_epochs = config.max_epochs if config is not None else -1
        start = self.swa_epoch_start
        if isinstance(start, float):
            if self._max_epochs == -1:
                raise ValueError(
                    f"StochasticWeightAveraging(swa_epoch_start={start!r}) is a fraction of "
                    "max_epochs, which is -1 (no limit); pass the epoch as an int"
                )
            start = int(self._max_epochs * start)
        self._start = max(start - 1, 0)
        assert rec.state is not None
        try:
            hyperparams = get_hyperparams(rec.state.opt_state)
        except ValueError as e:
            raise ValueError(f"StochasticWeightAveraging anneals the learning rate: {e}") from e
        if "lr" not in hyperparams:
            raise ValueError(
                "StochasticWeightAveraging anneals the learning rate, and the optimizer's "
                f"injected hyperparameters {sorted(hyperparams)} have no 'lr'; pass it as a "
                "number: optim.inject_hyperparams(optim.sgd)(lr=0.1)"
            )

    def on_train_epoch_start(self, rec: EventRecord) -> list[Transition] | None:
        state = rec.state
        assert state is not None
        epoch = state.epoch
        if not self.swa_start <= epoch <= self.swa_end:
            return None
        held = state.extra.get(SWA_KEY)
        if held is not None and held["epoch"] >= epoch:
            return None  # averaged already (a fit resumed within this epoch)
        out = [Transition(_Average(self.avg_fn, self.device, epoch), name="swa: average")]
        if held is None:  # SWALR is built: its first step (a change only if annealing_epochs=0)
            lr = get_hyperparams(state.opt_state)["lr"]
            new = swalr(lr, self.swa_lr, 0, self.annealing_epochs, self.annealing_strategy)
            if new != lr:
                out.append(Transition(_SetLr(new), name="swa: learning rate"))
        return out

    def on_train_epoch_end(self, rec: EventRecord) -> Transition | None:
        state = rec.state
        assert state is not None
        batches = rec.run.num_training_batches
        if state.epoch < self.swa_start or (not math.isinf(batches) and state.batch_idx < batches):
            return None  # before averaging, or an epoch cut short (Lightning steps no scheduler)
        lr = get_hyperparams(state.opt_state)["lr"]
        step = state.epoch - self.swa_start + 1  # SWALR's steps: one at each epoch's end
        new = swalr(lr, self.swa_lr, step, self.annealing_epochs, self.annealing_strategy)
        return Transition(_SetLr(new), name="swa: learning rate")

    def on_train_end(self, rec: EventRecord) -> Transition | None:
        state = rec.state
        assert state is not None
        if SWA_KEY not in state.extra:
            return None
        if self._max_epochs != -1 and state.epoch != self._max_epochs:
            return None  # stopped before the last epoch: as Lightning, the weights stay
        norms = _batch_norms(state.module)
        statistics = self._update_bn(rec, norms) if norms and self._max_epochs != -1 else None
        return Transition(_Finish(statistics), name="swa: final weights")

    # ----------------------------------------------------------------- BatchNorm

    def _update_bn(
        self, rec: EventRecord, norms: list[tuple[str, nn.modules.batchnorm._BatchNorm]]
    ) -> dict[str, Tensor]:
        """The BatchNorm running statistics of the averaged weights: one pass over the
        training loader (epoch ``max_epochs``'s order, as Lightning's extra epoch) in train
        mode without gradients, each layer's momentum ``None`` (a cumulative average). The
        state is read, not changed."""
        state, task, loader = rec.state, rec.run.task, rec.run.train_dataloader
        assert state is not None and state.module is not None
        if loader is None:
            raise RuntimeError(
                "StochasticWeightAveraging: no training loader to recompute the BatchNorm "
                "statistics with"
            )
        average = state.extra[SWA_KEY]["average"]
        params = {k: average[k].to(device=p.device, dtype=p.dtype) for k, p in state.params.items()}
        buffers = {k: b.detach().clone() for k, b in state.buffers.items()}
        names: list[str] = []
        for prefix, _ in norms:
            buffers[prefix + "running_mean"].zero_()
            buffers[prefix + "running_var"].fill_(1)
            names += [prefix + "running_mean", prefix + "running_var"]
            if prefix + "num_batches_tracked" in buffers:
                buffers[prefix + "num_batches_tracked"].zero_()
                names.append(prefix + "num_batches_tracked")
        first = next(iter(params.values()))
        device = first.device
        dtype = first.dtype if first.dtype != torch.float32 else None
        generators: tuple[int | str, ...] = (
            (first.get_device(),) if first.is_cuda else ("mps",) if first.is_mps else ()
        )
        module = state.module
        view = ModelView(module, params, buffers)
        forward = task.loss_fn if task is not None and task.loss_fn is not None else None
        momenta = [(m, m.momentum) for _, m in norms]
        was_training = module.training
        limit = rec.run.num_training_batches
        epoch = state.epoch
        try:
            for m, _ in momenta:
                m.momentum = None
            module.train()
            seed_shuffle(loader, state.seed, epoch)
            seed_batches(loader, state.seed, epoch)
            position_loader(loader, epoch, 0)
            for i, batch in enumerate(loader):
                if i >= limit:
                    break
                batch = _like(batch, device, dtype)
                seed = rng.derive_seed(state.seed, state.step, i, _UPDATE_BN)
                with torch.no_grad(), rng.seeded(seed, generators):
                    if forward is not None:  # the training forward pass, as Lightning's epoch
                        forward(view, batch)
                    else:  # a custom step: the model on the batch's first element (update_bn)
                        view(batch[0] if isinstance(batch, (list, tuple)) else batch)
        finally:
            restore_loader(loader)
            for m, momentum in momenta:
                m.momentum = momentum
            module.train(was_training)
        return {k: buffers[k] for k in names}
