"""Resume through the Trainer: a checkpoint determines the rest of the run, bitwise, also when
the run continues in a fresh process."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import _procs
import torch
import torch.nn.functional as F
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.data._position import _SkipFirst


def _task() -> eg.Task:
    tx = optim.adamw(optim.warmup_cosine(1e-2, warmup_steps=3, total_steps=40))

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return eg.Task(loss_fn, tx)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _data(n: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)
    ]


def _trainer(**kw) -> eg.Trainer:
    kw = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    } | kw
    return eg.Trainer(**kw)


class _SaveAt(eg.Listener):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, rec):
        if rec.run.global_step == self.step:
            return eg.Save(self.path)
        return None


def test_resume_mid_epoch_inside_an_accumulation_window_is_bitwise(tmp_path):
    task, data = _task(), _data()
    kw = {"max_epochs": 3, "accumulate_grad_batches": 3}
    full = _trainer(**kw).fit(task, task.init(_model(), seed=5), data, data[:2])

    # _SaveAt(5) saves after every batch while global_step == 5: the last save is two
    # micro-batches into the next accumulation window, mid-epoch 1
    ckpt = tmp_path / "mid"
    _trainer(**kw, callbacks=[_SaveAt(5, ckpt)], max_steps=6).fit(
        task, task.init(_model(), seed=5), data, data[:2]
    )
    meta = checkpoint.read_meta(ckpt)
    assert (meta["step"], meta["epoch"], meta["micro_step"]) == (5, 1, 2)
    assert meta["has_grad_accum"]
    resumed = _trainer(**kw).fit(task, task.init(_model(), seed=99), data, data[:2], ckpt_path=ckpt)
    assert resumed.fingerprint() == full.fingerprint()


def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from test_resume import _task, _model, _data, _trainer, _SaveAt
        task = _task()
        _trainer(max_steps=7, callbacks=[_SaveAt(7, {str(ckpt)!r})]).fit(
            task, task.init(_model(), seed=5), _data(), _data()[:2])
    """)
    _procs.run([sys.executable, "-c", script], check=True)
    task = _task()
    full = _trainer(max_epochs=2).fit(task, task.init(_model(), seed=5), _data(), _data()[:2])
    resumed = _trainer(max_epochs=2).fit(
        task, task.init(_model(), seed=0), _data(), _data()[:2], ckpt_path=ckpt
    )
    assert resumed.step == full.step == 20
    assert resumed.fingerprint() == full.fingerprint()


def test_listener_state_travels_in_the_checkpoint(tmp_path):
    task, data = _task(), _data()
    stopper = eg.EarlyStopping("val/loss", patience=50)
    _trainer(max_epochs=2, callbacks=[stopper]).fit(task, task.init(_model()), data, data[:2])
    path = tmp_path / "c"
    trainer = _trainer(max_epochs=2, callbacks=[stopper])
    trainer.fit(task, task.init(_model()), data, data[:2])
    trainer.save_checkpoint(path)
    fresh = eg.EarlyStopping("val/loss", patience=50)
    _trainer(max_epochs=2, callbacks=[fresh]).validate(
        task, task.init(_model()), data[:2], ckpt_path=path, verbose=False
    )
    assert fresh.state_dict() == stopper.state_dict()


def test_ckpt_path_last_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path):
    import pytest

    task, data = _task(), _data()
    root = tmp_path / "checkpoints"
    trainer = _trainer(
        max_steps=4,
        default_root_dir=tmp_path,
        callbacks=[_SaveAt(2, root / "a"), _SaveAt(4, root / "b")],
    )
    trainer.fit(task, task.init(_model(), seed=5), data)
    (root / "b" / "tensors.pt").write_bytes(b"broken")
    t = _trainer(max_steps=4, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="fails verification"):
        state = t.fit(task, task.init(_model()), data, ckpt_path="last")
    assert state.step == 4


