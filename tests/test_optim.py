"""engine.optim against torch.optim, plus the conformance suite every transform must pass."""

from __future__ import annotations

import functools
import io

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as tls

from engine import optim
from engine.optim import adaptive

# --------------------------------------------------------------------------- a real model

_G = torch.Generator().manual_seed(1234)
_X = torch.randn(32, 8, generator=_G)
_Y = torch.randn(32, 4, generator=_G)


def _mlp_params(dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "fc1.weight": ((16, 8), 0.3, 0.0),
        "fc1.bias": ((16,), 0.1, 0.0),
        "ln.weight": ((16,), 0.1, 1.0),
        "ln.bias": ((16,), 0.1, 0.0),
        "fc2.weight": ((4, 16), 0.3, 0.0),
        "fc2.bias": ((4,), 0.1, 0.0),
    }
    return {
        k: (torch.randn(shape, generator=g) * s + m).to(dtype).requires_grad_(True)
        for k, (shape, s, m) in shapes.items()
    }


def _loss(p, sign=1.0):
    """Linear -> tanh -> LayerNorm -> Linear, MSE on a fixed batch (negated to maximize).

    The tanh sits before the LayerNorm on purpose: Linear -> LayerNorm is invariant to shifting
    all pre-activations by the same amount, so the first layer would have a null direction whose
    gradient is pure rounding noise, which Adam/RMSprop normalise into full-size steps -- any two
    implementations that round differently then drift apart there without changing the loss.
    """
    h = torch.tanh(F.linear(_X.to(p["fc1.weight"].dtype), p["fc1.weight"], p["fc1.bias"]))
    h = F.layer_norm(h, (16,), p["ln.weight"], p["ln.bias"])
    return sign * F.mse_loss(F.linear(h, p["fc2.weight"], p["fc2.bias"]), _Y.to(h.dtype))


STEPS = 100


@functools.cache
def _reference(make_opt, make_sched=None, sign=1.0, steps=STEPS):
    """Parameters after ``steps`` steps of a torch.optim optimizer (cached per configuration)."""
    params = _mlp_params()
    opt = make_opt(list(params.values()))
    sched = make_sched(opt) if make_sched else None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(params, sign).backward()
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach() for k, v in params.items()}


def _ours(tx, mode="apply", sign=1.0, steps=STEPS):
    params = _mlp_params()
    state = tx.init(params)
    for step in range(steps):
        grads = torch.autograd.grad(_loss(params, sign), list(params.values()))
        grads = dict(zip(params, grads, strict=True))
        if mode == "apply":
            params, state = optim.apply_gradients(tx, grads, state, params, step)
        else:  # the composable form: update, then p += u
            with torch.no_grad():
                updates, state = tx.update(grads, state, params, step)
                optim.apply_updates(params, updates)
    return {k: v.detach() for k, v in params.items()}


def _compare(ours, theirs, exact, tol=1e-6):
    for k, p in theirs.items():
        assert ours[k].dtype == p.dtype
        if exact:
            assert torch.equal(ours[k], p), (k, (ours[k] - p).abs().max())
        else:  # 1e-6 relative, measured tensor-wise (elementwise is meaningless near zero)
            err = ((ours[k].double() - p.double()).norm() / p.double().norm()).item()
            assert err <= tol, (k, err)
    # the comparison must not be vacuous: the parameters moved
    assert any(not torch.equal(theirs[k], v) for k, v in _mlp_params().items())


# --------------------------------------------------------------------------- sgd

SGD_OPTIONS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.1},
    {"momentum": 0.9, "nesterov": True},
    {"weight_decay": 1e-2},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    {"maximize": True},
    {"momentum": 0.9, "dampening": 0.5, "weight_decay": 1e-2, "maximize": True},
]


def _opt(cls, **kw):
    """A hashable torch.optim factory (so references are cached)."""
    return functools.partial(_make, cls, tuple(sorted(kw.items())))


def _make(cls, items, params):
    return cls(params, **dict(items))


def _sign(kw):
    return -1.0 if kw.get("maximize") else 1.0


@pytest.mark.parametrize("kw", SGD_OPTIONS, ids=str)
@pytest.mark.parametrize(
    ("mode", "torch_kw", "exact"),
    [
        ("foreach", {"foreach": True}, True),
        ("fused", {"fused": True}, True),
        ("fused", {"foreach": True}, False),
        ("update", {"foreach": True}, False),
    ],
)
def test_sgd_matches_torch_after_100_steps(kw, mode, torch_kw, exact):
    tx = optim.sgd(0.05, **kw, fused=mode == "fused")
    theirs = _reference(_opt(torch.optim.SGD, lr=0.05, **kw, **torch_kw), sign=_sign(kw))
    ours = _ours(tx, "update" if mode == "update" else "apply", sign=_sign(kw))
    _compare(ours, theirs, exact)


