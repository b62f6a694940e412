"""Read a torch.profiler Chrome trace of one training step into GPU phase spans and collectives.

The lessons' recorded timelines (lesson 06) come from here: which GPU kernels
ran during forward, backward and the optimizer step, and when the NCCL
kernels ran beside them.
"""

from __future__ import annotations

import json

STEP_PHASES = ("forward", "backward", "optimizer")


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
              if e.get("cat") == "user_annotation" and e.get("name") in STEP_PHASES}
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
    spans = [(p, busy[p][0][0], busy[p][-1][1]) for p in STEP_PHASES if p in busy]
    return {"spans": spans, "busy": busy, "events": sorted(comm, key=lambda c: c["start"]),
            "n_kernels": len(kernels)}
