"""Fair timing of several candidates on every rank: interleaved trials, warm-up excluded.

Timing one candidate for all its trials and then the next lets clock boosts,
thermal state, caches and other tenants favour whichever ran first. Here the
trials are interleaved (round robin, with the starting candidate rotated each
round), warm-up calls are never counted, GPU work is timed with CUDA events
(the host returns before the GPU is done), and every trial starts behind a
barrier so that one rank arriving late is not billed as communication time.
A collective is as slow as its slowest rank, so each trial keeps the maximum
over ranks.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dpcourse.bench.records import Timing
from dpcourse.device import rank_device, synchronize


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def time_interleaved(fns: dict, *, warmup: int = 2, iters: int = 10, group=None,
                     device=None) -> dict[str, list[float]]:
    """Time each ``fn()`` in ``fns`` ``iters`` times, trials interleaved; return seconds per trial.

    Must be called on every rank of ``group`` with the same ``fns`` keys.

    Args:
        fns: ``{name: fn}``; each ``fn`` takes no arguments.
        warmup: untimed calls of each function first (connections, allocator, autotuning).
        iters: timed trials of each function.
        group: the process group to synchronize with; ``None`` means the default group.
        device: the device whose clock counts (default: this rank's device).

    Returns:
        ``{name: [seconds of trial 0, ...]}``; each entry is the slowest rank's time
        for that trial, identical on every rank.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}.")
    device = torch.device(device) if device is not None else rank_device(group)
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    synchronize(device)
    cuda = device.type == "cuda"
    raw: dict[str, list] = {name: [] for name in names}
    for trial in range(iters):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            if _distributed():
                dist.barrier(group=group)
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                raw[name].append((start, end))
            else:
                t0 = time.perf_counter()
                fns[name]()
                raw[name].append(time.perf_counter() - t0)
    if cuda:
        synchronize(device)
        raw = {n: [s.elapsed_time(e) / 1e3 for s, e in v] for n, v in raw.items()}
    times = torch.tensor([raw[n] for n in names], dtype=torch.float64, device=device)
    if _distributed():
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[i].tolist() for i, name in enumerate(names)}


def summarize(seconds: list[float]) -> Timing:
    """Reduce trial times to the statistics every benchmark row carries.

    Args:
        seconds: trial durations.

    Returns:
        A :class:`~dpcourse.bench.records.Timing`: ``median_s``, ``min_s``, ``max_s``,
        ``p25_s``, ``p75_s`` (quartiles; the interquartile range is the spread to quote)
        and ``trials``; it reads like a dict too (``summarize(t)["median_s"]``).
    """
    if not seconds:
        raise ValueError("no trial times to summarize.")
    if len(seconds) > 1:
        p25, _, p75 = statistics.quantiles(seconds, n=4, method="inclusive")
    else:
        p25 = p75 = seconds[0]
    return Timing(median_s=statistics.median(seconds), min_s=min(seconds), max_s=max(seconds),
                  p25_s=p25, p75_s=p75, trials=len(seconds))


def device_name(device: torch.device) -> str:
    """Return a human name for ``device`` (the GPU model, or the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
