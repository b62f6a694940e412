"""ShardedSampler gives DistributedSampler's shards; the datasets are deterministic."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dpcourse.data import ShardedSampler, make_classification, make_regression, shard_batch


@pytest.mark.parametrize("n", [0, 1, 5, 7, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle,drop_last", list(itertools.product([True, False], repeat=2)))
def test_same_indices_as_distributed_sampler(n, world, shuffle, drop_last):
    for rank in range(world):
        ours = ShardedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                              seed=7, drop_last=drop_last)
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=7, drop_last=drop_last)
        for epoch in range(3):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref), (rank, epoch)
            assert len(ours) == len(ref)


@pytest.mark.parametrize("n,world", [(12, 3), (10, 4), (7, 2)])
def test_shards_are_disjoint_and_cover_the_dataset(n, world):
    shards = [list(ShardedSampler(range(n), num_replicas=world, rank=r, seed=1))
              for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank does the same number of steps
    seen = [i for s in shards for i in s]
    assert set(seen) == set(range(n))
    padding = len(seen) - n
    assert padding == (-n) % world and padding < world  # only padding repeats
    dropped = [list(ShardedSampler(range(n), num_replicas=world, rank=r, drop_last=True))
               for r in range(world)]
    flat = [i for s in dropped for i in s]
    assert len(flat) == len(set(flat)) == n - n % world


def test_set_epoch_reshuffles_identically_on_every_rank():
    world = 3
    orders = {}
    for epoch in range(2):
        samplers = [ShardedSampler(range(30), num_replicas=world, rank=r, seed=5)
                    for r in range(world)]
        for s in samplers:
            s.set_epoch(epoch)
        assert len({tuple(s.global_order()) for s in samplers}) == 1
        orders[epoch] = samplers[0].global_order()
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_without_a_sampler_every_rank_sees_the_same_data():
    """The classic bug: with a plain DataLoader, K ranks train on one rank's batch K times."""
    data = make_regression(n=24)
    world, batch = 3, 4
    plain = [next(iter(DataLoader(data, batch_size=batch)))[0] for _ in range(world)]
    assert all(torch.equal(b, plain[0]) for b in plain)  # K identical gradients: no speed-up
    distinct_plain = {tuple(row.tolist()) for b in plain for row in b}
    sharded = [next(iter(DataLoader(data, batch_size=batch,
                                    sampler=ShardedSampler(data, num_replicas=world, rank=r))))[0]
               for r in range(world)]
    distinct_sharded = {tuple(row.tolist()) for b in sharded for row in b}
    assert len(distinct_plain) == batch            # effective batch: 4, not 12
    assert len(distinct_sharded) == batch * world  # effective batch: 12


def test_datasets_are_deterministic():
    a, b = make_regression(seed=3), make_regression(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    assert not torch.equal(a.tensors[0], make_regression(seed=4).tensors[0])
    x, y = make_classification(n=50, num_classes=3, seed=0).tensors
    assert x.shape == (50, 8) and y.dtype == torch.int64 and set(y.tolist()) <= {0, 1, 2}


def test_shard_batch_slices_evenly():
    x = torch.arange(12)
    assert torch.equal(torch.cat([shard_batch(x, r, 3) for r in range(3)]), x)
    with pytest.raises(ValueError, match="multiple of the world size"):
        shard_batch(torch.arange(10), 0, 3)


def test_clear_errors():
    with pytest.raises(RuntimeError, match="pass them explicitly"):
        ShardedSampler(range(4))
    with pytest.raises(ValueError, match="rank must be"):
        ShardedSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        ShardedSampler(range(4), num_replicas=0, rank=0)
    with pytest.raises(TypeError, match="len"):
        ShardedSampler(iter(range(4)), num_replicas=1, rank=0)
