"""SIGTERM at every phase of the last epoch of a fit: either the fit is interrupted (a checkpoint
``interrupted-step=N``, exit status 1, and a resume that ends where the uninterrupted run ends,
bitwise) or, after the last epoch's end, it had finished (it returns its final state and says
so on stderr). Never a signal swallowed in silence."""

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
from engine import checkpoint, optim

N_BATCHES, EPOCHS = 4, 2


def _task() -> eg.Task:
    return eg.Task(
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        optim.adamw(optim.warmup_cosine(1e-2, warmup_steps=2, total_steps=20)),
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
        for _ in range(N_BATCHES)
    ]


def _fit(root: Path, callbacks=(), ckpt_path=None) -> eg.TrainState:
    task = _task()
    trainer = eg.Trainer(
        max_epochs=EPOCHS,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_journal=False,
        callbacks=list(callbacks),  # with the default ModelCheckpoint: it saves at epoch end
    )
    return trainer.fit(task, task.init(_model(), seed=4), _data(), _data()[:2], ckpt_path=ckpt_path)


class KillAt(eg.Listener):
    """Sends this process SIGTERM at ``event`` of the last epoch (its last batch, for batch
    events; a validation of the fit, not the sanity check)."""

    def __init__(self, event: str) -> None:
        self.sent = False
        setattr(self, event, self._kill)

    def _kill(self, rec) -> None:
        import os
        import signal

        last_epoch = rec.run.current_epoch == EPOCHS - 1 or rec.event.value in (
            "on_train_end",
            "on_fit_end",
        )
        training_batch = rec.event.value in ("on_train_batch_start", "on_train_batch_end")
        training_batch |= rec.event.value == "on_before_optimizer_step"
        last_batch = not training_batch or rec.batch_idx == N_BATCHES - 1
        if last_epoch and last_batch and rec.stage == "fit" and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


INTERRUPTED = [
    "on_train_batch_start",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_batch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_save_checkpoint",  # the default ModelCheckpoint's, at the epoch's end
]
FINISHED = ["on_train_end", "on_fit_end"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    return _fit(tmp_path_factory.mktemp("full")).fingerprint()


@pytest.mark.parametrize("event", INTERRUPTED + FINISHED)
def test_sigterm_at_each_phase_of_the_last_epoch_is_acted_on(tmp_path, event, uninterrupted):
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from pathlib import Path
        from test_signals import KillAt, _fit
        state = _fit(Path({str(tmp_path)!r}), [KillAt({event!r})])
        print("returned", state.fingerprint())
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    interrupted = sorted((tmp_path / "checkpoints").glob("interrupted-step=*"))
    if event in FINISHED:
        assert done.returncode == 0, done.stderr
        assert "SIGTERM received after the last training step: the fit had finished" in (
            done.stderr
        )
        assert f"returned {uninterrupted}" in done.stdout
        assert not interrupted
        return
    assert done.returncode == 1 and "returned" not in done.stdout, done.stderr
    assert "SIGTERM received: finished step" in done.stderr
    assert len(interrupted) == 1 and checkpoint.inspect(interrupted[0])["verified"]
    resumed = _fit(tmp_path / "resumed", ckpt_path=interrupted[0])
    assert resumed.fingerprint() == uninterrupted
