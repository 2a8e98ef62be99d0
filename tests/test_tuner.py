"""``engine.Tuner`` and the tuner's listeners on engine alone: the state searched from is left
as it was, the learning rate reaches the task's own optimizer (a schedule, an injected rate,
a chain, parameter groups), the listeners' fits go on as Lightning's callbacks do, the
batch-size strategies try Lightning's sizes (golden sequences recorded from Lightning 2.6,
which ``tests/test_tuner_lightning.py`` checks are still Lightning's), and wrong arguments are
refused with what to pass. ``tests/test_tuner_lightning.py`` runs the searches against
Lightning's own tuner."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import engine as eg
from engine import optim
from engine.listeners import is_oom_error, lr_grid
from engine.listeners.batch_size_finder import binsearch_scaling, power_scaling, with_batch_size

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "enable_journal": False,
}


def _dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _loader(batch_size: int = 8, n: int = 64) -> DataLoader:
    return DataLoader(_dataset(n), batch_size=batch_size)


def _tuner(**flags) -> eg.Tuner:
    return eg.Tuner(eg.Trainer(**{**QUIET, **flags}))


SEARCH = {"min_lr": 1e-4, "max_lr": 1.0, "num_training": 20}


# ----------------------------------------------------------------------------- lr_find


def test_lr_find_leaves_the_state_it_is_given_as_it_was():
    task = eg.Task(_loss, optim.adamw(1e-3))
    state = task.init(_net())
    fingerprint = state.fingerprint()
    versions = [t._version for t in [*state.params.values(), *optim.state_dict(state.opt_state)
                                     .values()] if isinstance(t, torch.Tensor)]  # fmt: skip
    found = _tuner().lr_find(task, state, _loader(), **SEARCH)
    assert len(found.results["lr"]) == len(found.results["loss"]) > 0
    assert state.fingerprint() == fingerprint and not state.consumed
    after = [t._version for t in [*state.params.values(), *optim.state_dict(state.opt_state)
                                  .values()] if isinstance(t, torch.Tensor)]  # fmt: skip
    assert after == versions  # not written in place either (no donation reached them)
    trained = eg.Trainer(**QUIET, max_steps=2).fit(found.task, state, _loader())
    assert trained.step == 2


def test_lr_find_trains_at_each_grid_rate_on_the_trainers_flags():
    """The search's steps are those of a fit whose rate follows the grid: its losses are those
    of steps taken by hand at the grid's rates (the recorder's smoothing applied), under the
    Trainer's accumulation (the stepping batch's loss divided by the window, as Lightning's
    closure divides it)."""
    grid = lr_grid(**SEARCH)
    task = eg.Task(_loss, optim.sgd(0.1, momentum=0.9))
    state = task.init(_net())
    found = _tuner(accumulate_grad_batches=2).lr_find(task, state, _loader(), **SEARCH)
    assert found.results["lr"] == grid[: len(found.results["lr"])]
    # by hand: each optimizer step at grid[k], over two batches, the second's loss recorded
    step = eg.train_step(_loss, optim.sgd(lambda n: grid[n], momentum=0.9), accumulate=2)
    s, batches, avg, losses = state.copy(), list(_loader()), 0.0, []
    for k in range(len(found.results["lr"])):
        for j in range(2):
            s, metrics = step(s, batches[(2 * k + j) % len(batches)])
        avg = 0.98 * avg + (1 - 0.98) * (metrics["loss"] / 2).item()  # Lightning's / window
        losses.append(avg / (1 - 0.98 ** (k + 2)))
    assert found.results["loss"] == losses


def test_lr_find_reaches_an_injected_rate_a_chain_and_parameter_groups():
    """The same search through an injected rate (set from the grid at each step, the state's
    shape kept), a chain with clipping, and an optimizer per parameter group, gives the same
    curve as the plain optimizer where the math is the same."""
    plain = _tuner().lr_find(eg.Task(_loss, optim.sgd(0.1)), _state(optim.sgd(0.1)), _loader(),
                             **SEARCH)  # fmt: skip
    injected_tx = optim.inject_hyperparams(optim.sgd)(lr=0.1)
    injected = _tuner().lr_find(eg.Task(_loss, injected_tx), _state(injected_tx), _loader(),
                                **SEARCH)  # fmt: skip
    labels = {"0.weight": "a", "0.bias": "a", "2.weight": "b", "2.bias": "b"}
    groups_tx = optim.multi_transform({"a": optim.sgd(0.1), "b": optim.sgd(0.5)}, labels)
    groups = _tuner().lr_find(eg.Task(_loss, groups_tx), _state(groups_tx), _loader(), **SEARCH)
    chained_tx = optim.chain(optim.clip_by_global_norm(1e6), optim.sgd(0.1))
    chained = _tuner().lr_find(eg.Task(_loss, chained_tx), _state(chained_tx), _loader(),
                               **SEARCH)  # fmt: skip
    for other in (injected, groups, chained):
        assert other.results == plain.results
    # update_attr: the rate reaches an injected optimizer's new states, and an existing state
    state = _state(injected_tx)
    assert optim.get_hyperparams(injected.task.init(_net()).opt_state)["lr"] == injected.task_lr
    assert optim.get_hyperparams(injected.with_lr(state).opt_state)["lr"] == injected.task_lr
    assert optim.get_hyperparams(state.opt_state)["lr"] == 0.1  # a new state, not this one
    plain_state = _state(optim.sgd(0.1))
    assert plain.with_lr(plain_state) is plain_state  # nothing of the rate in the state


def _state(tx):
    return eg.Task(_loss, tx).init(_net())


def test_lr_find_without_update_attr_returns_no_task():
    task = eg.Task(_loss, optim.sgd(0.1))
    found = _tuner().lr_find(task, task.init(_net()), _loader(), update_attr=False, **SEARCH)
    assert found.task is None and found.suggestion() is not None
    with pytest.raises(ValueError, match="no suggested rate"):
        found.with_lr(task.init(_net()))


def test_lr_find_takes_a_datamodules_loader_and_sets_it_up():
    calls = []

    class Data:
        def prepare_data(self):
            calls.append("prepare_data")

        def setup(self, stage):
            calls.append(f"setup {stage}")

        def train_dataloader(self):
            calls.append("train_dataloader")
            return _loader()

        def teardown(self, stage):
            calls.append(f"teardown {stage}")

    task = eg.Task(_loss, optim.sgd(0.1))
    state = task.init(_net())
    by_dm = _tuner().lr_find(task, state, datamodule=Data(), **SEARCH)
    assert calls == ["prepare_data", "setup fit", "train_dataloader", "teardown fit"]
    assert by_dm.results == _tuner().lr_find(task, state, _loader(), **SEARCH).results


def test_suggestion_skips_nonfinite_losses_and_says_when_it_cannot_suggest():
    found = eg.tuner.LRFinderResult("exponential", 1e-3, 1.0, 5)
    found.results = {"lr": [1e-3, 1e-2, 1e-1, 0.5, 1.0], "loss": [1.0, 0.99, 0.5, 0.45, 9.0]}
    assert found.suggestion(0, 0) == 0.1  # skip_end=0 keeps the end (Lightning drops all)
    # a NaN loss is left out: the suggestion is that of the finite points, indexed in all
    found.results = {"lr": [1e-3, 1e-2, 1e-1, 0.3, 0.5, 1.0],
                     "loss": [1.0, 0.99, float("nan"), 0.8, 0.45, 9.0]}  # fmt: skip
    finite = eg.tuner.LRFinderResult("exponential", 1e-3, 1.0, 5)
    finite.results = {"lr": [1e-3, 1e-2, 0.3, 0.5, 1.0], "loss": [1.0, 0.99, 0.8, 0.45, 9.0]}
    assert found.suggestion(0, 1) == finite.suggestion(0, 1) == 0.5
    assert found.optimal_idx == 4 and finite.optimal_idx == 3
    with pytest.warns(RuntimeWarning, match="no learning rate suggested: 1 finite"):
        assert found.suggestion(4, 1) is None
    assert found.optimal_idx is None
    with pytest.raises(ValueError, match="skip_end=-1"):
        found.suggestion(0, -1)


def test_plot_draws_the_curve_and_the_suggestion_on_a_figure():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    task = eg.Task(_loss, optim.sgd(0.1))
    found = _tuner().lr_find(task, task.init(_net()), _loader(), **SEARCH)
    fig = found.plot(suggest=True)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    curve, mark = ax.lines
    assert list(curve.get_xdata()) == found.results["lr"]
    assert list(mark.get_xdata()) == [found.suggestion()]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "Learning rate"
    assert found.plot(ax=Figure().subplots()) is not fig  # onto the axes given


def test_plot_without_matplotlib_says_to_install_it(monkeypatch):
    found = eg.tuner.LRFinderResult("linear", 0.1, 1.0, 2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.raises(ImportError, match="pip install matplotlib"):
        found.plot()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"min_lr": 1.0, "max_lr": 0.1}, "max_lr must be greater than min_lr"),
        ({"min_lr": 0.0}, r"min_lr must be a positive float \(got 0.0\)"),
        ({"num_training": 0}, r"num_training must be a positive int \(got 0\)"),
        ({"mode": "cosine"}, "mode must be 'exponential' or 'linear'"),
        ({"early_stop_threshold": -1.0}, "early_stop_threshold must be a positive"),
        ({"method": "validate"}, "method='fit' is the only one"),
        ({"dataloaders": [1]}, "not dataloaders"),
    ],
)
def test_lr_find_refuses_bad_arguments(kw, match):
    task = eg.Task(_loss, optim.sgd(0.1))
    with pytest.raises(ValueError, match=match):
        _tuner().lr_find(task, task.init(_net()), _loader(), **kw)


def test_lr_find_refuses_an_optimizer_without_a_rate_and_a_custom_step():
    hand_built = optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-3))
    task = eg.Task(_loss, hand_built)
    with pytest.raises(ValueError, match="records no optimizer taking lr="):
        _tuner().lr_find(task, task.init(_net()), _loader())
    custom = eg.Task(step_fn=lambda s, b: (s, {}), tx=optim.sgd(0.1))
    with pytest.raises(ValueError, match="own step_fn"):
        _tuner().lr_find(custom, custom.init(_net()), _loader())


def test_the_tuner_refuses_what_lightnings_refuses():
    task = eg.Task(_loss, optim.sgd(0.1))
    state = task.init(_net())
    with pytest.raises(TypeError, match=r"pass an engine\.Trainer"):
        eg.Tuner(object())
    finder = eg.Tuner(eg.Trainer(**QUIET, callbacks=[eg.LearningRateFinder()]))
    with pytest.raises(ValueError, match="already has a LearningRateFinder"):
        finder.lr_find(task, state, _loader())
    with pytest.warns(UserWarning, match="fast_dev_run"):
        assert _tuner(fast_dev_run=True).lr_find(task, state, _loader()) is None
    with pytest.warns(UserWarning, match="fast_dev_run"):
        assert _tuner(fast_dev_run=True).scale_batch_size(task, state, _loader()) is None
    with pytest.raises(ValueError, match="searches the training batch size"):
        _tuner().scale_batch_size(task, state, dataloaders=_loader(), method="validate")
    with pytest.raises(TypeError, match="no batch size to change"):
        _tuner().scale_batch_size(task, state, DataLoader(_dataset(), batch_size=None))
    with pytest.raises(ValueError, match="no 'batch_size' attribute"):
        _tuner().scale_batch_size(task, state, datamodule=_Data(size=None))
    assert state.fingerprint() == task.init(_net()).fingerprint()


# ----------------------------------------------------------------------------- with_learning_rate


def test_with_learning_rate_keeps_the_optimizer_state_shape():
    for tx in (
        optim.adamw(1e-3, weight_decay=0.1),
        optim.inject_hyperparams(optim.adamw)(lr=1e-3, weight_decay=0.1),
        optim.from_torch(torch.optim.RAdam, lr=1e-3),
        optim.masked(optim.sgd(0.1), {"w": True, "b": False}),
    ):
        params = {"w": torch.ones(2), "b": torch.ones(1)}
        made = tx.init(params)
        for lr in (0.5, lambda n: 0.5):
            new = optim.with_learning_rate(tx, lr)
            assert torch.utils._pytree.tree_structure(new.init(params)) == (
                torch.utils._pytree.tree_structure(made)
            )
            out, _ = optim.apply_gradients(new, {"w": torch.ones(2), "b": torch.ones(1)}, made,
                                           params, 0, donate=False)  # fmt: skip
            assert out["w"].ne(params["w"]).all()


def test_with_learning_rate_steps_at_the_rate_given():
    """A step of the rebuilt optimizer is the step of the optimizer built with that rate,
    bitwise (AdamW's decoupled decay included), a schedule read at the step."""
    params = {"w": torch.randn(4, generator=torch.Generator().manual_seed(0))}
    grads = {"w": torch.randn(4, generator=torch.Generator().manual_seed(1))}
    for build in (optim.adamw, optim.inject_hyperparams(optim.adamw)):
        new = optim.with_learning_rate(build(lr=1e-3, weight_decay=0.1), lambda n: 0.25 * n)
        ref = build(lr=0.75, weight_decay=0.1)
        got, _ = optim.apply_gradients(new, grads, ref.init(params), params, 3, donate=False)
        want, _ = optim.apply_gradients(ref, grads, ref.init(params), params, 3, donate=False)
        assert torch.equal(got["w"], want["w"])


# ----------------------------------------------------------------------------- the listeners


def test_the_lr_finder_listener_goes_on_at_the_suggestion():
    """Lightning's semantics: the search runs when the fit starts, then the fit trains at the
    suggested rate from the state it was given: the same run as the Tuner's search followed
    by a fit of the state with that rate. The other listeners hear only the fit."""
    tx = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9)
    task = eg.Task(_loss, tx)
    finder, batches = eg.LearningRateFinder(**_listener_search()), []
    counter = eg.on(eg.Event.ON_TRAIN_BATCH_END, lambda rec: batches.append(rec.batch_idx))
    flags = {**QUIET, "max_epochs": 2}
    listened = eg.Trainer(**flags, callbacks=[finder, counter]).fit(task, task.init(_net()),
                                                                    _loader())  # fmt: skip
    found = eg.Tuner(eg.Trainer(**flags)).lr_find(task, task.init(_net()), _loader(), **SEARCH)
    by_hand = eg.Trainer(**flags).fit(found.task, found.with_lr(task.init(_net())), _loader())
    assert finder.optimal_lr.results == found.results
    assert optim.get_hyperparams(listened.opt_state)["lr"] == found.task_lr != 0.1
    assert listened.fingerprint() == by_hand.fingerprint()
    assert batches == list(range(8)) * 2


