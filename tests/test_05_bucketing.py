"""Lesson 05: bucket assignment; DataParallelBucketed against torch DDP and one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.ddp import DataParallelBucketed, assign_buckets
from dpcourse.ddp.buckets import MiB
from ddp_helpers import (assert_three_ways_agree, counting_all_reduce, global_batch, loss_of,
                         make_model, train_three_ways)

# (model, bucket_cap_mb): one bucket, several, one per parameter.
CASES = [("mlp", 25.0), ("mlp", 0.0005), ("frozen_layer", 0.0), ("tied", 0.0003), ("gpt", 0.004),
         ("gpt", 0.0)]


# -- assign_buckets: a pure function ------------------------------------------------


def _torch_assignment(tensors, cap_bytes):
    """torch DDP's own assignment, fed the parameters in the order their gradients arrive."""
    rev = list(reversed(tensors))
    buckets, _ = dist._compute_bucket_assignment_by_size(rev, [cap_bytes], [False] * len(rev))
    return [[len(tensors) - 1 - j for j in b] for b in buckets]


@pytest.mark.parametrize("cap_bytes", [0, 4, 16, 40, 10**9])
def test_assignment_matches_torch_ddp(cap_bytes):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.zeros(int(n)) for n in torch.randint(1, 9, (12,), generator=g)]
    assert assign_buckets(tensors, cap_bytes / MiB) == _torch_assignment(tensors, cap_bytes)


def test_bucket_closes_once_it_reaches_the_cap():
    assert assign_buckets([4, 4, 4], 8 / MiB) == [[2, 1], [0]]
    # The tensor that crosses the cap stays in the bucket: 4 + 6 > 8.
    assert assign_buckets([4, 6, 4], 8 / MiB) == [[2, 1], [0]]
    # A tensor larger than the cap is a bucket on its own.
    assert assign_buckets([4, 100, 4], 8 / MiB) == [[2, 1], [0]]
    assert assign_buckets([100, 4, 4], 8 / MiB) == [[2, 1], [0]]


def test_zero_cap_is_one_bucket_per_parameter_and_inf_is_one_bucket():
    assert assign_buckets([4, 4, 4], 0) == [[2], [1], [0]]
    assert assign_buckets([4, 4, 4], math.inf) == [[2, 1, 0]]
    assert assign_buckets([], 25) == []


def test_buckets_hold_one_dtype():
    ts = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(3),
          torch.zeros(1, dtype=torch.float64)]
    buckets = assign_buckets(ts, math.inf)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    for b in buckets:
        assert len({ts[i].dtype for i in b}) == 1


@pytest.mark.parametrize("bad,err", [(-1, ValueError), (float("nan"), ValueError),
                                     ("25", TypeError), (True, TypeError), (None, TypeError)])
def test_bad_bucket_cap_is_rejected(bad, err):
    with pytest.raises(err, match="bucket_cap_mb"):
        assign_buckets([4], bad)


# -- the wrapper, on several ranks ---------------------------------------------------


def _grads_are_views(model) -> bool:
    for bucket in model.buckets:
        lo = bucket.buffer.data_ptr()
        hi = lo + bucket.nbytes
        for p in bucket.params:
            if p.grad is None or not lo <= p.grad.data_ptr() < hi + (p.numel() == 0):
                return False
    return True


def _structure(name: str, cap: float) -> dict:
    """Collective counts and gradient storage of one wrapped model over two steps."""
    model = DataParallelBucketed(make_model(name), bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"names": [b.names for b in model.buckets], "nbytes": [b.nbytes for b in model.buckets],
           "dtypes": [str(b.buffer.dtype) for b in model.buckets], "counts": [], "bytes": [],
           "views": [], "first_after_backward": []}
    for step in range(2):
        x, y = global_batch(name, step)
        with CommTrace() as trace:
            model.trace = trace  # the wrapper marks "backward_end" on it
            loss_of(name, model, x, y).backward()
        out["counts"].append(trace.count("all_reduce"))
        out["bytes"].append(trace.bytes("all_reduce"))
        # Bucketed communication starts only once backward has produced every gradient.
        backward_end = dict(trace.marks)["backward_end"]
        out["first_after_backward"].append(trace.of("all_reduce")[0].start >= backward_end)
        out["views"].append(_grads_are_views(model))
        opt.step()
        opt.zero_grad(set_to_none=True)  # the next backward must re-point grads at the buckets
    out["trainable_bytes"] = sum(p.numel() * p.element_size()
                                 for p in model.parameters() if p.requires_grad)
    return out


