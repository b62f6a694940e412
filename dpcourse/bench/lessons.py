"""Record on GPUs what lessons 05, 06, 08 and 09 measure, as JSON files the lessons draw from.

A laptop cannot show overlap or link bandwidth, so the lessons show the CPU
measurement of the learner's own run beside numbers recorded once on GPUs.
``python -m dpcourse.bench.lessons OUT_DIR`` runs every measurement in three
launches (2 ranks over NVLink, 2 ranks over sockets as a slow link, 1 rank)
and writes ``lessonNN-<N>x-<gpu>.json`` for NN = 05, 06, 08, 09 (each with the
environment), plus rank 0's Chrome traces of the profiled steps.
``--timelines`` records only lesson 06's per-rank timelines (``timelines.json``).
Read the files with :func:`dpcourse.bench.recorded.load_recording`.

Model: GPT-2 small (about 124 M parameters, fp32 weights and gradients, bf16
autocast), 8 sequences of 1024 tokens per rank, fused AdamW, as ``dpcourse
bench ddp`` measures it.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from dpcourse.bench.allreduce import allreduce_sweep
from dpcourse.bench.records import to_json
from dpcourse.launch.env import SLOW_LINK_ENV, slow_link
from dpcourse.bench.ddp import _config, _wrap, ddp_step_times
from dpcourse.bench.timing import device_name, summarize, time_interleaved
from dpcourse.device import rank_device

PHASES = ("forward", "backward", "optimizer")
CONFIG = "auto"  # GPT-2 small on GPU, a tiny GPT on CPU (a dry run of this script)


def _gpt_step_parts(variant, cap, batch_size=8):
    """Build one GPT-2 small replica (a tiny GPT on CPU); return (wrapped, model, opt, step, forward)."""
    from dpcourse.models import GPT, random_tokens

    device = rank_device()
    _, cfg = _config("auto", device)  # GPT-2 small on GPU; a tiny GPT for a CPU dry run
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=dist.get_rank()))
    model = GPT(cfg, seed=0).to(device)
    wrapped = _wrap(variant, model, device, cap, None, None)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
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


def _phase_of(ts, ranges):
    for name, (start, end) in ranges.items():
        if start <= ts <= end:
            return name
    return None


def _merge(intervals, gap=2e-6):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def gpu_timeline(trace_path: str) -> dict:
    """Read a torch.profiler Chrome trace of one step into GPU phase spans and NCCL kernels.

    Each GPU kernel is given the phase (forward, backward, optimizer) during which the
    host launched it (matched by the profiler's correlation id), so the spans are when
    that phase's kernels really ran on the GPU. Kernels whose name contains ``nccl``
    are the communication.

    Returns:
        ``{"spans": [(phase, start_s, end_s)], "busy": {phase: [[start_s, end_s], ...]},
        "events": [{"op", "start", "end", "name", "stream"}], "streams": {...}}`` with
        times in seconds from the first kernel.
    """
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ranges = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") == "user_annotation" and e.get("name") in PHASES}
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
               and "dur" in e]
    if not kernels:
        return {"error": "no GPU kernels in the trace"}
    t0 = min(e["ts"] for e in kernels)
    busy, comm = {}, []
    for e in kernels:
        s, end = (e["ts"] - t0) * 1e-6, (e["ts"] + e["dur"] - t0) * 1e-6
        args = e.get("args", {})
        if "nccl" in e["name"].lower():
            comm.append({"op": "all_reduce", "start": s, "end": end, "stream": args.get("stream"),
                         "name": e["name"][:60]})
            continue
        phase = _phase_of(launch.get(args.get("correlation"), -1), ranges) or "other"
        busy.setdefault(phase, []).append((s, end))
    busy = {k: _merge(v) for k, v in busy.items()}
    spans = [(p, busy[p][0][0], busy[p][-1][1]) for p in PHASES if p in busy]
    return {"spans": spans, "busy": busy, "events": sorted(comm, key=lambda c: c["start"]),
            "n_kernels": len(kernels)}


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


def nvlink_rank(out_dir: str) -> dict:
    """Everything measured over the fast link (2 ranks); call on every rank."""
    from dpcourse.bench.steps import ddp_step_sweep

    out = {"device": device_name(rank_device()), "world_size": dist.get_world_size()}
    out["many_small_messages"] = many_small_messages(2**18)
    out["gpt2_grad_messages"] = gpt2_grad_messages()
    out["bucket_sweep"] = []
    for cap in (0, 1, 5, 25, 100):
        out["bucket_sweep"] += ddp_step_times(("bucketed", "overlapped", "torch_ddp"),
                                              config=CONFIG, bucket_cap_mb=cap, iters=10)
    out["variants"] = ddp_step_times(("local", "naive", "bucketed", "overlapped", "torch_ddp"),
                                     config=CONFIG, bucket_cap_mb=25, iters=20)
    out["step_parts"] = step_parts()
    out["timeline"] = {v: profile_step(v, out_dir=os.path.join(out_dir, "nvlink"))
                       for v in ("bucketed", "overlapped")}
    sizes = [2**k for k in range(10, 29, 2)]
    out["allreduce_sweep"] = allreduce_sweep(sizes, impls=("library", "ring"), warmup=3, iters=15)
    out["mlp_step_sweep"] = ddp_step_sweep(bucket_caps=(0, 1, 4, 16), iters=10)
    return out


def slow_rank(out_dir: str) -> dict:
    """What the slow link (NCCL over sockets) changes (2 ranks); call on every rank."""
    out = {"device": device_name(rank_device()), "world_size": dist.get_world_size()}
    out["variants"] = ddp_step_times(("local", "naive", "bucketed", "overlapped", "torch_ddp"),
                                     config=CONFIG, bucket_cap_mb=25, iters=10)
    out["step_parts"] = step_parts(iters=10)
    out["timeline"] = {"overlapped": profile_step("overlapped", out_dir=os.path.join(out_dir, "slow"))}
    sizes = [2**k for k in range(10, 27, 2)]
    out["allreduce_sweep"] = allreduce_sweep(sizes, impls=("library",), warmup=2, iters=8)
    return out


def timeline_rank(out_dir: str, variants=("bucketed", "overlapped")) -> dict:
    """Profile one step of each variant; every rank returns its own GPU timeline."""
    return {v: profile_step(v, out_dir=out_dir) for v in variants}


def one_rank() -> dict:
    """The same step on one GPU: the throughput(1) of scaling efficiency."""
    return {"variants": ddp_step_times(("local",), config=CONFIG, iters=20)}


def record_timelines(out_dir: str, env: dict) -> int:
    """Record every rank's timeline of one step, over the fast and the slow link."""
    import dpcourse

    out = {"environment": env, "what": "per-rank GPU timelines of one GPT-2 small step"}
    out["nvlink"] = dpcourse.run(timeline_rank, os.path.join(out_dir, "nvlink"), world_size=2,
                                 timeout=300)
    with slow_link(True):  # the ranks inherit the environment: NCCL over sockets
        out["slow_link"] = dpcourse.run(timeline_rank, os.path.join(out_dir, "slow"),
                                        world_size=2, timeout=300)
    with open(os.path.join(out_dir, "timelines.json"), "w") as f:
        json.dump(out, f, default=to_json)
    return 0


def main(argv=None) -> int:
    """Record everything (or, with ``--timelines``, lesson 06's timelines) into OUT_DIR."""
    import argparse

    import dpcourse
    from dpcourse.bench.report import environment, slug

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join("docs", "results"))
    parser.add_argument("--timelines", action="store_true",
                        help="record only lesson 06's per-rank GPU timelines, both links")
    args = parser.parse_args(argv)
    out_dir = args.out_dir
    os.environ.update(NCCL_NVLS_ENABLE="0")  # no NVLink multicast on shared machines
    backend, world_size = dpcourse.resolve_backend("auto", 2)
    env = environment(backend, world_size)
    record = {"model": "GPT-2 small, fp32 weights and gradients, bf16 autocast, fused AdamW, "
                       "8 x 1024 tokens per rank", "environment": env}
    if args.timelines:
        return record_timelines(out_dir, env)
    results = dpcourse.run(nvlink_rank, out_dir, world_size=2, timeout=400)
    record["nvlink"] = dict(results[0], timeline={v: [r["timeline"][v] for r in results]
                                                  for v in results[0]["timeline"]})
    print("fast link done", flush=True)
    record["one_gpu"] = dpcourse.run(one_rank, world_size=1, timeout=200)[0]
    print("one GPU done", flush=True)
    with slow_link(True):  # the ranks inherit the environment: NCCL over sockets
        results = dpcourse.run(slow_rank, out_dir, world_size=2, timeout=400)
    record["slow_link"] = dict(results[0], timeline={v: [r["timeline"][v] for r in results]
                                                     for v in results[0]["timeline"]})
    record["slow_link"]["nccl_env"] = dict(SLOW_LINK_ENV)
    gpu = slug(env.get("gpus", ["cpu"])[0]) if backend == "nccl" else "cpu"
    nv, slow, one = record["nvlink"], record["slow_link"], record["one_gpu"]
    head = {k: record[k] for k in ("model", "environment")}
    per_lesson = {
        "05": {"many_small_messages": nv["many_small_messages"],
               "gpt2_grad_messages": nv["gpt2_grad_messages"], "bucket_sweep": nv["bucket_sweep"]},
        "06": {"nvlink": {k: nv[k] for k in ("variants", "step_parts", "timeline")},
               "slow_link": {k: slow[k] for k in ("variants", "step_parts", "timeline")}},
        "08": {"one_gpu": one["variants"], "nvlink": nv["variants"], "slow_link": slow["variants"]},
        "09": {"allreduce_sweep": nv["allreduce_sweep"], "mlp_step_sweep": nv["mlp_step_sweep"],
               "slow_link_allreduce_sweep": slow["allreduce_sweep"]},
    }
    os.makedirs(out_dir, exist_ok=True)
    for lesson, data in per_lesson.items():
        path = os.path.join(out_dir, f"lesson{lesson}-{world_size}x-{gpu}.json")
        with open(path, "w") as f:
            json.dump(dict(head, lesson=lesson, **data), f, default=to_json)
        print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
