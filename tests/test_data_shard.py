"""Sharding loaders across ranks (engine.data.shard_loader): each rank reads a disjoint shard of
the epoch's deterministic order, as torch's DistributedSampler deals it, resumes without loading
on any world size, and keys per-batch augmentation by the global sample position.

Every rank is a loader object of its own here, as it is in a process of its own; no process group
is needed."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from engine.data import (
    SeededDataset,
    ShuffleSampler,
    order_outside_the_state,
    position_loader,
    randomness_outside_the_state,
    restore_loader,
    seed_batches,
    seed_shuffle,
    shard_loader,
    shard_start,
)
from engine.data._batch_keys import _BatchKey, _BatchKeys, _unkey
from engine.data._sharding import _Shard, _unshard
from engine.data._wrappers import _base


def _flat(loader: DataLoader) -> list[int]:
    return [int(i) for b in loader for i in b]


def _batches(loader: DataLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def _ranks(make, world: int, *, pad: bool) -> list[DataLoader]:
    """One loader per rank, each sharded."""
    loaders = [make() for _ in range(world)]
    for rank, dl in enumerate(loaders):
        assert shard_loader(dl, rank, world, pad=pad)
    return loaders


class Recorded(Dataset):
    """Sample i is i; records every index it loads."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.loaded.append(int(i))
        return i


class Noisy(Dataset):
    """Sample i is i plus random augmentation from torch's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.rand(1) + i


# ------------------------------------------------------------ the shards against torch's


@pytest.mark.parametrize("drop_last", [False, True])
def test_padded_shards_are_distributed_samplers_and_drop_the_same_batches(drop_last):
    for n, world, b in itertools.product((0, 1, 2, 5, 10, 11, 16), (1, 2, 3, 4), (1, 2, 3)):
        ds = range(n)
        make = functools.partial(DataLoader, ds, batch_size=b, drop_last=drop_last)
        ours = _ranks(make, world, pad=True)
        for rank, dl in enumerate(ours):
            # Lightning's training loaders: DistributedSampler(drop_last=False) under the user's
            # batch_size and drop_last
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
            reference = DataLoader(ds, batch_size=b, drop_last=drop_last, sampler=sampler)
            assert _batches(dl) == _batches(reference), (n, world, b, rank)
            assert len(dl) == len(reference)
        assert len({len(dl) for dl in ours}) == 1  # every rank takes part in every step


def test_shards_of_a_shuffled_order_are_distributed_samplers_given_its_order():
    """DistributedSampler(shuffle=True) draws randperm(seed + epoch); ours deals whatever order
    the base sampler draws (the Trainer's seeded one) the same way."""

    class TorchOrder(Sampler[int]):  # DistributedSampler's own permutation
        def __init__(self, n, seed, epoch):
            self.n, self.seed, self.epoch = n, seed, epoch

        def __iter__(self):
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return iter(torch.randperm(self.n, generator=g).tolist())

        def __len__(self):
            return self.n

    n, world, b = 23, 3, 4
    ours = _ranks(
        lambda: DataLoader(range(n), batch_size=b, sampler=TorchOrder(n, 5, 2)), 3, pad=True
    )
    for rank, dl in enumerate(ours):
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5)
        ref.set_epoch(2)
        assert _flat(dl) == list(ref)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "world", "b"), [(23, 3, 4), (20, 2, 5), (7, 4, 2)])
def test_shuffled_training_shards_are_lightnings_distributed_sampler(
    shuffle, drop_last, n, world, b
):
    """Lightning's use_distributed_sampler puts DistributedSampler(shuffle=True, seed) in place
    of a training loader's RandomSampler or SequentialSampler, whatever its shuffle flag, and
    calls set_epoch each epoch: a shuffle shard told (seed, epoch) by seed_shuffle deals the same
    batches, with the loader's batch_size and drop_last."""
    ds = Recorded(n)
    ours = [
        DataLoader(ds, batch_size=b, shuffle=shuffle, drop_last=drop_last) for _ in range(world)
    ]
    for rank, dl in enumerate(ours):
        assert shard_loader(dl, rank, world, pad=True, shuffle=True)
    for epoch in (0, 3):
        for rank, dl in enumerate(ours):
            seed_shuffle(dl, 7, epoch)
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=7)
            sampler.set_epoch(epoch)
            reference = DataLoader(ds, batch_size=b, drop_last=drop_last, sampler=sampler)
            assert _batches(dl) == _batches(reference), (epoch, rank)
            assert len(dl) == len(reference)