def test_sigterm_finishes_the_step_saves_and_the_resume_is_exact(tmp_path):
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import os, signal, sys; sys.path.insert(0, {here!r})
        import engine as eg
        from test_resume import _task, _model, _data, _trainer

        class Kill(eg.Listener):
            def on_train_batch_start(self, rec):
                if rec.run.global_step == 13:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step

        task = _task()
        _trainer(max_epochs=2, default_root_dir={str(tmp_path)!r}, callbacks=[Kill()]).fit(
            task, task.init(_model(), seed=5), _data(), _data()[:2])
        print("not reached")
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 1 and "not reached" not in done.stdout
    assert "SIGTERM received: finished step 14" in done.stderr
    saved = tmp_path / "checkpoints" / "interrupted-step=14"
    assert checkpoint.read_meta(saved)["step"] == 14
    task = _task()
    full = _trainer(max_epochs=2).fit(task, task.init(_model(), seed=5), _data(), _data()[:2])
    resumed = _trainer(max_epochs=2, default_root_dir=tmp_path).fit(
        task, task.init(_model()), _data(), _data()[:2], ckpt_path="last"
    )
    assert resumed.fingerprint() == full.fingerprint()


class _Counted(torch.utils.data.Dataset):
    """A map-style dataset that counts what it loads."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(2)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.loaded += 1
        return self.x[i], self.y[i]


def _shuffled(ds: _Counted) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=4, sampler=eg.data.ShuffleSampler(ds, seed=7))


def test_shuffled_data_resumes_mid_epoch_bitwise_without_loading_the_skipped_batches(tmp_path):
    task = _task()
    full = _trainer(max_epochs=3).fit(task, task.init(_model(), seed=5), _shuffled(_Counted()))
    ckpt = tmp_path / "c"
    _trainer(max_epochs=3, max_steps=13, callbacks=[_SaveAt(13, ckpt)]).fit(
        task, task.init(_model(), seed=5), _shuffled(_Counted())
    )
    assert checkpoint.read_meta(ckpt)["batch_idx"] == 3  # epoch 1, 3 of 10 batches done
    ds = _Counted()
    resumed = _trainer(max_epochs=3).fit(task, task.init(_model()), _shuffled(ds), ckpt_path=ckpt)
    assert resumed.fingerprint() == full.fingerprint()
    assert ds.loaded == 40 - 12 + 40  # the rest of epoch 1, then epoch 2: nothing skipped is read


def _plain_shuffle(ds: _Counted) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)  # a RandomSampler


def test_shuffle_true_resumes_mid_epoch_bitwise_in_a_fresh_process(tmp_path):
    # the Trainer seeds a RandomSampler without a generator from (state seed, epoch), so the
    # process's global generator (seeded differently in each of the three runs) plays no part
    ckpt = tmp_path / "c"
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        import torch
        from test_resume import _task, _model, _trainer, _SaveAt, _Counted, _plain_shuffle
        torch.manual_seed(222)
        task = _task()
        _trainer(max_epochs=3, max_steps=13, callbacks=[_SaveAt(13, {str(ckpt)!r})]).fit(
            task, task.init(_model(), seed=5), _plain_shuffle(_Counted()))
    """)
    _procs.run([sys.executable, "-c", script], check=True)
    assert checkpoint.read_meta(ckpt)["batch_idx"] == 3  # epoch 1, 3 of 10 batches done
    task = _task()
    torch.manual_seed(111)
    loader = _plain_shuffle(_Counted())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning that the order is outside the state
        full = _trainer(max_epochs=3).fit(task, task.init(_model(), seed=5), loader)
    assert loader.sampler.generator is None  # put back as it was
    torch.manual_seed(333)
    ds = _Counted()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor that skipped batches are loaded and dropped
        resumed = _trainer(max_epochs=3).fit(
            task, task.init(_model()), _plain_shuffle(ds), ckpt_path=ckpt
        )
    assert resumed.fingerprint() == full.fingerprint()
    assert ds.loaded == 40 - 12 + 40  # the rest of epoch 1, then epoch 2: nothing skipped is read
    # and the epochs were shuffled: a run over the unshuffled order ends elsewhere
    ordered = torch.utils.data.DataLoader(_Counted(), batch_size=4)
    other = _trainer(max_epochs=3).fit(task, task.init(_model(), seed=5), ordered)
    assert other.fingerprint() != full.fingerprint()


