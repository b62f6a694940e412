"""The grader's answers, written independently of the course package on purpose.

Each function here restates, from its definition, what an exercise must
compute, without importing ``dpcourse.comm``, ``dpcourse.ddp`` or
``dpcourse.costmodel``: a bug in the reference cannot hide the same bug in a
learner's code, and tests compare these with torch (torch DDP) and with the
reference (the bucket rule).

Only the grader's own process imports this module. Graded ranks cannot
(``dpcourse.grading.rank`` blocks it), and nothing here is sent to them.
"""

from __future__ import annotations

import torch
from torch import nn

MIB = 2**20


# -- lesson 04: the ring's chunks and its result ---------------------------------------------
def chunk_bounds(numel: int, world_size: int, index: int) -> tuple[int, int]:
    """Chunk ``index`` of ``numel`` elements as ``dist.reduce_scatter_tensor`` cuts them.

    The tensor is padded to ``world_size`` blocks of ``ceil(numel / world_size)``
    elements and block ``index`` goes to rank ``index``; its real elements are
    that block clipped to ``numel``, so the last chunks may be short or empty.
    """
    block = (numel + world_size - 1) // world_size
    return min(index * block, numel), min((index + 1) * block, numel)


def all_reduce_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of every rank's tensor, in their dtype."""
    total = inputs[0].clone()
    for t in inputs[1:]:
        total += t
    return total


def ring_sent_bytes(numel: int, world_size: int, rank: int, element_size: int) -> int:
    """Bytes rank r sends in exercise 04's leftward ring: every chunk but chunk r in the
    reduce-scatter, every chunk but chunk r - 1 in the all-gather (empty ones not at all)."""
    def length(i: int) -> int:
        lo, hi = chunk_bounds(numel, world_size, i % world_size)
        return hi - lo

    if world_size == 1:
        return 0
    return (2 * numel - length(rank) - length(rank - 1)) * element_size


def halving_doubling_sent_bytes(nbytes: int, world_size: int) -> list[int]:
    """Bytes each rank sends in exercise 04's halving-doubling all-reduce, smallest first.

    With ``p`` the largest power of two <= N, N - p ranks hand their tensor to a partner
    and get the sum back from it, and ``p`` ranks halve and double, each sending
    2 (p - 1) / p of the tensor. Exact when ``p`` divides the tensor's elements.
    """
    p = 1 << (world_size.bit_length() - 1)
    extra, share = world_size - p, 2 * (p - 1) * nbytes // p
    return sorted([nbytes] * extra + [share + nbytes] * extra + [share] * (p - extra))


# -- lesson 05: torch DDP's bucket rule ----------------------------------------------------------
def close_by_caps(order, nbytes: list[int], caps: list[float],
                  strict: bool = False) -> list[list[int]]:
    """Fill buckets along ``order``; bucket k closes once it holds >= ``caps[min(k, last)]`` bytes.

    Args:
        order: parameter indices in the order their gradients are bucketed.
        nbytes: each parameter's size in bytes, by index.
        caps: the first bucket's cap, the second's, ...; the last one holds for the rest.
        strict: close only once a bucket holds *more* than its cap (a common mistake, used to
            recognise it in feedback).
    """
    out, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += nbytes[i]
        cap = caps[min(len(out), len(caps) - 1)]
        if size > cap or (size == cap and not strict):
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def buckets(nbytes: list[int], bucket_cap_mb: float, strict: bool = False) -> list[list[int]]:
    """Indices per bucket: last parameter first; a bucket closes once it holds >= the cap.

    Args:
        nbytes: each parameter's size in bytes, in registration order.
        bucket_cap_mb: the cap in MiB.
        strict: as in :func:`close_by_caps`.
    """
    return close_by_caps(reversed(range(len(nbytes))), nbytes, [bucket_cap_mb * MIB], strict)


def buckets_with_first(nbytes: list[int], trainable: list[bool], bucket_cap_mb: float,
                       first_bucket_mb: float) -> list[list[int]]:
    """Return torch DDP's buckets with its smaller first bucket, in the order it all-reduces them.

    Args:
        nbytes: bytes of every parameter, in registration order (frozen ones included).
        trainable: whether each parameter requires a gradient.
        bucket_cap_mb: cap of every bucket after the first, in MiB.
        first_bucket_mb: cap of the first bucket, in MiB.

    Returns:
        Lists of indices into the parameters; frozen parameters are in none.
    """
    order = [i for i in reversed(range(len(nbytes))) if trainable[i]]
    return close_by_caps(order, nbytes, [first_bucket_mb * MIB, bucket_cap_mb * MIB])


# -- lesson 09: the alpha-beta model of a ring all-reduce --------------------------------------
def ring_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """2 (N - 1) messages of latency alpha, and 2 (N - 1) / N of the bytes at beta s/byte each."""
    steps = 2 * (world_size - 1)
    return steps * alpha + (steps / world_size) * nbytes * beta


def expected_ring_bytes(nbytes: float, world_size: int) -> float:
    """2 (N - 1) / N of the bytes leave each rank."""
    return 2 * (world_size - 1) * nbytes / world_size


