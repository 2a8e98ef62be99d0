"""Adam's step counters live on the host, as torch.optim's default Adam keeps them.

torch.optim's default (foreach, not ``capturable``) Adam and AdamW keep ``state["step"]`` on
the CPU and compute the bias corrections in Python floats; on an accelerator they end in one
``_foreach_addcdiv_``. engine's default does the same there, so a port is torch's bits on CUDA
as on the CPU. Without a GPU this is checked on the ``meta`` device, which runs torch's real
dispatch (which ops, in which order, with which scalars) without numbers: the same ops with the
same scalars on the same devices are the same CUDA kernels on the same inputs. The numbers
themselves are checked on a GPU by ``tests/test_devices.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import engine as eg
from engine import optim
from engine.optim import StepCounters
from engine.transforms import Compile, SingleDevice


class _Ops(TorchDispatchMode):
    """Every aten op dispatched, with its tensors as (device, dtype, shape) and its scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not name.startswith(("prim.", "profiler.")):
            self.ops.append((name, _describe(args), _describe(kwargs)))
        return func(*args, **kwargs)


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ("T", x.device.type, x.dtype, tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return tuple(_describe(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _describe(v)) for k, v in x.items()))
    return x


def _on_device(op) -> bool:
    return "'meta'" in repr(op)


def _device_ops(ops) -> list[tuple]:
    """The ops on the device, an in-place op named as its out-of-place form (torch adds the L2
    decay into a copy of the gradients where engine adds it into its own copy: the same kernel
    on the same values) and a multiplication by -1 as a negation (exact in IEEE arithmetic:
    the same bits for every number)."""
    out = []
    for name, args, kwargs in filter(_on_device, ops):
        base, _, overload = name.rpartition(".")
        base = base.removesuffix("_")
        if base == "aten._foreach_mul" and overload == "Scalar" and args[1] == -1.0:
            base, overload, args = "aten._foreach_neg", "default", args[:1]
        out.append((f"{base}.{overload}", args, kwargs))
    return out


def _shapes():
    return {"w": (4, 3), "b": (3,)}


def _torch_ops(cls, steps: int, **kw):
    """The ops of torch's default CUDA path (foreach; ``foreach=True`` because torch decides by
    device type, and meta is not one it lists) on its ``steps``-th step."""
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.empty(s, device="meta")) for s in _shapes().values()]
    grads = [torch.randn(s, generator=g).to("meta") for s in _shapes().values()]
    opt = cls(ps, lr=1e-2, foreach=True, **kw)
    for i in range(steps):
        for p, gr in zip(ps, grads, strict=True):
            p.grad = gr.clone()
        if i < steps - 1:
            opt.step()
    with _Ops() as ops:
        opt.step()
    return ops.ops


def _engine_ops(make, steps: int, **kw):
    g = torch.Generator().manual_seed(0)
    tx = make(1e-2, **kw)
    state = SingleDevice("meta").prepare(eg.TrainState.create(_Two(), tx))
    params, opt_state = dict(state.params), state.opt_state
    grads = {k: torch.randn(s, generator=g).to("meta") for k, s in _shapes().items()}
    ops = _Ops()
    for i in range(steps):
        step_grads = {k: v.clone() for k, v in grads.items()}
        if i == steps - 1:
            with ops:
                params, opt_state = optim.apply_gradients(tx, step_grads, opt_state, params, i)
        else:
            params, opt_state = optim.apply_gradients(tx, step_grads, opt_state, params, i)
    return ops.ops


class _Two(nn.Module):
    """Parameters named and shaped as ``_shapes``, in that order."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 3))
        self.b = nn.Parameter(torch.zeros(3))


CASES = [
    ("adam", {}),
    ("adam", {"weight_decay": 0.1}),
    ("adam", {"amsgrad": True, "maximize": True}),
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.0}),
    ("adamw", {"amsgrad": True, "maximize": True, "weight_decay": 0.3}),
]


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_default_adam_on_an_accelerator_runs_torchs_default_ops_with_its_scalars(name, kw):
    """On the third step (counters past 1): the device ops, their order and their scalars
    (bias corrections as Python floats, the final ``_foreach_addcdiv_``) are torch's, and the
    counters are read on the host as torch reads them (no device pow, no device sync)."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    theirs = _torch_ops(cls, 3, **kw)
    ours = _engine_ops(getattr(optim, name), 3, **kw)
    assert _device_ops(ours) == _device_ops(theirs)
    reads = [op for op in ours if op[0] == "aten._local_scalar_dense.default"]
    assert reads and all(op[1][0][1] == "cpu" for op in reads)
    assert len(reads) == sum(op[0] == "aten._local_scalar_dense.default" for op in theirs)
    assert [op for op in ours if op[0] == "aten._foreach_addcdiv_.ScalarList"], ours


def test_the_old_device_counters_op_order_is_caught():
    """The check above can fail: counters placed with the parameters (engine before host
    counters) compute the corrections on the device and end in a mul, div and add."""
    tx = optim.adamw(1e-2)
    params = {k: torch.zeros(s, device="meta") for k, s in _shapes().items()}
    state = tx.init(params)
    state = optim.base.map_counters(lambda t: t.to("meta"), state)
    grads = {k: torch.zeros(s, device="meta") for k, s in _shapes().items()}
    with _Ops() as ops:
        optim.apply_gradients(tx, grads, state, params, 0)
    ours = _device_ops(ops.ops)
    assert ours != _device_ops(_torch_ops(torch.optim.AdamW, 1))
    assert any(op[0] == "aten.pow.Scalar" for op in ours)


def test_adams_counters_are_host_step_counters_unless_fused():
    params = {"w": torch.zeros(2), "b": torch.zeros(1)}
    for tx in (optim.adam(), optim.adamw(), optim.scale_by_adam()):
        state = tx.init(params)
        steps = state if hasattr(state, "step") else state[0]
        assert type(steps.step) is StepCounters
        assert list(steps.step) == ["w", "b"]
    fused = optim.adamw(fused=True).init(params)[0]
    assert type(fused.step) is dict
    # the key paths of a state dict are a plain dict's: checkpoints of either load into both
    assert list(optim.state_dict(optim.adam().init(params))) == list(
        optim.state_dict(optim.adam(fused=True).init(params))
    )


def test_placement_keeps_host_counters_and_a_compiled_run_moves_them_with_the_parameters():
    state = eg.TrainState.create(nn.Linear(3, 2), optim.adamw(1e-2))
    placed = SingleDevice("meta").prepare(state)
    adam = placed.opt_state[0]
    assert {p.device.type for p in placed.params.values()} == {"meta"}
    assert {t.device.type for t in adam.exp_avg.values()} == {"meta"}
    assert {t.device.type for t in adam.step.values()} == {"cpu"}
    compiled = Compile().prepare(placed)
    assert type(compiled.opt_state[0].step) is StepCounters
    assert {t.device.type for t in compiled.opt_state[0].step.values()} == {"meta"}
    assert Compile().prepare(compiled) is compiled  # already there: nothing to do
    fused = SingleDevice("meta").prepare(
        eg.TrainState.create(nn.Linear(3, 2), optim.adamw(1e-2, fused=True))
    )
    assert {t.device.type for t in fused.opt_state[0].step.values()} == {"meta"}


def test_a_differentiable_step_keeps_the_counters_container():
    params = {"w": torch.ones(2, requires_grad=True)}
    tx = optim.adam(0.1)
    _, state = optim.differentiable_step(tx, {"w": torch.ones(2)}, tx.init(params), params, 0)
    assert type(state[0].step) is StepCounters
    assert float(state[0].step["w"]) == 1.0
