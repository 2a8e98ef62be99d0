"""Ranks that disagree before training (issue 24): data of other lengths on one rank is an
error on every rank before the first step (one collective at each stage's setup), a devices
value the accelerator does not take says what it does take, DP-SGD over several processes says
why not and what to do instead.

The rank tests run 2 gloo ranks (tests/_ranks.py), each with a deadline, so a hang or the
backend's abort fails fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks

import engine as eg
from engine.parallel import lengths
from engine.transforms import devices as devices_module

TIMEOUT = 90.0
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


# --------------------------------------------------------------------------- lengths, in-process


def test_a_loader_is_measured_whole_and_an_iterable_is_left_out():
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(5))

        def __len__(self):  # a declared length of an iterable is only a guess: not compared
            return 5

    assert lengths.measure(DataLoader(range(10), batch_size=3), "train", 0)[:4] == (
        "train",
        0,
        10,
        4,
    )
    measured = lengths.measure(DataLoader(Stream(), batch_size=2), "val", 1)
    assert measured[:4] == ("val", 1, None, None)
    assert lengths.measure([1, 2, 3], "predict", 0)[:4] == ("predict", 0, None, 3)
    assert lengths.measure(iter([1, 2]), "test", 0)[:4] == ("test", 0, None, None)


def test_the_disagreement_names_each_loader_and_each_ranks_lengths():
    L = lengths.Length
    same = [L("train", 0, 10, 4), L("val", 0, None, None)]
    assert lengths.disagreement([same, same, same]) is None
    message = lengths.disagreement(
        [
            [L("train", 0, 256, 32), L("val", 0, 8, 2), L("val", 1, 8, 2)],
            [L("train", 0, 232, 29), L("val", 0, 8, 2), L("val", 1, 8, 4)],
            [L("train", 0, 256, 32), L("val", 0, 8, 2), L("val", 1, 8, 2)],
        ]
    )
    assert message is not None
    assert (
        "the training dataloader: 256 samples in 32 batches on ranks 0, 2; 232 samples in 29 "
        "batches on rank 1" in message
    )
    assert (
        "the validation dataloader 1 (dataloader_idx=1): 8 samples in 2 batches on ranks 0, 2"
        in message
    )
    assert "8 samples in 4 batches on rank 1" in message
    assert "dataloader 0" not in message
    assert "Every rank must build the same dataset" in message
    assert "use_distributed_sampler=False" in message
    counts = lengths.disagreement([[L("test", 0, 4, 1), L("test", 1, 4, 1)], [L("test", 0, 4, 1)]])
    assert counts is not None and "the test dataloaders: 2 on rank 0; 1 on rank 1" in counts


# --------------------------------------------------------------------------- lengths, 2 ranks


def _task():
    import torch.nn.functional as F

    from engine import optim

    return eg.Task(
        lambda m, b: F.mse_loss(m(b[0]), b[1]),
        optim.sgd(0.1),
        eval_fn=lambda m, b: {"loss": F.mse_loss(m(b[0]), b[1])},
    )


def _data(n: int):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))


class _Steps(eg.Listener):
    """How many training / evaluation batches started on this rank."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, rec):
        self.batches += 1

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = on_train_batch_start


