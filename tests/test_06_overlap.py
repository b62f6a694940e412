"""Lesson 06: DataParallelOverlapped starts all-reduces during backward and stays exact."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.data import shard_batch
from dpcourse.ddp import DataParallelBucketed, DataParallelOverlapped
from fixture_models import UnusedLayerMLP
from ddp_helpers import (assert_three_ways_agree, counting_all_reduce, global_batch, loss_of,
                         make_model, train_three_ways)

CASES = [("deep_mlp", 0.0), ("deep_mlp", 0.003), ("gpt", 25.0), ("gpt", 0.004),
         ("frozen_bias", 0.0002), ("tied", 0.0)]


def _timeline(kind: str, steps: int = 3) -> dict:
    """Issue times of the all-reduces relative to the end of backward, for a deep model."""
    cls = DataParallelOverlapped if kind == "overlapped" else DataParallelBucketed
    model = cls(make_model("deep_mlp"), bucket_cap_mb=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"counts": [], "before_end": [], "async": [], "n_buckets": len(model.buckets)}
    for step in range(steps):
        x, y = global_batch("deep_mlp", step)
        with CommTrace() as trace:
            model.trace = trace
            loss_of("deep_mlp", model, x, y).backward()
        end = dict(trace.marks)["backward_end"]
        events = trace.of("all_reduce")
        out["counts"].append(len(events))
        out["before_end"].append(sum(e.start < end for e in events))
        out["async"].append(all(e.async_op and e.end is not None for e in events))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 1)
    return out


def _custom_all_reduce() -> dict:
    calls = []

    counting = counting_all_reduce(calls)

    train = train_three_ways("overlapped", "gpt", steps=3,
                             wrapper_kwargs={"bucket_cap_mb": 0.004, "all_reduce": counting})
    n = len(DataParallelOverlapped(make_model("gpt"), bucket_cap_mb=0.004).buckets)
    return {"train": train, "calls": len(calls), "n_buckets": n}


def _errors() -> dict:
    errors = {}
    model = DataParallelOverlapped(UnusedLayerMLP(), bucket_cap_mb=0.0)
    x, y = global_batch("mlp", 0)
    try:
        loss_of("mlp", model, x, y).backward()
    except RuntimeError as exc:
        errors["unused"] = str(exc)
    # The wrapper recovers: freeze the unused layer in a fresh wrapper and train on.
    model = DataParallelOverlapped(make_model("mlp"), bucket_cap_mb=0.0)
    loss = loss_of("mlp", model, x, y)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    return errors


def _create_graph() -> dict:
    """A backward with ``create_graph=True`` (grad mode on in the hooks): averaged all the same."""
    x, y = global_batch("mlp", 0)
    out = {}
    for as_view in (True, False):
        model = DataParallelOverlapped(make_model("mlp"), bucket_cap_mb=0.0,
                                       gradient_as_bucket_view=as_view)
        loss_of("mlp", model, shard_batch(x), shard_batch(y)).backward(create_graph=True)
        local = make_model("mlp")
        loss_of("mlp", local, x, y).backward()  # the global batch: the average of the shards
        out[as_view] = dict(
            diff=max((p.grad - q.grad).abs().max().item()
                     for p, q in zip(model.parameters(), local.parameters())),
            buffers_require_grad=any(b.buffer.requires_grad for b in model.buckets))
    return out


def _discarded() -> dict:
    """A wrapper nobody holds is freed: its hooks on the module hold it weakly, then do nothing."""
    module = make_model("mlp")
    wrapper = DataParallelOverlapped(module, bucket_cap_mb=0.0)
    freed = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    x, y = global_batch("mlp", 0)
    with CommTrace() as trace:
        loss_of("mlp", module, x, y).backward()
    return dict(freed=freed() is None, all_reduces=trace.count("all_reduce"),
                grads=all(p.grad is not None for p in module.parameters()))


def overlap_checks() -> dict:
    """Every multi-rank check of this lesson on one rank."""
    out = {"train": {f"{n}@{c}": train_three_ways("overlapped", n, steps=5,
                                                 wrapper_kwargs={"bucket_cap_mb": c})
                     for n, c in CASES}}
    out["batchnorm"] = train_three_ways("overlapped", "batchnorm", steps=4, single=False,
                                        wrapper_kwargs={"bucket_cap_mb": 0.0})
    out["timeline"] = {k: _timeline(k) for k in ("overlapped", "bucketed")}
    out["custom"] = _custom_all_reduce()
    out["errors"] = _errors()
    out["create_graph"] = _create_graph()
    out["discarded"] = _discarded()
    from dpcourse import demo

    out["demo"] = demo.train(steps=3)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return dpcourse.run(overlap_checks, world_size=request.param, backend="gloo")


@pytest.mark.parametrize("case", [f"{n}@{c}" for n, c in CASES])
def test_matches_torch_ddp_and_single_process_every_step(results, case):
    assert_three_ways_agree([r["train"][case] for r in results], label=case)


def test_buffers_broadcast_at_each_forward_like_torch_ddp(results):
    assert_three_ways_agree([r["batchnorm"] for r in results], label="batchnorm")


def test_all_reduces_start_before_backward_ends(results):
    for r in results:
        t = r["timeline"]["overlapped"]
        n = t["n_buckets"]
        assert n == 12 and t["counts"] == [n] * 3
        # All but the first layer's buckets are on the wire before backward is over
        # (the first layer's weight and bias are the last gradients to arrive).
        assert all(k >= n - 2 for k in t["before_end"]), t["before_end"]
        assert all(t["async"])


def test_bucketed_waits_for_the_end_of_backward(results):
    for r in results:
        t = r["timeline"]["bucketed"]
        assert t["counts"] == [t["n_buckets"]] * 3 and t["before_end"] == [0, 0, 0]


def test_custom_synchronous_all_reduce_works(results):
    c = results[0]["custom"]
    assert c["n_buckets"] > 1 and c["calls"] == 3 * c["n_buckets"]
    assert_three_ways_agree([r["custom"]["train"] for r in results], label="all_reduce=")


def test_clear_errors(results):
    e = results[0]["errors"]
    assert "unused.weight" in e["unused"] and "unused.bias" in e["unused"]
    assert "fc1" not in e["unused"]
    assert "backward" in e["twice"] and "once" in e["twice"]


def test_a_create_graph_backward_averages_and_keeps_the_buckets_out_of_the_graph(results):
    for r in results:
        for as_view, c in r["create_graph"].items():
            assert c["diff"] < 1e-6, (as_view, c)
            assert not c["buffers_require_grad"], as_view


def test_a_discarded_wrapper_is_freed_and_its_hooks_do_nothing(results):
    for r in results:
        assert r["discarded"] == dict(freed=True, all_reduces=0, grads=True)


def test_demo_trains_every_wrapper_like_torch_ddp(results):
    from dpcourse.demo import format_rows

    rows = results[0]["demo"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert set(r["max_diff"]) == {"DataParallelNaive", "DataParallelBucketed",
                                      "DataParallelOverlapped"}
        assert max(r["max_diff"].values()) < 1e-5
        assert len(set(round(v, 4) for v in r["loss"].values())) == 1
    table = format_rows(rows, len(results), "gloo")
    assert "Overlapped" in table and len(table.splitlines()) == 2 + len(rows)


def test_wrapping_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        DataParallelOverlapped(make_model("mlp"))
