"""Data that resumes exactly: per-sample randomness that does not depend on the number of
workers (and survives a fresh process), and iterables that save their own position."""

from __future__ import annotations

import random
import sys
import textwrap
import warnings
from pathlib import Path

import _procs
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import engine as eg
from engine import checkpoint
from engine.data import SampleKey, SeededDataset, ShuffleSampler

sys.path.insert(0, str(Path(__file__).parent))
from test_resume import _model, _SaveAt, _task, _trainer


class Augmented(Dataset):
    """Random augmentation drawn from torch's, Python's and NumPy's global generators."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(2)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        noise = 0.1 * torch.randn(6) + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return self.x[i] + noise, self.y[i]


def loader(workers: int, *, seeded: bool = True) -> DataLoader:
    ds = SeededDataset(Augmented(), seed=11) if seeded else Augmented()
    return DataLoader(ds, batch_size=4, sampler=ShuffleSampler(ds, seed=7), num_workers=workers)


def _epoch(dl: DataLoader, epoch: int) -> torch.Tensor:
    dl.sampler.set_epoch(epoch)
    return torch.cat([x for x, _ in dl])


def test_per_sample_randomness_does_not_depend_on_the_number_of_workers():
    by_workers = {w: [_epoch(loader(w), e) for e in (0, 1)] for w in (0, 1, 2)}
    for w in (1, 2):
        for e in (0, 1):
            assert torch.equal(by_workers[w][e], by_workers[0][e])
    # each epoch draws new augmentations (and the sampler a new order)
    assert not torch.equal(by_workers[0][0], by_workers[0][1])
    # without the wrapper the draws follow the workers' seeds: the check above can fail
    plain = [_epoch(loader(w, seeded=False), 0) for w in (0, 2)]
    assert not torch.equal(plain[0], plain[1])


def test_a_sample_is_a_function_of_seed_epoch_and_index_and_leaves_global_rngs_alone():
    ds = SeededDataset(Augmented(), seed=3)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    before = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    a = ds[SampleKey(1, 5)][0]
    after = (torch.rand(1), random.random(), np.random.rand())
    assert before == after  # the caller's sequences continue as if nothing was drawn
    ds.set_epoch(1)
    assert torch.equal(ds[5][0], a)  # a plain index uses the epoch set last
    assert not torch.equal(ds[SampleKey(2, 5)][0], a)
    assert not torch.equal(SeededDataset(Augmented(), seed=4)[SampleKey(1, 5)][0], a)


@pytest.mark.slow
def test_resume_with_two_workers_and_augmentation_in_a_fresh_process_is_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        from test_data_resume import loader
        from test_resume import _task, _model, _trainer, _SaveAt
        task = _task()
        _trainer(max_epochs=3, max_steps=9, callbacks=[_SaveAt(9, {str(ckpt)!r})]).fit(
            task, task.init(_model(), seed=5), loader(2))
    """)
    _procs.run([sys.executable, "-c", script], check=True)
    assert checkpoint.read_meta(ckpt)["batch_idx"] == 3  # epoch 1, 3 of 6 batches done
    task = _task()
    full = _trainer(max_epochs=3).fit(task, task.init(_model(), seed=5), loader(2))
    resumed = _trainer(max_epochs=3).fit(task, task.init(_model()), loader(2), ckpt_path=ckpt)
    assert resumed.step == full.step == 18
    assert resumed.fingerprint() == full.fingerprint()
    # and the run is the same with another number of workers
    other = _trainer(max_epochs=3).fit(task, task.init(_model(), seed=5), loader(0))
    assert other.fingerprint() == full.fingerprint()


class Stream:
    """An iterable of random batches from its own generator, which saves its position.

    Each pass continues where the last stopped and runs to the end of the epoch (``n``
    batches); ``drawn`` counts the batches made.
    """

    def __init__(self, n: int = 8, seed: int = 3) -> None:
        self.n, self.pos, self.drawn = n, 0, 0
        self.g = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.pos >= self.n:
            self.pos = 0
        while self.pos < self.n:
            x = torch.randn(4, 6, generator=self.g)
            y = torch.randint(0, 3, (4,), generator=self.g)
            self.pos += 1
            self.drawn += 1
            yield x, y

    def state_dict(self):
        return {"pos": self.pos, "rng": self.g.get_state()}

    def load_state_dict(self, state):
        self.pos = state["pos"]
        self.g.set_state(state["rng"])