def _listener_search():
    return {"min_lr": 1e-4, "max_lr": 1.0, "num_training_steps": 20}


def test_the_lr_finder_listener_without_update_attr_leaves_the_fit_as_it_was():
    task = eg.Task(_loss, optim.sgd(0.1))
    finder = eg.LearningRateFinder(update_attr=False, **_listener_search())
    with_finder = eg.Trainer(**QUIET, max_epochs=3, callbacks=[finder]).fit(
        task, task.init(_net()), _loader()
    )
    without = eg.Trainer(**QUIET, max_epochs=3).fit(task, task.init(_net()), _loader())
    assert with_finder.fingerprint() == without.fingerprint()
    assert finder.optimal_lr is not None and finder.optimal_lr.suggestion() is not None


def test_the_lr_finder_listener_needs_an_injected_rate_to_set_it():
    task = eg.Task(_loss, optim.sgd(0.1))
    trainer = eg.Trainer(**QUIET, max_epochs=1, callbacks=[eg.LearningRateFinder()])
    with pytest.raises(ValueError, match=r"optim.inject_hyperparams\(optim.adamw\)\(lr=1e-3\)"):
        trainer.fit(task, task.init(_net()), _loader())


def test_a_run_with_the_lr_finder_replays_bitwise(tmp_path):
    tx = optim.inject_hyperparams(optim.sgd)(lr=0.1)
    task = eg.Task(_loss, tx)
    trainer = eg.Trainer(**{**QUIET, "enable_journal": True}, max_epochs=2,
                         default_root_dir=tmp_path,
                         callbacks=[eg.LearningRateFinder(**_listener_search())])  # fmt: skip
    trainer.fit(task, task.init(_net()), _loader())
    names = [x["transition"] for x in eg.Journal.read(trainer.run_dir) if "transition" in x]
    assert len(names) == 1 and names[0].startswith("LearningRateFinder: lr=")
    report = eg.replay(trainer.run_dir, 1, 16, trust_code=True)
    assert report.identical and report.steps == 16, str(report)


