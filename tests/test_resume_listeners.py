"""Exact resume in a fresh process with validation and stateful listeners in play.

One configuration (dropout, an accumulation window of 2, validation twice per epoch, an
``EarlyStopping`` with ``min_delta`` that stops the run, a ``ModelCheckpoint`` keeping the best two
plus ``last``, a ``Timer``) is trained once without interruption in this process, and once in two
fresh processes: the first dies (``os._exit``, no clean-up) right after a checkpoint is saved at
step k, the second builds everything again and resumes from it to the end. Everything the
second process ends with must equal the uninterrupted run: parameters and optimizer state
bitwise, every metric logged after the save point, the listeners' states, where EarlyStopping
stopped, and the checkpoints ModelCheckpoint left on disk (names, positions, contents).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import _procs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import engine as eg
from engine import checkpoint, optim
from engine.listeners import EarlyStoppingReason

sys.path.insert(0, str(Path(__file__).parent))
from test_resume import _Log

HERE = Path(__file__).parent
PATIENCE, MIN_DELTA = 5, 0.03
KW = {
    "max_epochs": 8,  # EarlyStopping ends the run well before
    "val_check_interval": 0.5,  # after batches 5 and 10 of each epoch of 10
    "accumulate_grad_batches": 2,  # so the mid-epoch validation falls inside a window
    "log_every_n_steps": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _task() -> eg.Task:
    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return eg.Task(loss_fn, optim.adamw(3e-2))


def _model(init: int) -> nn.Module:
    torch.manual_seed(init)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _data(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # learnable labels: the validation loss falls by ever smaller steps, then rises, so
    # EarlyStopping (min_delta) waits, is reset, waits again and stops, while ModelCheckpoint's
    # top 2 keep changing on improvements smaller than min_delta
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        x = torch.randn(4, 6, generator=g)
        batches.append((x, (x[:, :3] + torch.randn(4, 3, generator=g)).argmax(-1)))
    return batches


class _Probe(eg.Listener):
    """Listed after EarlyStopping and ModelCheckpoint: what they hold after each training
    batch and each validation of the fit."""

    def __init__(self, es: eg.EarlyStopping, mc: eg.ModelCheckpoint) -> None:
        self.es, self.mc, self.seen = es, mc, []

    def _see(self, event: str, rec) -> None:
        t = rec.run
        self.seen.append(
            {
                "event": event,
                "epoch": t.current_epoch,
                "step": t.global_step,
                "micro_step": rec.state.micro_step,
                "wait": self.es.wait_count,
                "best": self.es.best_score,
                "top_k": sorted(os.path.basename(p) for p in self.mc.best_k_models),
            }
        )

    def on_train_batch_end(self, rec):
        self._see("batch", rec)

    def on_validation_end(self, rec):
        if rec.stage == "fit":
            self._see("validation", rec)


class _Crash(eg.Listener):
    """At the ``n``-th ``event`` of the fit, save a checkpoint to ``path`` (if given) and die
    without any clean-up, as a killed process would: at once without a path, else at the next
    event after the save (the driver writes a requested checkpoint once the event has reached
    every listener)."""

    def __init__(self, event: str, n: int, path: str | None) -> None:
        self.n, self.path, self.count, self.saved = n, path, 0, False
        for later in eg.Event:  # whichever event comes first after the save
            if later not in _NOT_AFTER and later.value != event:
                setattr(self, later.value, self._crash_if_saved)
        setattr(self, event, self._maybe_crash)

    def _maybe_crash(self, rec):
        self._crash_if_saved(rec)
        if rec.stage != "fit":
            return None
        self.count += 1
        if self.count != self.n:
            return None
        if self.path is None:
            self._crash()
        self.saved = True
        return eg.Save(self.path)

    def _crash_if_saved(self, rec):
        if self.saved:
            self._crash()

    @staticmethod
    def _crash():
        sys.stdout.flush()
        os._exit(0)


# the events of the save itself, and those inside the step (a listener on them splits the step)
_NOT_AFTER = {
    eg.Event.ON_SAVE_CHECKPOINT,
    eg.Event.ON_BEFORE_BACKWARD,
    eg.Event.ON_AFTER_BACKWARD,
    eg.Event.ON_BEFORE_OPTIMIZER_STEP,
}


def _run(
    root: str | Path,
    *,
    crash: tuple[str, int, str | None] | None = None,
    ckpt_path: str | None = None,
    mc_first: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit the configuration under ``root``; returns (JSON-able results, tensors)."""
    root = Path(root)
    es = eg.EarlyStopping("val/loss", patience=PATIENCE, min_delta=MIN_DELTA)
    mc = eg.ModelCheckpoint(
        dirpath=root / "ckpts",
        filename="{epoch}-{step}-{val/loss:.4f}",
        monitor="val/loss",
        save_top_k=2,
        save_last=True,
    )
    probe, log = _Probe(es, mc), _Log()
    listeners = [mc, es] if mc_first else [es, mc]
    listeners += [eg.Timer({"days": 1}, verbose=False), probe]
    if crash is not None:
        listeners.append(_Crash(*crash))  # last: the others have handled the event
    trainer = eg.Trainer(logger=log, default_root_dir=root, callbacks=listeners, **KW)
    task = _task()
    # resuming, the state gives only the structure: start it from other values
    state = task.init(_model(1 if ckpt_path else 0), seed=0 if ckpt_path else 5)
    state = trainer.fit(task, state, _data(10, 1), _data(3, 2), ckpt_path=ckpt_path)
    results = {
        "fingerprint": state.fingerprint(),
        "position": [state.step, state.epoch, state.batch_idx, state.micro_step],
        "rows": log.rows,
        "probe": probe.seen,
        "early_stopping": es.state_dict(),
        "model_checkpoint": _relative(mc.state_dict(), mc.dirpath),
        "on_disk": _on_disk(Path(mc.dirpath)),
    }
    tensors = {
        "params": dict(state.params),
        "buffers": dict(state.buffers),
        "grad_accum": dict(state.grad_accum or {}),
        "opt_state": {
            pytree.keystr(p): leaf for p, leaf in pytree.tree_flatten_with_path(state.opt_state)[0]
        },
    }
    return json.loads(json.dumps(results)), tensors  # both sides compare what JSON carried


