"""Check the NVLink kernels against ``dist.all_reduce`` in processes started by torchrun.

Small enough to run under ``compute-sanitizer`` (one process per GPU)::

    torchrun --nproc-per-node 2 -m dpcourse.comm.kernels.selfcheck --numel 1000,4097 --calls 20

Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from dpcourse.comm.kernels import (one_shot_all_reduce, release_workspaces,
                                   require_multicast_off, two_shot_all_reduce)

KERNELS = {"one_shot": one_shot_all_reduce, "two_shot": two_shot_all_reduce}


def count_wrong_calls(numel: int, calls: int, dtype: torch.dtype) -> int:
    """Run ``calls`` back-to-back calls of each kernel on integer data; return mismatches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(rank)
    base = torch.randint(-8, 9, (numel,), generator=g).to(dtype).to(dev)
    ref = base.clone()
    dist.all_reduce(ref)
    bad = 0
    for name, fn in KERNELS.items():
        out = torch.empty(calls, numel, dtype=dtype, device=dev)
        x = torch.empty_like(base)
        for i in range(calls):  # no host synchronisation between calls
            torch.add(base, i % 16, out=x)
            fn(x)
            out[i].copy_(x)
        want = ref + world * (torch.arange(calls, device=dev) % 16).to(dtype)[:, None]
        wrong = (out != want).any(dim=1).nonzero().flatten().tolist()
        if wrong:
            print(f"rank {rank}: {name} {dtype} numel {numel}: wrong after calls {wrong[:10]}",
                  flush=True)
        bad += len(wrong)
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", default="1000", help="comma-separated lengths")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    require_multicast_off()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        numels = [int(v) for v in args.numel.split(",")]
        bad = sum(count_wrong_calls(n, args.calls, d)
                  for n in numels for d in (torch.float32, torch.bfloat16))
        flag = torch.tensor([bad], device="cuda")
        dist.all_reduce(flag)
        if dist.get_rank() == 0:
            print(f"selfcheck: {'OK' if flag.item() == 0 else 'FAILED'} "
                  f"({dist.get_world_size()} ranks, numel {args.numel}, {args.calls} calls)")
        torch.cuda.synchronize()
        return 0 if flag.item() == 0 else 1
    finally:
        release_workspaces()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
