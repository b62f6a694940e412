"""Record where the time of a small all-reduce goes: host time per call and GPU time per call.

``python -m dpcourse.comm.kernels.record OUT_DIR`` (on a machine with 2 or more
GPUs) writes ``lesson12-<N>x-<gpu>.json`` for lesson 12: for NCCL, our kernels
and PyTorch's symmetric-memory ops, at a few sizes,

* ``host_us``: host time per call, launching back to back without waiting
  (what the CPU spends in Python, checks and the launch);
* ``device_us``: GPU time per call, summed over the kernels the profiler saw
  (waiting for the peer's flags included);

and, for 20 calls queued back to back on a tensor in symmetric memory
(:func:`queued_launch_paths`), the time per call to completion of our
two-shot through :func:`two_shot_all_reduce`, of the same compiled kernel
launched through Triton's runner and with nothing around Triton's launcher,
of an empty kernel launched the same way, and of PyTorch's
``two_shot_all_reduce_``.

The bandwidth sweep itself comes from ``dpcourse bench allreduce``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import dpcourse
from dpcourse.bench.report import environment, slug
from dpcourse.bench.timing import device_name

SIZES = (4 << 10, 256 << 10, 16 << 20)


def _impls() -> dict:
    from dpcourse.comm.kernels.bench_impls import kernel_impls

    return {"library": lambda t, group=None: dist.all_reduce(t, group=group), **kernel_impls()}


def bare_one_shot(x: torch.Tensor):
    """Return ``fn()`` that relaunches the compiled one-shot kernel on ``x`` with no Python checks.

    Measures what the launch itself costs: the same kernel and arguments as
    :func:`one_shot_all_reduce`, alternating the buffer halves, but no argument
    checks, no workspace lookup and no Triton dispatch. The launcher is given
    the tensors themselves; :func:`launch_only` gives it addresses, as a plan does.
    """
    from dpcourse.comm.kernels import allreduce as ar
    from dpcourse.comm.kernels import triton_allreduce as tk
    from dpcourse.comm.kernels.workspace import get_workspace

    n, element = x.numel(), x.element_size()
    ws = get_workspace(2 * n * element, None, x.device)
    block = ar.block_elems(x.dtype)
    grid = ar.grid_size(n, block, min(ar.ONE_SHOT_MAX_BLOCKS, ws.max_blocks))
    args = [(x, half, ws.deltas(element), ws.pad, ws.pad_deltas, n, ws.rank, ws.world_size, block)
            for half in ws.halves(x.dtype, n)]
    compiled = tk.one_shot_kernel[(grid,)](*args[ws.calls % 2][:6], RANK=ws.rank,
                                           WORLD=ws.world_size, BLOCK=block,
                                           num_warps=ar.NUM_WARPS)
    ws.calls += 1
    launch = compiled[(grid, 1, 1)]

    def fn(tensor=None, group=None):
        launch(*args[ws.calls % 2])
        ws.calls += 1

    fn()  # fails here, not in the timing loop, if the launcher wants other arguments
    torch.cuda.synchronize()
    return fn


def host_and_device_times(sizes=SIZES, calls: int = 200) -> list[dict]:
    """Return one row per (impl, size): ``host_us`` and ``device_us`` per call (every rank)."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for size in sizes:
        x = torch.zeros(size // 2, dtype=torch.bfloat16, device=dev)
        impls = _impls()
        try:
            impls["one_shot_bare_launch"] = bare_one_shot(x)
        except Exception as err:  # noqa: BLE001 - an experiment: record why it did not run
            rows.append({"impl": "one_shot_bare_launch", "nbytes": size, "error": repr(err)})
        for name, fn in impls.items():
            for _ in range(20):
                fn(x)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x)
            host = (time.perf_counter() - t0) / calls
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn(x)
                torch.cuda.synchronize()
            gpu = sum(e.device_time_total for e in prof.key_averages()
                      if e.device_time_total > 0 and not e.key.startswith("Memset"))
            rows.append({"impl": name, "nbytes": size, "host_us": host * 1e6,
                         "device_us": gpu / calls, "device": device_name(dev)})
            dist.barrier()
    return rows


def _plan_of(x: torch.Tensor, kernel=None):
    """Return the plan ``two_shot_all_reduce(x, kernel=kernel)`` binds (making one call)."""
    from dpcourse.comm.kernels import allreduce as ar
    from dpcourse.comm.kernels.workspace import PLANS

    ar.two_shot_all_reduce(x, kernel=kernel)
    return PLANS[ar._plan_key(ar.TWO_SHOT, x, None, ar.TWO_SHOT_MAX_BLOCKS, kernel)]