def _custom_and_errors() -> dict:
    calls = []

    counting = counting_all_reduce(calls)

    train = train_three_ways("bucketed", "deep_mlp", steps=3,
                             wrapper_kwargs={"bucket_cap_mb": 0.002, "all_reduce": counting})
    n_buckets = len(DataParallelBucketed(make_model("deep_mlp"), bucket_cap_mb=0.002).buckets)
    errors = {}
    for bad in (-1.0, "big"):
        try:
            DataParallelBucketed(make_model("mlp"), bucket_cap_mb=bad)
        except (TypeError, ValueError) as exc:
            errors[repr(bad)] = f"{type(exc).__name__}: {exc}"
    mixed = make_model("mlp")
    mixed[2].double()
    dtypes = [{str(p.dtype) for p in b.params} for b in
              DataParallelBucketed(mixed, bucket_cap_mb=math.inf).buckets]
    return {"train": train, "calls": len(calls), "n_buckets": n_buckets, "errors": errors,
            "mixed_dtypes": dtypes}


def bucketed_checks() -> dict:
    """Every multi-rank check of this lesson on one rank."""
    out = {"train": {f"{n}@{c}": train_three_ways("bucketed", n, steps=5,
                                                 wrapper_kwargs={"bucket_cap_mb": c})
                     for n, c in CASES}}
    out["structure"] = {f"{n}@{c}": _structure(n, c) for n, c in CASES}
    out["custom"] = _custom_and_errors()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return dpcourse.run(bucketed_checks, world_size=request.param, backend="gloo")


@pytest.mark.parametrize("case", [f"{n}@{c}" for n, c in CASES])
def test_matches_torch_ddp_and_single_process_every_step(results, case):
    assert_three_ways_agree([r["train"][case] for r in results], label=case)


@pytest.mark.parametrize("case", [f"{n}@{c}" for n, c in CASES])
def test_one_all_reduce_per_bucket_after_backward(results, case):
    s = results[0]["structure"][case]
    assert s["counts"] == [len(s["names"])] * 2
    assert s["bytes"] == [s["trainable_bytes"]] * 2 == [sum(s["nbytes"])] * 2
    assert s["first_after_backward"] == [True, True]


def test_bucket_counts_follow_the_cap(results):
    st = results[0]["structure"]
    assert len(st["mlp@25.0"]["names"]) == 1
    assert 1 < len(st["mlp@0.0005"]["names"]) < 6
    assert [len(b) for b in st["frozen_layer@0.0"]["names"]] == [1, 1, 1, 1]
    assert len(st["gpt@0.0"]["names"]) == sum(1 for _ in make_model("gpt").parameters())
    # Filled in reverse: the last layer's parameters are in the first bucket.
    assert st["mlp@0.0005"]["names"][0][0] == "4.bias"
    for name, cap in CASES:  # every bucket but possibly the last reaches the cap
        assert all(nb >= cap * MiB for nb in st[f"{name}@{cap}"]["nbytes"][:-1])


@pytest.mark.parametrize("case", [f"{n}@{c}" for n, c in CASES])
def test_gradients_are_views_into_the_bucket_buffers(results, case):
    for r in results:
        assert r["structure"][case]["views"] == [True, True]


def test_custom_all_reduce_is_called_once_per_bucket(results):
    c = results[0]["custom"]
    assert c["calls"] == 3 * c["n_buckets"] and c["n_buckets"] > 1
    assert_three_ways_agree([r["custom"]["train"] for r in results], label="all_reduce=")


def test_clear_errors_and_one_dtype_per_bucket(results):
    c = results[0]["custom"]
    assert c["errors"]["-1.0"].startswith("ValueError") and "bucket_cap_mb" in c["errors"]["-1.0"]
    assert c["errors"]["'big'"].startswith("TypeError")
    assert sorted(map(sorted, c["mixed_dtypes"])) == [["torch.float32"], ["torch.float64"]]
