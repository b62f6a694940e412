"""Wrong answers to the transfer exercises, one mistake each."""

import torch
import torch.distributed as dist


def _swap(send, recv, peer):
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_reduce_whole_tensor_swaps(tensor, group=None):
    """Pairs ranks a power of two apart, but swaps the whole tensor every round."""
    flat = tensor.view(-1)
    rank, n = dist.get_rank(), dist.get_world_size()
    if flat.numel() == 0:
        return
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if rank < 2 * extra and rank % 2 == 0:  # fold the ranks beyond a power of two
        dist.send(flat, rank + 1)
        dist.recv(flat, rank + 1)
        return
    if rank < 2 * extra:
        incoming = torch.empty_like(flat)
        dist.recv(incoming, rank - 1)
        flat += incoming
    vrank = rank // 2 if rank < 2 * extra else rank - extra
    mask = 1
    while mask < p:  # BUG: log2 p rounds, but each sends the whole tensor
        partner = vrank ^ mask
        peer = 2 * partner + 1 if partner < extra else partner + extra
        incoming = torch.empty_like(flat)
        _swap(flat.clone(), incoming, peer)
        flat += incoming
        mask *= 2
    if rank < 2 * extra:
        dist.send(flat, rank - 1)


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


def _buckets(order, params, caps):
    buckets, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def first_bucket_at_the_wrong_end(params, bucket_cap_mb=25.0, first_bucket_mb=1.0):
    """Gives the small cap to the bucket of the first-registered parameters (the last to go)."""
    order = [i for i in range(len(params)) if params[i].requires_grad]
    buckets = _buckets(order, params, [first_bucket_mb * 2**20, bucket_cap_mb * 2**20])
    return [list(reversed(b)) for b in reversed(buckets)]  # BUG: small bucket goes out last


def small_cap_for_every_bucket(params, bucket_cap_mb=25.0, first_bucket_mb=1.0):
    """Keeps the small cap after the first bucket."""
    order = [i for i in reversed(range(len(params))) if params[i].requires_grad]
    return _buckets(order, params, [first_bucket_mb * 2**20])  # BUG: one cap for all


def frozen_parameters_bucketed(params, bucket_cap_mb=25.0, first_bucket_mb=1.0):
    """Buckets every parameter, frozen or not."""
    order = list(reversed(range(len(params))))  # BUG: frozen ones never get a gradient
    return _buckets(order, params, [first_bucket_mb * 2**20, bucket_cap_mb * 2**20])


class ReverseRegistrationBuckets(torch.nn.Module):
    """Correct overlapped buckets, but in reverse registration order, as if layers ran in order."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)
        params = list(module.parameters())
        order = list(reversed(range(len(params))))  # BUG: not the order gradients arrive in
        self.buckets = [[params[i] for i in b]
                        for b in _buckets(order, params, [bucket_cap_mb * 2**20])]
        self.arrived, self.in_flight = [0] * len(self.buckets), []
        for b, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._ready(b))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _ready(self, b):
        self.arrived[b] += 1
        if self.arrived[b] == len(self.buckets[b]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
            self.in_flight.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self):
        for b, flat, work in self.in_flight:
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.in_flight, self.arrived = [], [0] * len(self.buckets)


def _accumulate(model, optimizer, micro_batches, loss_fn, weight, zero="before"):
    """One accumulation step; ``weight(i, rows)`` scales micro-batch i's loss."""
    rows = [len(y) for _, y in micro_batches]
    if zero == "before":
        optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        if zero == "inside":
            optimizer.zero_grad()
        last = i == len(micro_batches) - 1
        with model.no_sync() if not last else _nothing():
            (loss_fn(model(x), y) * weight(i, rows)).backward()
    optimizer.step()
    if zero == "after":
        optimizer.zero_grad()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _global_weight(i, rows):
    total = torch.tensor(float(sum(rows)))
    dist.all_reduce(total)
    return rows[i] * dist.get_world_size() / total.item()


def accumulate_divide_by_count(model, optimizer, micro_batches, loss_fn):
    """Divides every loss by the number of micro-batches, whatever their sizes."""
    _accumulate(model, optimizer, micro_batches, loss_fn,
                lambda i, rows: 1 / len(rows))  # BUG: a 2-row micro-batch counts like a 6-row


def accumulate_local_rows_only(model, optimizer, micro_batches, loss_fn):
    """Weights by rows, but only this rank's: every rank still counts 1/N."""
    _accumulate(model, optimizer, micro_batches, loss_fn,
                lambda i, rows: rows[i] / sum(rows))  # BUG: ranks hold different numbers of rows


def accumulate_zero_inside_loop(model, optimizer, micro_batches, loss_fn):
    """Right weights, but zero_grad before every micro-batch erases the earlier ones."""
    _accumulate(model, optimizer, micro_batches, loss_fn, _global_weight, zero="inside")


def accumulate_never_zeroed(model, optimizer, micro_batches, loss_fn):
    """Right weights, but the previous step's gradients are never cleared."""
    _accumulate(model, optimizer, micro_batches, loss_fn, _global_weight, zero="never")


def accumulate_zero_after_step(model, optimizer, micro_batches, loss_fn):
    """Correct: zero_grad right after optimizer.step(), as lesson 07's loop does."""
    _accumulate(model, optimizer, micro_batches, loss_fn, _global_weight, zero="after")


class _Complete(torch.nn.Module):
    """Naive DDP with switches for the mistakes of exercise 03's part 2."""

    buffers_each_forward, zeros_for_unused, include_frozen, skip_missing = True, False, False, False

    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)

    def forward(self, *args, **kwargs):
        if self.buffers_each_forward:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=0)
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        params = [p for p in self.module.parameters() if p.requires_grad or self.include_frozen]
        used = torch.tensor([float(p.grad is not None) for p in params])
        dist.all_reduce(used)
        for p, n in zip(params, used.tolist()):
            if p.grad is None and self.skip_missing:
                continue
            if n == 0 and not self.zeros_for_unused:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)