def test_a_custom_sampler_is_shuffled_as_lightnings_sampler_wrapper():
    """A custom sampler under Lightning's use_distributed_sampler: DistributedSamplerWrapper
    (shuffle=True), a permutation of the sampler's own order seeded with seed + epoch."""
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

    class EvensFirst(Sampler[int]):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

        def __len__(self):
            return self.n

    n, world, b = 19, 2, 3
    ours = [DataLoader(range(n), batch_size=b, sampler=EvensFirst(n)) for _ in range(world)]
    for rank, dl in enumerate(ours):
        assert shard_loader(dl, rank, world, pad=True, shuffle=True)
        seed_shuffle(dl, 3, 1)
        wrapper = DistributedSamplerWrapper(
            EvensFirst(n), num_replicas=world, rank=rank, shuffle=True, seed=3
        )
        wrapper.set_epoch(1)
        assert _batches(dl) == _batches(DataLoader(range(n), batch_size=b, sampler=wrapper))


def test_a_shuffle_sampler_keeps_its_own_order_in_a_shuffled_shard():
    """engine's ShuffleSampler is already the epoch's order: dealt as it is, so one process and
    W ranks read the same global batches."""
    n, world = 12, 2
    ours = _ranks(
        lambda: DataLoader(range(n), batch_size=3, sampler=ShuffleSampler(n, seed=4)),
        world,
        pad=True,
    )
    for dl in ours:
        assert shard_loader(dl, ours.index(dl), world, pad=True, shuffle=True)
        seed_shuffle(dl, 4, 0)
    whole = list(ShuffleSampler(n, seed=4))
    assert _flat(ours[0]) == whole[0::2] and _flat(ours[1]) == whole[1::2]


@pytest.mark.parametrize("make_sampler", ["random", "shuffle"])
def test_every_rank_deals_the_same_seeded_order(make_sampler):
    """The difference from DistributedSampler with shuffle: the order is the engine's (a
    RandomSampler the Trainer seeds from (seed, epoch), or a ShuffleSampler), the same on every
    rank however far each process's global generator has moved."""
    n, world, b = 19, 2, 3

    def make():
        ds = range(n)
        if make_sampler == "random":
            return DataLoader(ds, batch_size=b, shuffle=True)
        return DataLoader(ds, batch_size=b, sampler=ShuffleSampler(ds, seed=9))

    def epoch(dl, e):
        seed_shuffle(dl, seed=9, epoch=e)
        position_loader(dl, e, 0)
        return _flat(dl)

    whole = epoch(make(), 1)
    ranks = _ranks(make, world, pad=True)
    shards = []
    for rank, dl in enumerate(ranks):
        torch.rand(rank + 1)  # the processes' global generators differ
        shards.append(epoch(dl, 1))
    padded = whole + whole[: -n % world]
    assert [x for pair in zip(*shards, strict=True) for x in pair] == padded
    assert sorted(shards[0] + shards[1][:-1]) == list(range(n))  # rank 1's last is a repeat
    assert epoch(ranks[0], 2) != shards[0]  # another epoch, another order


