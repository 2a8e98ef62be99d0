"""ProgressBar outside a terminal (a line per finished loop) and in one (the live loss).

The lines are checked against real fits: through ``contextlib.redirect_stdout`` and through a
child process whose stdout is a pipe. The terminal is a stream whose ``isatty()`` is True; the
loss reads are counted with a loss object that counts its ``float()`` conversions and a fake
clock in place of the module's ``monotonic``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import engine as eg
from engine import optim
from engine.events import Event, EventRecord, RunView
from engine.listeners import ProgressBar
from engine.listeners import progress as progress_module

# ---------------------------------------------------------------------- helpers


def _loss_fn(model: Any, batch: Any) -> Any:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def _data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)
    ]


def _loader(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> DataLoader[Any]:
    """The same batches from a DataLoader (a list of several is several dataloaders)."""
    x, y = (torch.cat(t) for t in zip(*batches, strict=True))
    return DataLoader(TensorDataset(x, y), batch_size=len(batches[0][0]))


class _Losses(eg.Listener):
    """Records each training step's loss (the test's own sync, not the bar's)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, rec: EventRecord) -> None:
        self.losses.append(float(rec.outputs["loss"]))


def _trainer(root: Path, **kw: Any) -> eg.Trainer:
    flags: dict[str, Any] = {
        "max_epochs": 2,
        "default_root_dir": str(root),
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "enable_journal": False,
        "log_every_n_steps": 50,  # no logging step: the loss shown is the bar's own read
    }
    return eg.Trainer(**(flags | kw))


def _task() -> tuple[eg.Task, Any]:
    task = eg.Task(_loss_fn, optim.sgd(0.1), prog_bar=["acc"])
    torch.manual_seed(0)
    return task, task.init(torch.nn.Linear(6, 3), seed=0)


def _num(value: float) -> str:
    """A metric as the bar writes it."""
    return str(tqdm.format_num(value))


class _TTY(io.StringIO):
    """A terminal, as far as tqdm and ProgressBar can tell."""

    def isatty(self) -> bool:
        return True


class _CountingLoss:
    """A step's loss whose host reads (``float()``) are counted."""

    def __init__(self, value: float, reads: list[float], clock: _Clock) -> None:
        self.value, self.reads, self.clock = value, reads, clock

    def __float__(self) -> float:
        self.reads.append(self.clock.now)
        return self.value


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(progress_module, "monotonic", fake)
    return fake


def _rec(event: Event, run: RunView, **fields: Any) -> EventRecord:
    return EventRecord(event, run.stage, None, run.callback_metrics, run, **fields)


def _epoch(
    bar: ProgressBar,
    run: RunView,
    losses: list[Any],
    clock: _Clock | None = None,
    dt: float = 0.0,
) -> None:
    """One training epoch through the bar, a loss per batch, the clock advancing ``dt``."""
    bar.on_train_epoch_start(_rec(Event.ON_TRAIN_EPOCH_START, run))
    for i, loss in enumerate(losses):
        if clock is not None:
            clock.now += dt
        bar.on_train_batch_end(
            _rec(Event.ON_TRAIN_BATCH_END, run, batch_idx=i, outputs={"loss": loss})
        )
    bar.on_train_epoch_end(_rec(Event.ON_TRAIN_EPOCH_END, run))


_LINE = re.compile(
    r"^(?P<desc>[^:]+): +(?P<pct>\d+)% (?P<n>\d+)/(?P<total>\d+|\?) "
    r"\[\d\d:\d\d, +[\d.?]+it/s(?P<post>.*)\]$"
)


def _parse(text: str) -> list[tuple[str, str, dict[str, str]]]:
    """Each line as (description, "n/total", postfix items); fails on a line of another shape."""
    assert "\r" not in text and "\x1b" not in text, repr(text)
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        assert m is not None, f"not a progress line: {line!r}"
        post = dict(item.split("=", 1) for item in m["post"].split(", ")[1:])
        out.append((m["desc"], f"{m['n']}/{m['total']}", post))
    return out


# ---------------------------------------------------------------------- not a terminal


