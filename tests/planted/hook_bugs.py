"""Wrong answers to exercise 11 (a bf16 hook with error feedback), one mistake each."""

import torch
import torch.distributed as dist


def _send(compressed, bucket):
    """All-reduce the compressed bucket; the future's value is cast back into the buffer."""
    buffer = bucket.buffer()
    fut = dist.all_reduce(compressed, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def _previous(state, bucket):
    """The bucket's residual with each parameter's part in this step's order (zeros at first).

    The mistakes below keep each parameter's residual with its parameter, as they should: each
    shows one mistake only, also after the buckets are rebuilt.
    """
    buffer, i = bucket.buffer(), bucket.index()
    old, order = state.get(i), [id(p) for p in bucket.parameters()]
    if old is None:
        return torch.zeros_like(buffer)
    if state[("order", i)] != order:
        parts = dict(zip(state[("order", i)], old.split(state[("sizes", i)])))
        old = torch.cat([parts[k] for k in order])
    return old


def _keep(state, bucket, residual):
    """Keep ``residual`` under the bucket's index, with the order of its parameters."""
    i = bucket.index()
    state[i] = residual
    state[("order", i)] = [id(p) for p in bucket.parameters()]
    state[("sizes", i)] = [p.numel() for p in bucket.parameters()]


def no_feedback(state, bucket):
    """torch's bf16 hook written by hand: nothing kept, nothing fed back."""
    return _send(bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size()), bucket)


def residual_in_bf16(state, bucket):
    """Keeps the residual, but in bfloat16."""
    corrected = bucket.buffer() + _previous(state, bucket)
    compressed = corrected.to(torch.bfloat16).div_(dist.get_world_size())
    _keep(state, bucket,
          (corrected - compressed.float() * dist.get_world_size()).to(torch.bfloat16))
    return _send(compressed, bucket)


def residual_before_division(state, bucket):
    """Takes the residual of the cast alone, before the division by the world size."""
    corrected = bucket.buffer() + _previous(state, bucket)
    cast = corrected.to(torch.bfloat16)
    _keep(state, bucket, corrected - cast.float())
    return _send(cast.div_(dist.get_world_size()), bucket)


def feedback_added_twice(state, bucket):
    """Adds the residual into the buffer, then once more when compressing."""
    buffer, old = bucket.buffer(), _previous(state, bucket)
    buffer.add_(old)
    corrected = buffer + old
    compressed = corrected.to(torch.bfloat16).div_(dist.get_world_size())
    _keep(state, bucket, corrected - compressed.float() * dist.get_world_size())
    return _send(compressed, bucket)


def positional_residual(state, bucket):
    """Residual keyed by bucket index: right on a fixed layout, but kept by position only; under
    torch DDP, whose buckets are rebuilt in arrival order after the first step, and in the check,
    which rebuilds its buckets the same way, it lands on other parameters."""
    buffer, i, world = bucket.buffer(), bucket.index(), dist.get_world_size()
    corrected = buffer + state.get(i, torch.zeros_like(buffer))
    compressed = corrected.to(torch.bfloat16).div_(world)
    state[i] = corrected - compressed.float() * world
    return _send(compressed, bucket)