def test_an_unshuffled_data_loader_resumes_mid_epoch_without_loading_the_skipped_batches(
    tmp_path,
):
    task = _task()
    loader = torch.utils.data.DataLoader(_Counted(), batch_size=4)  # a SequentialSampler
    full = _trainer(max_epochs=2).fit(task, task.init(_model(), seed=5), loader)
    ckpt = tmp_path / "c"
    _trainer(max_epochs=2, max_steps=13, callbacks=[_SaveAt(13, ckpt)]).fit(
        task, task.init(_model(), seed=5), loader
    )
    ds = _Counted()
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = _trainer(max_epochs=2).fit(task, task.init(_model()), loader, ckpt_path=ckpt)
    assert resumed.fingerprint() == full.fingerprint()
    assert ds.loaded == 40 - 12
    assert not isinstance(loader.batch_sampler.sampler, _SkipFirst)  # put back
    assert len(list(loader)) == 10


def test_the_epoch_order_is_a_function_of_seed_and_epoch_only():
    a, b = eg.data.ShuffleSampler(50, seed=3), eg.data.ShuffleSampler(50, seed=3)
    orders = []
    for epoch in (0, 1, 0):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)
        orders.append(list(a))
    assert orders[0] == orders[2] != orders[1]
    assert sorted(orders[1]) == list(range(50))


def test_a_loader_that_cannot_skip_is_fast_forwarded_with_a_warning(tmp_path):
    import pytest

    task, data = _task(), _data()
    full = _trainer(max_epochs=2).fit(task, task.init(_model(), seed=5), data)
    ckpt = tmp_path / "c"
    _trainer(max_epochs=2, max_steps=13, callbacks=[_SaveAt(13, ckpt)]).fit(
        task, task.init(_model(), seed=5), data
    )
    with pytest.warns(UserWarning, match="loading and dropping 3 batches"):
        resumed = _trainer(max_epochs=2).fit(task, task.init(_model()), data, ckpt_path=ckpt)
    assert resumed.fingerprint() == full.fingerprint()


class _Log:
    """A logger that keeps every logged row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def finalize(self, status):
        pass


def test_logged_metrics_after_a_mid_epoch_resume_are_bitwise_identical(tmp_path):
    task, data = _task(), _data()
    kw = {
        "max_epochs": 3,
        "log_every_n_steps": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    full_log = _Log()
    eg.Trainer(logger=full_log, **kw).fit(task, task.init(_model(), seed=5), data, data[:3])
    ckpt = tmp_path / "c"
    eg.Trainer(logger=False, max_steps=14, callbacks=[_SaveAt(14, ckpt)], **kw).fit(
        task, task.init(_model(), seed=5), data, data[:3]
    )
    resumed_log = _Log()
    eg.Trainer(logger=resumed_log, **kw).fit(
        task, task.init(_model()), data, data[:3], ckpt_path=ckpt
    )
    after = [r for r in full_log.rows if r[0] > 14]
    assert any("train/loss_epoch" in m for _, m in after)  # the resumed epoch's mean is in
    assert resumed_log.rows == after


class _SaveOn(eg.Listener):
    """Save in a given event at a given (epoch, batch) position."""

    def __init__(
        self, event: str, epoch: int, batch_idx: int | None, path: Path, log: _Log | None = None
    ) -> None:
        self.epoch, self.batch_idx, self.path, self.log = epoch, batch_idx, path, log
        self.rows_at_save = 0
        setattr(self, event, self._maybe_save)

    def _maybe_save(self, rec):
        if rec.run.current_epoch == self.epoch and rec.batch_idx == self.batch_idx:
            self.rows_at_save = len(self.log.rows) if self.log is not None else 0
            return eg.Save(self.path)
        return None


import pytest  # noqa: E402


class _Ends(eg.Listener):
    """The ends of the fit's validations, in order, and how many preceded the checkpoint saved
    to ``path`` (a save comes after its event has reached every listener)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.seen, self.at_save = path, [], None

    def _see(self, rec) -> None:
        if rec.stage == "fit" and not rec.run.sanity_checking:
            self.seen.append((rec.event.value, rec.run.global_step))

    on_validation_epoch_end = on_validation_end = _see

    def on_save_checkpoint(self, rec):
        if self.path is not None and rec.checkpoint_path == str(self.path):
            self.at_save = len(self.seen)