def test_a_stateful_iterable_resumes_from_its_state_dict_without_replaying_batches(tmp_path):
    task = _task()
    full = _trainer(max_epochs=2).fit(task, task.init(_model(), seed=5), Stream())
    ckpt = tmp_path / "c"
    _trainer(max_epochs=2, max_steps=11, callbacks=[_SaveAt(11, ckpt)]).fit(
        task, task.init(_model(), seed=5), Stream()
    )
    meta = checkpoint.read_meta(ckpt)
    assert meta["batch_idx"] == 3 and meta["extra"]["trainer"]["data_state"]["pos"] == 3
    stream = Stream()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*loading and dropping")
        resumed = _trainer(max_epochs=2).fit(task, task.init(_model()), stream, ckpt_path=ckpt)
    assert resumed.fingerprint() == full.fingerprint()
    assert stream.drawn == 8 - 3  # the rest of epoch 1 only: the consumed batches are not redrawn


def test_loader_states_round_trip_through_json():
    g = torch.Generator().manual_seed(0)
    state = {"gen": g.get_state(), "pos": (1, 2), "f": float("inf"), 3: b"\x00\x01", "x": None}
    back = eg.data.state_from_json(eg.data.state_to_json(state))
    assert torch.equal(back["gen"], state["gen"]) and back["gen"].dtype == torch.uint8
    assert back["pos"] == (1, 2) and back["f"] == float("inf") and back[3] == b"\x00\x01"
    assert back["x"] is None
    import pytest

    with pytest.raises(TypeError, match="cannot store"):
        eg.data.state_to_json({"fn": lambda: 0})


