"""Lesson 10: BatchNorm statistics drift apart under data parallelism; SyncBatchNorm restores
the single-process model on the global batch, at two all-reduces per layer per step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.data import shard_batch
from dpcourse.ddp.sync_batchnorm import convert_sync_batchnorm
from fixture_models import BatchNormMLP
from ddp_helpers import global_batch, make_wrapper, state_of


def bn_runs(kind: str, steps: int = 3) -> dict:
    """Plain BN and SyncBN under our wrapper; states and all-reduces per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = BatchNormMLP(seed=0)
    plain = make_wrapper(kind, copy.deepcopy(base))
    synced = make_wrapper(kind, convert_sync_batchnorm(copy.deepcopy(base)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, synced)]
    out = {"plain": [], "sync": []}
    for step in range(steps):
        xs, ys = global_batch("batchnorm", step)
        xs = xs * (1 + rank)  # shards with different statistics, as real shards have
        for name, model in (("plain", plain), ("sync", synced)):
            with CommTrace() as trace:
                F.mse_loss(model(shard_batch(xs, rank, world)),
                           shard_batch(ys, rank, world)).backward()
            out.setdefault(f"comm_{name}", []).append(trace.count("all_reduce"))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["plain"].append(state_of(plain))
        out["sync"].append(state_of(synced))
    return out


def single_process_reference(steps: int, world: int) -> list[dict]:
    """One process, one BatchNorm, the global batch assembled from every rank's shard."""
    solo = BatchNormMLP(seed=0)
    opt = torch.optim.SGD(solo.parameters(), lr=0.1)
    states = []
    for step in range(steps):
        xs, ys = global_batch("batchnorm", step)
        x = torch.cat([shard_batch(xs * (1 + r), r, world) for r in range(world)])
        y = torch.cat([shard_batch(ys, r, world) for r in range(world)])
        F.mse_loss(solo(x), y).backward()
        opt.step()
        opt.zero_grad()
        states.append(state_of(solo))
    return states


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    world = request.param
    runs = dpcourse.run(bn_runs, "overlapped", world_size=world, backend="gloo")
    return runs, single_process_reference(3, world)


def test_sync_batchnorm_equals_one_process_on_the_global_batch(results):
    runs, single = results
    for r in runs:
        for mine, ref in zip(r["sync"], single):
            for n in ref:
                assert torch.allclose(mine[n].float(), ref[n].float(), rtol=1e-4, atol=1e-5), n


def test_plain_batchnorm_statistics_drift_apart(results):
    runs, single = results
    last = [r["plain"][-1]["norm.running_mean"] for r in runs]
    assert (last[1] - last[0]).abs().max() > 0.05          # ranks disagree
    assert (last[0] - single[-1]["norm.running_mean"]).abs().max() > 0.05  # and miss the truth


def test_sync_batchnorm_costs_two_all_reduces_per_layer_per_step(results):
    runs, _ = results
    for r in runs:
        assert [s - p for s, p in zip(r["comm_sync"], r["comm_plain"])] == [2, 2, 2]
