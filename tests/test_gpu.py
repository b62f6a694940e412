"""The same comparisons on GPUs over NCCL (skipped without at least 2 CUDA devices).

Collectives against ``dist.all_reduce`` and every data-parallel wrapper against
torch DDP and single-process training, with tensors on ``cuda:rank``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import (CommTrace, naive_all_reduce, ring_all_gather, ring_all_reduce,
                           ring_reduce_scatter)
from dpcourse.data import shard_batch
from ddp_helpers import global_batch, loss_of, make_model, make_wrapper, state_of

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA devices")]

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def collectives_on_nccl() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    out = []
    for n in sorted({0, 1, max(world - 1, 0), 2 * world + 1, 10007, 1 << 20}):
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(n * 10 + rank)
            x = torch.randint(-8, 9, (n,), generator=g).to(dtype).to(dev)
            ref = x.clone()
            dist.all_reduce(ref)
            for name, fn in (("ring", ring_all_reduce),
                             ("naive", naive_all_reduce)):
                got = x.clone()
                with CommTrace() as trace:
                    fn(got)
                    if name.startswith("ring"):
                        for _ in range(3):  # repeated calls stay correct (no ordering deadlock)
                            again = x.clone()
                            fn(again)
                            assert torch.equal(again, got)
                out.append((name, n, str(dtype), got.cpu(), ref.cpu(),
                            sorted(trace.collective_ops())))
            # the halves: reduce-scatter then all-gather is an all-reduce
            halves = x.clone()
            ring_reduce_scatter(halves)
            ring_all_gather(halves)
            out.append(("halves", n, str(dtype), halves.cpu(), ref.cpu(), []))
    return out


def wrappers_on_nccl(kind: str, name: str, kwargs: dict, steps: int = 5) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    base = make_model(name).to(dev)
    ours = make_wrapper(kind, copy.deepcopy(base), **kwargs)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[rank])
    solo = copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref, solo)]
    out = {"ours": [], "ddp": [], "single": []}
    for step in range(steps):
        xs, ys = (t.to(dev) for t in global_batch(name, step))
        for model in (ours, ref):
            loss_of(name, model, shard_batch(xs, rank, world), shard_batch(ys, rank, world)).backward()
        loss_of(name, solo, xs, ys).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for key, model in (("ours", ours), ("ddp", ref), ("single", solo)):
            out[key].append({k: v.cpu() for k, v in state_of(model).items()})
    return out


def test_collectives_match_nccl_all_reduce():
    for world in (1, 2):
        for name, n, dtype, got, ref, ops in dpcourse.run(collectives_on_nccl, world_size=world,
                                                          backend="nccl")[-1]:
            tol = TOL[getattr(torch, dtype.split(".")[-1])]
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol,
                                       msg=lambda m: f"{name} n={n} {dtype} world={world}: {m}")
            if name.startswith("ring"):
                assert ops == [], f"the ring must use only point-to-point ops, saw {ops}"


@pytest.mark.parametrize("kind,name,kwargs", [
    ("naive", "tied", {}),
    ("naive", "frozen_bias", {}),
    ("bucketed", "frozen_layer", {"bucket_cap_mb": 0.001}),
    ("overlapped", "gpt", {"bucket_cap_mb": 0.002}),
    ("overlapped", "tied", {"bucket_cap_mb": 0}),
    ("overlapped", "mlp", {"all_reduce": ring_all_reduce}),
])
def test_wrappers_match_torch_ddp_on_nccl(kind, name, kwargs):
    results = dpcourse.run(wrappers_on_nccl, kind, name, kwargs, world_size=2, backend="nccl")
    for rank, res in enumerate(results):
        for step in range(len(res["ours"])):
            for ref_name in ("ddp", "single"):
                for key, value in res["ours"][step].items():
                    torch.testing.assert_close(
                        value, res[ref_name][step][key], rtol=1e-4, atol=1e-5,
                        msg=lambda m, k=key, s=step, r=rank, rn=ref_name:
                        f"{kind}/{name} rank {r} step {s} {k} vs {rn}: {m}")