def test_fit_warns_when_a_random_sampler_draws_from_a_users_generator(tmp_path):
    import pytest

    task = _task()
    ds = Augmented()
    g = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match="generator you gave it"):
        _trainer(max_epochs=1).fit(
            task, task.init(_model()), DataLoader(ds, shuffle=True, generator=g)
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*RandomSampler")
        _trainer(max_epochs=1).fit(task, task.init(_model()), loader(0))
        # shuffle=True without a generator: the Trainer seeds it from the state
        _trainer(max_epochs=1).fit(task, task.init(_model()), DataLoader(ds, shuffle=True))


def test_a_random_sampler_subclass_with_its_own_order_is_left_alone_and_warned_about():
    from torch.utils.data import RandomSampler

    class GlobalOrder(RandomSampler):  # draws from the global generator whatever .generator is
        def __iter__(self):
            return iter(torch.randperm(len(self.data_source)).tolist())

    loader = DataLoader(range(8), sampler=GlobalOrder(range(8)))
    assert not eg.data.seed_shuffle(loader, seed=0, epoch=0)
    assert loader.sampler.generator is None
    assert eg.data.order_outside_the_state(loader)


# ------------------------------------------- random augmentation in a plain Dataset, unwrapped


class _Batches(eg.Listener):
    """Records every training batch's inputs."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_batch_end(self, rec):
        self.seen.append(rec.batch[0].clone())


def _perturb_global_rngs(k: int) -> None:
    """Other code (or another process) left the global generators somewhere else."""
    torch.manual_seed(1000 + k)
    random.seed(1000 + k)
    np.random.seed(1000 + k)


def plain_loader(workers: int = 2, *, order: str = "sequential", **kw) -> DataLoader:
    """A plain ``Augmented`` (no SeededDataset) in ``order``: "sequential", "shuffle"
    (``shuffle=True``) or "sampler" (a ``ShuffleSampler``, which skips by starting later)."""
    ds = Augmented()
    if order == "sampler":
        kw["sampler"] = ShuffleSampler(ds, seed=7)
    return DataLoader(ds, batch_size=4, shuffle=order == "shuffle", num_workers=workers, **kw)


def _fit_plain(dl, k: int, *listeners, **kw) -> tuple[eg.TrainState, torch.Tensor]:
    """Fit two epochs from seed 5 with the global generators in state ``k``; the state and the
    batches seen."""
    task, seen = _task(), _Batches()
    state = task.init(_model(), seed=5)
    _perturb_global_rngs(k)
    state = _trainer(max_epochs=2, callbacks=[seen, *listeners], **kw).fit(task, state, dl)
    return state, torch.stack(seen.seen)


def test_a_finished_trainer_and_its_persistent_workers_go_when_dropped_not_at_a_later_gc():
    # A DataLoader whose persistent workers are left to the garbage collector takes torch 5 s a
    # worker to shut down (its queues are finalized first), at whatever step the collector runs.
    # Dropping a Trainer must free its loaders by reference counting: no cycle through it.
    import gc
    import time
    import weakref

    dl = plain_loader(2, persistent_workers=True)
    trainer = _trainer(max_epochs=1)
    task = _task()
    trainer.fit(task, task.init(_model(), seed=5), dl)
    gone = weakref.ref(trainer), weakref.ref(dl), weakref.ref(dl._iterator)
    gc.disable()
    try:
        start = time.perf_counter()
        del trainer, dl
        assert [r() is None for r in gone] == [True, True, True]
        assert time.perf_counter() - start < 4.0  # the workers shut down at once
    finally:
        gc.enable()


def test_augmentation_in_a_plain_dataset_is_seeded_from_the_state_and_does_not_depend_on_workers():
    from torch.utils.data import Subset

    base, batches = _fit_plain(plain_loader(0), 0)
    again, batches_again = _fit_plain(plain_loader(2), 1)
    assert again.fingerprint() == base.fingerprint()
    assert torch.equal(batches_again, batches)
    twice = _fit_plain(plain_loader(2), 2)
    assert twice[0].fingerprint() == base.fingerprint()  # two fits with the same seed
    started = plain_loader(2, persistent_workers=True)
    _ = [b for b in started]  # its workers start before the fit, without the hook
    subset = DataLoader(Subset(Augmented(), range(24)), batch_size=4, num_workers=2)
    for dl in (plain_loader(1), plain_loader(2, persistent_workers=True), started, subset):
        state, seen = _fit_plain(dl, 3)
        assert torch.equal(seen, batches) and state.fingerprint() == base.fingerprint()
    # the same samples draw new numbers in the next epoch, and with another seed
    assert not torch.equal(batches[0], batches[6])
    other_seed = _trainer(max_epochs=1, callbacks=[seen := _Batches()]).fit(
        _task(), _task().init(_model(), seed=6), plain_loader(2)
    )
    assert other_seed.step == 6 and not torch.equal(torch.stack(seen.seen), batches[:6])


@pytest.mark.slow
@pytest.mark.parametrize("order", ["sequential", "shuffle", "sampler"])
def test_resume_with_two_workers_and_augmentation_in_a_plain_dataset_in_a_fresh_process_is_bitwise(
    tmp_path, order
):
    ckpt = tmp_path / "ckpt"
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {here!r})
        import torch
        from test_data_resume import plain_loader
        from test_resume import _task, _model, _trainer, _SaveAt
        task = _task()
        state = task.init(_model(), seed=5)
        torch.manual_seed(123)  # this process's global generators are its own business
        _trainer(max_epochs=3, max_steps=9, callbacks=[_SaveAt(9, {str(ckpt)!r})]).fit(
            task, state, plain_loader(2, order={order!r}))
    """)
    _procs.run([sys.executable, "-c", script], check=True)
    assert checkpoint.read_meta(ckpt)["batch_idx"] == 3  # epoch 1, 3 of 6 batches done
    task = _task()
    seen_full, seen_resumed = _Batches(), _Batches()
    state = task.init(_model(), seed=5)
    _perturb_global_rngs(0)
    full = _trainer(max_epochs=3, callbacks=[seen_full]).fit(
        task, state, plain_loader(2, order=order)
    )
    state = task.init(_model())
    _perturb_global_rngs(1)
    resumed = _trainer(max_epochs=3, callbacks=[seen_resumed]).fit(
        task, state, plain_loader(2, order=order), ckpt_path=ckpt
    )
    assert resumed.step == full.step == 18
    assert resumed.fingerprint() == full.fingerprint()
    assert torch.equal(torch.stack(seen_resumed.seen), torch.stack(seen_full.seen[9:]))


