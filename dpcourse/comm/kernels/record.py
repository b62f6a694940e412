"""Record where the time of a small all-reduce goes: host time per call and GPU time per call.

``python -m dpcourse.comm.kernels.record OUT_DIR`` (on a machine with 2 or more
GPUs) writes ``lesson12-<N>x-<gpu>.json`` for lesson 12: for NCCL, our kernels
and PyTorch's symmetric-memory ops, at a few sizes,

* ``host_us``: host time per call, launching back to back without waiting
  (what the CPU spends in Python, checks and the launch);
* ``device_us``: GPU time per call, summed over the kernels the profiler saw
  (waiting for the peer's flags included).

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
    checks, no workspace lookup and no Triton dispatch.
    """
    from dpcourse.comm.kernels import allreduce as ar
    from dpcourse.comm.kernels import triton_allreduce as tk
    from dpcourse.comm.kernels.workspace import get_workspace

    n, element = x.numel(), x.element_size()
    ws = get_workspace(2 * n * element, None, x.device)
    block = ar.block_elems(x.dtype)
    grid = ar.grid_size(n, block, min(ar.ONE_SHOT_MAX_BLOCKS, ws.max_blocks))
    half_len = (ws.nbytes // 2) // element
    args = [(x, ws.view(x.dtype, n, offset=h * half_len), ws.deltas(element), ws.pad,
             ws.pad_deltas, n, ws.rank, ws.world_size, block) for h in (0, 1)]
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


def main(out_dir: str) -> int:
    world = torch.cuda.device_count()
    env = environment("nccl", world)
    rows = dpcourse.run(host_and_device_times, world_size=world, backend="nccl", timeout=300)
    import triton

    env["triton"] = triton.__version__
    payload = {"what": "host and GPU time per all-reduce call, bf16", "environment": env,
               "rows_per_rank": rows}
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
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("docs", "results")))
