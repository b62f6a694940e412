"""Wrong answers to exercise 13 (the sharded optimizer step, ZeRO-1), one mistake each."""

import torch
import torch.distributed as dist

from dpcourse.zero import chunk_size


def _gather(params, shards, world, group=None):
    with torch.no_grad():
        for p, s in zip(params, shards):
            c = chunk_size(p.numel(), world)
            mine = torch.zeros(c, dtype=p.dtype)
            mine[:s.numel()] = s
            out = torch.empty(world * c, dtype=p.dtype)
            dist.all_gather_into_tensor(out, mine, group=group)
            p.view(-1).copy_(out[:p.numel()])


def summed_not_averaged(params, shard_optimizer, group=None):
    """Reduce-scatters the gradients but forgets to divide by the number of ranks."""
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        c = chunk_size(p.numel(), world)
        full = torch.zeros(world * c)
        full[:p.numel()] = p.grad.reshape(-1)
        mine = torch.empty(c)
        dist.reduce_scatter_tensor(mine, full, group=group)
        s.grad = mine[:s.numel()]
    shard_optimizer.step()
    _gather(params, shards, world, group)


def all_reduce_then_slice(params, shard_optimizer, group=None):
    """Right result, but all-reduces whole gradients before slicing: DDP's bytes plus a gather."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        g = p.grad.reshape(-1) / world
        dist.all_reduce(g, group=group)
        lo = min(rank * chunk_size(p.numel(), world), p.numel())
        s.grad = g[lo:lo + s.numel()].clone()
    shard_optimizer.step()
    _gather(params, shards, world, group)


def no_gather(params, shard_optimizer, group=None):
    """Steps the shards but never all-gathers: each rank keeps stale copies of the other chunks."""
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        c = chunk_size(p.numel(), world)
        full = torch.zeros(world * c)
        full[:p.numel()] = p.grad.reshape(-1) / world
        mine = torch.empty(c)
        dist.reduce_scatter_tensor(mine, full, group=group)
        s.grad = mine[:s.numel()]
    shard_optimizer.step()
