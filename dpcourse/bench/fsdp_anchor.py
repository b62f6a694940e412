"""Where torch's fully_shard spends a GPT-2-small step: GPU busy time against the step, and batch size.

``python -m dpcourse.bench.fsdp_anchor OUT_DIR`` (one rank per GPU) writes
``fsdp-anchor-<N>x-<gpu>.json`` with, for ``torch_ddp``, our ``fsdp``, ``torch_fsdp``
and ``torch_fsdp_tuned`` (:func:`dpcourse.bench.sharded.tuned_fully_shard`):

* the median step time of interleaved steps at 4, 8 and 16 sequences per rank: a step
  whose time barely grows with the batch is waiting on the host, not on the GPU;
* for one profiled step of ``fsdp`` and ``torch_fsdp_tuned``: how long the GPU was busy
  (union of kernel intervals) against the span from first to last kernel, and the host
  time inside each of FSDP2's ``FSDP::`` profiler ranges (pre_forward, all_gather, ...).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile

import torch
import torch.distributed as dist

BATCHES = (4, 8, 16)
VARIANTS = ("torch_ddp", "fsdp", "torch_fsdp", "torch_fsdp_tuned")


def gpu_busy(trace_events: list[dict]) -> dict:
    """Span from the first to the last GPU kernel, and the time some kernel was running (ms)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0}
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    return {"span_ms": (spans[-1][1] - spans[0][0]) / 1e3, "busy_ms": busy / 1e3}


def fsdp_host_ranges(trace_events: list[dict]) -> dict[str, float]:
    """Host milliseconds inside each kind of ``FSDP::`` range (``"FSDP::pre_forward (blocks.3)"``
    counts as ``FSDP::pre_forward``)."""
    total: dict[str, float] = collections.defaultdict(float)
    for e in trace_events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("FSDP::"):
            total[e["name"].split(" (")[0].split(" for ")[0]] += e.get("dur", 0) / 1e3
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def _profiled_step(step, device) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def fsdp_anchor(config: str = "auto", batches=BATCHES, iters: int = 8) -> dict:
    """Step times per batch size and one profiled step per FSDP; call on every rank.

    Args:
        config: ``"gpt2_small"``, ``"tiny"`` or ``"auto"`` (GPT-2 small on GPU, tiny on CPU).
        batches: sequences per rank to time; the profiled step uses 8 if listed, else the first.
        iters: timed, interleaved steps per variant and batch size.

    Returns:
        ``{"config", "rank", "median_ms": {batch: {variant: ms}}, "profile": {variant:
        {"span_ms", "busy_ms", "fsdp_host_ms"}}}``.
    """
    from dpcourse.bench.sharded import build_variant
    from dpcourse.bench.timing import summarize, time_interleaved
    from dpcourse.bench.workload import gpt_config, make_step
    from dpcourse.device import rank_device
    from dpcourse.models import random_tokens

    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg_name, cfg = gpt_config(config, device)
    built = {v: build_variant(v, cfg, device)[:3] for v in VARIANTS}
    out: dict = {"config": cfg_name, "rank": dist.get_rank(), "median_ms": {}, "profile": {}}
    profiled = 8 if 8 in batches else batches[0]
    for batch in batches:
        idx, targets = (t.to(device) for t in random_tokens(batch, cfg, seed=dist.get_rank()))
        steps = {v: make_step(m, o, idx, targets, amp) for v, (m, o, amp) in built.items()}
        times = time_interleaved(steps, warmup=2, iters=iters)
        out["median_ms"][batch] = {v: 1e3 * summarize(t).median_s for v, t in times.items()}
        if batch == profiled:
            for v in ("fsdp", "torch_fsdp_tuned"):
                events = _profiled_step(steps[v], device)
                out["profile"][v] = {**gpu_busy(events), "fsdp_host_ms": fsdp_host_ranges(events)}
    return out


def main(argv=None) -> int:
    import argparse

    import dpcourse
    from dpcourse.bench.report import environment, slug

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--config", default="auto", choices=("auto", "gpt2_small", "tiny"))
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    plan = dpcourse.plan_ranks()  # the course's rank rule: one per GPU, else 2 CPU ranks
    print(plan)
    per_rank = dpcourse.run(fsdp_anchor, args.config, world_size=plan.world_size,
                            backend=plan.backend, timeout=600)
    name = slug(torch.cuda.get_device_name(0)) if plan.backend == "nccl" else "cpu"
    path = os.path.join(args.out_dir, f"fsdp-anchor-{plan.world_size}x-{name}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "fsdp-anchor",
                   "environment": environment(plan.backend, plan.world_size),
                   "per_rank": per_rank}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
