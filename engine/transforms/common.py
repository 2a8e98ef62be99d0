"""The single-device, float32, single-process transforms, and the ones every run may use:
clipping, compilation, anomaly detection."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from engine.optim.base import GradientTransformation, StepCounters, map_counters, map_placed
from engine.state import TrainState
from engine.step import compile_core
from engine.transforms.base import Strategy, Transform

__all__ = ["Clip", "Compile", "DetectAnomaly", "Float32", "SingleDevice", "SingleProcess"]


class SingleDevice(Transform):
    """One device for the state and the batches (the CPU by default).

    ``prepare`` moves every tensor of the state there (a state already there is returned as
    it is); ``move`` moves a batch's tensors there. On the CPU, batches are left where they are:
    moving costs a traversal of the batch every step, and a CPU run's batches are on the CPU.

    On CUDA a CPU tensor is copied from pinned memory with ``non_blocking=True``, so the copy
    overlaps the previous step's kernels (a ``DataLoader(pin_memory=True)`` pins in its workers;
    otherwise ``move`` pins the tensor first). A batch is walked as torch's pytrees (tuples,
    lists, dicts, named tuples); any other object with a ``to(device)`` method is moved with it,
    as Lightning moves them.

    Args:
        device: where the run lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``).
        transfer: ``fn(batch, device) -> batch``, for batch types the walk above does not reach
            (Lightning's ``transfer_batch_to_device``); it replaces the walk.

    Example:
        >>> import torch
        >>> SingleDevice().move((torch.ones(2), "label"))
        (tensor([1., 1.]), 'label')
    """

    plugin_kind = "placement"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        transfer: Callable[[Any, torch.device], Any] | None = None,
    ) -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(
                f"SingleDevice({device!r}): not a device torch knows ({e}); pass e.g. 'cpu', "
                "'cuda', 'cuda:1' or 'mps'"
            ) from None
        if transfer is not None and not callable(transfer):
            raise TypeError(
                f"SingleDevice(transfer={transfer!r}): pass a function (batch, device) -> batch"
            )
        self.transfer = transfer

    def prepare(self, state: TrainState) -> TrainState:
        device = self.device
        tensors = [*state.params.values(), *state.buffers.values()]
        if all(_on(t, device) for t in tensors):
            return state

        def to(x: Any) -> Any:
            return x.to(device) if isinstance(x, Tensor) else x

        state.check_alive("SingleDevice.prepare()")
        moved = state.replace(
            params={
                k: v.detach().to(device).requires_grad_(v.requires_grad)
                for k, v in state.params.items()
            },
            buffers={k: v.to(device) for k, v in state.buffers.items()},
            opt_state=map_placed(to, state.opt_state),  # step counters stay on the host
            grad_accum=None if state.grad_accum is None else pytree.tree_map(to, state.grad_accum),
            precision=pytree.tree_map(to, state.precision),
            _ownership=type(state._ownership)(),
        )
        # the module template stays where it is: every call binds the state's tensors into its
        # slots, so its own weights are never read, and moving them would keep a second copy
        # of the model on the device
        return moved

    def move(self, batch: Any) -> Any:
        if self.transfer is not None:
            return self.transfer(batch, self.device)
        if self.device.type == "cpu":
            return batch
        return pytree.tree_map(self._leaf, batch)

    def _leaf(self, x: Any) -> Any:
        device = self.device
        if isinstance(x, Tensor):
            if device.type == "cuda" and x.device.type == "cpu":
                if not x.is_pinned():
                    x = x.pin_memory()
                return x.to(device, non_blocking=True)
            return x.to(device)
        to = getattr(x, "to", None)
        if callable(to) and not isinstance(x, (str, bytes, type)):
            return to(device)
        return x

    def rng_devices(self, state: TrainState) -> tuple[int | str, ...]:
        """The accelerator generators a step seeds besides the CPU's: a CUDA index or ``"mps"``."""
        if self.device.type == "mps":
            return ("mps",)
        if self.device.type != "cuda":
            return ()
        return (
            self.device.index if self.device.index is not None else torch.cuda.current_device(),
        )


def _on(t: Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class SingleProcess(Strategy):
    """One process (Lightning's ``strategy="single_device"``): every hook and every collective
    is the identity. A data-parallel strategy (``engine.parallel.DDP``) averages the gradients in
    ``reduce``; a sharded one shards in ``prepare``."""


class Float32(Transform):
    """Full float32 precision (Lightning's ``"32-true"``): every hook is the identity."""


class Clip(Transform):
    """A stateless gradient transformation before the optimizer (``gradient_clip_val``).

    Example:
        >>> from engine import optim
        >>> Clip(optim.clip_by_global_norm(1.0)).gradients() is not None
        True
    """

    def __init__(self, transformation: GradientTransformation) -> None:
        if not isinstance(transformation, GradientTransformation) or transformation.init(
            {}
        ) not in ((), None):
            raise TypeError(
                f"Clip takes a stateless GradientTransformation such as "
                f"optim.clip_by_global_norm(1.0) (got {transformation!r}); put stateful "
                "transforms in the optimizer"
            )
        self.transformation = transformation

    def gradients(self) -> GradientTransformation:
        return self.transformation


class Compile(Transform):
    """Compile each pure core of a step with ``torch.compile`` (forward, backward and the
    optimizer update in one graph), with the given ``torch.compile`` options."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def prepare(self, state: TrainState) -> TrainState:
        """The optimizer's host step counters (:class:`~engine.optim.StepCounters`) moved next
        to the parameters, as torch.optim's ``capturable`` ones: host scalars would split the
        graph's device work and keep CUDA graphs from capturing it. The compiled step computes
        the bias corrections on the device."""
        device = next((p.device for p in state.params.values()), None)
        counters = [
            x
            for x in pytree.tree_leaves(
                state.opt_state, is_leaf=lambda x: isinstance(x, StepCounters)
            )
            if isinstance(x, StepCounters)
        ]
        if device is None or all(t.device == device for c in counters for t in c.values()):
            return state
        state.check_alive("Compile.prepare()")
        return state.replace(opt_state=map_counters(lambda t: t.to(device), state.opt_state))

    def wrap_core(self, core: Callable) -> Callable:
        return compile_core(core, self.options)


class DetectAnomaly(Transform):
    """Run each core under ``torch.autograd.detect_anomaly()``: a NaN made in backward raises,
    naming the backward function and the forward line that made it (the Trainer's
    ``detect_anomaly=True``).

    Args:
        active: ``fn() -> bool``, asked before each call: detect only while it is true (anomaly
            mode slows a step several times; ``engine replay --detect-anomaly`` turns it on for
            the steps asked for). Default: always.

    Example:
        >>> import torch
        >>> core = DetectAnomaly().wrap_core(lambda: torch.is_anomaly_enabled())
        >>> core(), torch.is_anomaly_enabled()
        (True, False)
    """

    plugin_kind = "anomaly detection"

    wraps_any_step = True  # its wrap_core takes any callable: a custom step_fn too

    def __init__(self, active: Callable[[], bool] | None = None) -> None:
        if active is not None and not callable(active):
            raise TypeError(f"DetectAnomaly(active={active!r}): pass a function () -> bool")
        self.active = active

    def wrap_core(self, core: Callable) -> Callable:
        active = self.active

        def detecting(*args: Any) -> Any:
            if active is not None and not active():
                return core(*args)
            with torch.autograd.detect_anomaly():
                return core(*args)

        return detecting
