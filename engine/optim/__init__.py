"""Functional optimizers: gradient transformations as pure ``init`` / ``update`` functions.

Named optimizers (:func:`sgd`, :func:`adam`, :func:`adamw`, :func:`rmsprop`, :func:`adagrad`,
:func:`lion`) take torch.optim's arguments and reproduce it bitwise; they are :func:`chain` s of
the small transforms also exported here. :func:`from_torch` runs any other torch.optim class.
Learning-rate schedules (:mod:`engine.optim.schedules`) are re-exported here.

Example:
    >>> import torch
    >>> from engine import optim
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0),
    ...                  optim.adamw(optim.warmup_cosine(1e-3, 10, 100)))
    >>> params = {"w": torch.ones(3)}
    >>> state = tx.init(params)
    >>> params, state = optim.apply_gradients(tx, {"w": torch.ones(3)}, state, params, step=0)
"""

from engine.optim import schedules
from engine.optim.adaptive import (
    ScaleByAdagradState,
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByRmsState,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_lion,
    scale_by_rms,
)
from engine.optim.aliases import adagrad, adam, adamw, lion, rmsprop, sgd
from engine.optim.averaging import EmaState, ema_params, ema_weights
from engine.optim.base import (
    GradientTransformation,
    OptState,
    Params,
    Recipe,
    ScheduleLike,
    StepCounters,
    Updates,
    apply_gradients,
    apply_updates,
    chain,
    differentiable_step,
    has_deferred,
    identity,
    load_state_dict,
    recipes,
    resolve_total_steps,
    state_dict,
)
from engine.optim.freezing import (
    FreezableState,
    freezable,
    freeze,
    frozen_names,
    get_group_hyperparams,
    match_prefixes,
    set_group_hyperparams,
    unfreeze,
)
from engine.optim.inject import (
    InjectHyperparamsState,
    get_hyperparams,
    inject_hyperparams,
    set_hyperparams,
)
from engine.optim.masking import (
    MaskedState,
    MultiTransformState,
    decay_mask,
    masked,
    multi_transform,
)
from engine.optim.replacing import with_learning_rate
from engine.optim.schedules import (
    AutoLength,
    constant,
    cosine_decay,
    exponential,
    linear,
    multistep_lr,
    one_cycle,
    step_lr,
    warmup_cosine,
)
from engine.optim.torch_adapter import TorchOptimizerState, from_torch
from engine.optim.transforms import (
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    clip_by_value,
    decoupled_weight_decay,
    scale,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    # protocol (base)
    "GradientTransformation",
    "OptState",
    "Params",
    "ScheduleLike",
    "StepCounters",
    "Updates",
    "apply_gradients",
    "apply_updates",
    "chain",
    "differentiable_step",
    "identity",
    "load_state_dict",
    "state_dict",
    "Recipe",
    "has_deferred",
    "recipes",
    "resolve_total_steps",
    "with_learning_rate",
    # named optimizers
    "adagrad",
    "adam",
    "adamw",
    "lion",
    "rmsprop",
    "sgd",
    "from_torch",
    # transforms
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip_by_value",
    "decoupled_weight_decay",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "trace",
    # per-parameter options
    "decay_mask",
    "masked",
    "multi_transform",
    # hyperparameters as state (inject)
    "get_hyperparams",
    "inject_hyperparams",
    "set_hyperparams",
    # weight averaging and freezing (averaging, freezing)
    "ema_params",
    "ema_weights",
    "freezable",
    "freeze",
    "frozen_names",
    "get_group_hyperparams",
    "match_prefixes",
    "set_group_hyperparams",
    "unfreeze",
    # states
    "EmaState",
    "FreezableState",
    "InjectHyperparamsState",
    "MaskedState",
    "MultiTransformState",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "TorchOptimizerState",
    "TraceState",
    # schedules (also as the module optim.schedules)
    "schedules",
    "AutoLength",
    "constant",
    "cosine_decay",
    "exponential",
    "linear",
    "multistep_lr",
    "one_cycle",
    "step_lr",
    "warmup_cosine",
]
