"""The Trainer drives a user's own pure train step (``Task(step_fn=...)``): a GAN's two
optimizers in one step, with loop limits, validation, listeners, checkpoints and exact resume in
a fresh process; and the flags that act inside a built step are refused for it, by name."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim
from engine.step import CustomStep

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import gan  # noqa: E402  (examples/gan.py)

sys.path.remove(str(EXAMPLES))


def _trainer(root: Path, **kw) -> eg.Trainer:
    return eg.Trainer(
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


class _SaveAt(eg.Listener):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, rec):
        if rec.run.global_step == self.step:
            return eg.Save(self.path)
        return None


def _fit(root: Path, ckpt_path: str | None = None, **kw) -> eg.TrainState:
    task = gan.make_task()
    torch.manual_seed(0)
    state = task.init(gan.GAN(hidden=16), seed=3)
    train, val = gan.loaders(0)
    return _trainer(root, max_epochs=3, **kw).fit(task, state, train, val, ckpt_path=ckpt_path)


def test_a_gan_step_resumes_mid_epoch_in_a_fresh_process_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from pathlib import Path
        from test_custom_step import _fit, _SaveAt
        state = _fit(Path({str(tmp_path / "full")!r}), callbacks=[_SaveAt(21, Path({str(ckpt)!r}))])
        print(state.fingerprint())
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    full = done.stdout.split()[-1]
    meta = eg.checkpoint.read_meta(ckpt)
    assert (meta["step"], meta["epoch"], meta["batch_idx"]) == (21, 1, 5)  # mid-epoch
    resumed = _fit(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert resumed.step == 48 and resumed.fingerprint() == full


def test_a_gan_step_takes_both_optimizer_steps_and_keeps_both_states(tmp_path):
    task = gan.make_task()
    torch.manual_seed(0)
    state = task.init(gan.GAN(hidden=16), seed=3)
    before = {k: v.clone() for k, v in state.params.items()}
    (batch,) = [next(iter(gan.loaders(0)[0]))]
    state, metrics = task.train_step()(state, batch)
    assert state.step == 1 and state.batch_idx == 1
    assert sorted(metrics) == ["d_loss", "g_loss", "loss"]
    assert all(not torch.equal(before[k], state.params[k]) for k in before)  # both nets moved
    inner = state.opt_state.inner
    assert sorted(inner) == ["disc", "gen"]
    assert all(int(s) == 1 for s in inner["gen"][0].step.values())  # Adam's count, per group
    assert all(int(s) == 1 for s in inner["disc"][0].step.values())


@pytest.mark.parametrize(
    ("flag", "value"),
    [("accumulate_grad_batches", 2), ("gradient_clip_val", 1.0), ("compile", True)],
)
def test_flags_that_act_inside_a_built_step_are_refused_for_a_custom_one(tmp_path, flag, value):
    with pytest.raises(ValueError, match=rf"Trainer\({flag}=.*step_fn"):
        _fit(tmp_path, **{flag: value})


def test_listeners_inside_the_step_are_refused_for_a_custom_one(tmp_path):
    with pytest.raises(ValueError, match="on_after_backward run inside a step"):
        _fit(tmp_path, callbacks=[eg.on(eg.Event.ON_AFTER_BACKWARD, print)])


def test_a_task_is_a_loss_and_optimizer_or_a_step():
    def loss(m, b):
        return m(b).mean()

    def step(state, batch):
        return state, {}

    with pytest.raises(TypeError, match="give one"):
        eg.Task(loss, optim.sgd(0.1), step_fn=step)
    with pytest.raises(TypeError, match="must be callable"):
        eg.Task()
    with pytest.raises(TypeError, match=r"tx .* is missing"):
        eg.Task(loss)
    with pytest.raises(ValueError, match=r"Task\.init needs"):
        eg.Task(step_fn=step).init(nn.Linear(2, 1))
    with pytest.raises(ValueError, match="no evaluation function"):
        eg.Task(step_fn=step).eval_step()


def test_a_custom_step_that_breaks_its_contract_is_named(tmp_path):
    state = eg.TrainState.create(nn.Linear(2, 1), optim.sgd(0.1))

    def no_tuple(state, batch):
        return state

    def jumps(state, batch):
        return state.replace(batch_idx=state.batch_idx + 5), {}

    with pytest.raises(TypeError, match="no_tuple must return \\(state, metrics\\)"):
        CustomStep(no_tuple)(state, torch.ones(1, 2))
    state = eg.TrainState.create(nn.Linear(2, 1), optim.sgd(0.1))
    with pytest.raises(ValueError, match="jumps returned step 0, batch_idx 5"):
        CustomStep(jumps)(state, torch.ones(1, 2))


def test_a_custom_step_consumes_its_input_and_is_seeded_from_the_state():
    def noisy(state, batch):
        return state.replace(step=state.step + 1), {"loss": torch.rand(())}

    a = eg.TrainState.create(nn.Linear(2, 1), optim.sgd(0.1), seed=5)
    b = eg.TrainState.create(nn.Linear(2, 1), optim.sgd(0.1), seed=5)
    a2, ma = CustomStep(noisy)(a, None)
    _, mb = CustomStep(noisy)(b, None)
    assert torch.equal(ma["loss"], mb["loss"])  # the same draw from (seed, step)
    with pytest.raises(eg.ConsumedStateError):
        CustomStep(noisy)(a, None)
    assert not a2.consumed
    _ = F  # (torch.nn.functional: the GAN's losses)


def test_a_custom_step_refuses_an_autocasting_precision_and_runs_under_anomaly_detection():
    import warnings

    tx = optim.sgd(0.1)

    def step_fn(state, batch):
        seen.append(torch.is_anomaly_enabled())
        params = state.params
        loss = (eg.ModelView(state.module, params, state.buffers)(batch) ** 2).mean()
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        _, opt = optim.apply_gradients(tx, grads, state.opt_state, params, state.step)
        return state.replace(opt_state=opt, step=state.step + 1), {"loss": loss.detach()}

    seen: list[bool] = []
    task = eg.Task(step_fn=step_fn, tx=tx)
    data = [torch.ones(4, 2)] * 2
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*torch\.autocast"):
        eg.Trainer(max_epochs=1, precision="bf16-mixed", barebones=True).fit(
            task, task.init(torch.nn.Linear(2, 1)), data
        )
    state = eg.Trainer(max_epochs=1, precision="bf16-true", barebones=True).fit(
        task, task.init(torch.nn.Linear(2, 1)), data
    )
    assert state.params["weight"].dtype == torch.bfloat16  # a true precision casts for it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eg.Trainer(
            max_epochs=1,
            detect_anomaly=True,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
        ).fit(task, task.init(torch.nn.Linear(2, 1)), data)
    assert seen[-2:] == [True, True] and not torch.is_anomaly_enabled()