# --------------------------------------------------------------------------- adam / adamw

ADAM_OPTIONS = [
    {},
    {"amsgrad": True},
    {"weight_decay": 0.1},
    {"maximize": True},
    {"betas": (0.8, 0.99), "eps": 1e-6},
    {"amsgrad": True, "weight_decay": 0.1, "maximize": True},
]
ADAM_MODES = [
    ("fused", {"fused": True}, True),
    ("fused", {"foreach": True}, False),
    ("foreach", {"foreach": True}, True),
    ("update", {"foreach": True}, False),
]


@pytest.mark.parametrize("kw", ADAM_OPTIONS, ids=str)
@pytest.mark.parametrize(("mode", "torch_kw", "exact"), ADAM_MODES)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_and_adamw_match_torch_after_100_steps(name, kw, mode, torch_kw, exact):
    ours_fn, cls = {
        "adam": (optim.adam, torch.optim.Adam),
        "adamw": (optim.adamw, torch.optim.AdamW),
    }[name]
    # lr=1e-3 (the default): at 1e-2 torch's own fused and foreach paths drift 1e-6 apart
    tx = ours_fn(1e-3, **kw, fused=mode == "fused")
    theirs = _reference(_opt(cls, lr=1e-3, **kw, **torch_kw), sign=_sign(kw))
    ours = _ours(tx, "update" if mode == "update" else "apply", sign=_sign(kw))
    _compare(ours, theirs, exact)