def test_unpadded_shards_are_lightnings_unrepeated_sampler():
    for n, world, b in itertools.product((1, 3, 5, 10, 11), (1, 2, 3, 4), (1, 3)):
        if n < world:  # Lightning refuses a rank without samples; ours has an empty shard
            continue
        ds = range(n)
        ours = _ranks(functools.partial(DataLoader, ds, batch_size=b), world, pad=False)
        seen: list[int] = []
        for rank, dl in enumerate(ours):
            ref = UnrepeatedDistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
            assert _flat(dl) == list(ref)
            assert len(dl) == len(DataLoader(ds, batch_size=b, sampler=ref))
            seen += _flat(dl)
        assert sorted(seen) == list(range(n))  # no sample counted twice
    few = _ranks(functools.partial(DataLoader, range(2), batch_size=2), 3, pad=False)
    assert [_flat(dl) for dl in few] == [[0], [1], []] and [len(dl) for dl in few] == [1, 1, 0]


def test_unpadded_shards_with_drop_last_give_every_rank_the_same_batches():
    """Cut to a multiple of the world size first (DistributedSampler(drop_last=True)), then each
    rank drops its partial batch: the global partial batch is dropped."""
    for n, world, b in itertools.product((3, 5, 10, 11, 17), (2, 3, 4), (1, 2, 3)):
        ds = range(n)
        make = functools.partial(DataLoader, ds, batch_size=b, drop_last=True)
        ours = _ranks(make, world, pad=False)
        for rank, dl in enumerate(ours):
            sampler = DistributedSampler(
                ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True
            )
            reference = DataLoader(ds, batch_size=b, drop_last=True, sampler=sampler)
            assert _batches(dl) == _batches(reference)
        assert {len(dl) for dl in ours} == {n // (b * world)}
        assert {len(_batches(dl)) for dl in ours} == {n // (b * world)}


# ------------------------------------------------------------ what is kept, what is left alone


def test_a_users_distributed_sampler_is_kept():
    ds = range(10)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    dl = DataLoader(ds, batch_size=2, sampler=sampler)
    assert not shard_loader(dl, 0, 2, pad=True)
    assert dl.batch_sampler.sampler is sampler and _flat(dl) == [1, 3, 5, 7, 9]
    batched = DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=2, drop_last=False))
    assert not shard_loader(batched, 0, 2, pad=True)
    assert _flat(batched) == [1, 3, 5, 7, 9]
    position_loader(dl, epoch=3, skip_batches=0)
    assert sampler.epoch == 3  # position_loader gives it the epoch


def test_loaders_that_cannot_be_sharded_are_left_alone():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(6))

    for loader in (
        DataLoader(Stream(), batch_size=2),
        DataLoader(range(6), batch_size=None),
        [torch.zeros(2), torch.ones(2)],
        (x for x in range(3)),
    ):
        assert not shard_loader(loader, 1, 2, pad=True)
    unbatched = DataLoader(range(4), batch_size=None)
    assert not shard_loader(unbatched, 1, 2, pad=True)
    assert [int(x) for x in unbatched] == [0, 1, 2, 3]


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 1.0)])
def test_a_bad_rank_or_world_size_is_refused_by_value(rank, world):
    with pytest.raises(ValueError, match=r"rank|world_size"):
        shard_loader(DataLoader(range(4)), rank, world, pad=True)


class Pairs(BatchSampler):
    """A custom batch sampler: the batches of two, backwards."""

    def __iter__(self):
        return reversed(list(super().__iter__()))


