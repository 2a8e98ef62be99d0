"""A listener changes the training state only by returning a pure ``Transition``: applied by the
driver after the event, before the event's saves, journaled, and applied again by replay, so
resume (in a fresh process) and replay stay bitwise."""

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


def _halve(state: eg.TrainState) -> eg.TrainState:
    return state.replace(params={k: v * 0.5 for k, v in state.params.items()})


def _nudge(state: eg.TrainState) -> eg.TrainState:
    return state.replace(params={k: v + 0.01 for k, v in state.params.items()})


class Shrink(eg.Listener):
    """Halves the weights at each epoch's end and nudges them after each validation: two
    transitions a run, from two kinds of event (one the replay does not emit)."""

    def on_train_epoch_end(self, rec):
        return eg.Transition(_halve, name="halve")

    def on_validation_end(self, rec):
        if rec.stage == "fit" and not rec.run.sanity_checking:
            return eg.Transition(_nudge, name="nudge")
        return None


class SaveAt(eg.Listener):
    """Saves once: at the first ``event`` of epoch ``epoch``."""

    def __init__(self, event: str, epoch: int, path: Path) -> None:
        self.epoch, self.path, self.saved = epoch, path, False
        setattr(self, event, self._save)

    def _save(self, rec):
        if rec.run.current_epoch == self.epoch and not rec.run.sanity_checking and not self.saved:
            self.saved = True
            return eg.Save(self.path)
        return None


def _task() -> eg.Task:
    return eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adam(1e-2))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(6)]


def fit(root: Path, listeners=(), ckpt_path=None) -> tuple[eg.Trainer, eg.TrainState]:
    torch.manual_seed(0)
    task = _task()
    trainer = eg.Trainer(
        max_epochs=3,
        val_check_interval=3,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=2,
        callbacks=[Shrink(), *listeners],
    )
    data = _data()
    state = trainer.fit(
        task, task.init(nn.Linear(3, 1), seed=1), data, data[:2], ckpt_path=ckpt_path
    )
    return trainer, state


class _Seen(eg.Listener):
    """The weights at each epoch's end, and at the next epoch's start."""

    def __init__(self) -> None:
        self.ends, self.starts = [], []

    def on_train_epoch_end(self, rec):
        self.ends.append({k: v.clone() for k, v in rec.state.params.items()})

    def on_train_epoch_start(self, rec):
        self.starts.append({k: v.clone() for k, v in rec.state.params.items()})


def test_a_transition_is_applied_after_the_event_and_journaled(tmp_path):
    seen = _Seen()
    trainer, _ = fit(tmp_path, [seen])
    for before, after in zip(seen.ends, seen.starts[1:], strict=False):  # epochs 0 -> 1 -> 2
        assert all(torch.equal(after[k], before[k] * 0.5) for k in before)
    lines = [x for x in eg.Journal.read(trainer.run_dir) if "transition" in x]
    assert [(x["transition"], x["cause"]) for x in lines] == [
        ("nudge", "on_validation_end"),
        ("nudge", "on_validation_end"),
        ("halve", "on_train_epoch_end"),
    ] * 3
    assert all((Path(trainer.run_dir) / x["function"]).is_file() for x in lines)


@pytest.mark.parametrize("event", ["on_train_epoch_end", "on_validation_end"])
def test_a_checkpoint_asked_for_in_the_same_event_holds_the_new_state_and_resumes_bitwise(
    tmp_path, event
):
    here = str(Path(__file__).parent)
    ckpt = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from pathlib import Path
        from test_transitions import SaveAt, fit
        saver = SaveAt({event!r}, 1, Path({str(ckpt)!r}))
        _, state = fit(Path({str(tmp_path / "full")!r}), [saver])
        print(state.fingerprint())
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _, resumed = fit(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert resumed.fingerprint() == done.stdout.split()[-1]


def test_a_run_with_transitions_replays_bitwise_from_its_start_and_from_a_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer, _ = fit(tmp_path / "run", [SaveAt("on_validation_end", 1, ckpt)])
    report = eg.replay(trainer.run_dir, 1, 18, trust_code=True)
    assert report.identical and report.steps == 18, str(report)
    # from the checkpoint saved after the nudge of that validation (and before the one after
    # the epoch's last batch): the journal says which transitions it holds already
    lines = eg.Journal.read(trainer.run_dir)
    saved = next(x for x in lines if x.get("checkpoint") == str(ckpt.resolve()))
    report = eg.replay(trainer.run_dir, saved["step"] + 1, 18, trust_code=True)
    assert report.identical and report.checkpoint == str(ckpt.resolve()), str(report)


def test_a_replay_without_the_transitions_would_diverge(tmp_path):
    trainer, _ = fit(tmp_path)
    journal = Path(trainer.run_dir) / "journal.jsonl"
    text = journal.read_text().splitlines()
    kept = [line for line in text if '"transition"' not in line]
    journal.write_text("\n".join(kept) + "\n")
    report = eg.replay(trainer.run_dir, 1, 18, trust_code=True)
    assert not report.identical and report.divergence.step == 4  # after the first nudge


def test_a_replay_missing_a_transitions_function_says_which(tmp_path):
    trainer, _ = fit(tmp_path)
    (Path(trainer.run_dir) / "transition-0.pkl").unlink()
    with pytest.raises(eg.ReplayError, match=r"transition-0\.pkl is missing: .*'nudge' at step 3"):
        eg.replay(trainer.run_dir, 1, 18, trust_code=True)


def test_a_transition_that_moves_the_run_or_runs_inside_a_step_is_refused(tmp_path):
    class Jump(eg.Listener):
        def on_train_epoch_end(self, rec):
            return eg.Transition(lambda s: s.replace(step=s.step + 1), name="jump")

    class Inside(eg.Listener):
        def on_after_backward(self, rec):
            return eg.Transition(_halve)

    task = _task()
    for listener, error, match in [
        (Jump(), ValueError, r"changed \['step'\]"),
        (Inside(), RuntimeError, "not inside a step"),
    ]:
        trainer = eg.Trainer(max_epochs=1, logger=False, callbacks=[listener])
        with pytest.raises(error, match=match):
            trainer.fit(task, task.init(nn.Linear(3, 1)), _data())
    with pytest.raises(TypeError, match="pass a function"):
        eg.Transition("halve")
    _ = checkpoint  # (engine.checkpoint: the resumes above load through it)


class _AtFitStart(eg.Listener):
    """A transition asked for in on_fit_start: the event the journal asks for its start
    checkpoint in."""

    def on_fit_start(self, rec):
        return eg.Transition(_halve, name="halve-at-start")


def test_a_transition_in_on_fit_start_is_in_the_start_checkpoint_and_replays_once(tmp_path):
    """The journal's start checkpoint is saved after the event's requests (the transition
    included): its start line is written then, after the transition's line, so a replay from it
    does not halve the weights twice."""
    trainer, _ = fit(tmp_path, [_AtFitStart()])
    lines = eg.Journal.read(trainer.run_dir)
    first, start = lines[0], lines[1]
    assert first["transition"] == "halve-at-start" and start.get("start")
    saved = eg.checkpoint.read_meta(start["checkpoint"])
    assert start["fingerprint"] == saved["fingerprint"] and start["transitions"] == 1
    report = eg.replay(trainer.run_dir, 1, 18, trust_code=True)
    assert report.identical and report.steps == 18, str(report)