PORTS = [  # optim.x(lr, **kw) against torch.optim.X(params, lr, **kw), each with its defaults
    ("sgd", torch.optim.SGD, {}),
    ("sgd", torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    ("adam", torch.optim.Adam, {}),
    ("adam", torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}),
    ("adamw", torch.optim.AdamW, {}),
    ("adamw", torch.optim.AdamW, {"amsgrad": True, "maximize": True}),
    ("rmsprop", torch.optim.RMSprop, {}),
    ("rmsprop", torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
    ("adagrad", torch.optim.Adagrad, {}),
    ("adagrad", torch.optim.Adagrad, {"lr_decay": 0.01, "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("name", "cls", "kw"), PORTS, ids=lambda x: str(x))
def test_a_port_of_torch_optim_with_its_defaults_gives_torchs_parameters_bitwise(name, cls, kw):
    """``torch.optim.X(params, lr, ...)`` ported to ``optim.x(lr, ...)``, nothing else said:
    the same parameters bit for bit after 100 steps (torch's default path on this device; on
    the CPU its single-tensor loop), at the default rate and a larger one."""
    for lr in (1e-3, 1e-2):
        theirs = _reference(_opt(cls, lr=lr, **kw), sign=_sign(kw))
        _compare(_ours(getattr(optim, name)(lr, **kw), sign=_sign(kw)), theirs, exact=True)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_fused_true_is_torchs_fused_kernel_bitwise(name):
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    kw = {"momentum": 0.9} if name == "sgd" else {}
    theirs = _reference(_opt(cls, lr=1e-2, fused=True, **kw))
    _compare(_ours(getattr(optim, name)(1e-2, fused=True, **kw)), theirs, exact=True)
    # not the default path's bits: fused=True is a choice with consequences, as in torch
    default = _reference(_opt(cls, lr=1e-2, **kw))
    assert any(not torch.equal(theirs[k], default[k]) for k in theirs) or name == "sgd"


def test_fused_refuses_what_its_kernel_cannot_take_and_bad_values():
    params = {"w": torch.ones(3, dtype=torch.float64), "n": torch.ones(3, dtype=torch.int64)}
    tx = optim.sgd(1e-2, fused=True)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(ValueError, match=r"sgd\(fused=True\): parameter 'n' is torch.int64"):
        optim.apply_gradients(tx, grads, tx.init(params), params, 0)
    with pytest.raises(ValueError, match="'fused' must be True, False or None"):
        optim.adam(1e-3, fused="yes")  # type: ignore[arg-type]


def test_fused_adam_state_holds_float32_step_tensors_that_count_steps():
    params = _mlp_params(torch.float64)
    tx = optim.adam(1e-3, fused=True)
    state = tx.init(params)
    for step in range(3):
        grads = {k: torch.ones_like(v) for k, v in params.items()}
        params, state = optim.apply_gradients(tx, grads, state, params, step)
    adam_state = state[-1]
    assert isinstance(adam_state, optim.ScaleByAdamState)
    for k in params:
        assert adam_state.step[k].dtype == torch.float32 and adam_state.step[k].item() == 3.0
        assert adam_state.exp_avg[k].dtype == torch.float64


def test_fused_adamw_groups_mixed_dtypes_like_torch():
    def make():
        return {
            "a": torch.linspace(-1, 1, 6, dtype=torch.float64).requires_grad_(),
            "b": torch.linspace(1, 2, 5).requires_grad_(),
        }

    ref = make()
    opt = torch.optim.AdamW(list(ref.values()), lr=0.1, fused=True)
    ours, tx = make(), optim.adamw(0.1, fused=True)
    state = tx.init(ours)
    for step in range(5):
        for p in ref.values():
            p.grad = torch.cos(p.detach() * (step + 1))
        opt.step()
        grads = {k: torch.cos(p.detach() * (step + 1)) for k, p in ours.items()}
        ours, state = optim.apply_gradients(tx, grads, state, ours, step)
    for k in ref:
        assert torch.equal(ours[k], ref[k])


# --------------------------------------------------------------------------- rmsprop / adagrad

RMSPROP_OPTIONS = [
    {},
    {"centered": True},
    {"momentum": 0.9},
    {"centered": True, "momentum": 0.9},
    {"weight_decay": 1e-2},
    {"maximize": True},
    {"eps": 1e-6, "centered": True, "momentum": 0.5, "weight_decay": 1e-2, "maximize": True},
]


@pytest.mark.parametrize("kw", RMSPROP_OPTIONS, ids=str)
@pytest.mark.parametrize(("mode", "exact"), [("apply", True), ("update", False)])
def test_rmsprop_matches_torch_after_100_steps(kw, mode, exact):
    theirs = _reference(_opt(torch.optim.RMSprop, lr=1e-3, foreach=True, **kw), sign=_sign(kw))
    # The composable update form ends in u = -lr * x then p += u, where torch fuses
    # p.add_(x, alpha=-lr): one rounding apart per step. Centered RMSprop with momentum carries
    # that ulp for 100 steps to 0.8e-6 with 2 threads and 1.0e-6 with 1; the default (apply)
    # path is bitwise.
    tol = 2e-6 if kw.get("centered") and kw.get("momentum") else 1e-6
    _compare(_ours(optim.rmsprop(1e-3, **kw), mode, sign=_sign(kw)), theirs, exact, tol)


def test_rmsprop_with_a_short_average_is_bitwise():
    # alpha=0.9 on a deterministic gradient normalises near-zero gradient entries into full-size
    # steps: a one-ulp difference grows to 1e-4 in 100 steps, so only bitwise is a fair test.
    kw = {"alpha": 0.9, "eps": 1e-6, "centered": True, "momentum": 0.5}
    theirs = _reference(_opt(torch.optim.RMSprop, lr=1e-3, foreach=True, **kw))
    _compare(_ours(optim.rmsprop(1e-3, **kw)), theirs, exact=True)


ADAGRAD_OPTIONS = [
    {},
    {"lr_decay": 0.01},
    {"weight_decay": 1e-2},
    {"initial_accumulator_value": 0.1},
    {"eps": 1e-6},
    {"maximize": True},
    {"lr_decay": 0.01, "weight_decay": 1e-2, "initial_accumulator_value": 0.1, "maximize": True},
]


@pytest.mark.parametrize("kw", ADAGRAD_OPTIONS, ids=str)
@pytest.mark.parametrize(("mode", "exact"), [("apply", True), ("update", False)])
def test_adagrad_matches_torch_after_100_steps(kw, mode, exact):
    theirs = _reference(_opt(torch.optim.Adagrad, lr=0.05, foreach=True, **kw), sign=_sign(kw))
    _compare(_ours(optim.adagrad(0.05, **kw), mode, sign=_sign(kw)), theirs, exact)


# --------------------------------------------------------------------------- lion


def _lion_reference(lr, betas, weight_decay, steps=STEPS):
    """Lion (Chen et al. 2023, Algorithm 2), one tensor at a time."""
    b1, b2 = betas
    params = _mlp_params()
    exp_avg = {k: torch.zeros_like(v) for k, v in params.items()}
    for _ in range(steps):
        grads = torch.autograd.grad(_loss(params), list(params.values()))
        with torch.no_grad():
            for (k, p), g in zip(params.items(), grads, strict=True):
                m = exp_avg[k]
                p.mul_(1 - lr * weight_decay)
                update = m.mul(b1).add(g, alpha=1 - b1).sign_()
                p.add_(update, alpha=-lr)
                m.mul_(b2).add_(g, alpha=1 - b2)
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize(
    "kw", [{}, {"weight_decay": 0.1}, {"betas": (0.95, 0.98), "weight_decay": 1.0}], ids=str
)
@pytest.mark.parametrize(("mode", "exact"), [("apply", True), ("update", False)])
def test_lion_matches_the_papers_update(kw, mode, exact):
    theirs = _lion_reference(1e-3, kw.get("betas", (0.9, 0.99)), kw.get("weight_decay", 0.0))
    _compare(_ours(optim.lion(1e-3, **kw), mode), theirs, exact)


# --------------------------------------------------------------------------- schedules


@pytest.mark.parametrize(
    "make_opt",
    [
        _opt(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=True),
        _opt(torch.optim.AdamW, lr=1e-2, fused=True),
        _opt(torch.optim.Adam, lr=1e-2, foreach=True),
        _opt(torch.optim.RMSprop, lr=1e-3, momentum=0.5, foreach=True),
        _opt(torch.optim.Adagrad, lr=0.05, foreach=True),
    ],
    ids=["sgd", "adamw-fused", "adam-foreach", "rmsprop", "adagrad"],
)
def test_a_schedule_gives_bitwise_the_params_of_torch_lr_scheduler(make_opt):
    # gamma = 0.5 keeps torch's recursive lr products exact, so bitwise is attainable
    theirs = _reference(make_opt, functools.partial(tls.StepLR, step_size=30, gamma=0.5))
    cls, kw = make_opt.args[0], dict(make_opt.args[1])
    sched = optim.step_lr(kw.pop("lr"), step_size=30, gamma=0.5)
    fused = kw.pop("fused", False)
    kw.pop("foreach", None)
    build = {
        torch.optim.SGD: optim.sgd,
        torch.optim.Adam: optim.adam,
        torch.optim.AdamW: optim.adamw,
        torch.optim.RMSprop: optim.rmsprop,
        torch.optim.Adagrad: optim.adagrad,
    }[cls]
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        kw["fused"] = fused
    _compare(_ours(build(sched, **kw)), theirs, exact=True)


def test_warmup_cosine_schedule_matches_sequential_lr_to_1e6():
    def make_sched(o):
        return tls.SequentialLR(
            o,
            [tls.LinearLR(o, 0.1, 1.0, 10), tls.CosineAnnealingLR(o, T_max=90, eta_min=1e-4)],
            milestones=[10],
        )

    theirs = _reference(_opt(torch.optim.AdamW, lr=1e-2, fused=True), make_sched)
    sched = optim.warmup_cosine(1e-2, 10, 100, init=1e-3, end=1e-4)
    _compare(_ours(optim.adamw(sched)), theirs, exact=False)


# --------------------------------------------------------------------------- from_torch

FROM_TORCH = [
    (torch.optim.Adam, {}),
    (torch.optim.AdamW, {"fused": True, "amsgrad": True}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.Adagrad, {"initial_accumulator_value": 0.1}),  # initialises state eagerly
    (torch.optim.RAdam, {}),
    (torch.optim.NAdam, {}),
    (torch.optim.Adamax, {}),
    (torch.optim.Adadelta, {}),
    (torch.optim.ASGD, {}),
    (torch.optim.Rprop, {}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
]


@pytest.mark.parametrize(("cls", "kw"), FROM_TORCH, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("donate", [True, False])
def test_from_torch_is_bitwise_the_optimizer_itself(cls, kw, donate):
    steps = 20
    theirs = _reference(_opt(cls, lr=1e-2, **kw), steps=steps)
    tx = optim.from_torch(cls, lr=1e-2, **kw)
    params = _mlp_params()
    state = tx.init(params)
    for step in range(steps):
        grads = dict(
            zip(params, torch.autograd.grad(_loss(params), list(params.values())), strict=True)
        )
        # donate=False hands the optimizer fresh tensors every step
        params, state = optim.apply_gradients(tx, grads, state, params, step, donate=donate)
    _compare({k: v.detach() for k, v in params.items()}, theirs, exact=True)
    assert state.started and all(isinstance(v, dict) for v in state.state.values())
    assert all(p.grad is None for p in params.values())  # the adapter leaves .grad alone


def test_from_torch_state_is_real_tensors_in_the_pytree():
    tx = optim.from_torch(torch.optim.Adam, lr=1e-2)
    params = _mlp_params()
    state = tx.init(params)
    sd0 = optim.state_dict(state)
    assert ".state['fc1.weight']['exp_avg']" in sd0 and sd0[".started"] is False
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    params, state = optim.apply_gradients(tx, grads, state, params, 0)
    sd = optim.state_dict(state)
    assert sd.keys() == sd0.keys() and sd[".started"] is True
    assert sd[".state['fc1.weight']['step']"].item() == 1.0


def test_from_torch_follows_a_schedule():
    steps = 40
    theirs = _reference(
        _opt(torch.optim.NAdam, lr=1e-2),
        functools.partial(tls.StepLR, step_size=10, gamma=0.5),
        steps=steps,
    )
    tx = optim.from_torch(torch.optim.NAdam, lr=optim.step_lr(1e-2, 10, 0.5))
    _compare(_ours(tx, steps=steps), theirs, exact=True)


def test_from_torch_update_form_agrees_to_rounding():
    theirs = _reference(_opt(torch.optim.Adam, lr=1e-2), steps=20)
    tx = optim.from_torch(torch.optim.Adam, lr=1e-2)
    _compare(_ours(tx, mode="update", steps=20), theirs, exact=False)


def test_from_torch_rejects_what_it_cannot_run():
    with pytest.raises(TypeError, match=r"LBFGS.step\(\) needs a closure"):
        optim.from_torch(torch.optim.LBFGS, lr=1.0)
    with pytest.raises(TypeError, match="Optimizer subclass"):
        optim.from_torch(torch.optim.Adam([torch.zeros(1, requires_grad=True)]))
    with pytest.raises(ValueError, match=r"\(got -0.5\)"):
        optim.from_torch(torch.optim.Adam, lr=-0.5)
    with pytest.raises(ValueError, match=r"from_torch\(Adam.*beta parameter"):
        optim.from_torch(torch.optim.Adam, lr=1e-3, betas=(1.5, 0.9))


# --------------------------------------------------------------------------- transforms


def test_clip_by_global_norm_matches_clip_grad_norm_bitwise():
    for scale_ in (10.0, 0.01):  # clipped, and left alone (coefficient clamped to 1)
        grads = {k: torch.randn_like(v) * scale_ for k, v in _mlp_params().items()}
        leaves = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
        for leaf, g in zip(leaves, grads.values(), strict=True):
            leaf.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(leaves, max_norm=1.0)
        tx = optim.clip_by_global_norm(1.0)
        out, _ = tx.update(dict(grads), tx.init({}), {}, 0)
        for leaf, u in zip(leaves, out.values(), strict=True):
            assert torch.equal(leaf.grad, u)


def test_clip_by_value_matches_clip_grad_value_():
    grads = {k: torch.randn_like(v) for k, v in _mlp_params().items()}
    leaves = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
    for leaf, g in zip(leaves, grads.values(), strict=True):
        leaf.grad = g.clone()
    torch.nn.utils.clip_grad_value_(leaves, 0.5)
    tx = optim.clip_by_value(0.5)
    out, _ = tx.update(dict(grads), (), {}, 0)
    for leaf, u in zip(leaves, out.values(), strict=True):
        assert torch.equal(leaf.grad, u)


def test_adamw_mask_equals_torch_param_groups_bitwise():
    def groups(ps):  # torch's way: matrices decay, vectors (biases, LayerNorm) do not
        return [
            {"params": [p for p in ps if p.ndim >= 2]},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0},
        ]

    for fused in (True, False):
        theirs = _reference(functools.partial(_grouped, torch.optim.AdamW, groups, fused), steps=30)
        tx = optim.adamw(1e-2, weight_decay=0.5, mask=optim.decay_mask, fused=fused)
        _compare(_ours(tx, steps=30), theirs, exact=True)
        labels = {k: "decay" if m else "no" for k, m in optim.decay_mask(_mlp_params()).items()}
        tx = optim.multi_transform(
            {
                "decay": optim.adamw(1e-2, weight_decay=0.5, fused=fused),
                "no": optim.adamw(1e-2, weight_decay=0.0, fused=fused),
            },
            labels,
        )
        _compare(_ours(tx, steps=30), theirs, exact=True)


def _grouped(cls, groups, fused, params):
    kw = {"fused": True} if fused else {"foreach": True}
    return cls(groups(params), lr=1e-2, weight_decay=0.5, **kw)


def test_sgd_mask_leaves_unmasked_params_undecayed():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    tx = optim.sgd(1.0, weight_decay=0.5, mask=optim.decay_mask)
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    new, _ = optim.apply_gradients(tx, zero, tx.init(params), params, 0, donate=False)
    assert torch.equal(new["w"], torch.full((2, 2), 0.5)) and torch.equal(new["b"], params["b"])


def test_decay_mask_is_false_for_vectors_and_scalars():
    params = {
        "w": torch.zeros(3, 2),
        "conv": torch.zeros(1, 1, 3, 3),
        "b": torch.zeros(3),
        "t": torch.zeros(()),
    }
    assert optim.decay_mask(params) == {"w": True, "conv": True, "b": False, "t": False}


def test_masked_and_multi_transform_handle_empty_groups():
    params = _jagged(torch.float32)
    grads = _grads(params, 0)
    tx = optim.chain(optim.masked(optim.adam(1e-2), lambda ps: dict.fromkeys(ps, False)))
    new, _ = optim.apply_gradients(tx, grads, tx.init(params), params, 0, donate=False)
    for k in params:  # unmasked updates pass through: p + g
        assert torch.equal(new[k], params[k] + grads[k])
    tx = optim.multi_transform(
        {"a": optim.sgd(0.1), "unused": optim.adamw(0.1)}, lambda ps: dict.fromkeys(ps, "a")
    )
    new, _ = optim.apply_gradients(tx, grads, tx.init(params), params, 0, donate=False)
    for k in params:
        torch.testing.assert_close(new[k], params[k] - 0.1 * grads[k])


def test_tensor_math_bias_correction_agrees_with_python_floats(monkeypatch):
    """The path taken on accelerators and under torch.compile (no ``.item()``)."""
    expected = _ours(optim.adam(1e-2, amsgrad=True, fused=False), steps=20)
    expected_update = _ours(optim.adam(1e-2, fused=False), "update", steps=20)
    expected_ada = _ours(optim.adagrad(0.05, lr_decay=0.01), steps=20)
    monkeypatch.setattr(adaptive, "_tensor_math", lambda steps: True)
    _compare(_ours(optim.adam(1e-2, amsgrad=True, fused=False), steps=20), expected, True)
    _compare(_ours(optim.adam(1e-2, fused=False), "update", steps=20), expected_update, True)
    _compare(_ours(optim.adagrad(0.05, lr_decay=0.01), steps=20), expected_ada, True)


def test_state_dict_keys_are_readable():
    params = _mlp_params()
    sd = optim.state_dict(optim.adamw(1e-3).init(params))
    assert "[0].exp_avg['fc1.weight']" in sd and "[0].step['ln.bias']" in sd
    sd = optim.state_dict(optim.sgd(0.1, momentum=0.9).init(params))
    assert "[0].momentum_buffer['fc2.bias']" in sd


# --------------------------------------------------------------------------- conformance suite

_SCHED = optim.warmup_cosine(1e-2, warmup_steps=2, total_steps=10, init=1e-3)

CONFORMANCE = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd-all-options": lambda: optim.sgd(
        _SCHED, momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True
    ),
    "sgd-fused-dampening": lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, fused=True),
    "adam": lambda: optim.adam(1e-2),
    "adam-amsgrad-wd-maximize": lambda: optim.adam(
        _SCHED, amsgrad=True, weight_decay=0.1, maximize=True
    ),
    "adam-foreach": lambda: optim.adam(1e-2, amsgrad=True, fused=False),
    "adamw": lambda: optim.adamw(_SCHED),
    "adamw-foreach-masked": lambda: optim.adamw(
        1e-2, amsgrad=True, mask=optim.decay_mask, fused=False
    ),
    "rmsprop": lambda: optim.rmsprop(1e-2),
    "rmsprop-centered-momentum": lambda: optim.rmsprop(
        _SCHED, centered=True, momentum=0.9, weight_decay=1e-2
    ),
    "adagrad": lambda: optim.adagrad(_SCHED, lr_decay=0.1, initial_accumulator_value=0.1),
    "lion": lambda: optim.lion(1e-3, weight_decay=0.1),
    "identity": optim.identity,
    "scale": lambda: optim.scale(-0.5),
    "scale_by_learning_rate": lambda: optim.scale_by_learning_rate(_SCHED),
    "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
    "decoupled_weight_decay": lambda: optim.decoupled_weight_decay(0.1, _SCHED),
    "clip_by_global_norm": lambda: optim.clip_by_global_norm(0.5),
    "clip_by_value": lambda: optim.clip_by_value(0.1),
    "trace": lambda: optim.trace(0.9, dampening=0.1),
    "scale_by_adam": lambda: optim.scale_by_adam(amsgrad=True),
    "scale_by_rms": lambda: optim.scale_by_rms(centered=True),
    "scale_by_adagrad": lambda: optim.scale_by_adagrad(lr_decay=0.1),
    "scale_by_lion": lambda: optim.scale_by_lion(),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(_SCHED)),
    "masked": lambda: optim.chain(
        optim.masked(optim.add_decayed_weights(0.1), optim.decay_mask), optim.adam(1e-2)
    ),
    "masked-terminal": lambda: optim.masked(optim.adamw(1e-2), optim.decay_mask),
    "multi_transform": lambda: optim.multi_transform(
        {"decay": optim.adamw(1e-2, weight_decay=0.1), "rest": optim.sgd(0.1, momentum=0.9)},
        lambda ps: {k: "decay" if m else "rest" for k, m in optim.decay_mask(ps).items()},
    ),
    "from_torch-adam": lambda: optim.from_torch(torch.optim.Adam, lr=_SCHED),
    "from_torch-sgd": lambda: optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9),
    "from_torch-adagrad": lambda: optim.from_torch(torch.optim.Adagrad, lr=0.1),
}


