"""Lesson 11: comm hooks and the reducer's options, each step-for-step against torch DDP on gloo."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.ddp.bucket_assignment import assign_buckets
from hook_helpers import train_with_hook
from reducer_helpers import train_against_torch

HOOKS = ["allreduce", "fp16", "bf16", "learner", "powersgd"]
HOOK_TOL = {"allreduce": 1e-6, "learner": 1e-6, "powersgd": 1e-6, "fp16": 2e-3, "bf16": 2e-2}
HOOK_CASES = [(kind, hook) for kind in ("naive", "bucketed", "overlapped") for hook in HOOKS
              if not (kind == "naive" and hook == "powersgd")]

# name -> (wrapper, model, our kwargs, torch DDP kwargs, hook)
OPTION_CASES = {
    "unused-naive": ("naive", "unused", {"find_unused_parameters": True},
                     {"find_unused_parameters": True}, None),
    "unused-overlapped": ("overlapped", "unused",
                          {"find_unused_parameters": True, "bucket_cap_mb": 0.0},
                          {"find_unused_parameters": True}, None),
    "rank-branch-bucketed": ("bucketed", "rank_branch",
                             {"find_unused_parameters": True, "bucket_cap_mb": 0.001},
                             {"find_unused_parameters": True}, None),
    "static-graph": ("overlapped", "unused", {"static_graph": True, "bucket_cap_mb": 0.0005},
                     {"static_graph": True}, None),
    "no-bucket-view": ("overlapped", "gpt", {"gradient_as_bucket_view": False,
                                             "bucket_cap_mb": 0.004}, {}, None),
    # (PowerSGD over several buckets hangs torch DDP on gloo: its callbacks issue collectives
    # from gloo's thread. The GPU tests compare that case on NCCL.)
    "rebuild-fp16": ("overlapped", "deep_mlp", {"rebuild_buckets": True, "bucket_cap_mb": 0.002},
                     {"bucket_cap_mb": 0.002}, "fp16"),
    "first-bucket": ("bucketed", "gpt", {"rebuild_buckets": True, "first_bucket_mb": 0.001,
                                         "bucket_cap_mb": 0.004}, {}, None),
    "no-buffer-broadcast": ("bucketed", "batchnorm", {"broadcast_buffers": False},
                            {"broadcast_buffers": False}, None),
}


def reducer_checks() -> dict:
    """Every multi-rank check of this lesson on one rank."""
    out = {"hooks": {c: train_with_hook(c[0], "deep_mlp", c[1], steps=4) for c in HOOK_CASES}}
    out["options"] = {k: train_against_torch(*c, steps=4) for k, c in OPTION_CASES.items()}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return dpcourse.run(reducer_checks, world_size=request.param, backend="gloo", timeout=600)


def _worst(run: dict) -> float:
    return max((a[n] - b[n]).abs().max().item()
               for a, b in zip(run["ours"], run["ddp"]) for n in a)


@pytest.mark.parametrize("case", HOOK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_torch_hooks_run_unchanged_and_match_torch_ddp(results, case):
    # Same hook, same state, same buckets: the same arithmetic as torch's reducer. Two ranks
    # agree bit for bit; on three, gloo may sum in another order when the tensors differ.
    tol = 0.0 if len(results) == 2 else HOOK_TOL[case[1]]
    for r in results:
        assert _worst(r["hooks"][case]) <= tol


@pytest.mark.parametrize("case", HOOK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_bytes_on_the_wire_per_hook(results, case):
    full = results[0]["hooks"][(case[0], "allreduce")]["bytes"][0]
    for r in results:
        sent = r["hooks"][case]["bytes"]
        if case[1] in ("fp16", "bf16"):
            assert sent == [full // 2] * len(sent)   # 2-byte elements instead of 4
        elif case[1] == "powersgd":                  # plain all-reduce until start_powerSGD_iter
            assert sent[:2] == [full, full] and max(sent[2:]) < full / 4
        else:
            assert sent == [full] * len(sent)


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_option_matches_torch_ddp(results, case):
    hook = OPTION_CASES[case][4]
    tol = HOOK_TOL[hook] if hook and len(results) > 2 else 1e-6  # fp32: summation order only
    for r in results:
        run = r["options"][case]
        assert _worst(run) <= tol, case
        assert run["none_ours"] == run["none_ddp"]  # unused on every rank: .grad stays None


def test_globally_unused_parameters_keep_no_gradient(results):
    for r in results:
        assert r["options"]["unused-naive"]["none_ours"][0] == ["unused.weight", "unused.bias"]
        assert r["options"]["rank-branch-bucketed"]["none_ours"][0] == []  # rank 0 used it


def test_find_unused_costs_one_all_reduce_per_step_static_graph_only_the_first(results):
    for r in results:
        o = r["options"]
        n = len(o["unused-overlapped"]["buckets"])
        assert [c[0] for c in o["unused-overlapped"]["comm"]] == [n + 1] * 4
        n = len(o["static-graph"]["buckets"])
        assert [c[0] for c in o["static-graph"]["comm"]] == [n + 1, n, n, n]


def test_rebuild_agrees_on_rank_0_order_with_one_broadcast(results):
    for r in results:
        comm = r["options"]["rebuild-fp16"]["comm"]
        assert [c[1] for c in comm] == [0, 1, 0, 0]


def test_without_bucket_view_gradients_are_separate_tensors(results):
    for r in results:
        assert not any(r["options"]["no-bucket-view"]["grads_are_views"])
        assert all(r["options"]["first-bucket"]["grads_are_views"])


def test_buffers_drift_without_broadcast(results):
    for r in results[1:]:
        mine = r["options"]["no-buffer-broadcast"]["ours"][-1]["norm.running_mean"]
        assert not torch.equal(mine, results[0]["options"]["no-buffer-broadcast"]["ours"][-1][
            "norm.running_mean"])


@pytest.mark.parametrize("seed", range(5))
def test_bucket_assignment_matches_torch_compute_bucket_assignment(seed):
    rng = random.Random(seed)
    params = [torch.zeros(rng.randint(1, 400)) for _ in range(rng.randint(1, 14))]
    order = list(range(len(params)))
    rng.shuffle(order)
    first, cap = rng.choice([(0.0005, 0.002), (0.001, 0.001), (0.0, 0.003)])
    ours = assign_buckets(params, cap, order=order, first_bucket_mb=first)
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], [int(first * 2**20), int(cap * 2**20)],
        [False] * len(params), order)
    assert ours == [list(b) for b in theirs]


@pytest.mark.parametrize("cap", [0.0, 0.0005, 0.002, 25.0])
def test_the_default_order_is_reverse_registration_and_the_first_cap_the_cap(cap):
    params = [torch.zeros(n) for n in (7, 300, 5, 120, 64, 1)]
    order = list(reversed(range(len(params))))
    explicit = assign_buckets(params, cap, order=order, first_bucket_mb=cap)
    assert explicit == assign_buckets(params, cap)
