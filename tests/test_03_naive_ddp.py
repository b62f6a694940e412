"""Lesson 03: DataParallelNaive matches torch DDP and single-process training, step by step.

One launch per world size runs every check on real ranks (gloo) and returns
plain data; the assertions run here in the parent, so a failure names the case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.ddp import DataParallelNaive
from dpcourse.models import MLP
from fixture_models import BatchNormMLP, UnusedLayerMLP
from ddp_helpers import (assert_three_ways_agree, counting_all_reduce, global_batch, loss_of,
                         make_model, train_three_ways)

MODELS = ["mlp", "frozen_layer", "frozen_bias", "tied"]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}


def _no_sync_and_finish(rank, world):
    """no_sync accumulates locally; the next backward averages the sum (as torch DDP does)."""
    ours = DataParallelNaive(make_model("mlp"))
    ref = torch.nn.parallel.DistributedDataParallel(make_model("mlp"))
    x, y = global_batch("mlp", 0)
    x, y = x[rank::world], y[rank::world]
    out = {}
    with CommTrace() as trace:
        for model in (ours, ref):
            with model.no_sync():
                loss_of("mlp", model, x[:2], y[:2]).backward()
                loss_of("mlp", model, x[2:], y[2:]).backward()
        out["no_sync_all_reduces"] = trace.count("all_reduce")
        out["local_grads"] = _grads(ours)
    with CommTrace() as trace:
        loss_of("mlp", ours, x, y).backward()
        out["sync_all_reduces"] = trace.count("all_reduce")
        ours.finish_gradient_synchronization()
        ours.finish_gradient_synchronization()
        out["after_extra_finish_calls"] = trace.count("all_reduce")
    loss_of("mlp", ref, x, y).backward()
    out["ours"] = _grads(ours)
    out["ddp"] = {n: p.grad.clone() for n, p in ref.module.named_parameters()}
    # Explicit finish after a no_sync backward: communicates once, then never again.
    ours.module.zero_grad()
    with ours.no_sync():
        loss_of("mlp", ours, x, y).backward()
    with CommTrace() as trace:
        ours.finish_gradient_synchronization()
        first = trace.count("all_reduce")
        ours.finish_gradient_synchronization()
        out["explicit_finish_counts"] = (first, trace.count("all_reduce"))
    return out


def _plugin(rank, world):
    calls = []

    counting = counting_all_reduce(calls)

    res = train_three_ways("naive", "tied", steps=3, single=False,
                           wrapper_kwargs={"all_reduce": counting})
    return {"calls": len(calls), "numels": sorted(set(calls)), "train": res}


def _validation_errors():
    errors = {}
    cases = {
        "frozen": lambda: DataParallelNaive(MLP().requires_grad_(False)),
        "not_module": lambda: DataParallelNaive(lambda x: x),
        "bad_all_reduce": lambda: DataParallelNaive(MLP(), all_reduce="ring"),
        "devices": lambda: DataParallelNaive(
            torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2),
                                 "b": torch.nn.Linear(2, 2, device="meta")})),
    }
    for key, make in cases.items():
        try:
            make()
            errors[key] = None
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    model = DataParallelNaive(UnusedLayerMLP())
    x, y = global_batch("mlp", 0)
    try:
        loss_of("mlp", model, x, y).backward()
        errors["unused"] = None
    except RuntimeError as exc:
        errors["unused"] = str(exc)
    return errors


def naive_checks() -> dict:
    """Every check of this lesson, on one rank; returns plain data for the parent to assert on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"train": {m: train_three_ways("naive", m, steps=5) for m in MODELS}}
    out["batchnorm"] = train_three_ways("naive", "batchnorm", steps=5, single=False)
    # Construction broadcast: every rank starts from a different seed.
    out["rank0_init"] = [p.detach().clone() for p in MLP(seed=0).parameters()]
    out["broadcast"] = [p.detach().clone() for p in DataParallelNaive(MLP(seed=rank)).parameters()]
    bn = BatchNormMLP(seed=rank)
    bn.norm.running_mean.fill_(rank + 1.0)
    bn.register_buffer("scale", torch.full((3,), float(rank)))
    DataParallelNaive(bn)
    out["buffers"] = (bn.norm.running_mean.clone(), bn.scale.clone())
    # One all-reduce per trainable parameter; a tied weight counts once, frozen ones never.
    counts = {}
    for name in MODELS:
        model = DataParallelNaive(make_model(name))
        x, y = global_batch(name, 0)
        with CommTrace() as trace:
            loss_of(name, model, x, y).backward()
        counts[name] = (trace.count("all_reduce"),
                        sum(1 for p in model.parameters() if p.requires_grad))
    out["counts"] = counts
    out["no_sync"] = _no_sync_and_finish(rank, world)
    # Wrapping a module twice: the newer wrapper takes over, gradients are averaged once.
    module = make_model("mlp")
    older, newer = DataParallelNaive(module), DataParallelNaive(module)
    x, y = global_batch("mlp", 0)
    with CommTrace() as trace:
        loss_of("mlp", newer, x, y).backward()
    try:
        older(x)
        out["rewrap"] = (trace.count("all_reduce"), None)
    except RuntimeError as exc:
        out["rewrap"] = (trace.count("all_reduce"), str(exc))
    out["plugin"] = _plugin(rank, world)
    out["errors"] = _validation_errors()
    wrapped = DataParallelNaive(MLP())
    out["state_dict_keys"] = sorted(wrapped.state_dict())
    out["same_parameters"] = [a is b for a, b in
                              zip(wrapped.parameters(), wrapped.module.parameters())]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, dpcourse.run(naive_checks, world_size=request.param, backend="gloo")