class CompleteStaleBuffers(_Complete):
    """Broadcasts buffers once at construction only."""

    buffers_each_forward = False  # BUG: running statistics drift apart


class CompleteZerosForUnused(_Complete):
    """Gives a parameter no rank used a zero gradient."""

    zeros_for_unused = True  # BUG: torch DDP leaves it None


class CompleteSyncsFrozen(_Complete):
    """Synchronises frozen parameters too."""

    include_frozen, zeros_for_unused = True, True  # BUG: a frozen parameter gets a gradient


class CompleteSkipsMissing(_Complete):
    """Skips parameters without a gradient on this rank, as the warm-up did."""

    skip_missing = True  # BUG: the ranks issue different all-reduces


def mean_gradient_plain_mean(local_grad, local_size, group=None):
    """Averages the ranks' gradients, whatever their shard sizes."""
    out = local_grad.nan_to_num().clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()  # BUG: a mean of means


def mean_gradient_over_ranks_with_examples(local_grad, local_size, group=None):
    """Averages over the ranks that hold examples, ignoring how many each holds."""
    packed = torch.cat([local_grad, local_grad.new_tensor([float(local_size > 0)])])
    dist.all_reduce(packed)
    return packed[:-1] / packed[-1]  # BUG: a shard of 2 counts like a shard of 1


def mean_gradient_summed(local_grad, local_size, group=None):
    """Weights by shard size but never divides by the total."""
    out = local_grad * local_size
    dist.all_reduce(out)
    return out  # BUG: a sum over examples, not a mean


def shard_sizes_extra_last(n, world_size):
    """Gives the extra examples to the last shards."""
    base, extra = divmod(n, world_size)
    return [base + (1 if r >= world_size - extra else 0) for r in range(world_size)]  # BUG


def _save(path, model, optimizer, sampler, step, *, all_rngs=True, barrier=True, everyone=False,
          epoch=True):
    mine, rng = torch.get_rng_state(), []
    for src in range(dist.get_world_size()):
        state = mine.clone() if src == dist.get_rank() else torch.empty_like(mine)
        dist.broadcast(state, src=src)
        rng.append(state)
    if not all_rngs:
        rng = [rng[0]] * len(rng)
    if dist.get_rank() == 0 or everyone:
        target = path if dist.get_rank() == 0 else f"{path}.rank{dist.get_rank()}"
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": sampler.epoch if epoch else 0, "step": step, "rng": rng}, target)
    if barrier:
        dist.barrier()


def load_checkpoint(path, model, optimizer, sampler):
    """A correct load, for the planted saves."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.set_epoch(state["epoch"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["step"]


def save_rank_0_rng_only(path, model, optimizer, sampler, step):
    """Writes rank 0's generator state for every rank."""
    _save(path, model, optimizer, sampler, step, all_rngs=False)  # BUG: ranks' states differ


def save_without_barrier(path, model, optimizer, sampler, step):
    """Lets the other ranks return while rank 0 is still writing."""
    _save(path, model, optimizer, sampler, step, barrier=False)  # BUG: no wait


def save_on_every_rank(path, model, optimizer, sampler, step):
    """Every rank writes a file."""
    _save(path, model, optimizer, sampler, step, everyone=True)  # BUG: N writers


def save_without_epoch(path, model, optimizer, sampler, step):
    """Forgets the sampler's epoch."""
    _save(path, model, optimizer, sampler, step, epoch=False)  # BUG: the shuffle restarts


def shard_sizes(n, world_size):
    """Correct shard sizes (the ones tensor_split cuts), for the planted mean-gradient bugs."""
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


# -- 02: all-gather of pieces of different lengths -------------------------------------------

def _lengths(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    lengths = torch.zeros(n, dtype=torch.int64)
    lengths[rank] = tensor.numel()
    dist.all_reduce(lengths)
    return [int(x) for x in lengths]


def gather_own_length_buffers(tensor, group=None):
    """Receives every piece into a buffer shaped like its own tensor."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pieces = []
    for src in range(n):
        piece = tensor.clone() if src == rank else torch.empty_like(tensor)  # BUG: own length
        dist.broadcast(piece, src=src)
        pieces.append(piece)
    return torch.cat(pieces)


def gather_own_piece_first(tensor, group=None):
    """Right lengths and buffers, but puts its own piece first."""
    rank, lengths = dist.get_rank(), _lengths(tensor)
    mine, others = None, []
    for src, length in enumerate(lengths):
        piece = tensor.clone() if src == rank else tensor.new_empty(length)
        dist.broadcast(piece, src=src)
        if src == rank:
            mine = piece
        else:
            others.append(piece)
    return torch.cat([mine] + others)  # BUG: not rank order


def gather_in_default_dtype(tensor, group=None):
    """Writes its piece at its offset into a zero buffer and all-reduces it, in float32."""
    rank, lengths = dist.get_rank(), _lengths(tensor)
    out = torch.zeros(sum(lengths))  # BUG: torch's default dtype, not the tensor's
    start = sum(lengths[:rank])
    out[start:start + tensor.numel()] = tensor
    dist.all_reduce(out)
    return out


def gather_padded(tensor, group=None):
    """Pads every piece to the longest and never trims the padding."""
    rank, n = dist.get_rank(), dist.get_world_size()
    longest = torch.tensor([tensor.numel()])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    out = tensor.new_zeros(n * int(longest))
    start = rank * int(longest)
    out[start:start + tensor.numel()] = tensor
    dist.all_reduce(out)
    return out  # BUG: the padding stays