class _Data:
    """A datamodule whose loader reads ``batch_size``; records each loader's size."""

    def __init__(self, size: int | None = 4, n: int = 256):
        if size is not None:
            self.batch_size = size
        self.n, self.fetched = n, []

    def train_dataloader(self):
        self.fetched.append(self.batch_size)
        return _loader(self.batch_size, self.n)


def _failing_loss(fail_above: int, sizes: list[int]):
    def loss(model, batch):
        sizes.append(batch[0].shape[0])
        if batch[0].shape[0] > fail_above:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return _loss(model, batch)

    return loss


def test_the_batch_size_finder_listener_fits_with_the_size_found():
    sizes: list[int] = []
    task = eg.Task(_failing_loss(40, sizes), optim.sgd(0.1))
    data, finder = _Data(n=200), eg.BatchSizeFinder(steps_per_trial=1)
    state = eg.Trainer(**QUIET, max_epochs=1, callbacks=[finder]).fit(
        task, task.init(_net()), datamodule=data
    )
    assert finder.optimal_batch_size == data.batch_size == 32
    assert sizes[: -state.step] == [2, 4, 8, 16, 32, 64]  # the trials, a step each
    assert state.step == 7 and sizes[-state.step :] == [32] * 6 + [200 - 6 * 32]
    assert data.fetched == [4, 2, 4, 8, 16, 32, 64, 32]  # the fit's, the trials', the fit's


