"""Wrong all-reduces: a wrong chunk index, one that delegates, one that deadlocks, one that
sends every rank's whole tensor to every other rank."""

import torch
import torch.distributed as dist


def _bounds(numel, world_size, index):
    per_chunk = -(-numel // world_size)  # lesson 04's chunks
    return min(index * per_chunk, numel), min((index + 1) * per_chunk, numel)


def _exchange(send, recv, rank, n):
    ops = []  # exercise 04's ring turns left: send to rank - 1, receive from rank + 1
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, (rank - 1) % n))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, (rank + 1) % n))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def ring_all_reduce_wrong_chunk(tensor, group=None):
    """Reduce-scatter with the all-gather's chunk indices: rank r ends owning chunk r - 1, not r."""
    flat, rank, n = tensor.view(-1), dist.get_rank(), dist.get_world_size()
    for s in range(n - 1):
        a0, a1 = _bounds(flat.numel(), n, (rank + s) % n)      # BUG: should be (rank + s + 1) % n
        b0, b1 = _bounds(flat.numel(), n, (rank + s + 1) % n)  # BUG: should be (rank + s + 2) % n
        buf = torch.empty_like(flat[b0:b1])
        _exchange(flat[a0:a1], buf, rank, n)
        flat[b0:b1] += buf
    for s in range(n - 1):
        a0, a1 = _bounds(flat.numel(), n, (rank + s) % n)
        b0, b1 = _bounds(flat.numel(), n, (rank + s + 1) % n)
        _exchange(flat[a0:a1], flat[b0:b1], rank, n)


def ring_all_reduce_calls_reference(tensor, group=None):
    """Hands the work to the course's own reference implementation."""
    from dpcourse.comm import ring_all_reduce

    ring_all_reduce(tensor, group=group)


def ring_all_reduce_delegating(tensor, group=None):
    """Looks like a ring, but the sum comes from the library."""
    dist.all_reduce(tensor, group=group)


def ring_all_reduce_deadlock(tensor, group=None):
    """Every rank receives before it sends: all of them wait forever."""
    flat, rank, n = tensor.view(-1), dist.get_rank(), dist.get_world_size()
    if flat.numel() == 0 or n == 1:
        return
    buf = torch.empty_like(flat)
    dist.recv(buf, src=(rank - 1) % n)
    dist.send(flat, dst=(rank + 1) % n)
    flat += buf


def all_reduce_to_everyone(tensor, group=None):
    """One round, but every rank sends its whole tensor to every other rank: N - 1 copies."""
    flat, rank, n = tensor.view(-1), dist.get_rank(), dist.get_world_size()
    if flat.numel() == 0:
        return
    parts = [flat.clone() if r == rank else torch.empty_like(flat) for r in range(n)]
    ops = [dist.P2POp(dist.isend, parts[rank], r) for r in range(n) if r != rank]
    ops += [dist.P2POp(dist.irecv, parts[r], r) for r in range(n) if r != rank]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    flat.copy_(torch.stack(parts).sum(0))