def test_a_custom_batch_sampler_is_sharded_by_whole_batches():
    for n, world in itertools.product((1, 4, 7, 10), (1, 2, 3)):

        def make(n=n):
            return DataLoader(range(n), batch_sampler=Pairs(range(n), 2, False))

        whole = _batches(make())

        padded = (whole * world)[: -(-len(whole) // world) * world]
        for pad, dealt in ((True, padded), (False, whole)):
            for rank, dl in enumerate(_ranks(make, world, pad=pad)):
                assert _batches(dl) == dealt[rank::world]
                assert len(dl) == len(dealt[rank::world])
    dl = make()
    user = dl.batch_sampler
    assert shard_loader(dl, 1, 2, pad=True)
    assert position_loader(dl, epoch=0, skip_batches=1)  # one batch of this rank: 2 global
    assert _batches(dl) == [whole[3], whole[0]]  # global batches 3 and 5 (a repeat)
    restore_loader(dl)
    assert dl.batch_sampler is user and _batches(dl) == whole


def test_a_persistent_worker_pool_sees_the_shard_and_its_undoing():
    n = 8
    dl = DataLoader(
        range(n), batch_sampler=Pairs(range(n), 2, False), num_workers=1, persistent_workers=True
    )
    whole = _batches(dl)  # starts the pool
    assert shard_loader(dl, 0, 2, pad=False)
    assert _batches(dl) == whole[0::2]
    restore_loader(dl)
    assert _batches(dl) == whole


def test_sharding_again_with_the_same_arguments_does_nothing():
    dl = DataLoader(range(12), batch_size=2, sampler=ShuffleSampler(12, seed=1))
    assert shard_loader(dl, 1, 2, pad=True)
    shard = dl.batch_sampler.sampler
    position_loader(dl, epoch=0, skip_batches=2)
    rest = _batches(dl)
    assert shard_loader(dl, 1, 2, pad=True)
    assert dl.batch_sampler.sampler is shard and _batches(dl) == rest  # the start kept
    assert shard_loader(dl, 0, 3, pad=True)  # other arguments: a new deal, from the start
    assert dl.batch_sampler.sampler is shard and len(dl) == 2
    assert _flat(dl) == ShuffleSampler(12, seed=1).order()[0::3]


# ------------------------------------------------------------ restoring, in any order


def _wrap_steps(dl, rank=1, world=2):
    return {
        "shard": lambda: shard_loader(dl, rank, world, pad=True),
        "shuffle": lambda: seed_shuffle(dl, seed=3, epoch=1),
        "keys": lambda: seed_batches(dl, seed=3, epoch=1),
        "position": lambda: position_loader(dl, 1, 1),
    }


@pytest.mark.parametrize(
    "order", list(itertools.permutations(["shard", "shuffle", "keys", "position"]))
)
def test_restore_undoes_the_shard_and_the_rest_in_any_order(order):
    ds = Noisy(11)
    dl = DataLoader(ds, batch_size=2, shuffle=True)
    base, bs = dl.sampler, dl.batch_sampler
    steps = _wrap_steps(dl)
    for name in order:
        steps[name]()
        assert _base(bs.sampler) is base  # _base sees through every wrapper
        assert not order_outside_the_state(dl)
    assert len(dl) == 3  # rank 1's 6 samples of the 12 dealt
    restore_loader(dl)
    assert dl.batch_sampler is bs and bs.sampler is base
    assert base.generator is None and "__getitems__" not in vars(ds)
    assert len(dl) == 6 and sorted(int(x) for b in dl for x in b) == list(range(11))


def test_restore_undoes_each_wrapper_alone_after_sharding():
    dl = DataLoader(Noisy(8), batch_size=2)
    base = dl.sampler
    shard_loader(dl, 0, 2, pad=True)
    seed_batches(dl, seed=0, epoch=0)
    _unkey(dl)  # the keys alone: the shard stays
    assert isinstance(dl.batch_sampler.sampler, _Shard) and len(dl) == 2
    seed_batches(dl, seed=0, epoch=0)
    _unshard(dl)  # the shard alone, below the keys: the keys stay
    assert isinstance(dl.batch_sampler.sampler, _BatchKeys)
    assert dl.batch_sampler.sampler.sampler is base and len(dl) == 4
    restore_loader(dl)
    assert dl.batch_sampler.sampler is base


def test_what_is_outside_the_state_is_still_seen_through_a_shard():
    g = torch.Generator().manual_seed(0)
    users = DataLoader(range(8), batch_size=2, shuffle=True, generator=g)
    shard_loader(users, 0, 2, pad=True)
    assert order_outside_the_state(users)
    custom = DataLoader(
        Noisy(8), batch_sampler=Pairs(RandomSampler(range(8), generator=g), 2, False)
    )
    shard_loader(custom, 0, 2, pad=True)
    assert order_outside_the_state(custom)
    seedable = DataLoader(Noisy(8), batch_sampler=Pairs(RandomSampler(range(8)), 2, False))
    shard_loader(seedable, 0, 2, pad=True)
    assert not order_outside_the_state(seedable) and seed_shuffle(seedable, seed=0, epoch=0)
    with_workers = DataLoader(Noisy(8), batch_sampler=Pairs(range(8), 2, False), num_workers=2)
    shard_loader(with_workers, 0, 2, pad=True)
    assert randomness_outside_the_state(with_workers)
    plain = DataLoader(Noisy(8), batch_size=2, num_workers=2)
    shard_loader(plain, 0, 2, pad=True)
    assert not randomness_outside_the_state(plain)  # seed_batches takes it


# ------------------------------------------------------------ resuming without loading


@pytest.mark.parametrize("kind", ["random", "shuffle", "sequential", "seeded"])
def test_a_resumed_shard_skips_without_loading_and_continues_the_uninterrupted_epoch(kind):
    n, world, b, epoch = 21, 2, 3, 1

    def make():
        ds = Recorded(n)
        if kind == "random":
            return DataLoader(ds, batch_size=b, shuffle=True)
        if kind == "sequential":
            return DataLoader(ds, batch_size=b)
        if kind == "seeded":
            ds = SeededDataset(ds, seed=2)
        return DataLoader(ds, batch_size=b, sampler=ShuffleSampler(ds, seed=4))

    def run(skip):
        loaders = _ranks(make, world, pad=True)
        out = []
        for dl in loaders:
            seed_shuffle(dl, seed=6, epoch=epoch)
            seed_batches(dl, seed=6, epoch=epoch)
            assert position_loader(dl, epoch, skip)
            out.append(_batches(dl))
        inner = [dl.dataset.dataset if kind == "seeded" else dl.dataset for dl in loaders]
        return out, [ds.loaded for ds in inner]

    whole, _ = run(0)
    for skip in (1, 2, 4):
        resumed, loaded = run(skip)
        for rank in range(world):
            assert resumed[rank] == whole[rank][skip:]
            assert sorted(loaded[rank]) == sorted(x for bb in whole[rank][skip:] for x in bb)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 5),
    b=st.integers(1, 4),
    k=st.integers(0, 12),
    drop_last=st.booleans(),
)
def test_the_first_k_batches_of_every_rank_cover_the_first_k_global_batches(
    n, world, b, k, drop_last
):
    order = ShuffleSampler(n, seed=n).order()
    padded = (order * world)[: -(-n // world) * world]

    def make():
        return DataLoader(
            range(n), batch_size=b, sampler=ShuffleSampler(n, seed=n), drop_last=drop_last
        )

    loaders = _ranks(make, world, pad=True)
    per_rank = [_batches(dl)[:k] for dl in loaders]
    assert len({len(p) for p in per_rank}) == 1  # the same number of batches on every rank
    shard = len(padded) // world
    taken = min(k * b, shard // b * b if drop_last else shard)  # samples each rank took
    covered = taken * world
    assert Counter(x for p in per_rank for bb in p for x in bb) == Counter(padded[:covered])


def _seen_on(world, rank_batches, start, n, b, seed=8):
    """What ``world`` ranks see from global position ``start`` (each rank's first
    ``rank_batches`` batches, or all of them for None)."""
    seen: list[int] = []
    for rank in range(world):
        dl = DataLoader(range(n), batch_size=b, sampler=ShuffleSampler(n, seed=seed))
        shard_loader(dl, rank, world, pad=True)
        position_loader(dl, 0, 0)
        assert shard_start(dl, start)
        seen += _flat(dl)[: None if rank_batches is None else rank_batches * b]
    return seen


@pytest.mark.parametrize(("before", "after", "k"), [(2, 1, 3), (1, 2, 4), (2, 3, 3), (3, 2, 2)])
def test_a_resume_on_another_world_size_sees_each_sample_once(before, after, k):
    n, b = 23, 2  # k batches on each of `before` ranks
    position = k * b * before  # a multiple of b * after for these
    assert position % (b * after) == 0
    seen_before = _seen_on(before, k, 0, n, b)
    seen_after = _seen_on(after, None, position, n, b)
    order = ShuffleSampler(n, seed=8).order()
    assert sorted(seen_before) == sorted(order[:position])
    padding = order[: -n % after]  # the repeats that fill the last global position
    assert Counter(seen_before + seen_after) - Counter(padding) == Counter(range(n))
    assert len(seen_before) + len(seen_after) == n + len(padding)


def test_a_shard_start_is_refused_off_the_world_sizes_grid():
    dl = DataLoader(range(10), batch_size=2)
    assert not shard_start(dl, 4)  # not sharded
    shard_loader(dl, 0, 2, pad=True)
    for bad in (3, -2, 2.0):
        with pytest.raises(ValueError, match=f"multiple of the world size 2 \\(got {bad!r}\\)"):
            shard_start(dl, bad)
    custom = DataLoader(range(10), batch_sampler=Pairs(range(10), 2, False))
    shard_loader(custom, 0, 2, pad=True)
    assert not shard_start(custom, 4)  # sharded by batches: positions count batches


# ------------------------------------------------------------ per-batch seeds by global position


def _keys(dl) -> list[_BatchKey]:
    return [x for x in dl.batch_sampler.sampler if type(x) is _BatchKey]


def test_batch_keys_carry_the_global_position_of_the_first_sample():
    n, world, b = 13, 3, 2
    for rank, dl in enumerate(_ranks(lambda: DataLoader(Noisy(n), batch_size=b), world, pad=True)):
        seed_batches(dl, seed=1, epoch=0)
        assert [k.position for k in _keys(dl)] == [rank + j * b * world for j in range(len(dl))]
        position_loader(dl, 0, 2)  # resumed after 2 batches: the count goes on from there
        assert [k.position for k in _keys(dl)] == [rank + j * b * world for j in range(2, len(dl))]
    unsharded = DataLoader(Noisy(n), batch_size=b)
    seed_batches(unsharded, seed=1, epoch=0)
    assert [k.position for k in _keys(unsharded)] == list(range(0, n, b))


def test_ranks_draw_other_augmentations_for_their_batch_zero():
    class Noise(Dataset):  # the augmentation alone: a function of the batch's seed
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.rand(1)

    def noise(dl):
        seed_batches(dl, seed=3, epoch=2)
        return [x.clone() for x in dl]

    ranks = [noise(dl) for dl in _ranks(lambda: DataLoader(Noise(), batch_size=2), 2, pad=True)]
    assert not torch.equal(ranks[0][0], ranks[1][0])
    draws = [tuple(x.flatten().tolist()) for r in ranks for x in r]
    assert len(set(draws)) == len(draws)  # no two batches alike
    # with batch_size=1 the global position of rank r's batch j is the unsharded run's batch
    # r + 2j: the same augmentation, bitwise
    whole = noise(DataLoader(Noise(), batch_size=1))
    for rank, dl in enumerate(_ranks(lambda: DataLoader(Noise(), batch_size=1), 2, pad=True)):
        for j, x in enumerate(noise(dl)):
            assert torch.equal(x, whole[rank + 2 * j])


def test_a_resumed_shard_keys_its_batches_as_the_uninterrupted_one():
    def epoch(rank, skip):
        dl = DataLoader(Noisy(14), batch_size=2, shuffle=True)
        shard_loader(dl, rank, 2, pad=True)
        seed_shuffle(dl, seed=5, epoch=1)
        seed_batches(dl, seed=5, epoch=1)
        position_loader(dl, 1, skip)
        return [x.clone() for x in dl]

    for rank in (0, 1):
        whole, resumed = epoch(rank, 0), epoch(rank, 2)
        assert len(resumed) == len(whole) - 2
        assert all(torch.equal(a, b) for a, b in zip(resumed, whole[2:], strict=True))