def test_the_batch_size_finder_needs_a_datamodule():
    task = eg.Task(_loss, optim.sgd(0.1))
    trainer = eg.Trainer(**QUIET, max_epochs=1, callbacks=[eg.BatchSizeFinder()])
    with pytest.raises(ValueError, match=r"no datamodule: pass fit\(datamodule=\.\.\.\)"):
        trainer.fit(task, task.init(_net()), _loader())


# ----------------------------------------------------------------------------- scale_batch_size

# (mode, fail above, arguments) -> (size, sizes tried): recorded from Lightning 2.6's
# Tuner.scale_batch_size on a 1000-sample datamodule starting at init_val
# (tests/test_tuner_lightning.py checks these are still Lightning's)
LIGHTNING_TRIED = {
    ("power", 48, ()): (32, [2, 4, 8, 16, 32, 64]),
    ("binsearch", 48, ()): (45, [2, 4, 8, 16, 32, 64, 48, 56, 52, 50, 49]),
    ("power", 100, (("init_val", 3), ("steps_per_trial", 2))): (96, [3, 6, 12, 24, 48, 96, 192]),
    ("binsearch", 100, (("init_val", 3), ("steps_per_trial", 2))): (
        95, [3, 6, 12, 24, 48, 96, 192, 144, 120, 108, 102, 99, 100, 101]),
    ("power", 37, (("max_trials", 4),)): (16, [2, 4, 8, 16]),
    ("binsearch", 37, (("max_trials", 4),)): (15, [2, 4, 8, 16]),
    ("power", 300, (("max_val", 256), ("margin", 0.1))): (256, [2, 4, 8, 16, 32, 64, 128]),
    ("binsearch", 300, (("max_val", 256), ("margin", 0.1))): (
        230, [2, 4, 8, 16, 32, 64, 128]),
    ("power", 1, ()): (1, [2, 1, 2]),
    ("binsearch", 1, ()): (1, [2]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(LIGHTNING_TRIED, key=repr))
def test_the_strategies_try_lightnings_sizes(case, monkeypatch):
    # the trials hold no memory: the garbage collection after each failure (a quarter second
    # in this process) is left out
    monkeypatch.setattr("engine.listeners.batch_size_finder._release_memory", lambda: None)
    mode, fail_above, kw = case
    kw = dict(kw)
    kw.pop("steps_per_trial", None)
    tried: list[int] = []

    def trial(size: int) -> None:
        tried.append(size)
        if size > fail_above:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    init, trials = kw.pop("init_val", 2), kw.pop("max_trials", 25)
    if mode == "power":
        kw.pop("margin", None)
        size = power_scaling(trial, init, trials, dataset_length=1000, **kw)
    else:
        size = binsearch_scaling(trial, init, trials, dataset_length=1000, **kw)
    assert (size, tried) == LIGHTNING_TRIED[case]


def test_scale_batch_size_trains_copies_and_rebuilds_the_loader():
    sizes: list[int] = []
    task = eg.Task(_failing_loss(48, sizes), optim.adamw(1e-3))
    state = task.init(_net())
    fingerprint = state.fingerprint()
    loader = DataLoader(_dataset(256), batch_size=5, shuffle=True, drop_last=True)
    size = _tuner().scale_batch_size(task, state, loader, mode="power", steps_per_trial=2)
    assert size == 32 and sizes == [2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64]
    assert state.fingerprint() == fingerprint and not state.consumed
    rebuilt = with_batch_size(loader, 7)
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.sampler) == (7, True, loader.sampler)