def launch_only(x: torch.Tensor, kernel=None):
    """Return ``fn()`` making the launch of ``two_shot_all_reduce(x, kernel=kernel)``'s plan alone.

    ``x`` comes from :func:`symmetric_empty`. One call binds the plan; ``fn()`` then
    calls its launcher with the arguments the plan would pass, without the Python of
    :func:`two_shot_all_reduce` around it: no plan lookup, no checks.
    """
    plan = _plan_of(x, kernel)
    c_launch, grid, tail, device = plan.c_launch, plan.grid, plan.tails[0], plan.device

    def fn(tensor=None, group=None):
        c_launch(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), *tail)

    torch.cuda.synchronize()
    return fn


def triton_runner(x: torch.Tensor):
    """Return ``fn()`` launching the plan's compiled kernel through Triton's own runner.

    ``compiled[(grid, 1, 1)](*args, stream=stream)`` with the plan's arguments: how
    the plans launched before they called the launcher directly
    (:class:`~dpcourse.comm.kernels.triton_launch.DirectLaunch`).
    """
    plan = _plan_of(x)
    launcher, device = plan.launcher, plan.device
    runner = launcher.compiled[(plan.grid, 1, 1)]
    args = plan.tails[0][len(launcher.head):]

    def fn(tensor=None, group=None):
        runner(*args, stream=torch._C._cuda_getCurrentRawStream(device))

    torch.cuda.synchronize()
    return fn


def queued_launch_paths(sizes=SIZES[:2], calls: int = 20, trials: int = 15) -> list[dict]:
    """Return one row per (path, size): time per call of ``calls`` queued calls (every rank).

    Medians of ``trials`` interleaved trials: ``per_call_us`` from the first launch until
    the GPU finished the last, ``host_us`` until the host had issued the last. Timed here,
    not with :func:`dpcourse.bench.timing.time_interleaved`, which records GPU events
    only: the host's own time is what this measures.
    """
    from dpcourse.comm.kernels import triton_allreduce as tk
    from dpcourse.comm.kernels.allreduce import two_shot_all_reduce
    from dpcourse.comm.kernels.bench_impls import kernel_impls
    from dpcourse.comm.kernels.workspace import symmetric_empty

    rows = []
    for size in sizes:
        x = symmetric_empty(size // 2, dtype=torch.bfloat16)
        x.zero_()
        torch_two_shot = kernel_impls()["torch_two_shot"]
        paths = {"two_shot_all_reduce": lambda: two_shot_all_reduce(x),
                 "two_shot_triton_runner": triton_runner(x),
                 "two_shot_kernel_launch_only": launch_only(x),
                 "empty_kernel_launch_only": launch_only(x, tk.empty_kernel),
                 "torch_two_shot": lambda: torch_two_shot(x)}
        for fn in paths.values():
            for _ in range(20):
                fn()
        times: dict[str, list] = {name: [] for name in paths}
        for _ in range(trials):
            for name, fn in paths.items():
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                issued = time.perf_counter()
                torch.cuda.synchronize()
                times[name].append(((time.perf_counter() - t0) / calls, (issued - t0) / calls))
        for name, t in times.items():
            rows.append({"impl": name, "nbytes": size, "calls_per_trial": calls,
                         "per_call_us": sorted(a for a, _ in t)[trials // 2] * 1e6,
                         "host_us": sorted(b for _, b in t)[trials // 2] * 1e6})
        del x, paths
        torch.cuda.synchronize()
        dist.barrier()
    return rows


def main(out_dir: str) -> int:
    world = torch.cuda.device_count()
    env = environment("nccl", world)
    rows = dpcourse.run(host_and_device_times, world_size=world, backend="nccl", timeout=300)
    queued = dpcourse.run(queued_launch_paths, world_size=world, backend="nccl", timeout=300)
    import triton

    env["triton"] = triton.__version__
    payload = {"what": "host and GPU time per all-reduce call, bf16", "environment": env,
               "rows_per_rank": rows, "queued_rows_per_rank": queued}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"lesson12-{world}x-{slug(rows[0][0]['device'])}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    for r in rows[0]:
        if "error" in r:
            print(r)
            continue
        print(f"{r['impl']:20s} {r['nbytes']:>9d} B  host {r['host_us']:6.1f} us  "
              f"GPU {r['device_us']:7.1f} us")
    for r in queued[0]:
        print(f"{r['impl']:28s} {r['nbytes']:>9d} B  queued: {r['per_call_us']:6.1f} us per call, "
              f"host {r['host_us']:6.1f} us")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("docs", "results")))