def test_a_fit_not_in_a_terminal_prints_a_line_per_epoch_and_per_validation(tmp_path):
    task, state = _task()
    losses = _Losses()
    trainer = _trainer(tmp_path, num_sanity_val_steps=2, callbacks=[losses])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer.fit(task, state, train_dataloaders=_data(5), val_dataloaders=_data(3, seed=1))
    lines = _parse(log.getvalue())
    # no sanity-check line: its results are discarded
    assert [(d, n) for d, n, _ in lines] == [
        ("Validation DataLoader 0", "3/3"),
        ("Epoch 0", "5/5"),
        ("Validation DataLoader 0", "3/3"),
        ("Epoch 1", "5/5"),
    ]
    shown = trainer.progress_bar_metrics
    val, epoch = lines[2][2], lines[3][2]
    assert val == {"val/loss": _num(shown["val/loss"]), "val/acc": _num(shown["val/acc"])}
    # the epoch's line: the logger's version, the last step's loss (no logging step was
    # reached) and the validation's metrics
    assert epoch == {
        "v_num": "0",
        "train/loss": _num(losses.losses[-1]),
        "val/loss": _num(shown["val/loss"]),
        "val/acc": _num(shown["val/acc"]),
    }
    assert lines[1][2]["train/loss"] == _num(losses.losses[4])

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        (result,) = trainer.test(task, trainer.state, dataloaders=_data(2), verbose=False)
        trainer.predict(task, trainer.state, dataloaders=[x for x, _ in _data(3)])
    assert _parse(log.getvalue()) == [
        ("Testing DataLoader 0", "2/2", {k: _num(v) for k, v in result.items()}),
        ("Predicting DataLoader 0", "3/3", {}),
    ]


def test_each_validation_dataloader_gets_a_line_with_its_own_metrics(tmp_path):
    task, state = _task()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, logger=False)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        val = [_loader(_data(2, seed=1)), _loader(_data(3, seed=2))]
        trainer.fit(task, state, _data(2), val_dataloaders=val)
    lines = _parse(log.getvalue())
    assert [(d, n) for d, n, _ in lines] == [
        ("Validation DataLoader 0", "2/2"),
        ("Validation DataLoader 1", "3/3"),
        ("Epoch 0", "2/2"),
    ]
    assert set(lines[0][2]) == {"val/loss/dataloader_idx_0", "val/acc/dataloader_idx_0"}
    assert set(lines[1][2]) == {"val/loss/dataloader_idx_1", "val/acc/dataloader_idx_1"}
    assert "v_num" not in lines[2][2] and "val/loss/dataloader_idx_1" in lines[2][2]


def test_lines_read_the_loss_once_per_epoch_and_print_the_batches_reached(clock):
    reads: list[float] = []
    log = io.StringIO()
    run = RunView(stage="fit", num_training_batches=8, current_epoch=2)
    with contextlib.redirect_stdout(log):
        bar = ProgressBar(loss_interval=0.0)  # even so: no read per batch without drawing
        _epoch(bar, run, [_CountingLoss(0.5, reads, clock) for _ in range(8)], clock, dt=1.0)
        # a stop (or an exception) part way through an epoch: the batches reached
        bar.on_train_epoch_start(_rec(Event.ON_TRAIN_EPOCH_START, run))
        for i in range(3):
            bar.on_train_batch_end(_rec(Event.ON_TRAIN_BATCH_END, run, batch_idx=i))
        bar.on_exception(_rec(Event.ON_EXCEPTION, run, exception=RuntimeError("boom")))
    assert len(reads) == 1  # at the epoch's end only
    assert _parse(log.getvalue()) == [
        ("Epoch 2", "8/8", {"train/loss": "0.5"}),
        ("Epoch 2", "3/8", {"train/loss": "0.5"}),  # the last value read; no new read
    ]
    assert len(reads) == 1


def test_lines_are_off_with_refresh_rate_zero_and_a_given_file_gets_bars(tmp_path):
    task, state = _task()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer = _trainer(tmp_path, max_epochs=1, callbacks=[ProgressBar(refresh_rate=0)])
        trainer.fit(task, state, _data(2), val_dataloaders=_data(1))
    assert log.getvalue() == ""
    out = io.StringIO()  # not a terminal, but given: bars, as before
    task, state = _task()
    _trainer(tmp_path, max_epochs=1, callbacks=[ProgressBar(file=out)]).fit(task, state, _data(2))
    assert "\r" in out.getvalue() and "Epoch 0: 100%|" in out.getvalue()