@pytest.mark.parametrize("model", MODELS)
def test_matches_torch_ddp_and_single_process_every_step(results, model):
    _, res = results
    assert_three_ways_agree([r["train"][model] for r in res], label=model)


def test_buffers_follow_rank0_like_torch_ddp(results):
    _, res = results
    assert_three_ways_agree([r["batchnorm"] for r in res], label="batchnorm")


def test_construction_broadcasts_rank0_parameters(results):
    _, res = results
    for r in res:
        for got, want in zip(r["broadcast"], res[0]["rank0_init"]):
            assert torch.equal(got, want)


def test_construction_broadcasts_buffers(results):
    _, res = results
    for r in res:
        assert torch.equal(r["buffers"][0], torch.ones(16))
        assert torch.equal(r["buffers"][1], torch.zeros(3))


def test_one_all_reduce_per_trainable_parameter(results):
    _, res = results
    expected = {"mlp": 6, "frozen_layer": 4, "frozen_bias": 5, "tied": 3}
    for r in res:
        assert r["counts"] == {m: (n, n) for m, n in expected.items()}


def test_no_sync_accumulates_locally_then_averages_like_torch_ddp(results):
    world, res = results
    for r in res:
        ns = r["no_sync"]
        assert ns["no_sync_all_reduces"] == 0
        assert ns["sync_all_reduces"] == 6
        assert ns["after_extra_finish_calls"] == 6  # finish after backward: nothing left to do
        assert ns["explicit_finish_counts"] == (6, 6)
        for k in ns["ddp"]:
            torch.testing.assert_close(ns["ours"][k], ns["ddp"][k], rtol=1e-5, atol=1e-6)
    # Inside no_sync the gradients were local: they differ between ranks.
    local0, local1 = res[0]["no_sync"]["local_grads"], res[1]["no_sync"]["local_grads"]
    assert any(not torch.equal(local0[k], local1[k]) for k in local0)


def test_wrapping_a_module_again_replaces_the_older_wrapper(results):
    _, res = results
    for r in res:
        count, error = r["rewrap"]
        assert count == 6 and "newer wrapper" in error


def test_custom_all_reduce_is_used(results):
    _, res = results
    for r in res:
        # 3 steps x 3 trainable tensors (the tied weight once).
        assert r["plugin"]["calls"] == 9
        assert r["plugin"]["numels"] == sorted({16 * 8, 8 * 8, 8})
    assert_three_ways_agree([r["plugin"]["train"] for r in res], label="all_reduce=")


def test_clear_errors(results):
    _, res = results
    e = res[0]["errors"]
    assert "no trainable parameters" in e["frozen"]
    assert "torch.nn.Module" in e["not_module"]
    assert "all_reduce must be a function" in e["bad_all_reduce"]
    assert "several devices" in e["devices"]
    assert "unused.weight" in e["unused"] and "unused.bias" in e["unused"]
    assert "fc1" not in e["unused"] and "requires_grad_(False)" in e["unused"]


def test_state_dict_like_torch_ddp(results):
    _, res = results
    ddp_keys = sorted("module." + k for k in MLP().state_dict())
    assert res[0]["state_dict_keys"] == ddp_keys
    assert res[0]["same_parameters"] == [True] * 6


def test_needs_a_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="dpcourse.run"):
        DataParallelNaive(MLP())
