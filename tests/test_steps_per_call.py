"""K optimizer steps per call (``steps_per_call``): the same numbers as K single steps (bitwise
eager, within compile's tolerance compiled), metrics for every micro-batch, bad input refused
before the state is consumed."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import optim

pytestmark = pytest.mark.budget(
    share=0.10,
    why="seven tests compile K-step blocks, and a clean machine's Inductor cache is cold: 54 s in "
    "CI's run (5.8%), 10 s with a warm cache, 90 s cold alone",
)


def _mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 5))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 10, generator=g), torch.randint(0, 5, (16,), generator=g))
        for _ in range(n)
    ]


def _ce(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def _singles(batches, *, accumulate=1, dropout=0.0, compile=False, flush_last=False, **kw):
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=accumulate, compile=compile, **kw)
    state = eg.TrainState.create(_mlp(dropout), tx, seed=3)
    out = []
    for i, b in enumerate(batches):
        state, m = step(state, b, flush=flush_last and i == len(batches) - 1)
        out.append(m)
    return state, out


def _assert_states_equal(a, b, exact=True):
    for k in a.params:
        if exact:
            assert torch.equal(a.params[k], b.params[k]), k
        else:
            torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-5, atol=1e-6)
    assert (a.step, a.micro_step, a.batch_idx) == (b.step, b.micro_step, b.batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_eager_block_is_bitwise_single_steps_with_dropout(accumulate):
    K = 3
    batches = _batches(K * accumulate * 2)
    ref, ref_metrics = _singles(batches, accumulate=accumulate, dropout=0.3, grad_norm=True)
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=accumulate, steps_per_call=K, grad_norm=True)
    state = eg.TrainState.create(_mlp(0.3), tx, seed=3)
    n = K * accumulate
    state, first = step(state, batches[:n])
    state, second = step(state, batches[n:])
    _assert_states_equal(state, ref)
    assert state.step == 2 * K
    for got, part in ((first, ref_metrics[:n]), (second, ref_metrics[n:])):
        assert got["loss"].shape == (n,)
        assert torch.equal(got["loss"], torch.stack([m["loss"] for m in part]))
        assert torch.equal(got["acc"], torch.stack([m["acc"] for m in part]))
        # grad_norm is reported by the calls that step the optimizer: one per window
        assert torch.equal(
            got["grad_norm"], torch.stack([m["grad_norm"] for m in part if "grad_norm" in m])
        )
        assert got["grad_norm"].shape == (K,)


def test_stacked_batch_equals_the_list():
    batches = _batches(4)
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, steps_per_call=4)
    a, ma = step(eg.TrainState.create(_mlp(), tx, seed=0), batches)
    stacked = (torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
    b, mb = step(eg.TrainState.create(_mlp(), tx, seed=0), stacked, stacked=True)
    _assert_states_equal(a, b)
    assert torch.equal(ma["loss"], mb["loss"])


def test_a_shorter_call_runs_single_steps_and_flushes_the_partial_window():
    batches = _batches(3)
    ref, _ = _singles(batches, accumulate=2, flush_last=True)
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, accumulate=2, steps_per_call=4)
    state = eg.TrainState.create(_mlp(), tx, seed=3)
    state, metrics = step(state, batches, flush=True)
    _assert_states_equal(state, ref)
    assert state.step == 2 and state.micro_step == 0 and metrics["loss"].shape == (3,)


def test_donate_false_leaves_the_input_state_unchanged():
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, steps_per_call=2, donate=False)
    state = eg.TrainState.create(_mlp(), tx, seed=0)
    before = {k: v.clone() for k, v in state.params.items()}
    new, _ = step(state, _batches(2))
    assert all(torch.equal(before[k], state.params[k]) for k in before)
    assert new.step == 2 and state.step == 0


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_steps_per_call_must_be_a_positive_int(bad):
    with pytest.raises(
        ValueError, match=r"steps_per_call must be a positive int.*" + repr(bad).replace(".", r"\.")
    ):
        eg.train_step(_ce, optim.sgd(0.1), steps_per_call=bad)


def test_bad_batches_are_refused_before_the_state_is_consumed():
    tx = optim.sgd(0.1)
    step = eg.train_step(_ce, tx, steps_per_call=2)
    state = eg.TrainState.create(_mlp(), tx, seed=0)
    x, y = _batches(1)[0]
    with pytest.raises(TypeError, match="list or tuple of batches"):
        step(state, iter([(x, y), (x, y)]))
    with pytest.raises(ValueError, match="empty"):
        step(state, [])
    with pytest.raises(TypeError, match="stacked=True takes a batch of tensors"):
        step(state, (x, "labels"), stacked=True)
    with pytest.raises(ValueError, match=r"first dimensions differ \(\[3, 4\]\)"):
        step(state, (torch.zeros(3, 16, 10), torch.zeros(4, 16)), stacked=True)
    state, _ = step(state, [(x, y), (x, y)])  # still the caller's: nothing was consumed
    assert state.step == 2


def test_compiled_block_is_one_graph_and_equals_single_compiled_steps():
    K = 2
    batches = _batches(2 * K)
    ref, ref_metrics = _singles(batches, compile=True)
    eager, _ = _singles(batches)
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, compile=True, steps_per_call=K)
    state = eg.TrainState.create(_mlp(), tx, seed=3)
    losses = []
    for i in range(0, len(batches), K):
        state, m = step(state, batches[i : i + K])
        losses.append(m["loss"])
    assert step._block is not None  # the calls ran as blocks, not as single steps
    # one graph each, the step counter symbolic from the first call: no recompile for it
    # (one graph would have been specialised to the first call's step, then compiled again)
    single = eg.train_step(_ce, tx, compile=True)
    one = eg.TrainState.create(_mlp(), tx, seed=3)
    for b in batches[:3]:
        one, _ = single(one, b)
    for core in (step._block, single._update):
        (compiled,) = core.by_module.values()
        code = compiled._torchdynamo_orig_callable.__code__
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) == 1
    _assert_states_equal(state, ref, exact=False)
    _assert_states_equal(state, eager, exact=False)
    torch.testing.assert_close(
        torch.cat(losses), torch.stack([m["loss"] for m in ref_metrics]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "compile",
    [True, {"options": {"size_asserts": False}}, {"mode": "default"}],
    ids=["engine-options", "user-options", "user-mode"],
)
def test_a_compiled_block_computes_the_floats_of_single_compiled_steps(compile):
    # a block and a single step store each step's values alike (STORE_EACH_STEP) with any
    # Inductor options the user gives: a run whose blocks fall elsewhere (a resumed one)
    # continues bitwise
    batches = _batches(8)
    ref, ref_metrics = _singles(batches, compile=compile)
    step, state, losses = _in_blocks(batches, 4, compile=compile)
    assert step._block is not None  # the calls ran as blocks
    _assert_states_equal(state, ref)
    assert torch.equal(losses, torch.stack([m["loss"] for m in ref_metrics]))


def _in_blocks(batches, k, **kw):
    """``(step, state, losses)`` of a ``steps_per_call=k`` step called on ``batches``, k at a
    time, from the state :func:`_singles` starts from."""
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, steps_per_call=k, **kw)
    state = eg.TrainState.create(_mlp(), tx, seed=3)
    losses = []
    for i in range(0, len(batches), k):
        state, m = step(state, batches[i : i + k])
        losses.append(m["loss"])
    return step, state, torch.cat(losses)


def test_a_cpu_model_over_the_unroll_limit_runs_its_blocks_as_single_compiled_steps(monkeypatch):
    # _mlp has 517 parameter elements: a limit under that makes it "large"
    import engine.step._train as train

    batches = _batches(8)
    ref, ref_metrics = _singles(batches, compile=True)
    for limit, unrolled in ((516, False), (517, True)):
        monkeypatch.setattr(train, "UNROLL_LIMIT", limit)
        step, state, losses = _in_blocks(batches, 4, compile=True)
        assert (step._block is not None) is unrolled
        _assert_states_equal(state, ref)
        assert torch.equal(losses, torch.stack([m["loss"] for m in ref_metrics]))


# ---------------------------------------------------------------- the Trainer's blocks


def _data(n=20, seed=5):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n * 8, 10, generator=g), torch.randint(0, 5, (n * 8,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(
    tmp_path,
    name,
    *,
    steps_per_call,
    callbacks=(),
    compile=False,
    ckpt_path=None,
    dropout=0.2,
    **flags,
):
    tx = optim.adamw(1e-2)
    task = eg.Task(_ce, tx)
    state = eg.TrainState.create(_mlp(dropout), tx, seed=7)
    trainer = eg.Trainer(
        default_root_dir=tmp_path / name,
        steps_per_call=steps_per_call,
        callbacks=list(callbacks),
        compile=compile,
        enable_progress_bar=False,
        enable_model_summary=False,
        **flags,
    )
    state = trainer.fit(task, state, train_dataloaders=_data(), ckpt_path=ckpt_path)
    return trainer, state


def _count_blocks(monkeypatch):
    from engine.step._train import TrainStep

    calls = []
    steps = TrainStep.steps

    def counting(self, state, batches, **kw):
        calls.append((state.step, len(batches)))
        return steps(self, state, batches, **kw)

    monkeypatch.setattr(TrainStep, "steps", counting)
    return calls


def test_trainer_blocks_end_where_the_loop_looks_and_equal_single_steps(tmp_path, monkeypatch):
    # 20 batches an epoch, K=4, logs every 5 steps: blocks may not hold step 5, 10, ...
    # inside, so from step 0: a block (steps 1-4), a single (5), a block (6-9), a single ...
    calls = _count_blocks(monkeypatch)
    flags = dict(max_epochs=2, log_every_n_steps=5)
    one, ref = _fit(tmp_path, "one", steps_per_call=1, **flags)
    assert calls == []
    four, got = _fit(tmp_path, "four", steps_per_call=4, **flags)
    assert calls == [(s, 4) for s in (0, 5, 10, 15, 20, 25, 30, 35)]
    _assert_states_equal(got, ref)  # eager: bitwise, dropout included
    assert got.step == 40
    # every step's metrics reached the loggers and the journal, as with one step per call
    assert four.logged_metrics == one.logged_metrics

    def journal(t):
        lines = (Path(t.log_dir) / "journal.jsonl").read_text().splitlines()
        return [
            {k: v for k, v in json.loads(x).items() if k not in ("time", "wall")} for x in lines
        ]

    a, b = journal(one), journal(four)
    assert [x.get("losses") for x in a] == [x.get("losses") for x in b]
    assert any(x.get("losses") for x in a)


def test_validation_points_and_max_steps_end_blocks(tmp_path, monkeypatch):
    calls = _count_blocks(monkeypatch)
    val = _data(3, seed=9)
    tx = optim.adamw(1e-2)
    task = eg.Task(_ce, tx)
    trainer = eg.Trainer(
        default_root_dir=tmp_path,
        steps_per_call=3,
        val_check_interval=7,
        max_steps=17,
        log_every_n_steps=100,
        accumulate_grad_batches=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    state = trainer.fit(task, eg.TrainState.create(_mlp(), tx, seed=7), _data(), val)
    # validation after batches 6 and 13, max_steps 17: blocks 0-2, 3-5 end before them
    assert calls == [(0, 3), (3, 3), (7, 3), (10, 3), (14, 3)]
    assert state.step == 17


def test_a_listener_that_must_see_every_batch_makes_it_one_step_per_call(tmp_path, monkeypatch):
    calls = _count_blocks(monkeypatch)
    seen = []

    class EveryBatch(eg.Listener):
        def on_train_batch_end(self, rec):
            seen.append(rec.state.step)

    with pytest.warns(
        UserWarning,
        match=r"steps_per_call=4\) runs one optimizer step per call: EveryBatch must see every",
    ):
        _fit(tmp_path, "x", steps_per_call=4, callbacks=[EveryBatch()], max_epochs=1)
    assert calls == [] and seen == list(range(1, 21))


def test_a_listener_that_handles_blocks_hears_each_block_once(tmp_path):
    seen = []

    class PerBlock(eg.Listener):
        handles_blocks = True

        def block_ends(self):
            return (6,)

        def on_train_batch_end(self, rec):
            seen.append(
                (
                    rec.state.step,
                    rec.batch_idx,
                    None if rec.block is None else tuple(rec.block["loss"].shape),
                )
            )

    _fit(
        tmp_path, "x", steps_per_call=4, callbacks=[PerBlock()], max_epochs=1, log_every_n_steps=100
    )
    # blocks end at multiples of 6: block 1-4, singles 5 and 6, block 7-10, singles 11 and 12,
    # block 13-16, then singles to 20 (the epoch ends inside the next four)
    assert seen == [
        (4, 3, (4,)),
        (5, 4, None),
        (6, 5, None),
        (10, 9, (4,)),
        (11, 10, None),
        (12, 11, None),
        (16, 15, (4,)),
        (17, 16, None),
        (18, 17, None),
        (19, 18, None),
        (20, 19, None),
    ]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_trainer_refuses_a_bad_steps_per_call(bad):
    with pytest.raises(ValueError, match=r"Trainer\(steps_per_call="):
        eg.Trainer(steps_per_call=bad)


def test_compiled_blocks_resume_bitwise_from_a_checkpoint_between_blocks(tmp_path, monkeypatch):
    calls = _count_blocks(monkeypatch)
    saver = eg.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    flags = dict(
        max_epochs=2, log_every_n_steps=100, compile=True, enable_journal=False, dropout=0.0
    )
    _, whole = _fit(tmp_path, "whole", steps_per_call=4, callbacks=[saver], **flags)
    assert (0, 4) in calls  # blocks ran
    saved = sorted((tmp_path / "ckpt").glob("*step=18*"))
    assert saved, sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    _, resumed = _fit(tmp_path, "resumed", steps_per_call=4, ckpt_path=saved[0], **flags)
    _assert_states_equal(resumed, whole)
    _, single = _fit(tmp_path, "single", steps_per_call=1, **flags)
    _assert_states_equal(whole, single, exact=False)  # within compile's tolerance


class _SignalsAt(torch.utils.data.Dataset):
    """A dataset that sends this process SIGTERM when it loads sample ``at``."""

    def __init__(self, x, y, at):
        self.x, self.y, self.at = x, y, at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        return self.x[i], self.y[i]


def _signalled_fit(root, at=None, ckpt_path=None):
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(160, 10, generator=g), torch.randint(0, 5, (160,), generator=g)
    loader = torch.utils.data.DataLoader(_SignalsAt(x, y, at), batch_size=8)
    tx = optim.adamw(1e-2)
    trainer = eg.Trainer(
        default_root_dir=root,
        steps_per_call=4,
        max_epochs=1,
        log_every_n_steps=100,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_journal=False,
    )
    return trainer.fit(
        eg.Task(_ce, tx),
        eg.TrainState.create(_mlp(0.2), tx, seed=7),
        loader,
        ckpt_path=ckpt_path,
    )


def test_a_sigterm_inside_a_block_lands_after_it_and_resumes_bitwise(tmp_path):
    import subprocess
    import sys
    import textwrap

    here = str(Path(__file__).parent)
    # sample 50 is in batch 6 (0-based), loaded for the block of batches 4-7
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from test_steps_per_call import _signalled_fit
        _signalled_fit({str(tmp_path / "run")!r}, at=50)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "SIGTERM received: finished step 8" in done.stderr, done.stderr[-3000:]
    (saved,) = (tmp_path / "run" / "checkpoints").glob("interrupted-step=*")
    assert saved.name == "interrupted-step=8"
    whole = _signalled_fit(tmp_path / "whole")
    resumed = _signalled_fit(tmp_path / "resumed", ckpt_path=saved)
    _assert_states_equal(resumed, whole)


def test_an_eager_run_with_blocks_replays_bitwise_step_by_step(tmp_path, monkeypatch):
    trainer, _ = _fit(tmp_path, "eager", steps_per_call=4, max_epochs=1, log_every_n_steps=5)
    calls = _count_blocks(monkeypatch)
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical, str(report)
    assert report.steps == 20 and calls == []  # eager blocks are their single steps


def _journal_lines(run_dir):
    path = Path(run_dir) / "journal.jsonl"
    return path, [json.loads(x) for x in path.read_text().splitlines()]


def test_a_compiled_run_with_blocks_replays_its_blocks_bitwise(tmp_path, monkeypatch):
    # 20 batches, K=4, a line every 5 steps, accumulation 2: blocks of 8 batches at steps
    # 0 and 5 of each 10-step epoch; the other steps run alone
    calls = _count_blocks(monkeypatch)
    flags = dict(max_epochs=2, log_every_n_steps=5, accumulate_grad_batches=2, dropout=0.2)
    saver = eg.ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)
    trainer, _ = _fit(tmp_path, "run", steps_per_call=4, compile=True, callbacks=[saver], **flags)
    ran = list(calls)
    assert ran == [(0, 8), (5, 8), (10, 8), (15, 8)]
    path, lines = _journal_lines(trainer.run_dir)
    assert [b for x in lines for b in x.get("blocks", ())] == [[1, 4], [6, 4], [11, 4], [16, 4]]

    calls.clear()
    report = eg.replay(trainer.run_dir, trust_code=True)
    assert report.identical, str(report)
    assert calls == ran  # the same calls again: each block one graph, as it ran
    assert report.steps == 20 and report.compared >= 20

    # from a checkpoint between blocks, to a step inside one: the whole block runs
    calls.clear()
    report = eg.replay(trainer.run_dir, from_step=11, to_step=13, trust_code=True)
    assert report.identical, str(report)
    assert report.start_step == 10 and calls == [(10, 8)]

    # a journal that names no blocks for them: the replay runs single compiled steps, which
    # match the blocks only within compile's tolerance: the first step of the block differs
    kept = path.read_text()
    edited = [
        {k: v for k, v in x.items() if not (k == "blocks" and x["step"] == 15)} for x in lines
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in edited))
    report = eg.replay(trainer.run_dir, from_step=11, to_step=20, trust_code=True)
    assert not report.identical and report.first_divergent_step in range(11, 16), str(report)

    # a fit journaled before journals named blocks: refused, before any step
    unmarked = [{k: v for k, v in x.items() if k != "records_blocks"} for x in lines]
    path.write_text("".join(json.dumps(x) + "\n" for x in unmarked))
    calls.clear()
    with pytest.raises(eg.ReplayError, match=r"steps_per_call=4, and this fit's journal does not"):
        eg.replay(trainer.run_dir, trust_code=True)
    assert calls == []
    path.write_text(kept.replace("[[6, 4]]", '[[6, "4"]]'))
    with pytest.raises(eg.ReplayError, match=r"blocks entry \[6, '4'\] is not"):
        eg.replay(trainer.run_dir, trust_code=True)


def test_reduce_overhead_marks_the_state_static_and_not_the_batch():
    # CUDA graphs replay a graph at fixed input addresses: the donated state keeps them (its
    # tensors are updated in place); the batch is new every call. On the CPU the mode only
    # compiles, and the marks are what a GPU's CUDA graphs read.
    tx = optim.adamw(1e-2)
    step = eg.train_step(_ce, tx, compile={"mode": "reduce-overhead"})
    state = eg.TrainState.create(_mlp(), tx, seed=3)
    batches = _batches(3)
    for b in batches:
        state, _ = step(state, b)
    ref, _ = _singles(batches, compile=True)
    _assert_states_equal(state, ref, exact=False)
    leaves = torch.utils._pytree.tree_leaves((state.params, state.opt_state))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert tensors and all(getattr(t, "_dynamo_static_input_type", None) for t in tensors)
    assert all(getattr(t, "_dynamo_static_input_type", None) is None for t in batches[0])


def test_an_iterable_of_unknown_length_ends_inside_a_block_and_still_equals_single_steps(
    tmp_path, monkeypatch
):
    calls = _count_blocks(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(80, 10, generator=g), torch.randint(0, 5, (80,), generator=g)

    class Stream(torch.utils.data.IterableDataset):  # 10 batches of 8, no len()
        def __iter__(self):
            return iter(zip(x.split(8), y.split(8), strict=True))

    results = {}
    for k in (1, 4):
        tx = optim.adamw(1e-2)
        trainer = eg.Trainer(
            default_root_dir=tmp_path / str(k),
            steps_per_call=k,
            max_epochs=2,
            log_every_n_steps=100,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accumulate_grad_batches=2,
        )
        loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
        results[k] = trainer.fit(
            eg.Task(_ce, tx), eg.TrainState.create(_mlp(0.2), tx, seed=7), loader
        )
    _assert_states_equal(results[4], results[1])
    assert results[4].step == 10  # 5 windows of 2 an epoch
    # a block of 4 windows is 8 batches: one from batch 0; the stream ends inside the next
    # gather (batches 8, 9), which run as single batches
    assert calls == [(0, 8), (5, 8)]