def test_a_fit_seeds_batches_only_while_it_runs_and_leaves_the_loader_as_the_user_made_it(
    tmp_path,
):
    def init(worker_id: int) -> None:
        pass

    dl = plain_loader(2, order="shuffle", persistent_workers=True, worker_init_fn=init)
    sampler, dataset = dl.batch_sampler.sampler, dl.dataset
    ckpt = tmp_path / "c"
    _fit_plain(dl, 0, _SaveAt(9, ckpt), max_steps=9)
    task, seen = _task(), _Batches()
    state = task.init(_model())
    _perturb_global_rngs(1)
    _trainer(max_epochs=2, max_steps=10, callbacks=[seen]).fit(task, state, dl, ckpt_path=ckpt)
    # the resumed fit (on the same loader and workers) saw the uninterrupted run's 10th batch
    assert len(seen.seen) == 1
    assert torch.equal(seen.seen[0], _fit_plain(plain_loader(0, order="shuffle"), 2)[1][9])
    assert "__getitems__" not in vars(dataset) and dl.dataset is dataset
    assert dl.batch_sampler.sampler is sampler and dl.sampler is sampler
    assert sampler.generator is None and dl.worker_init_fn is init
    # outside a fit the (still running, persistent) workers draw unseeded, new numbers each pass
    a, b = (torch.cat([x for x, _ in dl]) for _ in range(2))
    assert not torch.equal(a, b)


def test_fit_warns_when_workers_draw_outside_the_state():
    from torch.utils.data import BatchSampler, SequentialSampler

    class Pairs(BatchSampler):  # a custom batch sampler: the Trainer cannot key its batches
        pass

    def custom(ds, workers=2):
        batches = Pairs(SequentialSampler(ds), batch_size=4, drop_last=False)
        return DataLoader(ds, batch_sampler=batches, num_workers=workers)

    task = _task()
    with pytest.warns(UserWarning, match=r"outside the run's state.*SeededDataset") as record:
        _trainer(max_epochs=2).fit(task, task.init(_model()), custom(Augmented()))
    assert sum("worker processes" in str(w.message) for w in record) == 1  # once a fit
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*worker processes")
        _trainer(max_epochs=1).fit(task, task.init(_model()), custom(Augmented(), workers=0))
        _trainer(max_epochs=1).fit(task, task.init(_model()), custom(SeededDataset(Augmented())))
        _trainer(max_epochs=1).fit(task, task.init(_model()), plain_loader(2))  # seeded


def _draws() -> tuple[float, float, float]:
    """One number from each global generator: torch's CPU one, Python's, NumPy's."""
    return float(torch.rand(())), random.random(), float(np.random.rand())


def test_seeded_batches_hold_the_main_process_streams_until_restore_loader_gives_them_back():
    dl = plain_loader(0)
    assert eg.data.seed_batches(dl, seed=0, epoch=0)

    def one_pass(k: int) -> tuple[list[torch.Tensor], list[tuple[float, float, float]]]:
        """The batches and what code draws between them, from global generators in state k."""
        _perturb_global_rngs(k)
        batches, between = [], []
        for x, _ in dl:  # each batch draws from all three generators inside
            batches.append(x)
            between.append(_draws())
        return batches, between

    batches, between = one_pass(0)
    again, between_again = one_pass(1)
    # between two batches, code draws on from the last batch's stream: a function of the key
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert between == between_again and len(set(between)) == len(between)
    eg.data.restore_loader(dl)
    # restore_loader gives the caller's streams back as they were before the first batch
    _perturb_global_rngs(2)
    _draws()
    assert eg.data.seed_batches(dl, seed=0, epoch=0)
    it = iter(dl)  # (an iterator draws its workers' base seed from torch's generator)
    before = _states()
    _ = [b for b in it]
    assert _states() != before
    eg.data.restore_loader(dl)
    assert _states() == before
    draw = _draws()
    eg.data.restore_loader(dl)  # twice: nothing more to give back
    assert _states() != before and _draws() != draw


def _states() -> tuple[bytes, object, str]:
    """The three global generators' states, comparable with ``==``."""
    return (torch.get_rng_state().numpy().tobytes(), random.getstate(), repr(np.random.get_state()))


def test_seeded_batches_with_workers_leave_the_main_process_streams_alone():
    dl = plain_loader(2)
    assert eg.data.seed_batches(dl, seed=0, epoch=0)
    _perturb_global_rngs(0)
    it = iter(dl)
    before = _states()
    _ = [b for b in it]
    assert _states() == before
    eg.data.restore_loader(dl)
    assert _states() == before


