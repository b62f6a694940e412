"""When do FSDP's all-gathers and reduce-scatters run, relative to the compute kernels?

One training step of a GPT under :class:`~dpcourse.fsdp.FullyShardedDataParallel`
is profiled on the GPU; its kernels are split into communication (NCCL) and
compute, and the time during which both ran is measured. With prefetch the
next unit's all-gather runs while the current unit computes.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist

from dpcourse.device import rank_device

from dpcourse.bench.timing import time_interleaved


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_ms(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Milliseconds during which some communication kernel and some compute kernel both ran."""
    total, comp = 0.0, _union(compute)
    for s, e in _union(comm):
        total += sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in comp)
    return total


def kernel_intervals(trace_path: str) -> list[tuple[str, float, float]]:
    """``(kind, start_ms, end_ms)`` of every GPU kernel in a Chrome trace; kind names the collective."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    t0 = min(e["ts"] for e in kernels)
    out = []
    for e in kernels:
        name = e["name"].lower()
        kind = ("all_gather" if "allgather" in name else "reduce_scatter" if "reducescatter" in name
                else "other_comm" if "nccl" in name else "compute")
        out.append((kind, (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3))
    return out


def fsdp_timeline(*, config: str = "gpt2_small", batch_size: int = 8, iters: int = 10) -> dict:
    """Profile one FSDP step with and without prefetch and time both; call on every rank.

    Returns:
        ``{"prefetch": {...}, "no_prefetch": {...}}``, each with ``median_s`` (interleaved
        timing), ``comm_ms``, ``compute_ms``, ``overlap_ms`` and ``kernels`` (compute merged
        into busy intervals, then the collectives, each ``[kind, start_ms, end_ms]``).
    """
    from torch.profiler import ProfilerActivity, profile

    from dpcourse.bench.workload import gpt_config, make_step
    from dpcourse.fsdp import FullyShardedDataParallel
    from dpcourse.models import GPT, random_tokens

    device = rank_device()
    torch.cuda.set_device(device)
    _, cfg = gpt_config(config, device)
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=dist.get_rank()))
    steps, out = {}, {}
    for prefetch in (True, False):
        with torch.device(device):
            model = FullyShardedDataParallel(GPT(cfg, seed=0), compute_dtype=torch.bfloat16,
                                             prefetch=prefetch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        steps["prefetch" if prefetch else "no_prefetch"] = make_step(model, opt, idx, targets, None)
    times = time_interleaved(steps, warmup=3, iters=iters, device=device)
    for name, step in steps.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            kernels = kernel_intervals(path)
        comm = [(s, e) for k, s, e in kernels if k != "compute"]
        compute = [(s, e) for k, s, e in kernels if k == "compute"]
        busy = _union(compute)
        out[name] = {
            "median_s": sorted(times[name])[len(times[name]) // 2],
            "comm_ms": sum(e - s for s, e in _union(comm)),
            "compute_ms": sum(e - s for s, e in busy),
            "overlap_ms": overlap_ms(comm, compute),
            "kernels": [["compute", s, e] for s, e in busy]
            + [[k, s, e] for k, s, e in kernels if k != "compute"],
        }
    return out


LANES = ("compute", "all_gather", "reduce_scatter")


def plot_kernels(kernels, ax=None, title: str = ""):
    """Draw one rank's recorded kernels: a lane each for compute, all-gathers and reduce-scatters.

    Args:
        kernels: ``[kind, start_ms, end_ms]`` triples (the ``"kernels"`` of :func:`fsdp_timeline`).
        ax: matplotlib axes (default: a new figure).
        title: the axes' title.

    Returns:
        The axes.
    """
    from dpcourse.plots import figure_axes

    fig, ax = figure_axes(ax, figsize=(10, 2.2))
    colors = {"compute": "tab:gray", "all_gather": "tab:blue", "reduce_scatter": "tab:orange"}
    for lane, kind in enumerate(LANES):
        bars = [(s, e - s) for k, s, e in kernels if k == kind]
        ax.broken_barh(bars, (lane - 0.4, 0.8), color=colors[kind])
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_xlabel("ms since the step's first kernel")
    ax.set_title(title)
    return ax
