"""Measure what the cost model predicts: DDP step times at several bucket sizes, on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.bench.records import BucketStepRow
from dpcourse.bench.timing import summarize, time_interleaved
from dpcourse.device import rank_device


def ddp_step_sweep(bucket_caps=(0, 1, 4, 16), *, in_features: int = 256, hidden: int = 1024,
                   depth: int = 5, batch_size: int = 64, warmup: int = 2, iters: int = 8,
                   group=None) -> list[BucketStepRow]:
    """Time one SGD step of an MLP per bucket size, with and without overlap; call on every rank.

    Timed: ``"local"`` (no communication: the compute a prediction starts from), then
    for each cap ``"bucketed"`` (all-reduce after backward) and ``"overlapped"``
    (all-reduce during backward). Every variant of every cap is built first and all
    are timed interleaved, so a slow moment of the machine hits them alike instead of
    whichever cap happened to run then.

    Args:
        bucket_caps: ``bucket_cap_mb`` values (0: one bucket per parameter).
        in_features, hidden, depth: the MLP's shape (see :class:`dpcourse.models.MLP`).
        batch_size: examples per rank per step.
        warmup: untimed steps per variant.
        iters: timed steps per variant.
        group: the process group; ``None`` means the default group.

    Returns:
        One :class:`~dpcourse.bench.records.BucketStepRow` for ``"local"``
        (``bucket_cap_mb`` None), then one per (cap, variant), identical on every rank: ``variant``, ``bucket_cap_mb``, ``n_buckets``,
        ``bucket_bytes`` (sizes in launch order), ``grad_bytes``, ``world_size`` and the
        timing statistics (``median_s``, ``p25_s``, ...).
    """
    from dpcourse.ddp import DataParallelBucketed, DataParallelOverlapped
    from dpcourse.models import MLP

    device = rank_device(group)
    g = torch.Generator().manual_seed(dist.get_rank(group))
    x = torch.randn(batch_size, in_features, generator=g).to(device)
    y = torch.randn(batch_size, 1, generator=g).to(device)
    model = MLP(in_features, hidden, 1, depth, seed=0).to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = {("local", None): _sgd_step(model, model, x, y)}
    buckets = {None: []}
    wrappers = {"bucketed": DataParallelBucketed, "overlapped": DataParallelOverlapped}
    for cap in bucket_caps:
        for variant, wrapper in wrappers.items():
            model = MLP(in_features, hidden, 1, depth, seed=0).to(device)
            wrapped = wrapper(model, bucket_cap_mb=cap, group=group)
            buckets[cap] = [b.nbytes for b in wrapped.buckets]
            steps[(variant, cap)] = _sgd_step(wrapped, model, x, y)
    times = time_interleaved(steps, warmup=warmup, iters=iters, group=group, device=device)
    rows = []
    for (variant, cap), seconds in times.items():
        rows.append(BucketStepRow(
            **summarize(seconds), variant=variant, bucket_cap_mb=cap,
            n_buckets=len(buckets[cap]), bucket_bytes=buckets[cap], grad_bytes=grad_bytes,
            world_size=dist.get_world_size(group)))
    return rows


def _sgd_step(wrapped, model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        loss = F.mse_loss(wrapped(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step
