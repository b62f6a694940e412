"""Where a data-parallel step spends its time: torch.profiler around a few steps per variant.

Use it when a wrapper is slower than torch DDP: the tables show whether the
difference is GPU work (kernels, communication) or CPU time in Python hooks,
and the Chrome traces (open in https://ui.perfetto.dev) show the overlap.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dpcourse.bench.ddp import _wrap
from dpcourse.bench.workload import adamw, autocast_dtype, gpt_config, make_step
from dpcourse.device import rank_device


def profile_ddp_steps(variants=("overlapped", "torch_ddp"), *, config: str = "auto",
                      batch_size: int = 8, bucket_cap_mb: float = 25.0, warmup: int = 3,
                      steps: int = 3, out_dir: str | None = None, row_limit: int = 12) -> dict:
    """Profile ``steps`` training steps of each variant after ``warmup``; call on every rank.

    Args:
        variants: variant names of :func:`dpcourse.bench.ddp_step_times`.
        config: model config (``"auto"``, ``"gpt2_small"``, ``"tiny"``).
        batch_size: sequences per rank.
        bucket_cap_mb: bucket size for the bucketed variants and torch DDP.
        warmup: unprofiled steps first.
        steps: profiled steps.
        out_dir: if given, rank 0 writes ``trace-<variant>.json`` (Chrome trace format) there.
        row_limit: rows per table.

    Returns:
        ``{variant: {"by_device_time": table, "by_cpu_time": table, "step_ms": mean
        wall time per profiled step}}``, as text tables.
    """
    from dpcourse.models import GPT, random_tokens

    device = rank_device()
    _, cfg = gpt_config(config, device)
    amp = autocast_dtype(device)
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=dist.get_rank()))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    device_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = {}
    for variant in variants:
        model = GPT(cfg, seed=0).to(device)
        wrapped = _wrap(variant, model, device, bucket_cap_mb, None, None)
        opt = adamw(model.parameters(), device)
        step = make_step(wrapped, opt, idx, targets, amp)
        for _ in range(warmup):
            step()
        dist.barrier()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall_s = time.perf_counter() - start
        events = prof.key_averages()
        out[variant] = {
            "by_device_time": events.table(sort_by=device_key, row_limit=row_limit),
            "by_cpu_time": events.table(sort_by="self_cpu_time_total", row_limit=row_limit),
            "step_ms": 1e3 * wall_s / steps,  # with profiler overhead: compare, don't quote
        }
        if out_dir and dist.get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(out_dir, f"trace-{variant}.json"))
        del wrapped, model, opt, step
    return out