def _jagged(dtype):
    """Params of different shapes, a 0-dim scalar among them."""
    g = torch.Generator().manual_seed(7)
    shapes = {"matrix": (3, 4), "vector": (5,), "scalar": (), "cube": (2, 3, 2), "one": (1,)}
    return {
        k: torch.randn(s, generator=g).to(dtype).requires_grad_(True) for k, s in shapes.items()
    }


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}


def _clone_tree(tree):
    return torch.utils._pytree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree
    )


def _tree_equal(a, b):
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    if sa != sb:
        return False
    return all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb, strict=True)
    )


def _run(tx, params, state, start, steps, donate=True):
    for step in range(start, start + steps):
        params, state = optim.apply_gradients(
            tx, _grads(params, step), state, params, step, donate=donate
        )
    return params, state


DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.mark.parametrize("name", sorted(CONFORMANCE))
def test_conformance_inputs_are_untouched_without_donation(name):
    tx = CONFORMANCE[name]()
    params = _jagged(torch.float32)
    params, state = _run(tx, params, tx.init(params), 0, 2)  # non-trivial state first
    grads = _grads(params, 2)
    before = _clone_tree((params, grads, state))
    new_params, _ = optim.apply_gradients(tx, grads, state, params, 2, donate=False)
    assert _tree_equal((params, grads, state), before)
    assert all(new_params[k] is not params[k] for k in params)
    assert not _tree_equal(new_params, params)
    # update itself never writes the params (it may consume grads and state)
    tx.update(_clone_tree(grads), _clone_tree(state), params, 2)
    assert _tree_equal(params, before[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CONFORMANCE))
