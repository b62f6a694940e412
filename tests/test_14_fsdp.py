"""Lesson 14: FullyShardedDataParallel equals one process (fp32) and torch's fully_shard (bf16)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import CommTrace
from dpcourse.fsdp import FullyShardedDataParallel, default_units
from dpcourse.zero import chunk_size
from ddp_helpers import global_batch, loss_of, make_model
from zero_helpers import OPTIMIZERS, local_backward, max_diff, on_device, single_process_run

STEPS = 3
TOL_FP32 = 3e-5  # as in lesson 13: only the order of additions differs (AdamW amplifies it)
# bf16: our run against torch's fully_shard with the same policy (param and reduce dtype
# bf16), and both against fp32 single-process training. On 2 gloo ranks the two bf16 runs
# agree exactly (same casts, same sums); on 3 ranks the 3-way bf16 gradient sums round
# differently and the runs differ by about as much as each differs from fp32 (measured:
# ours 4.7e-4 / torch 3.5e-4 from fp32 on the MLP). Asserted: ours is no farther from fp32
# than twice torch's distance, and no farther from torch's than that either.
BF16_FACTOR = 2.0
MODELS = ["mlp", "gpt", "tied", "frozen_layer", "frozen_bias"]


def _fsdp_run(name: str, opt_name: str, *, compute_dtype=None, prefetch=True,
              micro: int = 1) -> list[dict]:
    model = FullyShardedDataParallel(make_model(name), compute_dtype=compute_dtype,
                                     prefetch=prefetch)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    out = []
    for step in range(STEPS):
        local_backward(name, model, step, micro)
        model.finish_gradient_synchronization()  # idempotent: backward already called it
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        out.append(model.gather_full_params())
    return out


def _torch_units(model):
    """default_units without those holding a weight tied to another module (torch wants them grouped)."""
    ids = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                ids.setdefault(id(p), set()).add(id(m))
    return [u for u in default_units(model)
            if all(ids[id(p)] <= {id(m) for m in u.modules()} for p in u.parameters())]


def _torch_run(name: str, opt_name: str, compute_dtype=None) -> list[dict]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(name)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
    for u in _torch_units(model):
        fully_shard(u, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    out = []
    for step in range(STEPS):
        local_backward(name, model, step)
        opt.step()
        opt.zero_grad()
        out.append({n: p.full_tensor().clone() for n, p in model.named_parameters()})
    return out


def _relative_diff(a: list[dict], b: list[dict]) -> float:
    return max(((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp_min(1e-12)).item()
               for sa, sb in zip(a, b, strict=True) for k in sb)


def _bf16_distances(name: str) -> dict:
    ours = _fsdp_run(name, "sgd", compute_dtype=torch.bfloat16)
    ref = _torch_run(name, "sgd", torch.bfloat16)
    fp32 = single_process_run(name, make_model(name), "sgd", STEPS)
    return {"ours_torch": max_diff(ours, ref), "ours_fp32": max_diff(ours, fp32),
            "torch_fp32": max_diff(ref, fp32)}


def _bf16_ok(d: dict, world: int) -> bool:
    if world == 2 and d["ours_torch"] > 1e-6:
        return False
    bound = BF16_FACTOR * d["torch_fp32"] + 1e-6
    return d["ours_fp32"] <= bound and d["ours_torch"] <= bound


def _structure(prefetch: bool) -> dict:
    """Collectives of one step of a 2-block GPT, and the moments each unit's forward ends."""
    model = FullyShardedDataParallel(make_model("gpt"), prefetch=prefetch)
    blocks = [u.module for u in model.units[1:]]
    with CommTrace() as trace:
        for i, b in enumerate(blocks):
            b.register_forward_hook(lambda *a, i=i: trace.mark(f"forward_end_{i}") and None)
        local_backward("gpt", model, 0)
    flats = [f for u in model.units for f in u.flats]
    gathered = [f.is_unsharded for f in flats]
    return {"events": trace.to_records(), "marks": dict(trace.marks),
            "units": [[f.numel for f in u.flats] for u in model.units],
            "chunks": [f.chunk for f in flats], "gathered_after_step": gathered,
            "shard_numels": [p.numel() for p in model.parameters()],
            "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _eval_and_errors() -> dict:
    out: dict = {}
    base = make_model("gpt")
    model = FullyShardedDataParallel(copy.deepcopy(base))
    x, y = global_batch("gpt", 0)
    with torch.no_grad():
        logits, _ = model(x)
    out["eval_diff"] = (logits - base(x)[0]).abs().max().item()
    out["eval_freed"] = not any(f.is_unsharded for u in model.units for f in u.flats)
    # Backward prefetches the frozen first layer, whose backward never runs: its gather
    # must be finished before its memory is released, or gloo writes into freed memory.
    frozen = FullyShardedDataParallel(make_model("frozen_layer"))
    local_backward("frozen_layer", frozen, 0)
    out["in_flight_after_step"] = [f._work is not None for u in frozen.units for f in u.flats]
    errors = {}
    try:
        FullyShardedDataParallel(make_model("mlp"), compute_dtype=torch.int8)
    except ValueError as exc:
        errors["dtype"] = str(exc)
    twice = torch.nn.Sequential(torch.nn.Linear(4, 4))
    twice.forward = lambda x: twice[0](twice[0](x))  # one unit used twice
    try:
        FullyShardedDataParallel(twice)(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    out["errors"] = errors
    return out


def fsdp_checks() -> dict:
    """Every multi-rank check of this lesson on one rank."""
    out: dict = {"single": {}, "torch": {}, "bf16": {}}
    for name in MODELS:
        for opt_name in ("adamw", "sgd"):
            ref = single_process_run(name, make_model(name), opt_name, STEPS)
            out["single"][f"{name}/{opt_name}"] = max_diff(_fsdp_run(name, opt_name), ref)
    out["single"]["gpt/adamw/no-prefetch"] = max_diff(
        _fsdp_run("gpt", "adamw", prefetch=False),
        single_process_run("gpt", make_model("gpt"), "adamw", STEPS))
    out["single"]["gpt/sgd/accumulate"] = max_diff(
        _fsdp_run("gpt", "sgd", micro=2), single_process_run("gpt", make_model("gpt"), "sgd",
                                                             STEPS))
    for name in ("mlp", "gpt", "tied"):
        out["torch"][name] = _relative_diff(_fsdp_run(name, "sgd"), _torch_run(name, "sgd"))
        out["bf16"][name] = _bf16_distances(name)
    out["structure"] = {p: _structure(p) for p in (True, False)}
    out.update(_eval_and_errors())
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, dpcourse.run(fsdp_checks, world_size=request.param, backend="gloo")


def test_fp32_equals_single_process(results):
    for r in results[1]:
        bad = {k: v for k, v in r["single"].items() if not v < TOL_FP32}
        assert not bad, bad


def test_equals_torch_fully_shard_fp32_and_bf16(results):
    for r in results[1]:
        assert all(v < 1e-5 for v in r["torch"].values()), r["torch"]
        assert all(_bf16_ok(d, results[0]) for d in r["bf16"].values()), r["bf16"]


def test_each_rank_holds_one_nth_of_every_unit(results):
    world, res = results
    for r in res:
        s = r["structure"][True]
        assert s["shard_dtypes"] == ["torch.float32"]
        want = [chunk_size(n, world) for unit in s["units"] for n in unit]
        assert s["shard_numels"] == want == s["chunks"]
        assert not any(s["gathered_after_step"])  # every gathered weight freed after backward


def test_gathers_and_reduce_scatters_per_step(results):
    world, res = results
    s = res[0]["structure"][True]
    elems = [world * c for c in s["chunks"]]  # padded flat sizes, in unit order
    root, blocks = elems[0], elems[1:]
    gathers = [e["nbytes"] // 4 for e in s["events"] if e["op"] == "all_gather_into_tensor"]
    scatters = [e["nbytes"] // 4 for e in s["events"] if e["op"] == "reduce_scatter_tensor"]
    # Forward: root, then each block; backward: each block again, last first. The root
    # stays gathered from its forward to the end of backward.
    assert gathers == [root] + blocks + blocks[::-1]
    assert sorted(scatters) == sorted(elems)
    assert {e["op"] for e in s["events"]} == {"all_gather_into_tensor", "reduce_scatter_tensor"}


def test_prefetch_starts_the_next_gather_before_the_unit_finishes(results):
    for r in results[1]:
        for prefetch in (True, False):
            s = r["structure"][prefetch]
            ends = [s["marks"][f"forward_end_{i}"] for i in range(2)]
            gathers = [e["start"] for e in s["events"] if e["op"] == "all_gather_into_tensor"]
            # gathers[2] is block 1's: with prefetch it leaves before block 0's forward ends.
            assert (gathers[2] < ends[0]) is prefetch


def test_eval_and_clear_errors(results):
    r = results[1][0]
    assert r["eval_diff"] < 1e-5 and r["eval_freed"]
    assert not any(r["in_flight_after_step"]), r["in_flight_after_step"]
    assert "compute_dtype" in r["errors"]["dtype"]
    assert "twice" in r["errors"]["twice"]


def test_timeline_overlap_counts_time_both_ran():
    from dpcourse.bench.fsdp_timeline import overlap_ms

    compute = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    assert overlap_ms([(2.5, 5.5)], compute) == 1.0  # 2.5-3 and 5-5.5
    assert overlap_ms([(3.0, 5.0)], compute) == 0.0
    assert overlap_ms([(0.0, 1.0), (0.5, 1.5)], compute) == 1.5  # comm counted once


@pytest.mark.gpu(2)
def test_nccl_equals_single_process_and_torch():
    res = dpcourse.run(_nccl_checks, world_size=2, backend="nccl")
    for r in res:
        assert r["single"] < 1e-4, r
        assert r["torch"] < 1e-5, r
        bound = BF16_FACTOR * r["bf16"]["torch_fp32"] + 1e-6
        assert r["bf16"]["ours_fp32"] <= bound and r["bf16"]["ours_torch"] <= bound, r


def _nccl_checks() -> dict:
    """The fp32 and bf16 comparisons on GPUs (models and batches on this rank's device)."""
    import sys

    import zero_helpers

    dev = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(dev)
    with on_device(dev, sys.modules[__name__], zero_helpers):
        ref = single_process_run("gpt", make_model("gpt"), "sgd", STEPS)
        return {"single": max_diff(_fsdp_run("gpt", "sgd"), ref),
                "torch": _relative_diff(_fsdp_run("gpt", "sgd"), _torch_run("gpt", "sgd")),
                "bf16": _bf16_distances("gpt")}


def test_bench_ddp_times_the_sharded_variants_beside_torch_ddp():
    from dpcourse.bench import ddp_step_times

    variants = ["torch_ddp", "zero1", "zero2", "fsdp", "torch_fsdp"]
    rows = dpcourse.run(ddp_step_times, variants, world_size=2, backend="gloo", iters=1, warmup=1,
                        batch_size=2)[0]
    rows = [r if isinstance(r, dict) else r.__dict__ for r in rows]
    assert [r["variant"] for r in rows] == variants
    assert all(r["median_s"] > 0 and r["vs_torch_ddp"] > 0 for r in rows)
    assert all(r["peak_bytes_per_rank"] is None for r in rows)  # measured on GPUs only
