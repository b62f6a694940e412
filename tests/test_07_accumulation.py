"""Lesson 07: gradient accumulation with no_sync equals one step on a K*A times larger batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.data import shard_batch
from ddp_helpers import (GLOBAL_BATCH, assert_three_ways_agree, global_batch, loss_of,
                         make_model, make_wrapper, train_three_ways)

# (wrapper, model, micro-steps A, wrapper kwargs): a different model for each wrapper.
CASES = [("naive", "frozen_bias", 2, {}), ("bucketed", "gpt", 3, {"bucket_cap_mb": 0.004}),
         ("overlapped", "deep_mlp", 2, {"bucket_cap_mb": 0.002}),
         ("overlapped", "tied", 3, {"bucket_cap_mb": 0.0})]


def _key(case) -> str:
    return f"{case[0]}-{case[1]}-A{case[2]}"


def _comm_per_micro_step(kind: str, name: str, kwargs: dict, accumulation: int = 3) -> dict:
    """Collectives issued by each micro-step; then an explicit finish after no_sync, twice."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_wrapper(kind, make_model(name), **kwargs)
    expected = len(getattr(model, "buckets", [p for p in model.parameters() if p.requires_grad]))
    xs, ys = global_batch(name, 0, GLOBAL_BATCH * accumulation)
    counts = []
    for micro in range(accumulation):
        sl = slice(micro * GLOBAL_BATCH, (micro + 1) * GLOBAL_BATCH)
        x, y = shard_batch(xs[sl], rank, world), shard_batch(ys[sl], rank, world)
        with CommTrace() as trace:
            if micro < accumulation - 1:
                with model.no_sync():
                    (loss_of(name, model, x, y) / accumulation).backward()
            else:
                (loss_of(name, model, x, y) / accumulation).backward()
        counts.append(len(trace.events))
    # Explicit synchronisation of gradients accumulated under no_sync.
    model.module.zero_grad()
    x, y = shard_batch(xs[:GLOBAL_BATCH], rank, world), shard_batch(ys[:GLOBAL_BATCH], rank, world)
    with model.no_sync():
        loss_of(name, model, x, y).backward()
    with CommTrace() as trace:
        model.finish_gradient_synchronization()
        explicit = [trace.count("all_reduce")]
        model.finish_gradient_synchronization()
        explicit.append(trace.count("all_reduce"))
    ref = torch.nn.parallel.DistributedDataParallel(make_model(name))
    loss_of(name, ref, x, y).backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in
               zip(model.parameters(), ref.parameters()) if p.requires_grad)
    return {"counts": counts, "expected": expected, "explicit": explicit, "explicit_diff": diff}


def _unscaled_loss_is_a_times_too_large() -> float:
    """Skip dividing the loss by A and the accumulated gradient is A times the big-batch one."""
    rank, world, A = dist.get_rank(), dist.get_world_size(), 2
    model = make_wrapper("bucketed", make_model("mlp"), bucket_cap_mb=0.0)
    solo = make_model("mlp")
    xs, ys = global_batch("mlp", 0, GLOBAL_BATCH * A)
    for micro in range(A):
        sl = slice(micro * GLOBAL_BATCH, (micro + 1) * GLOBAL_BATCH)
        x, y = shard_batch(xs[sl], rank, world), shard_batch(ys[sl], rank, world)
        if micro < A - 1:
            with model.no_sync():
                loss_of("mlp", model, x, y).backward()
        else:
            loss_of("mlp", model, x, y).backward()
    loss_of("mlp", solo, xs, ys).backward()
    ratios = [(p.grad.norm() / q.grad.norm()).item()
              for p, q in zip(model.parameters(), solo.parameters())]
    return max(abs(r - A) for r in ratios)


def accumulation_checks() -> dict:
    """Every multi-rank check of this lesson on one rank."""
    out = {"train": {_key(c): train_three_ways(c[0], c[1], steps=3, wrapper_kwargs=c[3],
                                               accumulation=c[2]) for c in CASES}}
    out["comm"] = {_key(c): _comm_per_micro_step(c[0], c[1], c[3]) for c in CASES}
    out["unscaled"] = _unscaled_loss_is_a_times_too_large()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return dpcourse.run(accumulation_checks, world_size=request.param, backend="gloo")


@pytest.mark.parametrize("case", [_key(c) for c in CASES])
def test_accumulation_equals_one_large_batch(results, case):
    # torch DDP runs the same no_sync loop; the single process takes one step on K*A*b examples.
    assert_three_ways_agree([r["train"][case] for r in results], label=case)


@pytest.mark.parametrize("case", [_key(c) for c in CASES])
def test_no_communication_inside_no_sync(results, case):
    for r in results:
        c = r["comm"][case]
        assert c["counts"] == [0, 0, c["expected"]]


@pytest.mark.parametrize("case", [_key(c) for c in CASES])
def test_explicit_finish_after_no_sync_communicates_once(results, case):
    for r in results:
        c = r["comm"][case]
        assert c["explicit"] == [c["expected"], c["expected"]]
        assert c["explicit_diff"] < 1e-6


def test_loss_must_be_divided_by_the_number_of_micro_steps(results):
    for r in results:
        assert r["unscaled"] < 1e-4
