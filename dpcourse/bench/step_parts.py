"""The parts of one GPT step, timed and profiled on every rank (lessons 05, 06 and 08 on GPUs).

The step is the benchmarks' (:mod:`dpcourse.bench.workload`): GPT-2 small on a
GPU, a tiny GPT on CPU for a dry run.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from dpcourse.bench.chrome_trace import gpu_timeline
from dpcourse.bench.ddp import _wrap
from dpcourse.bench.timing import summarize, time_interleaved
from dpcourse.bench.workload import adamw, autocast_dtype, gpt_config
from dpcourse.device import rank_device


def _gpt_step_parts(variant, cap, batch_size=8):
    """Build one GPT-2 small replica (a tiny GPT on CPU); return (wrapped, model, opt, step, forward)."""
    from dpcourse.models import GPT, random_tokens

    device = rank_device()
    _, cfg = gpt_config("auto", device)  # GPT-2 small on GPU; a tiny GPT for a CPU dry run
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=dist.get_rank()))
    model = GPT(cfg, seed=0).to(device)
    wrapped = _wrap(variant, model, device, cap, None, None)
    opt = adamw(model.parameters(), device)
    amp = autocast_dtype(device)

    def forward():
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            return wrapped(idx, targets)[1]

    def step():
        loss = forward()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return wrapped, model, opt, step, forward


def step_parts(cap: float = 25.0, iters: int = 15, warmup: int = 3) -> dict:
    """Time the parts of a step and the step with and without overlap; call on every rank.

    Timed interleaved: ``forward`` (forward and loss only), ``optimizer`` (the
    fused AdamW step alone), ``local`` (the whole step, no communication),
    ``comm_all`` (every bucket's all-reduce, one after another, no compute),
    ``comm_last`` (the last bucket's all-reduce alone), ``bucketed``,
    ``overlapped`` and ``torch_ddp``.

    Returns:
        ``{"medians": {name: seconds}, "stats": {name: summary}, "bucket_bytes": [...],
        "bucket_names": [...]}``.
    """
    steps = {}
    wrapped, model, opt, local_step, forward = _gpt_step_parts("local", cap)
    steps["local"] = local_step
    steps["forward"] = lambda: forward()
    # The optimizer alone: gradients stay in place (never zeroed), so every call does full work.
    _, omodel, oopt, _, _ = _gpt_step_parts("local", cap)
    for p in omodel.parameters():
        p.grad = torch.zeros_like(p)
    steps["optimizer"] = oopt.step
    for variant in ("bucketed", "overlapped", "torch_ddp"):
        w, _, _, step, _ = _gpt_step_parts(variant, cap)
        steps[variant] = step
        if variant == "overlapped":
            buckets = w.buckets
    buffers = [torch.zeros(b.nbytes // 4, device=rank_device()) for b in buckets]
    steps["comm_all"] = lambda: [dist.all_reduce(b) for b in buffers]
    steps["comm_last"] = lambda: dist.all_reduce(buffers[-1])
    times = time_interleaved(steps, warmup=warmup, iters=iters)
    stats = {k: summarize(v) for k, v in times.items()}
    return {"medians": {k: s["median_s"] for k, s in stats.items()}, "stats": stats,
            "bucket_bytes": [b.nbytes for b in buckets],
            "bucket_names": [list(b.names) for b in buckets]}


def profile_step(variant: str = "overlapped", cap: float = 25.0, out_dir: str | None = None,
                 warmup: int = 3) -> dict:
    """Profile one training step of ``variant`` on every rank; return its GPU timeline.

    Rank 0 also copies its raw Chrome trace (gzipped) into ``out_dir``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    _, model, opt, _, forward = _gpt_step_parts(variant, cap)
    cuda = rank_device().type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        forward().backward()
        opt.step()
        opt.zero_grad()
    sync()
    dist.barrier()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function("forward"):
            loss = forward()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad()
        sync()
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "trace.json")
    prof.export_chrome_trace(path)
    try:  # a trace format this parser does not know must not lose the other measurements
        out = gpu_timeline(path)
    except Exception as exc:  # noqa: BLE001
        out = {"error": repr(exc)}
    if out_dir and dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "rb") as src, gzip.open(os.path.join(out_dir, f"trace-{variant}.json.gz"),
                                                "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(tmp, ignore_errors=True)
    return out
