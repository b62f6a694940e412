"""All-reduce bandwidth sweeps: the hand-built collectives against the library's, on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.bench.records import AllReduceRow
from dpcourse.bench.timing import device_name, summarize, time_interleaved
from dpcourse.comm import naive_all_reduce, ring_all_reduce
from dpcourse.costmodel.alphabeta import bus_factor
from dpcourse.device import rank_device


def allreduce_impls() -> dict:
    """Return the named all-reduce implementations a sweep can compare.

    Returns:
        ``{name: fn(tensor, group=...)}``: ``"library"`` (``dist.all_reduce``: NCCL or
        gloo's own), ``"ring"`` (the ring the lessons build) and ``"naive"`` (through rank 0).
    """
    return {
        # A lambda, so dist.all_reduce is looked up at call time (CommTrace can see it).
        "library": lambda t, group=None: dist.all_reduce(t, group=group),
        "ring": ring_all_reduce,
        "naive": naive_all_reduce,
    }


def _resolve(impls) -> dict:
    known = allreduce_impls()
    if isinstance(impls, dict):
        return dict(impls)
    out = {}
    for name in impls:
        if name not in known:
            from dpcourse.comm.kernels.bench_impls import kernel_impls  # GPU-only rows

            gpu = kernel_impls()
            if name not in gpu:
                raise ValueError(f"unknown all-reduce impl {name!r}: choose from "
                                 f"{sorted(known) + sorted(gpu)} or pass a dict {{name: fn}}.")
            known[name] = gpu[name]
        out[name] = known[name]
    return out


def _repeated(fn, tensor: torch.Tensor, group, calls: int):
    """Return a function that calls ``fn(tensor, group=group)`` ``calls`` times back to back."""
    if calls == 1:
        return lambda: fn(tensor, group=group)

    def trial():
        for _ in range(calls):
            fn(tensor, group=group)
    return trial


def allreduce_sweep(sizes, impls=("ring", "library"), *, warmup: int = 3, iters: int = 10,
                    dtype=torch.float32, group=None,
                    calls_per_trial: int = 1) -> list[AllReduceRow]:
    """Time all-reduce implementations over message sizes; call on every rank of ``group``.

    For each size, every implementation gets ``warmup`` untimed calls, then
    ``iters`` timed trials interleaved with the other implementations'.
    Bandwidths are in bytes/s: ``algbw = nbytes / median_s`` and
    ``busbw = algbw * 2 (N - 1) / N``, the rate each rank's link actually
    carries in a ring, comparable with the link's speed for any ``N``.

    With ``calls_per_trial=1`` a trial is one call right after a barrier: its
    latency, launch and the ranks' arrival skew included. With ``k > 1`` a
    trial is ``k`` calls back to back, its time divided by ``k``: the rate at
    which calls complete when they queue up (as DDP's bucket all-reduces do),
    where the host's launch of one call overlaps the GPU's work on the last.

    Args:
        sizes: message sizes in bytes (rounded down to whole elements, at least one).
        impls: names from :func:`allreduce_impls`, or a dict ``{name: fn(tensor, group=...)}`` (e.g. your own ring).
        warmup: untimed calls per implementation and size.
        iters: timed trials per implementation and size.
        dtype: element type of the message.
        group: the process group; ``None`` means the default group.
        calls_per_trial: calls timed together in each trial (see above).

    Returns:
        One :class:`~dpcourse.bench.records.AllReduceRow` per (size, impl), identical on
        every rank: ``impl``, ``nbytes``, ``numel``, ``dtype``, ``world_size``,
        ``backend``, ``device``, ``median_s``, ``min_s``, ``max_s``, ``p25_s``, ``p75_s``,
        ``trials``, ``latency_us`` (the median in microseconds), ``algbw``, ``busbw`` and,
        when ``"library"`` is among the impls, ``vs_library`` (library median / this
        median: the bandwidth ratio; else None), and ``calls_per_trial``.
    """
    if calls_per_trial < 1:
        raise ValueError(f"calls_per_trial must be at least 1, got {calls_per_trial}.")
    fns = _resolve(impls)
    world_size = dist.get_world_size(group)
    device = rank_device(group)
    element = torch.empty((), dtype=dtype).element_size()
    rows = []
    for size in sizes:
        numel = max(1, int(size) // element)
        # Values never change the speed; zeros stay finite however often they are summed.
        tensor = torch.zeros(numel, dtype=dtype, device=device)
        calls = {name: _repeated(fn, tensor, group, calls_per_trial) for name, fn in fns.items()}
        times = time_interleaved(calls, warmup=warmup, iters=iters, group=group, device=device)
        for name in fns:
            timing = summarize([t / calls_per_trial for t in times[name]])
            algbw = numel * element / timing.median_s
            rows.append(AllReduceRow(
                **timing, impl=name, nbytes=numel * element, numel=numel,
                dtype=str(dtype).replace("torch.", ""), world_size=world_size,
                backend=dist.get_backend(group), device=device_name(device),
                latency_us=timing.median_s * 1e6, algbw=algbw,
                busbw=algbw * bus_factor(world_size), calls_per_trial=calls_per_trial))
        if "library" in fns:  # speed relative to the library at this size (>1: faster)
            library = next(r.median_s for r in rows[-len(fns):] if r.impl == "library")
            for row in rows[-len(fns):]:
                row.vs_library = library / row.median_s
        del tensor, calls
    return rows