def test_conformance_dtype_is_kept(name, dtype):
    tx = CONFORMANCE[name]()
    params = _jagged(dtype)
    params, state = _run(tx, params, tx.init(params), 0, 3)
    for k, p in params.items():
        assert p.dtype == dtype, k
        assert torch.isfinite(p).all(), k
    updates, _ = tx.update(_grads(params, 3), state, params, 3)
    assert all(u.dtype == dtype for u in updates.values())


@pytest.mark.parametrize("name", sorted(CONFORMANCE))
def test_conformance_state_round_trip_is_bitwise(name):
    tx = CONFORMANCE[name]()
    params, state = _run(tx, _jagged(torch.float32), tx.init(_jagged(torch.float32)), 0, 3)
    buf = io.BytesIO()
    torch.save(optim.state_dict(state), buf)
    buf.seek(0)
    loaded = optim.load_state_dict(tx.init(_jagged(torch.float32)), torch.load(buf))
    assert _tree_equal(loaded, state)
    p1, s1 = _run(tx, _clone_tree(params), state, 3, 3)
    p2, s2 = _run(tx, _clone_tree(params), loaded, 3, 3)
    assert _tree_equal(p1, p2) and _tree_equal(optim.state_dict(s1), optim.state_dict(s2))


@pytest.mark.parametrize("name", sorted(CONFORMANCE))
def test_conformance_jagged_shapes_with_a_scalar_param(name):
    tx = CONFORMANCE[name]()
    params = _jagged(torch.float64)
    start = _clone_tree(params)
    params, _ = _run(tx, params, tx.init(params), 0, 3)
    for k, p in params.items():
        assert p.shape == start[k].shape and torch.isfinite(p).all()
    assert not torch.equal(params["scalar"], start["scalar"])