# -- lessons 03, 06, 07, 10, 13, 14: data-parallel training, computed in one process -------------
def train_one_process(model_fn, seed: int, batches: list, optimizer, *,
                      loss_fn=nn.functional.mse_loss, divide_by_initial_world_size: bool = True,
                      prepare=None) -> dict:
    """Train in one process what data-parallel ranks compute together; record every step.

    Each step, every rank with data accumulates its gradient over its micro-batches (each
    micro-batch's loss divided by their number, as lesson 07 divides it); the ranks'
    gradients, each divided by the divisor before they are summed (as DDP's reducer
    divides), are the step's gradient, with which one optimizer steps. A parameter no rank
    produced a gradient for keeps none. One rank holding the whole batch is one process
    training on it (see :func:`whole_batch`).

    Args:
        model_fn: ``model_fn(seed)`` builds the check's model.
        seed: rank 0's seed (DDP starts every replica from rank 0's parameters and buffers).
        batches: ``batches[step][rank]`` is that rank's list of micro-batches ``(x, y)``; an
            empty list means the rank has no data in that step (it joined).
        optimizer: ``optimizer(params)`` builds the optimizer over the model's parameters.
        loss_fn: ``loss_fn(output, y)``, one micro-batch's loss before the division.
        divide_by_initial_world_size: divide by the number of ranks (True), or by the number
            of ranks with data in the step (False), as ``Join``'s keyword.
        prepare: ``prepare(model, step, rank)`` runs before a rank's forward (e.g. to choose
            the layers that rank uses).

    Returns:
        ``{"init", "grads", "params", "buffers"}``: the parameters before training; per step,
        the gradients it stepped with (``None`` for a parameter without one), the parameters
        after it, and per rank the buffers after its forward. Before a rank's first forward
        of a step the model holds rank 0's buffers as they were when the step began (DDP's
        ``broadcast_buffers``).
    """
    model = model_fn(seed)
    params = list(model.parameters())
    opt = optimizer(params)
    rank0_buffers = [b.detach().clone() for b in model.buffers()]
    out: dict = {"init": [p.detach().clone() for p in params], "grads": [], "params": [],
                 "buffers": []}
    for step, per_rank in enumerate(batches):
        with_data = sum(1 for micro in per_rank if micro)
        divisor = len(per_rank) if divide_by_initial_world_size else with_data
        total: list = [None] * len(params)
        buffers = []
        for rank, micro in enumerate(per_rank):
            with torch.no_grad():
                for b, v in zip(model.buffers(), rank0_buffers):
                    b.copy_(v)
            if prepare is not None:
                prepare(model, step, rank)
            model.zero_grad(set_to_none=True)
            for x, y in micro:
                (loss_fn(model(x), y) / len(micro)).backward()
            buffers.append([b.detach().clone() for b in model.buffers()])
            for i, p in enumerate(params):
                if p.grad is not None:
                    g = p.grad.detach() / divisor
                    total[i] = g if total[i] is None else total[i] + g
        rank0_buffers = buffers[0]
        for p, g in zip(params, total):
            p.grad = None if g is None else g.clone()
        opt.step()
        out["grads"].append(total)
        out["params"].append([p.detach().clone() for p in params])
        out["buffers"].append(buffers)
    return out


def whole_batch(batches: list) -> list:
    """``batches[step][rank]`` (lists of micro-batches) as one rank with all of a step's rows."""
    return [[[(torch.cat([x for micro in per_rank for x, _ in micro]),
               torch.cat([y for micro in per_rank for _, y in micro]))]] for per_rank in batches]


# -- lesson 14: FSDP's flat layout and the collectives of one step ------------------------------
def flat_chunk(numel: int, world_size: int) -> int:
    """Elements per rank of a flat vector of ``numel`` elements padded to a multiple of N."""
    return -(-numel // world_size)


def flat_shard(tensors: list[torch.Tensor], world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the tensors concatenated and zero-padded to N x chunk."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    c = flat_chunk(flat.numel(), world_size)
    padded = torch.zeros(world_size * c, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * c:(rank + 1) * c]


def unflatten(shards: list[torch.Tensor], shapes: list) -> list[torch.Tensor]:
    """The tensors of ``shapes`` rebuilt from every rank's shard (in rank order)."""
    flat = torch.cat([s.reshape(-1) for s in shards])
    out, start = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[start:start + n].reshape(shape))
        start += n
    return out


def fsdp_step_collectives(units: list[list[tuple[int, bool]]], world_size: int,
                          element_size: int = 4) -> dict[str, list[list[tuple[str, int]]]]:
    """What one FSDP training step issues, as groups of ``(op, bytes)`` (order within a group free).

    Args:
        units: per unit, in forward order, its flats as ``(numel, trainable)``.
        world_size: ranks ``N``.
        element_size: bytes per element.

    Returns:
        ``{"forward": groups, "backward": groups}``: forward all-gathers every flat of every
        unit, unit by unit; backward, in reverse unit order, all-gathers a unit's flats again
        and then reduce-scatters each of its trainable flats once. Bytes are those of the
        ``N x chunk`` buffer (gathered output, scattered input), as CommTrace records them.
    """
    def full(numel: int) -> int:
        return world_size * flat_chunk(numel, world_size) * element_size

    forward = [[("all_gather_into_tensor", full(n)) for n, _ in flats] for flats in units]
    backward = []
    for flats in reversed(units):
        backward.append([("all_gather_into_tensor", full(n)) for n, _ in flats])
        backward.append([("reduce_scatter_tensor", full(n)) for n, t in flats if t])
    return {"forward": forward, "backward": [g for g in backward if g]}


# -- lesson 11: torch's 16-bit compression hook ------------------------------------------------
def compress_hook(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What torch's ``bf16_compress_hook``/``fp16_compress_hook`` leave in a bucket, every rank.

    Each rank casts its bucket to ``dtype`` and divides by the world size *in* ``dtype``; the
    all-reduce sums those in rank order (in ``dtype``), and the sum is cast back.

    Args:
        grads: every rank's flat bucket, in rank order.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
    """
    n = len(grads)
    total = grads[0].to(dtype).div_(n)
    for g in grads[1:]:
        total += g.to(dtype).div_(n)
    return total.to(grads[0].dtype)
