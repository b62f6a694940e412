"""Lessons 10-11 on GPUs over NCCL (skipped without 2 CUDA devices): Join, comm hooks
(PowerSGD over several rebuilt buckets included), the reducer options, and torch's own
nn.SyncBatchNorm under our wrappers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join

import dpcourse
from dpcourse.data import shard_batch
from fixture_models import BatchNormMLP
from ddp_helpers import global_batch, loss_of, make_wrapper, state_of
from hook_helpers import hook_and_state
from reducer_helpers import build

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA devices")]

# name -> (wrapper, model, our kwargs, torch kwargs, hook)
CASES = {
    "powersgd-rebuilt-buckets": ("overlapped", "deep_mlp",
                                 {"rebuild_buckets": True, "bucket_cap_mb": 0.002},
                                 {"bucket_cap_mb": 0.002}, "powersgd"),
    "bf16-hook": ("overlapped", "gpt", {"bucket_cap_mb": 0.004}, {"bucket_cap_mb": 0.004}, "bf16"),
    "fp16-hook": ("bucketed", "gpt", {}, {}, "fp16"),
    "unused": ("overlapped", "unused", {"find_unused_parameters": True, "bucket_cap_mb": 0.0},
               {"find_unused_parameters": True}, None),
    "static-graph": ("overlapped", "unused", {"static_graph": True}, {"static_graph": True}, None),
    "no-bucket-view": ("overlapped", "gpt", {"gradient_as_bucket_view": False}, {}, None),
}
TOL = {None: 1e-5, "powersgd": 1e-4, "bf16": 2e-2, "fp16": 2e-3}


def against_torch_on_nccl(case: str, steps: int = 5) -> float:
    """Largest parameter difference to torch DDP over ``steps`` steps (hooks run on both)."""
    kind, name, ours, theirs, hook = CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    base = build(name).to(dev)
    model = make_wrapper(kind, copy.deepcopy(base), **ours)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[rank],
                                                    **theirs)
    if hook:
        model.register_comm_hook(*hook_and_state(hook))
        ref.register_comm_hook(*hook_and_state(hook))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    data = "mlp" if name == "unused" else name
    worst = 0.0
    for step in range(steps):
        xs, ys = global_batch(data, step)
        x, y = shard_batch(xs, rank, world).to(dev), shard_batch(ys, rank, world).to(dev)
        for m in (model, ref):
            loss_of(data, m, x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        a, b = state_of(model), state_of(ref)
        worst = max(worst, max((a[n] - b[n]).abs().max().item() for n in a))
    return worst


def join_on_nccl(counts) -> float:
    """Ours and torch DDP under Join with uneven batch counts: largest final difference."""
    rank = dist.get_rank()
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(50 + rank)
    batches = [(torch.randn(4, 8, generator=g).to(dev), torch.randn(4, 1, generator=g).to(dev))
               for _ in range(counts[rank])]
    base = BatchNormMLP(seed=0).to(dev)
    states = []
    for model in (make_wrapper("overlapped", copy.deepcopy(base), bucket_cap_mb=0.0005),
                  torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                            device_ids=[rank])):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([model]):
            for x, y in batches:
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        states.append(state_of(model))
    return max((states[0][n].float() - states[1][n].float()).abs().max().item()
               for n in states[0])


def torch_sync_batchnorm_under_ours(steps: int = 3) -> float:
    """torch's nn.SyncBatchNorm inside our wrapper vs one process on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    base = BatchNormMLP(seed=0)
    model = make_wrapper("overlapped", torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        copy.deepcopy(base)).to(dev))
    solo = copy.deepcopy(base).to(dev)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, solo)]
    for step in range(steps):
        xs, ys = (t.to(dev) for t in global_batch("batchnorm", step))
        F.mse_loss(model(shard_batch(xs, rank, world)), shard_batch(ys, rank, world)).backward()
        F.mse_loss(solo(xs), ys).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    a, b = state_of(model), state_of(solo)
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def all_nccl_checks() -> dict:
    """Every check of this file in one launch (each launch starts NCCL anew)."""
    out = {case: against_torch_on_nccl(case) for case in CASES}
    out["join"] = join_on_nccl([5, 2])
    out["sync_batchnorm"] = torch_sync_batchnorm_under_ours()
    return out


@pytest.fixture(scope="module")
def results():
    return dpcourse.run(all_nccl_checks, world_size=2, backend="nccl", timeout=180)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reducer_options_and_hooks_match_torch_ddp_on_nccl(results, case):
    worst = [r[case] for r in results]
    assert max(worst) <= TOL[CASES[case][4]], worst


def test_join_matches_torch_ddp_on_nccl(results):
    assert max(r["join"] for r in results) < 1e-5


def test_torch_sync_batchnorm_works_under_our_wrapper(results):
    assert max(r["sync_batchnorm"] for r in results) < 1e-4