def test_scale_batch_size_stops_growing_at_the_datasets_length():
    task = eg.Task(_loss, optim.sgd(0.1))
    data = _Data(n=20)
    size = _tuner().scale_batch_size(task, task.init(_net()), datamodule=data, steps_per_trial=1)
    assert size == 32 and data.batch_size == 32 and data.fetched == [2, 4, 8, 16, 32]


def test_scale_batch_size_raises_what_is_no_oom_and_an_oom_at_size_one():
    def broken(model, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    task = eg.Task(broken, optim.sgd(0.1))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _tuner().scale_batch_size(task, task.init(_net()), _loader())
    oom = eg.Task(_failing_loss(0, []), optim.sgd(0.1))
    with pytest.raises(RuntimeError, match="even batch size 1 runs out of memory"):
        _tuner().scale_batch_size(oom, oom.init(_net()), _loader(), init_val=1)


def test_is_oom_error_knows_the_messages_of_the_devices():
    assert is_oom_error(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_oom_error(torch.OutOfMemoryError("MPS backend out of memory"))
    assert is_oom_error(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error"))
    assert is_oom_error(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom_error(RuntimeError("Expected all tensors to be on the same device"))
    assert not is_oom_error(ValueError("out of memory"))  # Lightning's: RuntimeErrors only


# ----------------------------------------------------------------------------- Search


def test_a_search_runs_trials_mid_fit_without_changing_the_fit():
    task = eg.Task(_loss, optim.sgd(0.1))
    trials_ran = []

    class Probe(eg.Listener):
        def on_train_epoch_start(self, rec):
            def search(trials):
                end = trials.fit(rec.run.task, rec.state.copy(), rec.run.train_dataloader,
                                 steps=3)  # fmt: skip
                trials_ran.append(end.step - rec.state.step)

            return eg.Search(search)

    probed = eg.Trainer(**QUIET, max_epochs=2, callbacks=[Probe()]).fit(
        task, task.init(_net()), _loader()
    )
    plain = eg.Trainer(**QUIET, max_epochs=2).fit(task, task.init(_net()), _loader())
    assert trials_ran == [3, 3] and probed.fingerprint() == plain.fingerprint()


def test_a_search_outside_fit_or_returning_a_search_is_refused():
    task = eg.Task(_loss, optim.sgd(0.1))
    again = eg.on(eg.Event.ON_FIT_START, lambda rec: eg.Search(lambda t: eg.Search(print)))
    with pytest.raises(RuntimeError, match="returned another Search"):
        eg.Trainer(**QUIET, max_epochs=1, callbacks=[again]).fit(task, task.init(_net()),
                                                                 _loader())  # fmt: skip
    in_validate = eg.on(eg.Event.ON_VALIDATION_START, lambda rec: eg.Search(print))
    with pytest.raises(RuntimeError, match="a search runs trial fits between the steps of a fit"):
        eg.Trainer(**QUIET, callbacks=[in_validate]).validate(task, task.init(_net()), _loader())
    with pytest.raises(TypeError, match="pass a function trials"):
        eg.Search(3)


def test_lightnings_tuner_attribute_names_engines():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = eg.Trainer(**QUIET)
    with pytest.raises(AttributeError, match=r"engine.Tuner\(trainer\)"):
        trainer.tuner  # noqa: B018


def test_a_resumed_fit_does_not_search_again(tmp_path):
    """The checkpoint holds what the listeners found: resumed, the batch-size finder sets the
    size it found on the new datamodule without a trial, the learning-rate finder leaves the
    checkpoint's rate, and the fit goes on with both."""
    sizes: list[int] = []
    task = eg.Task(_failing_loss(40, sizes), optim.inject_hyperparams(optim.sgd)(lr=0.1))
    flags = {**QUIET, "max_epochs": 1}
    first = [eg.BatchSizeFinder(steps_per_trial=1), eg.LearningRateFinder(**_listener_search())]
    trainer = eg.Trainer(**flags, callbacks=first)
    state = trainer.fit(task, task.init(_net()), datamodule=_Data(n=1024))
    # as in Lightning, the learning-rate search (listed second) ran at the size found
    assert first[1].optimal_lr.results["lr"] == lr_grid(1e-4, 1.0, 20)
    assert sizes[-(20 + 32) :] == [32] * (20 + 32)  # its 20 steps, then the fit's 32
    trainer.save_checkpoint(tmp_path / "ckpt")
    found_lr = optim.get_hyperparams(state.opt_state)["lr"]
    assert first[0].optimal_batch_size == 32 and found_lr != 0.1
    sizes.clear()
    again = [eg.BatchSizeFinder(steps_per_trial=1), eg.LearningRateFinder(**_listener_search())]
    data = _Data(n=1024)
    resumed = eg.Trainer(**{**flags, "max_epochs": 2}, callbacks=again).fit(
        task, task.init(_net()), datamodule=data, ckpt_path=str(tmp_path / "ckpt")
    )
    assert again[0].optimal_batch_size == data.batch_size == 32 and again[1].optimal_lr is None
    assert sizes == [32] * 32  # the second epoch alone: no trial ran
    assert optim.get_hyperparams(resumed.opt_state)["lr"] == found_lr
