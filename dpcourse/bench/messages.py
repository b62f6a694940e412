"""The price of many small messages: the same bytes all-reduced as 1 or many messages (lesson 05).

Call on every rank (through :func:`dpcourse.run`); the calls are timed interleaved.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.bench.timing import summarize, time_interleaved
from dpcourse.device import rank_device


def many_small_messages(total_bytes: int, counts=(1, 4, 16, 64, 256), iters: int = 20) -> list[dict]:
    """Time ``total_bytes`` all-reduced as K equal messages, for each K; call on every rank."""
    device = rank_device()
    calls = {}
    for k in counts:
        pieces = [torch.zeros(total_bytes // 4 // k, device=device) for _ in range(k)]
        calls[k] = lambda pieces=pieces: [dist.all_reduce(p) for p in pieces]
    times = time_interleaved(calls, warmup=3, iters=iters)
    return [dict(messages=k, bytes_each=total_bytes // k, total_bytes=total_bytes,
                 **summarize(times[k])) for k in counts]


def gpt2_grad_messages(caps=(0, 25, float("inf")), iters: int = 20) -> list[dict]:
    """All-reduce GPT-2 small's gradients as the buckets of each cap (0: one per tensor)."""
    from dpcourse.ddp import assign_buckets
    from dpcourse.models import GPT, gpt2_small

    with torch.device("meta"):
        params = list(GPT(gpt2_small()).parameters())
    device = rank_device()
    calls, meta = {}, {}
    for cap in caps:
        groups = assign_buckets(params, cap)
        sizes = [sum(params[i].numel() for i in g) for g in groups]
        bufs = [torch.zeros(n, device=device) for n in sizes]
        calls[cap] = lambda bufs=bufs: [dist.all_reduce(b) for b in bufs]
        meta[cap] = dict(bucket_cap_mb=cap, messages=len(bufs), total_bytes=4 * sum(sizes))
    times = time_interleaved(calls, warmup=3, iters=iters)
    rows = []
    for cap in caps:
        row = dict(meta[cap], **summarize(times[cap]))
        row["achieved_bytes_per_s"] = row["total_bytes"] / row["median_s"]
        rows.append(row)
    return rows