@pytest.mark.parametrize("name", sorted(CONFORMANCE))
def test_conformance_donated_step_updates_the_same_tensors_in_place(name):
    tx = CONFORMANCE[name]()
    params = _jagged(torch.float32)
    state = tx.init(params)
    expected, _ = _run(tx, _clone_tree(params), _clone_tree(state), 0, 2, donate=False)
    ids = {k: (id(p), p.data_ptr()) for k, p in params.items()}
    out, _ = _run(tx, params, state, 0, 2, donate=True)
    assert {k: (id(p), p.data_ptr()) for k, p in out.items()} == ids
    assert _tree_equal(out, expected)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "build",
    [
        lambda: optim.sgd(-0.1),
        lambda: optim.adam(-0.1),
        lambda: optim.adamw(-0.1),
        lambda: optim.rmsprop(-0.1),
        lambda: optim.adagrad(-0.1),
        lambda: optim.lion(-0.1),
        lambda: optim.scale_by_learning_rate(-0.1),
    ],
)
def test_negative_lr_is_rejected_naming_the_value(build):
    with pytest.raises(ValueError, match=r"'lr' must be a non-negative float.*\(got -0.1\)"):
        build()


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: optim.adam(betas=(1.0, 0.999)),
            r"'betas\[0\]' must be a float in \[0.0, 1.0\) \(got 1.0\)",
        ),
        (lambda: optim.adamw(betas=(0.9, -0.1)), r"'betas\[1\]'.*\(got -0.1\)"),
        (lambda: optim.lion(betas=(0.9,)), r"'betas' must be a pair.*\(got \(0.9,\)\)"),
        (lambda: optim.adam(eps=-1e-8), r"'eps'.*\(got -1e-08\)"),
        (lambda: optim.sgd(0.1, momentum=-0.9), r"'momentum'.*\(got -0.9\)"),
        (lambda: optim.sgd(0.1, nesterov=True), r"nesterov.*momentum=0.0"),
        (lambda: optim.adamw(weight_decay=-1.0), r"'weight_decay'.*\(got -1.0\)"),
        (lambda: optim.adagrad(lr_decay=-1.0), r"'lr_decay'.*\(got -1.0\)"),
        (lambda: optim.clip_by_global_norm(-1.0), r"'max_norm'.*\(got -1.0\)"),
        (lambda: optim.adam(fused="yes"), r"'fused' must be True, False or None \(got 'yes'\)"),
    ],
)
def test_bad_hyperparameters_are_rejected_naming_the_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_mismatched_keys_are_rejected_naming_them():
    params = _jagged(torch.float32)
    tx = optim.adam(1e-2)
    state = tx.init(params)
    grads = _grads(params, 0)
    del grads["vector"]
    with pytest.raises(KeyError, match=r"missing grads: \['vector'\]"):
        optim.apply_gradients(tx, grads, state, params, 0)
    other = {"w": torch.zeros(2)}
    with pytest.raises(KeyError, match=r"state was built for \['cube', 'matrix'"):
        optim.adam(1e-2, fused=False).update({"w": torch.zeros(2)}, state, other, 0)
    with pytest.raises(KeyError, match=r"mask must give one entry per parameter.*got \['w'\]"):
        optim.masked(optim.scale(1.0), {"w": True}).init(params)
    with pytest.raises(KeyError, match=r"parameter \\?'matrix\\?' has label \\?'x"):
        optim.multi_transform({"a": optim.sgd(0.1)}, dict.fromkeys(params, "x")).init(params)


def test_fused_true_rejects_unsupported_params_and_none_falls_back():
    params = {"w": torch.zeros(2, device="meta")}
    grads = {"w": torch.ones(2, device="meta")}
    tx = optim.adamw(0.1, fused=True)
    with pytest.raises(ValueError, match=r"parameter 'w' is torch.float32 on meta"):
        optim.apply_gradients(tx, grads, tx.init(params), params, 0)
    tx = optim.adamw(0.1)  # fused=None: the foreach path
    new, _ = optim.apply_gradients(tx, grads, tx.init(params), params, 0)
    assert new["w"].device.type == "meta"


def test_complex_params_are_refused_with_a_pointer_to_from_torch():
    params = {"z": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(TypeError, match=r"'z' is complex.*from_torch"):
        optim.adam(0.1).init(params)
