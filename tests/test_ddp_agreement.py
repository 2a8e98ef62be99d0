"""How often the ranks of a data-parallel fit agree on stops and signals: after every batch
where a listener can ask to stop, every few batches where none can (each says ``may_stop =
False``, as the Trainer's own listeners do), and a SIGTERM on one rank is acted on by both at
the same step either way. 2 gloo ranks under torchrun, each run with a timeout."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset
    import engine as eg
    from engine import optim
    from engine.parallel import DDP

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(400, 6, generator=g), torch.randn(400, 3, generator=g)

    loaded = [0]

    class Data(Dataset):  # rank `signal_rank` sends itself SIGTERM at its `at`-th sample
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            loaded[0] += 1
            if rank == args.get("signal_rank") and loaded[0] == args.get("signal_at"):
                os.kill(os.getpid(), signal.SIGTERM)
            return x[i], y[i]

    calls = []
    agree = DDP.agree

    def counting(self, flags):
        calls.append(len(flags))
        return agree(self, flags)

    DDP.agree = counting
    from engine.step import TrainStep

    blocks, steps = [], TrainStep.steps

    def recording(self, state, batches, **kw):
        blocks.append(state.step)
        return steps(self, state, batches, **kw)

    TrainStep.steps = recording
    callbacks = []
    if args["listener"]:
        class Watch(eg.Listener):  # may ask to stop (the default): an agreement every batch
            def on_train_batch_end(self, rec):
                return None
        callbacks.append(Watch())
    if args.get("epoch_listener"):
        class AtEpochEnd(eg.Listener):  # may stop (the default): an agreement after every batch
            def on_train_epoch_end(self, rec):
                return None
        callbacks.append(AtEpochEnd())
    if args.get("rank_zero_listener"):
        class OnRankZero(eg.Listener):  # hears batches on rank 0 only, and must see each
            rank_zero_only = True

            def on_train_batch_end(self, rec):
                return None
        callbacks.append(OnRankZero())
    if args.get("journal_every"):  # rank 0's alone: its lines end blocks on every rank alike
        callbacks.append(eg.listeners.Journal(every_n_steps=args["journal_every"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2))
    trainer = eg.Trainer(
        accelerator="cpu", strategy="ddp", devices=2, max_epochs=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        default_root_dir=args["root"], steps_per_call=args.get("steps_per_call", 1),
    )
    step = fingerprint = None
    try:
        state = trainer.fit(task, task.init(model, seed=0), DataLoader(Data(), batch_size=4))
        step, fingerprint = state.step, state.fingerprint()
    finally:
        with open(os.path.join(args["root"], f"rank{rank}.json"), "w") as f:
            out = {"agreements": len(calls), "blocks": blocks}
            json.dump({**out, "step": step, "fingerprint": fingerprint}, f)
    """
)


def _run(tmp_path: Path, **args):
    script = tmp_path / "agree.py"
    script.write_text(SCRIPT)
    args = {"root": str(tmp_path), "listener": False, **args}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return torchrun([str(script), json.dumps(args)], 2, env=env, timeout=240)


def test_without_a_listener_that_may_stop_the_ranks_agree_every_few_batches(tmp_path):
    # 400 samples, 200 a rank, batches of 4: 50 steps
    for name in ("lazy", "eager"):
        (tmp_path / name).mkdir()
        done = _run(tmp_path / name, listener=name == "eager")
        assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        few = json.loads((tmp_path / "lazy" / f"rank{rank}.json").read_text())
        many = json.loads((tmp_path / "eager" / f"rank{rank}.json").read_text())
        assert few["step"] == many["step"] == 50
        assert many["agreements"] >= 50  # after every batch
        assert few["agreements"] < 25, few  # a step takes ~1 ms: every batch ~0.25 s apart


@pytest.mark.parametrize("listener", [False, True])
def test_a_sigterm_on_one_rank_stops_both_at_the_same_step(tmp_path, listener):
    done = _run(tmp_path, listener=listener, signal_rank=1, signal_at=90)  # in batch 23
    assert done.returncode != 0
    saved = sorted((tmp_path / "checkpoints").glob("interrupted-step=*"))
    assert len(saved) == 1, (saved, done.stderr[-3000:])
    step = int(saved[0].name.split("=")[1])
    # acted on at the next agreement: within a quarter second of batches, or at the epoch end
    assert 22 <= step <= 50
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    said = re.findall(r"SIGTERM received: finished step (\d+)", done.stderr)
    assert len(said) >= 2 and set(said) == {str(step)}, (ranks, done.stderr[-4000:])
    assert ranks[0]["agreements"] == ranks[1]["agreements"], ranks


def test_blocks_of_steps_under_ddp_end_where_single_steps_do(tmp_path):
    # eager blocks are their single steps, each with its gradient all-reduce: bitwise
    runs = {}
    for k in (1, 4):
        (tmp_path / str(k)).mkdir()
        # the journal's lines (every 6 steps; rank 0 writes them) end blocks on both ranks
        done = _run(tmp_path / str(k), steps_per_call=k, journal_every=6, epoch_listener=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "runs one optimizer step per call" not in done.stderr  # no listener refused it
        runs[k] = [json.loads((tmp_path / str(k) / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert runs[1][0]["fingerprint"] == runs[4][0]["fingerprint"] == runs[4][1]["fingerprint"]
    assert runs[4][0]["step"] == 50
    # the same blocks on both ranks, ended by rank 0's journal lines (6, 12, ...) too
    assert runs[4][0]["blocks"] == runs[4][1]["blocks"] == [0, 6, 12, 18, 24, 30, 36, 42]
    assert runs[4][0]["agreements"] == runs[4][1]["agreements"]


def test_a_rank_zero_listener_that_must_see_every_batch_turns_blocks_off_on_every_rank(
    tmp_path,
):
    # it is heard on rank 0 only, but decides the plan of both: otherwise rank 0 would run
    # single steps and rank 1 blocks, and their checks' collectives would not line up
    done = _run(tmp_path, steps_per_call=4, rank_zero_listener=True, epoch_listener=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("runs one optimizer step per call: OnRankZero must see") == 2
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["blocks"] == ranks[1]["blocks"] == []
    assert ranks[0]["agreements"] == ranks[1]["agreements"] >= 50
