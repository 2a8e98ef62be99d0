"""A user's own training step (private): :class:`CustomStep` runs ``fn(state, batch)`` the way
the driver runs a :class:`TrainStep` (seeded, training mode, batch counter, state consumed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine import rng
from engine.state import TrainState
from engine.step._common import Batch, Metrics, _cuda_devices, _detached, _set_mode


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
