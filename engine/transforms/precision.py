"""Precision transforms: Lightning's six precisions on the step-transform seam.

=====================  ===========================  =========================================
Lightning's flag       transform                    what it does
=====================  ===========================  =========================================
``"32-true"``          :class:`Float32`             nothing (the default)
``"64-true"``          ``TruePrecision(float64)``   parameters, buffers, optimizer moments and
``"16-true"``          ``TruePrecision(float16)``   the batches' floating tensors in that
``"bf16-true"``        ``TruePrecision(bfloat16)``  dtype
``"bf16-mixed"``       ``MixedPrecision(bfloat16)`` ``torch.autocast`` around the forward pass
                                                    (train, eval, predict); float32 master
                                                    parameters and optimizer state
``"16-mixed"``         ``MixedPrecision(float16)``  the same in float16, with a dynamic loss
                                                    scale kept in ``TrainState.precision``
``"transformer-        :class:`TransformerEngine`   NVIDIA Transformer Engine's FP8 autocast
engine"``                                           (needs ``transformer_engine``)
=====================  ===========================  =========================================

Every ``prepare`` is idempotent: a state already prepared (cast, or holding a loss scale) is
returned as it is, so a resume template and the state restored into it go through the same
pipeline.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from engine.state import TrainState
from engine.step import GradFn, UpdateFn
from engine.transforms.base import Transform
from engine.transforms.common import Float32

__all__ = [
    "PRECISIONS",
    "DynamicLossScale",
    "MixedPrecision",
    "TransformerEngine",
    "TruePrecision",
    "canonical_precision",
    "precision_transform",
]

# Lightning's names and their aliases (``Trainer(precision=...)``)
PRECISIONS = (
    "64-true",
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "transformer-engine",
    "transformer-engine-float16",
)
_ALIASES: dict[Any, str] = {
    None: "32-true",
    64: "64-true",
    "64": "64-true",
    32: "32-true",
    "32": "32-true",
    16: "16-mixed",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
}

_LOW = (torch.float16, torch.bfloat16)


def canonical_precision(value: Any) -> str:
    """Lightning's canonical name of a precision flag (``16`` -> ``"16-mixed"``).

    Example:
        >>> canonical_precision(16), canonical_precision("bf16"), canonical_precision(None)
        ('16-mixed', 'bf16-mixed', '32-true')
    """
    hashable = not isinstance(value, bool) and isinstance(value, (int, str, type(None)))
    if hashable and value in _ALIASES:
        return _ALIASES[value]
    if hashable and value in PRECISIONS:
        return str(value)
    accepted = ", ".join(repr(p) for p in PRECISIONS)
    raise ValueError(
        f"Trainer(precision={value!r}): accepted values are {accepted} and Lightning's aliases "
        "64, 32, 16, '64', '32', '16', 'bf16' (or an engine precision transform in plugins=)"
    )


def precision_transform(value: Any) -> Transform:
    """The transform of a precision flag (Lightning's values and aliases).

    Example:
        >>> precision_transform("bf16-mixed")
        MixedPrecision(dtype=torch.bfloat16)
        >>> precision_transform(64)
        TruePrecision(dtype=torch.float64)
    """
    name = canonical_precision(value)
    if name == "32-true":
        return Float32()
    if name.endswith("-true"):
        return TruePrecision(
            {"64": torch.float64, "16": torch.float16, "bf16": torch.bfloat16}[name.split("-")[0]]
        )
    if name == "16-mixed":
        return MixedPrecision(torch.float16)
    if name == "bf16-mixed":
        return MixedPrecision(torch.bfloat16)
    return TransformerEngine(torch.float16 if name.endswith("float16") else torch.bfloat16)


def _check_dtype(owner: str, dtype: Any, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    if dtype not in allowed:
        names = ", ".join(f"torch.{str(d).split('.')[-1]}" for d in allowed)
        raise ValueError(f"{owner}(dtype={dtype!r}): pass one of {names}")
    return dtype


def _floating(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point()


# --------------------------------------------------------------------------- true precisions


class TruePrecision(Transform):
    """Everything in one dtype (Lightning's ``"64-true"``, ``"16-true"``, ``"bf16-true"``).

    ``prepare`` casts the parameters, the floating buffers, the gradient accumulator and the
    optimizer's per-parameter tensors (moments; step counters stay as they are, as
    ``torch.optim.Optimizer.load_state_dict`` keeps its ``step``), so the state is what
    Lightning's module-then-optimizer setup builds in that dtype. ``move`` casts each batch's
    floating tensors (Lightning's ``convert_input``); integer tensors such as class labels are
    left alone.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> half = TruePrecision(torch.bfloat16)
        >>> state = half.prepare(eg.TrainState.create(torch.nn.Linear(2, 1), optim.adam(1e-3)))
        >>> state.params["weight"].dtype, state.opt_state[0].exp_avg["weight"].dtype
        (torch.bfloat16, torch.bfloat16)
        >>> half.move((torch.ones(1), torch.tensor([3])))
        (tensor([1.], dtype=torch.bfloat16), tensor([3]))
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = _check_dtype(
            "TruePrecision", dtype, (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        )

    def prepare(self, state: TrainState) -> TrainState:
        dtype = self.dtype
        tensors = [*state.params.values(), *state.buffers.values()]
        if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
            return state
        state.check_alive(f"{self!r}.prepare()")

        def cast(t: Tensor) -> Tensor:
            return t.detach().to(dtype) if t.is_floating_point() else t

        params = {k: cast(v).requires_grad_(v.requires_grad) for k, v in state.params.items()}
        return state.replace(
            params=params,
            buffers={k: cast(v) for k, v in state.buffers.items()},
            opt_state=_cast_opt_state(state.opt_state, state.params, dtype),
            grad_accum=None
            if state.grad_accum is None
            else {k: cast(v) for k, v in state.grad_accum.items()},
            _ownership=type(state._ownership)(),
        )

    def move(self, batch: Any) -> Any:
        dtype = self.dtype
        return pytree.tree_map(lambda x: x.to(dtype) if _floating(x) else x, batch)


def _cast_opt_state(opt_state: Any, params: dict[str, Tensor], dtype: torch.dtype) -> Any:
    """The optimizer state's per-parameter floating tensors (under a key naming a parameter, with
    its shape) cast to ``dtype``; step counters (under a field or key named ``step`` or
    ``count``) and everything else kept."""
    leaves, spec = pytree.tree_flatten_with_path(opt_state)
    out = []
    for path, leaf in leaves:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        owner = next((n for n in reversed(names) if isinstance(n, str) and n in params), None)
        counter = any(n in ("step", "count") for n in names)
        if (
            _floating(leaf)
            and owner is not None
            and not counter
            and leaf.shape == params[owner].shape
        ):
            leaf = leaf.detach().to(dtype)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


# --------------------------------------------------------------------------- mixed precision


@attrs.frozen
class DynamicLossScale:
    """Dynamic loss scaling, with ``torch.amp.GradScaler``'s defaults and arithmetic.

    The loss is multiplied by the scale before backward; before the optimizer the gradients are
    unscaled and checked: a step with an inf/NaN gradient is skipped (parameters and optimizer
    state untouched) and the scale multiplied by ``backoff_factor``; after ``growth_interval``
    steps in a row without one, the scale is multiplied by ``growth_factor``.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __attrs_post_init__(self) -> None:
        for name, ok in (
            ("init_scale", _number(self.init_scale) and self.init_scale > 0),
            ("growth_factor", _number(self.growth_factor) and self.growth_factor > 1.0),
            (
                "backoff_factor",
                _number(self.backoff_factor) and 0.0 < self.backoff_factor < 1.0,
            ),
            (
                "growth_interval",
                isinstance(self.growth_interval, int)
                and not isinstance(self.growth_interval, bool)
                and self.growth_interval > 0,
            ),
        ):
            if not ok:
                raise ValueError(
                    f"DynamicLossScale({name}={getattr(self, name)!r}): init_scale > 0, "
                    "growth_factor > 1, 0 < backoff_factor < 1 and an int growth_interval > 0"
                )

    def init(self, device: torch.device) -> dict[str, Tensor]:
        """The state a run starts with: ``{"scale", "growth_tracker"}`` on ``device``."""
        return {
            "scale": torch.full((), float(self.init_scale), dtype=torch.float32, device=device),
            "growth_tracker": torch.zeros((), dtype=torch.int32, device=device),
        }


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


class MixedPrecision(Transform):
    """Automatic mixed precision (Lightning's ``"bf16-mixed"`` and ``"16-mixed"``).

    The forward pass of every step (train, eval, predict) runs under ``torch.autocast`` in
    ``dtype`` on the parameters' device; parameters, gradients and optimizer state stay float32.
    With float16 a :class:`DynamicLossScale` scales the loss (its state, ``{"scale",
    "growth_tracker"}``, lives in ``TrainState.precision`` and travels with checkpoints); an
    optimizer step whose gradients hold an inf or NaN is skipped and reported as the metric
    ``"skipped"`` (1.0; 0.0 on the steps taken). With bfloat16 it declares
    :attr:`~engine.transforms.Transform.param_dtype`: a sharding strategy
    (``engine.parallel.FSDP``) gathers the parameters in bfloat16, and reduces their gradients
    in float32.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        loss_scale: a :class:`DynamicLossScale`, or ``None`` for none; by default one for
            float16 and none for bfloat16 (whose range is float32's).
        device_type: the autocast device type; by default the parameters' device's.

    A skipped step checks the gradients on the host in eager mode (as ``GradScaler.step`` does:
    one sync per optimizer step); compiled, the update runs and is undone with ``torch.where``
    inside the graph, so nothing syncs.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim, transforms
        >>> tx = optim.sgd(0.1)
        >>> pipeline = transforms.compose(precision=MixedPrecision(torch.float16))
        >>> state = pipeline.prepare(eg.TrainState.create(torch.nn.Linear(2, 1), tx))
        >>> float(state.precision["scale"])
        65536.0
        >>> step = pipeline.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]), tx)
        >>> batch = (torch.ones(4, 2), torch.full((4, 1), 100.0))  # gradients overflow float16
        >>> state, metrics = step(state, batch)
        >>> float(metrics["skipped"]), float(state.precision["scale"])  # skipped, backed off
        (1.0, 32768.0)
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        loss_scale: DynamicLossScale | str | None = "default",
        device_type: str | None = None,
    ) -> None:
        self.dtype = _check_dtype("MixedPrecision", dtype, _LOW)
        if isinstance(loss_scale, str) and loss_scale == "default":
            loss_scale = DynamicLossScale() if dtype == torch.float16 else None
        if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
            raise TypeError(
                f"MixedPrecision(loss_scale={loss_scale!r}): pass a DynamicLossScale(...) or None"
            )
        self.loss_scale: DynamicLossScale | None = loss_scale
        # what a sharding strategy gathers the parameters in (Transform.param_dtype): bfloat16,
        # the dtype autocast runs the forward's matrix products in. Not float16: a parameter
        # that autocast reads in float32 (a norm's weight) would get its gradient, scaled by
        # the loss scale and summed over the batch, squeezed through float16 on its way to
        # the float32 reduction, and overflow (a skipped step) where autocast keeps it float32
        self.param_dtype = torch.bfloat16 if dtype == torch.bfloat16 else None
        if device_type is not None and device_type not in ("cpu", "cuda", "mps", "xpu"):
            raise ValueError(
                f"MixedPrecision(device_type={device_type!r}): pass 'cpu', 'cuda', 'mps' or None "
                "(the parameters' device)"
            )
        self.device_type = device_type

    def __repr__(self) -> str:
        parts = [f"dtype={self.dtype}"]
        default = DynamicLossScale() if self.dtype == torch.float16 else None
        if self.loss_scale != default:
            parts.append(f"loss_scale={self.loss_scale!r}")
        if self.device_type is not None:
            parts.append(f"device_type={self.device_type!r}")
        return f"MixedPrecision({', '.join(parts)})"

    def _autocast(self, device: torch.device) -> torch.autocast:
        return torch.autocast(self.device_type or device.type, dtype=self.dtype)

    # ------------------------------------------------------------------ hooks

    def prepare(self, state: TrainState) -> TrainState:
        wrong = [k for k, p in state.params.items() if p.dtype in _LOW]
        if wrong:
            raise ValueError(
                f"{self!r}: parameters {wrong[:3]} are {state.params[wrong[0]].dtype}; mixed "
                "precision keeps float32 master parameters and autocasts the forward pass. "
                "Create the state from a float32 model, or use the true precision "
                f"('{'bf16' if self.dtype == torch.bfloat16 else '16'}-true')"
            )
        if self.loss_scale is None:
            return state
        if state.precision is not None:
            _check_scale_state(state.precision, self)
            return state
        device = next(iter(state.params.values())).device if state.params else torch.device("cpu")
        return state.replace(precision=self.loss_scale.init(device))

    def wrap_grad(self, grad_fn: GradFn) -> GradFn:
        autocast = self._autocast

        def autocast_forward(forward: Callable, params: list[Tensor]) -> Callable:
            device = params[0].device if params else torch.device("cpu")

            def run() -> Any:
                with autocast(device):
                    return forward()

            return run

        if self.loss_scale is None:

            def mixed(forward, params, accumulate, precision):
                return grad_fn(autocast_forward(forward, params), params, accumulate, precision)

            return mixed

        def scaled(forward, params, accumulate, precision):
            run = autocast_forward(forward, params)
            kept: list[Tensor] = []

            def scaled_forward() -> tuple[Tensor, Any]:
                loss, aux = run()
                kept.append(loss)
                return loss * precision["scale"], aux

            grads, _, aux = grad_fn(scaled_forward, params, accumulate, precision)
            return grads, kept[0], aux  # the loss as the loss function returned it

        return scaled

    def wrap_eval(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        autocast = self._autocast

        def mixed(model: Any, batch: Any) -> Any:
            with autocast(_device_of(model)):
                return fn(model, batch)

        return mixed

    def wrap_update(self, update_fn: UpdateFn) -> UpdateFn:
        scale_cfg = self.loss_scale
        if scale_cfg is None:
            return update_fn

        def update(grads, params, opt_state, precision, step):
            # new tensors, never the old state's updated in place: an asynchronous checkpoint
            # of the previous state hashes its precision tensors after this step has run
            scale = precision["scale"].clone()
            tracker = precision["growth_tracker"].clone()
            inv_scale = scale.double().reciprocal().float()
            if torch.compiler.is_compiling():  # GradScaler's arithmetic in traceable ops
                found_inf = _unscale(list(grads.values()), inv_scale)
                opt_state, metrics = _undone_if(
                    found_inf, update_fn, grads, params, opt_state, precision, step
                )
                scale, tracker = _updated_scale(scale, tracker, found_inf, scale_cfg)
            else:
                found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
                for group in _by_device_and_dtype(list(grads.values())):
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
                if found_inf.item():  # GradScaler.step's one sync: skip the optimizer
                    metrics = {}
                else:
                    opt_state, _, metrics = update_fn(grads, params, opt_state, precision, step)
                torch._amp_update_scale_(
                    scale,
                    tracker,
                    found_inf,
                    scale_cfg.growth_factor,
                    scale_cfg.backoff_factor,
                    scale_cfg.growth_interval,
                )
            metrics = {**metrics, "skipped": found_inf}
            return opt_state, {"scale": scale, "growth_tracker": tracker}, metrics

        return update


def _device_of(model: Any) -> torch.device:
    tensors = getattr(model, "params", model)
    for t in tensors.values() if isinstance(tensors, dict) else ():
        return t.device
    return torch.device("cpu")


def _by_device_and_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _unscale(grads: list[Tensor], inv_scale: Tensor) -> Tensor:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` in ops a compiler traces: the
    gradients multiplied by ``inv_scale`` in place; 1.0 if any held an inf or NaN, else 0.0."""
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    torch._foreach_mul_(grads, inv_scale)
    return (~finite).float()


def _updated_scale(
    scale: Tensor, tracker: Tensor, found_inf: Tensor, cfg: DynamicLossScale
) -> tuple[Tensor, Tensor]:
    """``torch._amp_update_scale_``'s rule, branch-free: back off on an overflow; grow after
    ``growth_interval`` clean steps in a row (if the grown scale is finite)."""
    found = found_inf > 0
    successful = tracker + 1
    grow = successful >= cfg.growth_interval
    grown = scale * cfg.growth_factor
    grown = torch.where(torch.isfinite(grown), grown, scale)
    new_scale = torch.where(found, scale * cfg.backoff_factor, torch.where(grow, grown, scale))
    new_tracker = torch.where(found | grow, torch.zeros_like(tracker), successful)
    return new_scale, new_tracker


def _undone_if(found_inf: Tensor, update_fn, grads, params, opt_state, precision, step):
    """The update, taken and then undone where ``found_inf``: the compiled form of a skipped
    step, branch-free (``torch.where`` keeps the old bits exactly)."""
    old_params = [p.clone() for p in params.values()]
    old_leaves = pytree.tree_leaves(opt_state)
    old_leaves = [x.clone() if isinstance(x, Tensor) else x for x in old_leaves]
    new_state, _, metrics = update_fn(grads, params, opt_state, precision, step)
    skip = found_inf > 0
    with torch.no_grad():
        for p, old in zip(params.values(), old_params, strict=True):
            p.copy_(torch.where(skip, old, p))
    new_leaves, new_spec = pytree.tree_flatten(new_state)
    kept = [
        torch.where(skip, old, new) if isinstance(new, Tensor) else new
        for old, new in zip(old_leaves, new_leaves, strict=True)
    ]
    return pytree.tree_unflatten(kept, new_spec), metrics


def _check_scale_state(precision: Any, owner: Any) -> None:
    if not (
        isinstance(precision, dict)
        and set(precision) == {"scale", "growth_tracker"}
        and all(isinstance(v, Tensor) for v in precision.values())
    ):
        raise ValueError(
            f"{owner!r}: the state's precision state is {precision!r}, not a loss scale "
            "({'scale', 'growth_tracker'}); was the state prepared for another precision?"
        )


# --------------------------------------------------------------------------- transformer engine


class TransformerEngine(Transform):
    """NVIDIA Transformer Engine's FP8 autocast around the forward pass (Lightning's
    ``"transformer-engine"``, weights in bfloat16; ``"transformer-engine-float16"``: float16).

    The model must use Transformer Engine's layers (``transformer_engine.pytorch.Linear``...);
    their FP8 scaling history lives inside those modules, outside the :class:`TrainState`, so a
    resumed or replayed run is not bitwise equal to the original (a warning says so).
    """

    def __init__(self, weights_dtype: torch.dtype = torch.bfloat16, recipe: Any = None) -> None:
        if importlib.util.find_spec("transformer_engine") is None:
            raise ValueError(
                "precision='transformer-engine' needs NVIDIA Transformer Engine, which is not "
                "installed (pip install 'transformer-engine[pytorch]' on a machine with an NVIDIA "
                "GPU); or pick another precision: 'bf16-mixed', '16-mixed', 'bf16-true', ..."
            )
        self.dtype = _check_dtype("TransformerEngine", weights_dtype, _LOW)
        self.recipe = recipe
        self._cast = TruePrecision(weights_dtype)
        warnings.warn(
            "precision='transformer-engine': FP8 scaling state lives in Transformer Engine's "
            "modules, outside the TrainState; checkpoints resume the weights and optimizer, not "
            "bitwise the FP8 history",
            stacklevel=2,
        )

    def prepare(self, state: TrainState) -> TrainState:
        return self._cast.prepare(state)

    def move(self, batch: Any) -> Any:
        return self._cast.move(batch)

    def _fp8(self) -> Any:
        te = importlib.import_module("transformer_engine.pytorch")
        return te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)

    def wrap_grad(self, grad_fn: GradFn) -> GradFn:
        fp8 = self._fp8

        def under_fp8(forward, params, accumulate, precision):
            def run() -> Any:
                with fp8():
                    return forward()

            return grad_fn(run, params, accumulate, precision)

        return under_fp8

    def wrap_eval(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        fp8 = self._fp8

        def under_fp8(model: Any, batch: Any) -> Any:
            with fp8():
                return fn(model, batch)

        return under_fp8