def _attempt(call) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _different_data(rank: int, root: str) -> dict:
    """Each stage with data of other lengths on rank 1, then the same data (it trains)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    gathers = 0
    gather = dist.all_gather_object

    def counted(*args, **kwargs):
        nonlocal gathers
        gathers += 1
        return gather(*args, **kwargs)

    dist.all_gather_object = counted  # type: ignore[assignment]
    out: dict = {}
    task, steps = _task(), _Steps()

    def trainer(**flags):
        return eg.Trainer(
            strategy="ddp",
            devices=2,
            max_epochs=1,
            default_root_dir=root,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            **{"callbacks": [steps], **QUIET, **flags},
        )

    def state():
        return task.init(torch.nn.Linear(6, 3))

    # the case: rank 1's dataset 232 samples, rank 0's 256; a validation loader beside
    n = 256 if rank == 0 else 232
    t = trainer()
    out["fit"] = _attempt(
        lambda: t.fit(
            task,
            state(),
            DataLoader(_data(n), batch_size=8),
            DataLoader(_data(16), batch_size=4),
        )
    )
    out["fit_gathers"] = gathers
    # a validation loader of another batch size on rank 1 (the second of two)
    out["validate"] = _attempt(
        lambda: trainer().validate(
            task,
            state(),
            [DataLoader(_data(16), batch_size=4), DataLoader(_data(16), batch_size=4 + 4 * rank)],
            verbose=False,
        )
    )
    # one test loader on rank 1, two on rank 0
    out["test"] = _attempt(
        lambda: trainer().test(
            task, state(), [DataLoader(_data(8), batch_size=4)] * (2 - rank), verbose=False
        )
    )
    out["predict"] = _attempt(
        lambda: trainer().predict(task, state(), DataLoader(_data(10 + rank), batch_size=4))
    )
    out["batches_before"] = steps.batches
    # the same data on both: it trains as before, with one gather of the lengths at setup
    gathers = 0

    class AtStart(eg.Listener):
        def on_train_start(self, rec):
            out["same_gathers"] = gathers  # the setup's, before the metrics' own syncs

    t = trainer(callbacks=[steps, AtStart()])
    fitted = t.fit(
        task, state(), DataLoader(_data(24), batch_size=4), DataLoader(_data(8), batch_size=4)
    )
    out["same_steps"] = fitted.step
    return out


@pytest.mark.slow
def test_ranks_with_data_of_other_lengths_both_fail_before_the_first_step(tmp_path):
    results = run_ranks(_different_data, 2, str(tmp_path), timeout=TIMEOUT)
    for r in results:
        fit = r["fit"]
        assert fit is not None, "the fit with other data on rank 1 ran"
        assert fit.startswith("DDP: the ranks built different data")
        assert (
            "the training dataloader: 256 samples in 32 batches on rank 0; 232 samples in 29 "
            "batches on rank 1" in fit
        )
        assert "validation" not in fit.split(". Every")[0]  # the same on both: not named
        assert "Every rank must build the same dataset" in fit
        assert r["fit_gathers"] == 1  # one collective for the training and validation loaders
        assert (
            "the validation dataloader 1 (dataloader_idx=1): 16 samples in 4 batches on rank 0; "
            "16 samples in 2 batches on rank 1" in r["validate"]
        )
        assert "the test dataloaders: 2 on rank 0; 1 on rank 1" in r["test"]
        assert (
            "the predict dataloader: 10 samples in 3 batches on rank 0; 11 samples in 3 batches "
            "on rank 1" in r["predict"]
        )
        assert r["batches_before"] == 0  # no batch started anywhere before those errors
        assert r["same_steps"] == 3 and r["same_gathers"] == 1


class _Reloading:
    """A datamodule whose training data shrinks on rank 1 at its second epoch."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        self.calls += 1
        n = 16 - 4 * self.rank * (self.calls > 1)
        return DataLoader(_data(n), batch_size=4)


def _reloaded(rank: int, root: str) -> dict:
    steps = _Steps()
    t = eg.Trainer(
        strategy="ddp",
        devices=2,
        max_epochs=3,
        reload_dataloaders_every_n_epochs=1,
        default_root_dir=root,
        callbacks=[steps],
        enable_checkpointing=False,
        **QUIET,
    )
    task = _task()
    message = _attempt(
        lambda: t.fit(task, task.init(torch.nn.Linear(6, 3)), datamodule=_Reloading(rank))
    )
    return {"message": message, "batches": steps.batches}


@pytest.mark.slow
def test_a_reloaded_loader_of_other_lengths_fails_on_every_rank_before_its_epoch(tmp_path):
    results = run_ranks(_reloaded, 2, str(tmp_path), timeout=TIMEOUT)
    for r in results:
        assert r["message"] is not None
        assert (
            "the training dataloader: 16 samples in 4 batches on rank 0; 12 samples in 3 "
            "batches on rank 1" in r["message"]
        )
        assert r["batches"] == 2  # the first epoch's (each rank's shard of 4 batches), no more


def _uneven_evaluation(rank: int, root: str) -> dict:
    """FSDP validation of 11 samples in batches of 1 (unpadded: 6 batches on rank 0, 5 on
    rank 1, and rank 0's last forward would gather alone), then with the user's own
    DistributedSampler(drop_last=True), then of a multiple of the world size: each rank's
    batches and the warnings."""
    import warnings

    from torch.utils.data import DataLoader, DistributedSampler

    class Count(eg.Listener):
        batches = 0

        def on_validation_batch_end(self, rec):
            self.batches += 1

    task, out = _task(), {}
    for name, loader in (
        ("uneven", DataLoader(_data(11), batch_size=1)),
        (
            "drop_last",
            DataLoader(
                _data(11),
                batch_size=1,
                sampler=DistributedSampler(_data(11), 2, rank, shuffle=False, drop_last=True),
            ),
        ),
        ("even", DataLoader(_data(12), batch_size=1)),
    ):
        count = Count()
        trainer = eg.Trainer(
            strategy="fsdp", devices=2, default_root_dir=root, callbacks=[count], **QUIET
        )
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.validate(task, task.init(torch.nn.Linear(6, 3)), loader, verbose=False)
        said = [str(w.message) for w in seen if "FSDP: evaluation shards" in str(w.message)]
        out[name] = {"said": said, "batches": count.batches}
    return out


