"""Wrong answers to exercise 11 (a bf16 hook with error feedback), one mistake each."""

import torch
import torch.distributed as dist


def _send(compressed, bucket):
    """All-reduce the compressed bucket; the future's value is cast back into the buffer."""
    buffer = bucket.buffer()
    fut = dist.all_reduce(compressed, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def no_feedback(state, bucket):
    """torch's bf16 hook written by hand: nothing kept, nothing fed back."""
    return _send(bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size()), bucket)


def residual_in_bf16(state, bucket):
    """Keeps the residual, but in bfloat16."""
    buffer, i = bucket.buffer(), bucket.index()
    corrected = buffer + state.get(i, torch.zeros_like(buffer))
    compressed = corrected.to(torch.bfloat16).div_(dist.get_world_size())
    state[i] = (corrected - compressed.float() * dist.get_world_size()).to(torch.bfloat16)
    return _send(compressed, bucket)


def residual_before_division(state, bucket):
    """Takes the residual of the cast alone, before the division by the world size."""
    buffer, i = bucket.buffer(), bucket.index()
    corrected = buffer + state.get(i, torch.zeros_like(buffer))
    cast = corrected.to(torch.bfloat16)
    state[i] = corrected - cast.float()
    return _send(cast.div_(dist.get_world_size()), bucket)


def feedback_added_twice(state, bucket):
    """Adds the residual into the buffer, then once more when compressing."""
    buffer, i = bucket.buffer(), bucket.index()
    old = state.get(i, torch.zeros_like(buffer))
    buffer.add_(old)
    corrected = buffer + old
    compressed = corrected.to(torch.bfloat16).div_(dist.get_world_size())
    state[i] = corrected - compressed.float() * dist.get_world_size()
    return _send(compressed, bucket)


def positional_residual(state, bucket):
    """Right on a fixed layout, but keeps the residual by position only: under torch DDP, whose
    buckets are rebuilt in arrival order after the first step, it lands on other parameters."""
    buffer, i, world = bucket.buffer(), bucket.index(), dist.get_world_size()
    corrected = buffer + state.get(i, torch.zeros_like(buffer))
    compressed = corrected.to(torch.bfloat16).div_(world)
    state[i] = corrected - compressed.float() * world
    return _send(compressed, bucket)