def test_a_child_process_with_its_stdout_piped_prints_the_lines(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch, torch.nn.functional as F
        import engine as eg
        from engine import optim

        def loss_fn(model, batch):
            x, y = batch
            return F.cross_entropy(model(x), y), {{}}

        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
                for _ in range(4)]
        task = eg.Task(loss_fn, optim.sgd(0.1))
        trainer = eg.Trainer(max_epochs=3, default_root_dir={str(tmp_path)!r}, logger=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             num_sanity_val_steps=1)
        trainer.fit(task, task.init(torch.nn.Linear(6, 3), seed=0), data, data[:2])
        print("done")
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = _procs.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert child.returncode == 0, child.stderr
    out = child.stdout
    assert out.endswith("done\n") and "\r" not in out
    lines = _parse(out.removesuffix("done\n"))
    assert [(d, n) for d, n, _ in lines] == [
        (desc, n)
        for e in range(3)
        for desc, n in (("Validation DataLoader 0", "2/2"), (f"Epoch {e}", "4/4"))
    ]
    for _, _, post in lines[1::2]:
        assert set(post) == {"train/loss", "val/loss"}
    assert "Epoch" not in child.stderr  # nothing drawn on stderr either


# ---------------------------------------------------------------------- a terminal


def test_in_a_terminal_the_loss_shows_from_the_first_batch_before_any_logging_step(tmp_path):
    task, state = _task()
    losses = _Losses()
    screen = _TTY()
    with contextlib.redirect_stdout(screen):
        trainer = _trainer(tmp_path, max_epochs=1, logger=False, callbacks=[losses])
        trainer.fit(task, state, _data(6))
    frames = [s.strip() for s in screen.getvalue().split("\r") if s.strip()]
    first = next(s for s in frames if s.startswith("Epoch 0:") and " 1/6 " in s)
    assert f"train/loss={_num(losses.losses[0])}" in first
    last = [s for s in frames if s.startswith("Epoch 0: 100%")][-1]
    assert f"train/loss={_num(losses.losses[-1])}" in last and "train/acc" not in last
    assert trainer.progress_bar_metrics == {}  # no logging step: all from the bar's reads


def test_in_a_terminal_the_loss_is_read_at_most_once_per_interval(clock):
    reads: list[float] = []
    screen = _TTY()
    run = RunView(stage="fit", num_training_batches=200)
    bar = ProgressBar(file=screen, min_interval=1 / 8, loss_interval=0.5)
    # 200 batches of 1/128 s (exact in binary): drawn every 16 batches, read every 64
    dt = 1 / 128
    _epoch(bar, run, [_CountingLoss(float(i), reads, clock) for i in range(200)], clock, dt)
    assert reads == [1000 + dt * (1 + 64 * k) for k in range(4)] + [1000 + dt * 200]
    frames = [s for s in screen.getvalue().split("\r") if s.startswith("Epoch 0")]
    # between reads the bar shows the value read last: batches 64, 80, 96 and 112
    assert sum("train/loss=64]" in s for s in frames) == 4
    assert "train/loss=192]" in frames[-2] and "200/200" in frames[-2]  # the last batch
    assert "train/loss=199]" in frames[-1]  # the epoch's end reads the last step's


def test_no_loss_is_kept_or_read_with_loss_interval_none(clock):
    reads: list[float] = []
    screen = _TTY()
    run = RunView(stage="fit", num_training_batches=3, progress_bar_metrics={"train/loss": 9.0})
    bar = ProgressBar(file=screen, loss_interval=None)
    _epoch(bar, run, [_CountingLoss(1.0, reads, clock) for _ in range(3)], clock, dt=1.0)
    assert reads == [] and "train/loss=9" in screen.getvalue().split("\r")[-1]


def test_the_kept_loss_is_dropped_when_training_ends_and_when_pickled(clock):
    reads: list[float] = []
    bar = ProgressBar(file=_TTY())
    run = RunView(stage="fit", num_training_batches=2)
    bar.on_train_epoch_start(_rec(Event.ON_TRAIN_EPOCH_START, run))
    loss = _CountingLoss(1.0, reads, clock)
    bar.on_train_batch_end(_rec(Event.ON_TRAIN_BATCH_END, run, batch_idx=0, outputs={"loss": loss}))
    copy = pickle.loads(pickle.dumps(bar))
    assert copy._loss is None and copy._loss_value is None and copy.train_progress_bar is None
    bar.on_train_end(_rec(Event.ON_TRAIN_END, run))
    assert bar._loss is None and bar._loss_value is None


def test_a_tensor_loss_is_read_as_its_mean():
    assert progress_module._to_float(torch.tensor([1.0, 2.0, 4.5])) == 2.5
    assert progress_module._to_float(torch.tensor(0.25, dtype=torch.bfloat16)) == 0.25
    assert progress_module._to_float(3) == 3.0


def test_a_negative_loss_interval_is_refused():
    with pytest.raises(ValueError, match=r"-1\.0.*None"):
        ProgressBar(loss_interval=-1.0)
    with pytest.raises(ValueError, match="nan"):
        ProgressBar(loss_interval=float("nan"))