def test_a_fit_over_a_loader_without_workers_gives_the_callers_streams_back_when_it_ends():
    task = _task()

    def caller_draws(seed: int, *listeners) -> list[tuple[float, float, float]]:
        """What the caller draws before and after a fit (one that raises at step 3 too)."""
        state, dl = task.init(_model(), seed=seed), plain_loader(0)
        _perturb_global_rngs(4)
        out = [_draws()]
        try:
            _trainer(max_epochs=2, callbacks=list(listeners)).fit(task, state, dl)
        except RuntimeError as e:
            assert str(e) == "boom"
        return [*out, _draws()]

    class Boom(eg.Listener):
        def on_train_batch_end(self, rec):
            if rec.run.global_step == 3:
                raise RuntimeError("boom")

    drawn = caller_draws(5)
    # whatever the batches drew, and if the fit raised, the caller's streams come back as
    # they were at the first batch: Python's and NumPy's as if no fit had run, torch's moved
    # by the base seed the first iter(loader) draws
    assert caller_draws(6) == caller_draws(5, Boom()) == drawn
    _perturb_global_rngs(4)
    assert [d[1:] for d in drawn] == [_draws()[1:], _draws()[1:]]


def test_a_step_drawing_from_python_and_numpy_resumes_bitwise_without_workers(tmp_path):
    # with num_workers=0 the step runs while the last batch's streams hold the generators, so
    # what it draws from Python's random and NumPy (a MixUp weight) is a function of the run's
    # seed, and a resumed run redraws it
    import torch.nn.functional as F

    def loss_fn(model, batch):
        x, y = batch
        w = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        return w * F.cross_entropy(model(x), y)

    task = eg.Task(loss_fn, eg.optim.adamw(1e-2))
    ckpt = tmp_path / "ckpt"
    _perturb_global_rngs(0)
    full = _trainer(max_epochs=2, callbacks=[_SaveAt(9, ckpt)]).fit(
        task, task.init(_model(), seed=5), plain_loader(0, order="shuffle")
    )
    _perturb_global_rngs(1)
    resumed = _trainer(max_epochs=2).fit(
        task, task.init(_model()), plain_loader(0, order="shuffle"), ckpt_path=ckpt
    )
    assert resumed.step == full.step == 12
    assert resumed.fingerprint() == full.fingerprint()


@pytest.mark.parametrize("order", ["sequential", "shuffle"])
def test_a_resumed_epoch_keys_the_rest_as_the_whole_epoch_did(order):
    def epoch(skip: int) -> list[torch.Tensor]:
        dl = plain_loader(0, order=order)
        eg.data.seed_shuffle(dl, seed=3, epoch=1)
        assert eg.data.seed_batches(dl, seed=3, epoch=1)
        assert eg.data.position_loader(dl, 1, skip)
        try:
            return [x for x, _ in dl]
        finally:
            eg.data.restore_loader(dl)

    whole = epoch(0)
    assert len(whole) == 6
    for skip in (1, 4, 6):
        rest = epoch(skip)
        assert len(rest) == 6 - skip
        assert all(torch.equal(a, b) for a, b in zip(rest, whole[skip:], strict=True))


def _mixing_collate(samples):
    """A collate_fn that draws (MixUp's weight, from all three generators)."""
    x = torch.stack([s[0] for s in samples])
    w = float(torch.rand(())) + random.random() + float(np.random.rand())
    return x * w


def test_a_random_collate_draws_the_same_whatever_num_workers():
    # a keyed load leaves the generators seeded, in a worker and in the main process, so the
    # loader's collate_fn draws on from the batch's own stream: the same with no worker, one
    # or two, pass after pass (before, with none it drew from the caller's streams, and each
    # worker from its own)
    def batches(workers: int, k: int) -> list[torch.Tensor]:
        dl = plain_loader(workers, collate_fn=_mixing_collate)
        assert eg.data.seed_batches(dl, seed=0, epoch=0)
        _perturb_global_rngs(k)
        try:
            return [b for b in dl]
        finally:
            eg.data.restore_loader(dl)

    zero = batches(0, 0)
    for workers, k in ((0, 1), (1, 2), (2, 3)):
        assert all(torch.equal(a, b) for a, b in zip(zero, batches(workers, k), strict=True))


def _mixing_pairs(samples):
    """A (x, y) collate that scales the inputs by a MixUp-like weight from all three
    generators."""
    x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    return x * (float(torch.rand(())) + random.random() + float(np.random.rand())), y


