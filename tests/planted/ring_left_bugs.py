"""Attempts at exercise 04's leftward ring: each right or wrong in one named way."""

import torch
import torch.distributed as dist


def _bounds(numel, world_size, index):
    """Lesson 04's chunks: ceil(numel / N) each, the last ones short or empty."""
    per_chunk = -(-numel // world_size)
    return min(index * per_chunk, numel), min((index + 1) * per_chunk, numel)


def chunk_bounds_even_split(numel, world_size, index):
    """Chunk lengths differing by at most one, longer ones first: not the lesson's layout."""
    base, extra = divmod(numel, world_size)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def chunk_bounds_tensor_split(numel, world_size, index):
    """Hands the cut to torch.tensor_split, whose pieces are the even split, not the lesson's."""
    pieces = torch.arange(numel).tensor_split(world_size)
    start = sum(len(p) for p in pieces[:index])
    return start, start + len(pieces[index])


def chunk_bounds_unclipped(numel, world_size, index):
    """The lesson's chunk length, but the last chunks run past the tensor's end."""
    per_chunk = -(-numel // world_size)
    return index * per_chunk, (index + 1) * per_chunk


def ring_reduce_scatter_even_split(tensor, group=None):
    """The leftward reduce-scatter, right schedule, cut with the even split."""
    flat, rank, n = tensor.view(-1), dist.get_rank(), dist.get_world_size()
    for s in range(n - 1):
        a0, a1 = chunk_bounds_even_split(flat.numel(), n, (rank + s + 1) % n)
        b0, b1 = chunk_bounds_even_split(flat.numel(), n, (rank + s + 2) % n)
        buf = torch.empty_like(flat[b0:b1])
        _exchange(flat[a0:a1], buf, (rank - 1) % n, (rank + 1) % n)
        flat[b0:b1] += buf


def _exchange(send, recv, to, frm):
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, to))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, frm))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _ring(tensor, direction, rs_send, rs_recv, ag_send, ag_recv):
    """A ring all-reduce; ``direction`` +1 sends to rank + 1, -1 to rank - 1; chunk schedules."""
    flat, rank, n = tensor.view(-1), dist.get_rank(), dist.get_world_size()
    to, frm = (rank + direction) % n, (rank - direction) % n
    for s in range(n - 1):
        a0, a1 = _bounds(flat.numel(), n, rs_send(rank, s, n))
        b0, b1 = _bounds(flat.numel(), n, rs_recv(rank, s, n))
        buf = torch.empty_like(flat[b0:b1])
        _exchange(flat[a0:a1], buf, to, frm)
        flat[b0:b1] += buf
    for s in range(n - 1):
        a0, a1 = _bounds(flat.numel(), n, ag_send(rank, s, n))
        b0, b1 = _bounds(flat.numel(), n, ag_recv(rank, s, n))
        _exchange(flat[a0:a1], flat[b0:b1], to, frm)


def ring_all_reduce_leftward(tensor, group=None):
    """Right: sends to rank - 1, and rank r receives chunk r at the reduce-scatter's last step."""
    _ring(tensor, -1, lambda r, s, n: (r + s + 1) % n, lambda r, s, n: (r + s + 2) % n,
          lambda r, s, n: (r + s) % n, lambda r, s, n: (r + s + 1) % n)


def ring_all_reduce_rightward(tensor, group=None):
    """Lesson 04's ring, copied: right sums, but every message goes to rank + 1."""
    _ring(tensor, +1, lambda r, s, n: (r - s - 1) % n, lambda r, s, n: (r - s - 2) % n,
          lambda r, s, n: (r - s) % n, lambda r, s, n: (r - s - 1) % n)


def ring_all_reduce_lesson_schedule(tensor, group=None):
    """Turns left but keeps lesson 04's chunk schedule: chunks are added in the wrong places."""
    _ring(tensor, -1, lambda r, s, n: (r - s - 1) % n, lambda r, s, n: (r - s - 2) % n,
          lambda r, s, n: (r - s) % n, lambda r, s, n: (r - s - 1) % n)


def ring_all_reduce_averaged(tensor, group=None):
    """The leftward ring, then divided by the world size: all_reduce sums, it does not average."""
    ring_all_reduce_leftward(tensor)
    tensor.div_(dist.get_world_size())


def ring_all_reduce_short_skipped(tensor, group=None):
    """Leaves tensors shorter than the world size alone, as if there were nothing to reduce."""
    if tensor.numel() < dist.get_world_size():
        return
    ring_all_reduce_leftward(tensor)


def ring_all_reduce_shifted(tensor, group=None):
    """Reduce-scatter one step short of the right schedule: rank r ends owning chunk r - 1.

    Every message pairs up (both sides name the same chunk), so nothing raises; the
    all-gather then spreads chunks that are not complete.
    """
    _ring(tensor, -1, lambda r, s, n: (r + s) % n, lambda r, s, n: (r + s + 1) % n,
          lambda r, s, n: (r + s) % n, lambda r, s, n: (r + s + 1) % n)


def ring_all_reduce_padded(tensor, group=None):
    """The leftward ring on a copy padded to N equal chunks: right sums, padding sent too."""
    flat, n = tensor.view(-1), dist.get_world_size()
    padded = torch.zeros(-(-flat.numel() // n) * n, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    ring_all_reduce_leftward(padded)
    flat.copy_(padded[:flat.numel()])
