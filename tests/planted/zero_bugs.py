"""Wrong answers to exercise 13 (ZeRO-2 over micro-batches with a frozen layer), one mistake each.

Each has the exercise's signature ``(params, shard_optimizer, last, group=None)``.
"""

import torch
import torch.distributed as dist

from dpcourse.zero import chunk_size

_CALLS: dict = {}  # micro-batches seen per shard optimizer (for divided_by_micro_count_again)


def _reduced_chunk(p, world, group=None, divide=True, chunk=None):
    """This rank's chunk of ``p.grad`` summed (or averaged) over the ranks, padding included."""
    c = chunk or chunk_size(p.numel(), world)
    full = torch.zeros(world * c)
    if p.grad is not None:
        full[:p.numel()] = p.grad.reshape(-1) / (world if divide else 1)
    mine = torch.empty(c)
    dist.reduce_scatter_tensor(mine, full, group=group)
    return mine


def _add(s, chunk):
    part = chunk[:s.numel()]
    s.grad = part if s.grad is None else s.grad.add_(part)


def _gather(params, shards, world, group=None, frozen_too=False):
    with torch.no_grad():
        for p, s in zip(params, shards):
            if not (p.requires_grad or frozen_too):
                continue
            c = chunk_size(p.numel(), world)
            mine = torch.zeros(c, dtype=p.dtype)
            mine[:s.numel()] = s
            out = torch.empty(world * c, dtype=p.dtype)
            dist.all_gather_into_tensor(out, mine, group=group)
            p.view(-1).copy_(out[:p.numel()])


def _zero2(params, shard_optimizer, last, group=None, *, divide=True, overwrite=False,
           chunk_of=None):
    """ZeRO-2's step with one switch turned; ``chunk_of(numel, world)`` replaces chunk_size."""
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        if not p.requires_grad:
            continue
        mine = _reduced_chunk(p, world, group, divide,
                              chunk_of(p.numel(), world) if chunk_of else None)
        if overwrite:
            s.grad = mine[:s.numel()]
        else:
            _add(s, mine)
        p.grad = None
    if last:
        shard_optimizer.step()
        _gather(params, shards, world, group)


def zero1_transcribed(params, shard_optimizer, last, group=None):
    """Lesson 13's zero1 step, once per optimizer step: backward kept every full gradient."""
    if not last:
        return
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        if p.requires_grad:
            s.grad = _reduced_chunk(p, world, group)[:s.numel()]
    shard_optimizer.step()
    _gather(params, shards, world, group)


def zero1_transcribed_literally(params, shard_optimizer, last, group=None):
    """The zero1 step copied as it stands: reads .grad of the frozen layer too (None)."""
    if not last:
        return
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
    _gather(params, shards, world, group, frozen_too=True)


def summed_not_averaged(params, shard_optimizer, last, group=None):
    """Accumulates reduce-scattered chunks but never divides by the number of ranks."""
    _zero2(params, shard_optimizer, last, group, divide=False)


def divided_by_micro_count_again(params, shard_optimizer, last, group=None):
    """Averages over the micro-batches at the end, although each loss was already divided."""
    key = id(shard_optimizer)
    _CALLS[key] = _CALLS.get(key, 0) + 1
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        if p.requires_grad:
            _add(s, _reduced_chunk(p, world, group))
            p.grad = None
    if last:
        for s in shards:
            if s.grad is not None:
                s.grad.div_(_CALLS[key])
        _CALLS[key] = 0
        shard_optimizer.step()
        _gather(params, shards, world, group)


def overwrites_shard_grad(params, shard_optimizer, last, group=None):
    """Frees each full gradient but replaces the shard's .grad instead of adding to it."""
    _zero2(params, shard_optimizer, last, group, overwrite=True)


def floor_chunk(params, shard_optimizer, last, group=None):
    """Cuts chunks of numel // N + 1 elements: wrong wherever N divides numel."""
    _zero2(params, shard_optimizer, last, group, chunk_of=lambda n, w: n // w + 1)


def zeros_for_frozen(params, shard_optimizer, last, group=None):
    """Sends zeros for the frozen layer and gives its shards a zero .grad."""
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        _add(s, _reduced_chunk(p, world, group))
        p.grad = None
    if last:
        shard_optimizer.step()
        _gather(params, shards, world, group, frozen_too=True)


def all_reduce_then_slice(params, shard_optimizer, last, group=None):
    """Right result, but all-reduces whole gradients before slicing: twice a reduce-scatter's bytes."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        if not p.requires_grad:
            continue
        g = p.grad.reshape(-1) / world
        dist.all_reduce(g, group=group)
        lo = min(rank * chunk_size(p.numel(), world), p.numel())
        _add(s, g[lo:lo + s.numel()].clone())
        p.grad = None
    if last:
        shard_optimizer.step()
        _gather(params, shards, world, group)


def no_gather(params, shard_optimizer, last, group=None):
    """Steps the shards but never all-gathers: each rank keeps stale copies of the other chunks."""
    world = dist.get_world_size(group)
    shards = shard_optimizer.param_groups[0]["params"]
    for p, s in zip(params, shards):
        if p.requires_grad:
            _add(s, _reduced_chunk(p, world, group))
            p.grad = None
    if last:
        shard_optimizer.step()