def _relative(state: dict[str, Any], dirpath: str) -> dict[str, Any]:
    """A ModelCheckpoint state with the paths relative to its directory."""

    def rel(p: str) -> str:
        return os.path.relpath(p, dirpath) if p else p

    state = {k: v for k, v in state.items() if k != "dirpath"}
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        state[key] = rel(state[key])
    if "last_checkpoint_saved" in state:
        state["last_checkpoint_saved"] = rel(state["last_checkpoint_saved"])
    state["best_k_models"] = {rel(k): v for k, v in state["best_k_models"].items()}
    return state


def _on_disk(dirpath: Path) -> dict[str, Any]:
    """Every checkpoint in ``dirpath``: its position, metrics, listener and loop state, and a
    hash of each tensor's bits."""
    found = {}
    for path in sorted(dirpath.iterdir()):
        meta = checkpoint.read_meta(path)
        tensors = torch.load(path / "tensors.pt", weights_only=True)
        saved = meta["extra"]["listeners"]  # the Timer's times differ, of course
        listeners = {k: v for k, v in saved.items() if k.startswith("EarlyStopping")}
        listeners |= {
            k: _relative(v, str(dirpath))
            for k, v in saved.items()
            if k.startswith("ModelCheckpoint")
        }
        found[path.name] = {
            "position": [meta[k] for k in ("step", "epoch", "batch_idx", "micro_step")],
            "metrics": meta["metrics"],
            "listeners": listeners,
            # when it was saved differs between runs, of course
            "trainer": {k: v for k, v in meta["extra"]["trainer"].items() if k != "saved_at_ns"},
            "train_metrics": meta["extra"]["train_metrics"],
            "tensors": {
                k: hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy()).hexdigest()
                for k, t in sorted(tensors.items())
            },
        }
    return found