@pytest.mark.slow
def test_fsdp_pads_evaluation_shards_so_every_rank_runs_as_many_forwards(tmp_path):
    """Every FSDP forward gathers the parameters (a collective): unpadded evaluation shards of
    11 samples on 2 ranks made rank 0's sixth forward wait alone (gloo failed or hung). They
    are padded as DistributedSampler pads them, saying which samples count twice."""
    rank0, rank1 = run_ranks(_uneven_evaluation, 2, str(tmp_path), timeout=TIMEOUT)
    assert rank0["uneven"]["batches"] == rank1["uneven"]["batches"] == 6
    assert len(rank0["uneven"]["said"]) == 1 and not rank1["uneven"]["said"]  # rank 0, once
    message = rank0["uneven"]["said"][0]
    assert (
        "the validation dataloader (11 samples in 11 batches) repeats 1 sample of its order"
        in message
    )
    assert (
        "multiple of 2 samples" in message and "DistributedSampler(..., drop_last=True)" in message
    )
    assert rank0["drop_last"]["batches"] == rank1["drop_last"]["batches"] == 5
    assert rank0["even"]["batches"] == rank1["even"]["batches"] == 6
    for r in (rank0, rank1):
        assert r["drop_last"]["said"] == [] and r["even"]["said"] == []


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "auto", "ddp_spawn"])
@pytest.mark.parametrize("devices", [0, -2, "x", [], "0", True, 1.5])
def test_a_bad_devices_value_on_the_cpu_says_what_the_cpu_takes(strategy, devices):
    with pytest.raises(ValueError) as e:
        eg.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)
    message = str(e.value)
    assert message.startswith(f"Trainer(devices={devices!r}): on the CPU pass a number of ")
    assert "N >= 1" in message and "strategy='ddp'" in message
    assert "a list of one device index" not in message  # the old advice, wrong for ddp


def test_a_bad_devices_value_on_cuda_and_mps_says_what_each_takes(monkeypatch):
    monkeypatch.setattr(devices_module, "_cuda_count", lambda: 4)
    monkeypatch.setattr(devices_module, "available_accelerators", lambda: ["cuda:0 (a)", "cpu"])
    with pytest.raises(ValueError, match=r"on CUDA pass a number of GPUs from 1 to 4 .* -1 for"):
        devices_module.resolve_devices("cuda", 0)
    with pytest.raises(ValueError, match=r"Trainer\(devices='x'\): on CUDA .* '0,1'"):
        devices_module.resolve_devices("gpu", "x")
    monkeypatch.setattr(devices_module, "_cuda_count", lambda: 0)
    monkeypatch.setattr(devices_module, "_mps", lambda: True)
    with pytest.raises(ValueError, match=r"Trainer\(devices=-2\): MPS is one device: pass 1"):
        devices_module.resolve_devices("mps", -2)
    # without the accelerator, that comes first
    monkeypatch.setattr(devices_module, "_mps", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        devices_module.resolve_devices("cuda", 0)


# --------------------------------------------------------------------------- DP-SGD


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "ddp_spawn", "auto"])
def test_dpsgd_over_several_processes_says_why_not_and_what_to_do(strategy):
    from engine.privacy import DPSGD

    dp = DPSGD(max_grad_norm=1.0, noise_multiplier=1.1, sample_rate=0.1, expected_batch_size=8)
    with pytest.raises(ValueError) as e:
        eg.Trainer(strategy=strategy, accelerator="cpu", devices=2, plugins=[dp], logger=False)
    message = str(e.value)
    assert "DP-SGD runs in one process and this run has 2" in message
    assert "sqrt(world_size) = sqrt(2) times the noise" in message  # why
    assert "epsilon() would account for a mechanism that never ran" in message
    assert "Train it on one process (devices=1" in message  # what to do
    assert "accumulate_grad_batches" in message
    eg.Trainer(accelerator="cpu", devices=1, plugins=[dp], logger=False)  # one process: fine


def test_dpsgd_composed_with_a_strategy_of_two_ranks_gives_the_same_reason():
    from engine import transforms
    from engine.privacy import DPSGD
    from engine.transforms.base import Strategy

    class Two(Strategy):
        @property
        def world_size(self) -> int:
            return 2

    dp = DPSGD(max_grad_norm=1.0, noise_multiplier=1.1, sample_rate=0.1, expected_batch_size=8)
    with pytest.raises(ValueError, match=r"(?s)sqrt\(2\) times the noise .*devices=1"):
        transforms.compose(privacy=dp, strategy=Two())


def test_a_signalled_rank_reports_a_failed_collective_without_waiting_for_answers(monkeypatch):
    """A rank whose collective failed asks the others where they are and waits up to a grace
    period for the answers, for its error message; once torchrun's SIGTERM has come (a peer
    died, the group is being stopped) it does not wait for answers a dead rank never gives, so
    the restart is not held up by diagnostics."""
    from engine.parallel import _watchdog

    class Silent:  # the store of a group whose other rank is dead: nobody answers
        def check(self, keys):
            return False

        def set(self, key, value):
            pass

    sleeps: list[float] = []
    monkeypatch.setattr(_watchdog.time, "sleep", sleeps.append)
    clock = iter(range(0, 10_000))  # each look at the clock one second later
    monkeypatch.setattr(_watchdog.time, "monotonic", lambda: float(next(clock)))
    watch = _watchdog._Watch(1800.0, 0, 2, Silent())
    monkeypatch.setattr(_watchdog, "_signalled", False)
    assert watch.others() == {1: None} and len(sleeps) >= 4  # waited out the grace
    sleeps.clear()
    _watchdog.signalled()
    assert watch.others() == {1: None} and sleeps == []  # at once
