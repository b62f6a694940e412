"""Lesson 13: ShardedOptimizer (ZeRO-1/2) equals one process and torch's ZeroRedundancyOptimizer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.ddp import DataParallelOverlapped
from dpcourse.zero import (ShardedOptimizer, chunk_size, gradient_bytes, optimizer_state_bytes,
                           shard_range, trace_wire_bytes, zero_bytes_per_rank)
from dpcourse.zero.layout import make_shard_buckets
from ddp_helpers import make_model
from zero_helpers import (OPTIMIZERS, local_backward, max_diff, on_device, param_state,
                          single_process_run)

STEPS = 3
# fp32: only the order of additions differs. AdamW divides by sqrt(v), so a rounding
# difference in a tiny gradient moves a weight by up to lr * (relative error): 3e-5 over
# 3 steps at lr=1e-2 (measured worst case on 3 gloo ranks: 1.2e-5).
TOL = 3e-5
# (model, optimizer, bucket_cap_mb): uneven sizes (mlp biases), frozen, tied (gpt).
CASES = [("mlp", "adamw", 0.0), ("frozen_layer", "sgd", 0.0005), ("gpt", "adamw", 0.004),
         ("tied", "sgd", 25.0)]


# -- pure layout ---------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_cover_every_element_once(numel, world):
    ranges = [shard_range(numel, world, r) for r in range(world)]
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(numel))
    assert all(hi - lo <= chunk_size(numel, world) for lo, hi in ranges)


def test_pack_then_unpack_round_trips_uneven_tensors():
    params = [torch.randn(5), torch.randn(2, 3), torch.randn(1)]
    buckets = make_shard_buckets(params, 3, 0.0)
    assert [len(b.params) for b in buckets] == [1, 1, 1]
    for b in buckets:
        m = b.new_matrix(3)
        b.pack(m, b.params)
        saved = [p.clone() for p in b.params]
        for p in b.params:
            p.zero_()
        b.unpack(m)
        for p, s in zip(b.params, saved):
            assert torch.equal(p, s)


def test_zero_formula_divides_state_then_gradients_then_weights():
    ddp, z1, z2, z3 = (zero_bytes_per_rank(1000, 4, s) for s in (0, 1, 2, 3))
    assert ddp == {"params": 4000, "grads": 4000, "optimizer": 8000, "total": 16000}  # fp32 AdamW
    assert z1["optimizer"] == 2000 and z1["grads"] == 4000 and z1["params"] == 4000
    assert z2["grads"] == 1000 and z2["params"] == 4000
    assert z3["params"] == 1000 and z3["total"] == ddp["total"] / 4
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(1000, 4, 4)


def test_zero_formula_reproduces_the_papers_figures():
    """Rajbhandari et al. (2020), figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)."""
    per_param = zero_bytes_per_rank(1, 1, 0, mixed_precision=True)
    assert per_param == {"params": 2, "grads": 2, "optimizer": 12, "total": 16}  # 2 + 2 + K
    paper_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}  # baseline, P_os, P_os+g, P_os+g+p
    for stage, want in paper_gb.items():
        got = zero_bytes_per_rank(7.5e9, 64, stage, mixed_precision=True)["total"] / 1e9
        assert abs(got - want) <= 0.05, (stage, got, want)   # the paper prints one decimal


# -- on several ranks ------------------------------------------------------------------------


def _train(name: str, opt_name: str, cap: float, mode: str, steps: int = STEPS,
           micro: int = 1) -> list[dict]:
    base = make_model(name)
    cls, kw = OPTIMIZERS[opt_name]
    model = copy.deepcopy(base)
    if mode == "averaged":
        model = DataParallelOverlapped(model, bucket_cap_mb=cap)
    opt = ShardedOptimizer(model.parameters(), cls, gradients=mode, bucket_cap_mb=cap, **kw)
    out = []
    for step in range(steps):
        local_backward(name, model, step, micro)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        out.append(param_state(model))
    return out


def _torch_zero(name: str, opt_name: str) -> list[dict]:
    model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(make_model(name)))
    cls, kw = OPTIMIZERS[opt_name]
    opt = ZeroRedundancyOptimizer([p for p in model.parameters() if p.requires_grad],
                                  optimizer_class=cls, **kw)
    out = []
    for step in range(STEPS):
        local_backward(name, model, step)
        opt.step()
        opt.zero_grad()
        out.append(param_state(model))
    return out


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                                     "lr": 3e-2}]


def _groups_and_scheduler() -> dict:
    """Parameter groups with their own hyperparameters, and a scheduler changing lr."""
    base = make_model("gpt")
    runs = {}
    for kind in ("ours", "single"):
        model = copy.deepcopy(base)
        if kind == "ours":
            opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, gradients="sharded",
                                   bucket_cap_mb=0.002, lr=1e-2)
        else:
            opt = torch.optim.AdamW(_groups(model), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        states = []
        for step in range(STEPS):
            if kind == "ours":
                local_backward("gpt", model, step)
            else:
                from ddp_helpers import global_batch, loss_of
                loss_of("gpt", model, *global_batch("gpt", step)).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            states.append(param_state(model))
        runs[kind] = states
    return {"diff": max_diff(runs["ours"], runs["single"])}


def _memory_and_traffic() -> dict:
    """State bytes per rank and recorded bytes per step for DDP, ZeRO-1 and ZeRO-2."""
    world = dist.get_world_size()
    out = {}
    for mode in ("ddp", "averaged", "reduce_scatter", "sharded"):
        model = make_model("gpt")
        if mode in ("ddp", "averaged"):
            model = DataParallelOverlapped(model, bucket_cap_mb=0.004)
        if mode == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, gradients=mode,
                                   bucket_cap_mb=0.004, lr=1e-3)
        params = list(model.parameters())
        for step in range(2):
            with CommTrace() as trace:
                local_backward("gpt", model, step)
                grads = gradient_bytes(params, opt)
                opt.step()
            opt.zero_grad()
        out[mode] = {"state": optimizer_state_bytes(opt), "grads": grads,
                     "wire": trace_wire_bytes(trace.to_records(), world),
                     "ops": sorted(trace.collective_ops())}
    n = sum(p.numel() for p in make_model("gpt").parameters())
    out["n_params"] = n
    return out


def _accumulation() -> dict:
    """ZeRO-2 over two micro-batches per step equals one process on the whole batch."""
    ours = _train("gpt", "adamw", 0.003, "sharded", micro=2)
    return {"diff": max_diff(ours, single_process_run("gpt", make_model("gpt"), "adamw", STEPS))}


def _errors() -> dict:
    errors = {}
    params = make_model("mlp").parameters()
    for key, call in {
        "mode": lambda: ShardedOptimizer(params, torch.optim.SGD, gradients="all", lr=0.1),
        "instance": lambda: ShardedOptimizer(list(make_model("mlp").parameters()),
                                             torch.optim.SGD(make_model("mlp").parameters(),
                                                             lr=0.1)),
        "frozen": lambda: ShardedOptimizer([p.requires_grad_(False) for p in
                                            make_model("mlp").parameters()], torch.optim.SGD,
                                           lr=0.1),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def zero_checks() -> dict:
    """Every multi-rank check of this lesson on one rank."""
    out: dict = {"train": {}, "torch_zero": {}}
    for name, opt_name, cap in CASES:
        single = single_process_run(name, make_model(name), opt_name, STEPS)
        key = f"{name}/{opt_name}@{cap}"
        runs = {mode: _train(name, opt_name, cap, mode)
                for mode in ("averaged", "reduce_scatter", "sharded")}
        out["train"][key] = {mode: max_diff(r, single) for mode, r in runs.items()}
        out["torch_zero"][key] = max_diff(runs["averaged"], _torch_zero(name, opt_name))
        out["train"][key]["final"] = runs["sharded"][-1]
    out["groups"] = _groups_and_scheduler()
    out["memory"] = _memory_and_traffic()
    out["accumulation"] = _accumulation()
    out["errors"] = _errors()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, dpcourse.run(zero_checks, world_size=request.param, backend="gloo")


@pytest.mark.parametrize("case", [f"{n}/{o}@{c}" for n, o, c in CASES])
def test_every_mode_equals_single_process(results, case):
    _, res = results
    for r in res:
        for mode in ("averaged", "reduce_scatter", "sharded"):
            assert r["train"][case][mode] < TOL, (mode, r["train"][case][mode])
    for k, v in res[0]["train"][case]["final"].items():  # every rank holds the same weights
        assert all(torch.equal(v, r["train"][case]["final"][k]) for r in res)


@pytest.mark.parametrize("case", [f"{n}/{o}@{c}" for n, o, c in CASES])
def test_equals_torch_zero_redundancy_optimizer(results, case):
    for r in results[1]:
        assert r["torch_zero"][case] < TOL


def test_parameter_groups_and_scheduler(results):
    for r in results[1]:
        assert r["groups"]["diff"] < TOL


def test_gradient_accumulation_with_sharded_gradients(results):
    for r in results[1]:
        assert r["accumulation"]["diff"] < TOL


def test_state_and_gradients_shrink_as_the_formula_says(results):
    world, res = results
    for r in res:
        m = r["memory"]
        n = m["n_params"]
        padding = 4 * world * 40  # < world elements per tensor, fp32, a tiny GPT has < 40 tensors
        steps = 8 * 40  # AdamW's scalar step counter per tensor
        ddp = zero_bytes_per_rank(n, world, 0)
        for mode, stage in (("averaged", 1), ("reduce_scatter", 1), ("sharded", 2)):
            want = zero_bytes_per_rank(n, world, stage)
            assert abs(m[mode]["state"] - want["optimizer"]) <= 2 * padding + steps, mode
        assert abs(m["ddp"]["state"] - ddp["optimizer"]) <= steps
        assert m["ddp"]["grads"] == m["averaged"]["grads"] == m["reduce_scatter"]["grads"] == 4 * n
        assert abs(m["sharded"]["grads"] - 4 * n / world) <= padding


def test_zero_moves_the_same_bytes_as_ddp(results):
    world, res = results
    m = res[0]["memory"]
    padding = 4 * world * 40 * 2
    assert m["ddp"]["ops"] == ["all_reduce"]
    for mode in ("reduce_scatter", "sharded"):
        assert m[mode]["ops"] == ["all_gather_into_tensor", "reduce_scatter_tensor"]
        assert abs(m[mode]["wire"] - m["ddp"]["wire"]) <= padding
    # Over a DDP wrapper ZeRO-1 adds an all-gather to DDP's all-reduce: 1.5x the bytes.
    assert m["averaged"]["ops"] == ["all_gather_into_tensor", "all_reduce"]
    assert abs(m["averaged"]["wire"] - 1.5 * m["ddp"]["wire"]) <= padding


def test_clear_errors(results):
    e = results[1][0]["errors"]
    assert e["mode"].startswith("ValueError") and "sharded" in e["mode"]
    assert e["instance"].startswith("TypeError") and "class" in e["instance"]
    assert e["frozen"].startswith("ValueError") and "trainable" in e["frozen"]


@pytest.mark.gpu(2)
def test_nccl_every_mode_equals_single_process_and_torch():
    for r in dpcourse.run(_nccl_checks, world_size=2, backend="nccl"):
        assert all(v < 1e-4 for v in r.values()), r  # GPU kernels sum in their own order


def _nccl_checks() -> dict:
    """The GPT/AdamW comparisons on GPUs (models and batches on this rank's device)."""
    import sys

    import zero_helpers

    dev = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(dev)
    with on_device(dev, sys.modules[__name__], zero_helpers):
        single = single_process_run("gpt", make_model("gpt"), "adamw", STEPS)
        out = {mode: max_diff(_train("gpt", "adamw", 0.004, mode), single)
               for mode in ("averaged", "reduce_scatter", "sharded")}
        out["torch_zero"] = max_diff(_train("gpt", "adamw", 0.004, "averaged"),
                                     _torch_zero("gpt", "adamw"))
    return out


# Exercise 13 (ZeRO-2 over micro-batches, with a frozen layer): tests/test_exercise_13_transfer.py
