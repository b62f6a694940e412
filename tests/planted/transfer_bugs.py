"""Wrong answers to the transfer exercises, one mistake each."""

import torch
import torch.distributed as dist


def _swap(send, recv, peer):
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_reduce_recursive_doubling_power_of_two(tensor, group=None):
    """Swaps the whole tensor with a partner each round: log2 N rounds, but too many bytes."""
    flat = tensor.view(-1)
    rank, n = dist.get_rank(), dist.get_world_size()
    if flat.numel() == 0:
        return
    mask = 1
    while mask < n:  # BUG: whole tensors (and only right when n is a power of two)
        incoming = torch.empty_like(flat)
        _swap(flat.clone(), incoming, rank ^ mask)
        flat += incoming
        mask *= 2


def all_reduce_ring(tensor, group=None):
    """A correct ring: right sums, but 2 (N - 1) rounds."""
    flat = tensor.view(-1)
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n

    def bounds(i):
        base, extra = divmod(flat.numel(), n)
        start = i * base + min(i, extra)
        return start, start + base + (1 if i < extra else 0)

    def exchange(send, recv):
        ops = ([dist.P2POp(dist.isend, send, right)] if send.numel() else []) + \
              ([dist.P2POp(dist.irecv, recv, left)] if recv.numel() else [])
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    for s in range(n - 1):  # BUG (for this exercise): linear in N
        (a, b), (c, d) = bounds((rank - s - 1) % n), bounds((rank - s - 2) % n)
        incoming = torch.empty_like(flat[c:d])
        exchange(flat[a:b], incoming)
        flat[c:d] += incoming
    for s in range(n - 1):
        (a, b), (c, d) = bounds((rank - s) % n), bounds((rank - s - 1) % n)
        exchange(flat[a:b], flat[c:d])