def test_a_seeded_datasets_random_collate_in_a_fit_does_not_depend_on_num_workers():
    # during a fit a SeededDataset's samples leave the generators seeded in the training
    # process too, so the collate draws on from the last sample's stream, as in a worker;
    # the fit's end gives the caller's streams back
    def fit(workers: int, k: int):
        task, seen = _task(), _Batches()
        ds = SeededDataset(Augmented(), seed=11)
        dl = DataLoader(
            ds,
            batch_size=4,
            sampler=ShuffleSampler(ds, seed=7),
            num_workers=workers,
            collate_fn=_mixing_pairs,
        )
        state = task.init(_model(), seed=5)
        _perturb_global_rngs(k)
        state = _trainer(max_epochs=2, callbacks=[seen]).fit(task, state, dl)
        return state, torch.stack(seen.seen), _draws()[1:]

    state, batches, after = fit(0, 0)
    for workers, k in ((0, 1), (2, 2)):
        other, other_batches, _ = fit(workers, k)
        assert torch.equal(other_batches, batches)
        assert other.fingerprint() == state.fingerprint()
    _perturb_global_rngs(0)
    assert after == _draws()[1:]  # Python's and NumPy's: as if no fit had run
    # outside a fit, each sample puts the caller's streams back, as before
    ds = SeededDataset(Augmented(), seed=11)
    _perturb_global_rngs(3)
    before = _states()
    _ = [ds[i] for i in range(4)]
    assert _states() == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda dl: eg.data.position_loader(dl, 0, -1), r"position_loader\(skip_batches=-1\)"),
        (lambda dl: eg.data.position_loader(dl, -1, 0), r"position_loader\(epoch=-1\)"),
        (lambda dl: eg.data.position_loader(dl, 0, 2.5), r"skip_batches=2.5\): .* int >= 0"),
        (lambda dl: eg.data.seed_batches(dl, "0", 0), r"seed_batches\(seed='0'\)"),
        (lambda dl: eg.data.seed_batches(dl, -5, 0), r"seed=-5\): seed must be an int in \[0"),
        (lambda dl: eg.data.seed_batches(dl, 2**63, 0), r"seed=9223372036854775808\)"),
        (lambda dl: eg.data.seed_batches(dl, 0, True), r"seed_batches\(epoch=True\)"),
        (lambda dl: eg.data.seed_shuffle(dl, 1.5, 0), r"seed_shuffle\(seed=1.5\)"),
        (lambda dl: eg.data.seed_shuffle(dl, 0, -1), r"seed_shuffle\(epoch=-1\)"),
        (lambda dl: ShuffleSampler(dl.dataset, seed=None), r"ShuffleSampler\(seed=None\)"),
        (lambda dl: ShuffleSampler(8).set_epoch(-1), r"set_epoch\(epoch=-1\)"),
        (lambda dl: ShuffleSampler(-3), r"ShuffleSampler\(data_source=-3\)"),
        (lambda dl: SeededDataset(dl.dataset, seed=-1), r"SeededDataset\(seed=-1\)"),
        (lambda dl: SeededDataset(dl.dataset).set_epoch("1"), r"set_epoch\(epoch='1'\)"),
    ],
)
def test_the_data_functions_refuse_bad_seeds_epochs_and_counts_by_name(call, message):
    dl = plain_loader(0, order="shuffle")
    with pytest.raises(ValueError, match=message):
        call(dl)
    # nothing was changed on the way to the refusal: the loader loads as the user made it
    assert type(dl.batch_sampler.sampler).__name__ == "RandomSampler"
    assert "__getitems__" not in vars(dl.dataset) and dl.sampler.generator is None


def test_the_data_functions_take_numpy_integers():
    dl = plain_loader(0, order="shuffle")
    assert eg.data.seed_shuffle(dl, np.int64(3), np.int32(1))
    assert eg.data.seed_batches(dl, np.uint32(3), np.int64(1))
    assert eg.data.position_loader(dl, np.int64(1), np.int64(2))
    assert len([b for b in dl]) == 4
    eg.data.restore_loader(dl)


def test_a_shuffle_sampler_takes_only_a_bool_for_shuffle():
    with pytest.raises(TypeError, match=r"ShuffleSampler\(shuffle='no'\): .* True or False"):
        ShuffleSampler(8, shuffle="no")
    assert list(ShuffleSampler(4, shuffle=False)) == [0, 1, 2, 3]