def _python(script: str) -> None:
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _in_fresh_processes(
    tmp_path: Path, crash: tuple[str, int], *, from_last: bool = False, mc_first: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run up to the crash in one process, resume in another; return the second's results."""
    root, saved, out = tmp_path / "interrupted", tmp_path / "crash-ckpt", tmp_path / "out"
    first = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from test_resume_listeners import _run
        _run({str(root)!r}, crash={(*crash, None if from_last else str(saved))!r},
             mc_first={mc_first!r})
        sys.exit("the crash did not happen")
    """)
    _python(first)
    ckpt = "last" if from_last else str(saved)
    second = textwrap.dedent(f"""
        import json, sys, warnings; sys.path.insert(0, {str(HERE)!r})
        import torch
        from test_resume_listeners import _run
        warnings.simplefilter("error")  # a resume that needs a warning is not the exact one
        # (but the checkpoint directory of the interrupted run is, of course, not empty)
        warnings.filterwarnings("ignore", "ModelCheckpoint: the checkpoint directory")
        warnings.filterwarnings("ignore", "resuming mid-epoch by loading and dropping")  # lists
        results, tensors = _run({str(root)!r}, ckpt_path={ckpt!r}, mc_first={mc_first!r})
        with open({str(out)!r} + ".json", "w") as f:
            json.dump(results, f)
        torch.save(tensors, {str(out)!r} + ".pt")
    """)
    _python(second)
    resumed = json.loads(Path(f"{out}.json").read_text())
    return resumed, torch.load(f"{out}.pt", weights_only=True)


def _tail(rows: list[Any], n: int) -> list[Any]:
    return rows[len(rows) - n :]


def _assert_same_run(
    full, full_tensors, resumed, resumed_tensors, saved_at: int, *, logs_after: bool = True
) -> None:
    # the state, bitwise
    assert resumed["position"] == full["position"]
    for group in ("params", "buffers", "grad_accum", "opt_state"):
        assert resumed_tensors[group].keys() == full_tensors[group].keys(), group
        for k, v in full_tensors[group].items():
            w = resumed_tensors[group][k]
            if isinstance(v, torch.Tensor):
                assert w.dtype == v.dtype and torch.equal(w, v), f"{group} {k}"
            else:
                assert w == v, f"{group} {k}"
    assert resumed["fingerprint"] == full["fingerprint"]

    # every row logged after the save point, in order: the resumed run logs exactly the tail
    later = [r for r in full["rows"] if r[0] > saved_at]
    assert bool(later) == logs_after and len(resumed["rows"]) >= len(later)
    assert resumed["rows"] == _tail(full["rows"], len(resumed["rows"]))
    assert [r for r in resumed["rows"] if r[0] > saved_at] == later

    # the listeners' view after every batch and validation since the resume
    assert resumed["probe"] == _tail(full["probe"], len(resumed["probe"]))

    # EarlyStopping: same counters, same best score, stopped in the same epoch for the same reason
    assert resumed["early_stopping"] == full["early_stopping"]

    # ModelCheckpoint: the same bookkeeping and the same checkpoints left on disk, saved at the
    # same positions with the same contents
    assert resumed["model_checkpoint"] == full["model_checkpoint"]
    assert sorted(resumed["on_disk"]) == sorted(full["on_disk"])
    for name, saved in full["on_disk"].items():
        # metrics included: the trainer's callback_metrics survive the resume
        assert resumed["on_disk"][name] == saved, name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The references: each whole run in this process, never interrupted (by listener order)."""
    cache: dict[bool, tuple[dict[str, Any], dict[str, Any]]] = {}

    def get(mc_first: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        if mc_first not in cache:
            cache[mc_first] = _run(tmp_path_factory.mktemp("uninterrupted"), mc_first=mc_first)
            _check_premises(cache[mc_first][0])
        return cache[mc_first]

    return get


def _check_premises(results: dict[str, Any]) -> None:
    """EarlyStopping ends the run, after its wait count went up, was reset by an improvement
    larger than min_delta and went up again; the top 2 still change near the end."""
    es = results["early_stopping"]
    validations = [p for p in results["probe"] if p["event"] == "validation"]
    assert es["stopping_reason"] == EarlyStoppingReason.PATIENCE_EXHAUSTED.value
    assert results["position"][1] < KW["max_epochs"]
    waits = [v["wait"] for v in validations]
    assert 0 < waits.index(1) < waits.index(0, waits.index(1)) < len(waits) - PATIENCE
    assert validations[-2]["top_k"] != validations[-4]["top_k"]
    assert len(results["on_disk"]) == 3  # the best two and last


def _premise_mid_patience(full, crash: tuple[str, int], *, top_k_changes: bool) -> dict[str, Any]:
    """The probe's entry at the crash point, checked to be mid-way through EarlyStopping's
    patience and followed by further validations (two or more when the top 2 still change)."""
    event, n = crash
    kind = "batch" if event == "on_train_batch_end" else "validation"
    at = [p for p in full["probe"] if p["event"] == kind][n - 1]
    i = full["probe"].index(at)
    after = [p for p in full["probe"][i + 1 :] if p["event"] == "validation"]
    assert 0 < at["wait"] < PATIENCE
    assert after[-1]["wait"] == PATIENCE  # it is EarlyStopping that ends the run
    if top_k_changes:
        assert len(after) >= 2 and any(p["top_k"] != at["top_k"] for p in after)
    else:
        assert all(p["top_k"] == at["top_k"] for p in after)
    return at


@pytest.mark.parametrize(
    ("crash", "top_k_changes"),
    [
        # epoch 5, batch 5: inside an accumulation window, right before a validation that
        # enters the top 2 (the resumed process runs it, saves, deletes a file the first saved)
        (("on_train_batch_end", 55), True),
        # epoch 6, batch 3: inside a window, after the last save, before the stopping validation
        (("on_train_batch_end", 63), False),
        # in the validation after epoch 5's batch 5 (the other listeners have handled it)
        (("on_validation_end", 11), True),
    ],
    ids=["batch-end-before-validation", "batch-end-after-the-last-save", "validation-end"],
)
def test_a_fresh_process_resumes_listeners_and_validation_exactly(
    tmp_path, uninterrupted, crash, top_k_changes
):
    full, full_tensors = uninterrupted()
    at = _premise_mid_patience(full, crash, top_k_changes=top_k_changes)
    if crash[0] == "on_train_batch_end":
        assert at["micro_step"] == 1  # inside the accumulation window
    resumed, resumed_tensors = _in_fresh_processes(tmp_path, crash)
    meta = checkpoint.read_meta(tmp_path / "crash-ckpt")
    assert [meta["step"], meta["micro_step"]] == [at["step"], at["micro_step"]]
    _assert_same_run(full, full_tensors, resumed, resumed_tensors, saved_at=at["step"])
    if crash == ("on_train_batch_end", 55):
        # the validation right after the saved batch ran in the resumed process and logged
        assert any(k.startswith("val/") for s, m in resumed["rows"] if s == at["step"] for k in m)


def test_the_checkpoints_saved_at_one_step_are_interchangeable(uninterrupted):
    """A top-k checkpoint and ``last`` saved at the same step hold the same state, the listeners'
    included: ``ckpt_path="last"``, which tells them apart only by modification time, may resume
    from either."""
    full, _ = uninterrupted()
    by_position: dict[str, list[dict[str, Any]]] = {}
    for saved in full["on_disk"].values():
        by_position.setdefault(json.dumps(saved["position"]), []).append(saved)
    pairs = [group for group in by_position.values() if len(group) > 1]
    assert pairs  # "last" was saved with the newest top-k checkpoint
    for first, *others in pairs:
        for other in others:
            assert other == first


@pytest.mark.parametrize("mc_first", [False, True], ids=["es-first", "mc-first"])
def test_a_crash_resumed_with_ckpt_path_last_continues_exactly(tmp_path, uninterrupted, mc_first):
    """A process killed mid-epoch (no checkpoint of its own) resumes from ModelCheckpoint's
    newest checkpoint, which it wrote in on_validation_end."""
    full, full_tensors = uninterrupted(mc_first)
    crash = ("on_train_batch_end", 63)  # after the last save, before the stopping validation
    _premise_mid_patience(full, crash, top_k_changes=False)
    resumed, resumed_tensors = _in_fresh_processes(
        tmp_path, crash, from_last=True, mc_first=mc_first
    )
    saved_at = full["on_disk"]["last"]["position"][0]
    _assert_same_run(full, full_tensors, resumed, resumed_tensors, saved_at=saved_at)


def test_a_checkpoint_saved_after_the_stop_request_trains_on_until_asked_again(
    tmp_path, uninterrupted
):
    """Saved in the validation where EarlyStopping stops the run (after its check), the
    checkpoint records the stop, but a resume does not carry it (Lightning's does not): the fit
    trains on past the uninterrupted run's end, and EarlyStopping, restored with its patience
    used up, asks again at its next check."""
    full, _ = uninterrupted()
    stops = [p for p in full["probe"] if p["event"] == "validation"]
    assert stops[-1]["wait"] == PATIENCE  # the last validation is the stopping one
    resumed, _ = _in_fresh_processes(tmp_path, ("on_validation_end", len(stops)))
    later = [p for p in resumed["probe"] if p["event"] == "validation"]
    assert resumed["position"][0] > full["position"][0], (resumed["position"], full["position"])
    assert len(later) == 1 and later[0]["step"] > stops[-1]["step"], later
    assert later[0]["wait"] == PATIENCE + 1
    reason = resumed["early_stopping"]["stopping_reason"]
    assert reason == EarlyStoppingReason.PATIENCE_EXHAUSTED.value


class _Metrics(eg.Listener):
    """The trainer's callback_metrics at the start of each training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, dict[str, float]]] = []

    def on_train_batch_start(self, rec):
        t = rec.run
        self.seen.append((t.current_epoch, rec.batch_idx, dict(t.callback_metrics)))


class _SaveAt(eg.Listener):
    """Save at the end of training batch ``batch_idx`` of ``epoch``."""

    def __init__(self, epoch: int, batch_idx: int, path: str) -> None:
        self.epoch, self.batch_idx, self.path = epoch, batch_idx, path

    def on_train_batch_end(self, rec):
        if (rec.run.current_epoch, rec.batch_idx) == (self.epoch, self.batch_idx):
            return eg.Save(self.path)
        return None


def test_callback_metrics_survive_a_resume(tmp_path):
    """What listeners read (EarlyStopping's and ModelCheckpoint's monitor, the file names, the
    metrics a checkpoint records) is the same after a resume as without one."""
    ckpt = str(tmp_path / "c")
    kw = KW | {"max_epochs": 2, "logger": False, "enable_checkpointing": False}
    task = _task()
    full = _Metrics()
    # saved in epoch 1 after batch 3: epoch 0's mean and two validations were logged before
    eg.Trainer(callbacks=[full, _SaveAt(1, 2, ckpt)], **kw).fit(
        task, task.init(_model(0), seed=5), _data(10, 1), _data(3, 2)
    )
    resumed = _Metrics()
    with pytest.warns(UserWarning, match="loading and dropping"):
        eg.Trainer(callbacks=[resumed], **kw).fit(
            task, task.init(_model(1)), _data(10, 1), _data(3, 2), ckpt_path=ckpt
        )
    assert resumed.seen[0][:2] == (1, 3)
    assert {"train/loss_epoch", "val/loss"} <= full.seen[-len(resumed.seen)][2].keys()
    assert resumed.seen == _tail(full.seen, len(resumed.seen))