_VALIDATING = {  # validation every 3 batches across epochs, logging every 2 steps
    "max_epochs": 3,
    "log_every_n_steps": 2,
    "val_check_interval": 3,
    "check_val_every_n_epoch": None,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _uninterrupted(task: eg.Task, data: list) -> tuple[_Log, _Ends]:
    """What the run that never stopped logged, and the validation ends it fired."""
    full_log, full_ends = _Log(), _Ends()
    eg.Trainer(logger=full_log, callbacks=[full_ends], **_VALIDATING).fit(
        task, task.init(_model(), seed=5), data, data[:3]
    )
    return full_log, full_ends


@pytest.mark.parametrize(
    ("event", "epoch", "batch_idx"),
    [
        ("on_train_batch_end", 1, 1),  # before this batch's scheduled validation
        ("on_validation_end", 1, None),  # after the validation of a batch
        ("on_validation_epoch_end", 1, None),  # with its on_validation_end still to come
        ("on_validation_batch_end", 1, 1),  # in the middle of that validation
        ("on_train_epoch_end", 0, None),  # after the epoch's metrics were logged
    ],
)
def test_a_resume_completes_the_batch_or_epoch_the_checkpoint_was_saved_in(
    tmp_path, event, epoch, batch_idx
):
    task, data, kw = _task(), _data(), _VALIDATING
    full_log, full_ends = _uninterrupted(task, data)
    ckpt, saving_log = tmp_path / "c", _Log()
    saver = _SaveOn(event, epoch, batch_idx, ckpt, saving_log)
    saving_ends = _Ends(ckpt)
    eg.Trainer(logger=saving_log, callbacks=[saver, saving_ends], **kw).fit(
        task, task.init(_model(), seed=5), data, data[:3]
    )
    assert saving_log.rows == full_log.rows
    resumed_log, resumed_ends = _Log(), _Ends()
    state = eg.Trainer(logger=resumed_log, callbacks=[resumed_ends], **kw).fit(
        task, task.init(_model()), data, data[:3], ckpt_path=ckpt
    )
    # exactly what was logged after the save point, validation and epoch means included:
    # nothing logged before it again, nothing that followed it missing
    assert resumed_log.rows == full_log.rows[saver.rows_at_save :]
    # and the validation ends that followed it fire once each
    assert resumed_ends.seen == full_ends.seen[saving_ends.at_save :]
    assert any(k.startswith("val/") for _, m in resumed_log.rows for k in m)
    assert state.step == 30


@pytest.mark.parametrize(
    ("event", "phase", "old_phase", "old_event"),
    [
        # an engine before requests recorded the event a listener saved in, and the keys of
        # the listeners yet to have it; "validated" covered both ends of a validation
        ("on_validation_end", "validation_end", "validated", ["on_validation_end", ["Later"]]),
        ("on_validation_epoch_end", "validated", "validated", ["on_validation_epoch_end", []]),
        ("on_train_batch_end", "batch_end", "batch_end", ["on_train_batch_end", ["Later"]]),
        ("on_train_epoch_end", "epoch_end", "epoch_end", None),
    ],
)
def test_a_checkpoint_of_the_engine_before_requests_still_resumes(
    tmp_path, event, phase, old_phase, old_event
):
    from test_checkpoint_integrity import _forge

    task, data, kw = _task(), _data(), _VALIDATING
    full_log, full_ends = _uninterrupted(task, data)
    batch_idx = 1 if event == "on_train_batch_end" else None
    ckpt = tmp_path / "c"
    saver, saving_ends = _SaveOn(event, 1, batch_idx, ckpt, _Log()), _Ends(ckpt)
    eg.Trainer(logger=saver.log, callbacks=[saver, saving_ends], **kw).fit(
        task, task.init(_model(), seed=5), data, data[:3]
    )
    meta = checkpoint.read_meta(ckpt)
    assert meta["extra"]["trainer"]["phase"] == phase and "event" not in meta["extra"]["trainer"]
    meta["extra"]["trainer"].update(phase=old_phase, event=old_event)
    _forge(ckpt, meta)
    resumed_log, resumed_ends = _Log(), _Ends()
    state = eg.Trainer(logger=resumed_log, callbacks=[resumed_ends], **kw).fit(
        task, task.init(_model()), data, data[:3], ckpt_path=ckpt
    )
    assert resumed_log.rows == full_log.rows[saver.rows_at_save :]
    assert resumed_ends.seen == full_ends.seen[saving_ends.at_save :]
    assert state.step == 30


def test_a_checkpoint_records_the_run_configuration(tmp_path):
    task = _task()
    trainer = _trainer(max_epochs=2, accumulate_grad_batches=3, gradient_clip_val=0.5)
    trainer.fit(task, task.init(_model()), _data())
    config = checkpoint.read_meta(trainer.save_checkpoint(tmp_path / "c"))["extra"]["config"]
    assert config["max_epochs"] == 2 and config["accumulate_grad_batches"] == 3
    assert config["gradient_clip_val"] == 0.5 and config["torch_version"] == torch.__version__


def test_a_loader_that_both_trains_and_validates_skips_only_in_training_on_resume(tmp_path):
    class Watch(eg.Listener):
        def __init__(self):
            self.val_batches, self.val_loss = 0, None

        def on_validation_batch_end(self, rec):
            if not rec.run.sanity_checking:
                self.val_batches += 1

        def on_validation_end(self, rec):
            if not rec.run.sanity_checking:
                self.val_loss = rec.run.callback_metrics["val/loss"]

    task = _task()
    shared = torch.utils.data.DataLoader(_Counted(), batch_size=4)
    kw = {"max_epochs": 1, "num_sanity_val_steps": 0}
    full_watch = Watch()
    _trainer(**kw, callbacks=[full_watch, _SaveAt(3, tmp_path / "c")]).fit(
        task, task.init(_model(), seed=5), shared, shared
    )
    watch = Watch()
    _trainer(**kw, callbacks=[watch]).fit(
        task, task.init(_model()), shared, shared, ckpt_path=tmp_path / "c"
    )
    assert watch.val_batches == full_watch.val_batches == 10
    assert watch.val_loss == full_watch.val_loss


def test_every_training_loader_a_fit_positioned_is_put_back(tmp_path):
    class Reloading:  # a new shuffled loader every epoch
        def __init__(self):
            self.made = []

        def train_dataloader(self):
            self.made.append(torch.utils.data.DataLoader(_Counted(), batch_size=4, shuffle=True))
            return self.made[-1]

    dm, task = Reloading(), _task()
    _trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1).fit(
        task, task.init(_model()), datamodule=dm
    )
    assert len(dm.made) == 3
    for loader in dm.made:
        assert loader.sampler.generator is None
        assert not isinstance(loader.batch_sampler.sampler, _SkipFirst)


def test_a_cpu_fit_resumed_on_another_thread_count_is_warned_about(tmp_path):
    """A CPU reduction sums per-thread parts: the resume says which count continues the run
    exactly, and says nothing under the same count."""
    task, data = _task(), _data(4)
    ckpt = tmp_path / "c"
    torch.set_num_threads(1)  # the autouse fixture gives the process's count back after
    _trainer(max_epochs=1, callbacks=[_SaveAt(2, ckpt)], max_steps=3).fit(
        task, task.init(_model(), seed=5), data
    )
    assert checkpoint.read_meta(ckpt)["extra"]["config"]["threads"] == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(max_epochs=1).fit(task, task.init(_model()), data, ckpt_path=ckpt)
    assert not [w for w in caught if "thread" in str(w.message)]
    torch.set_num_threads(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(max_epochs=1).fit(task, task.init(_model()), data, ckpt_path=ckpt)
    (said,) = [str(w.message) for w in caught if "thread" in str(w.message)]
    assert "saved by a fit on 1 thread(s)" in said and "computes on 2" in said
    assert "torch.set_num_threads(1)" in said
