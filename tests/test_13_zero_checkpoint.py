"""Lesson 13: a ShardedOptimizer checkpoint (consolidated state dict) resumes training exactly."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import dpcourse
from dpcourse.ddp import DataParallelOverlapped
from dpcourse.models import MLP
from dpcourse.zero import ShardedOptimizer
from ddp_helpers import global_batch, loss_of, make_model
from zero_helpers import local_backward, on_device, param_state

SAVED_AT, MORE = 2, 2  # steps before the checkpoint, steps after it
TOL = 3e-5             # as test_13_zero: ours against one process / torch differ in summation order
# AdamW with eps=1e-6, not its default 1e-8. Its update is lr * m / (sqrt(v) + eps), so a
# difference d in a gradient moves the weight by up to lr * d / eps. Some gradients are zero in
# exact arithmetic and rounding noise in floating point: the key third of the GPT's qkv bias
# (softmax ignores a shift shared by every score; test_key_bias_gradient_is_rounding_noise).
# Their noise, about 1e-12, depends on the order of additions, which differs between one
# process and the ranks; at eps=1e-8 AdamW turns it into weight differences near TOL
# (4.4e-05 once, on 3 ranks), at eps=1e-6 into at most lr * 1e-12 / 1e-6 = 1e-8 per step.
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}
# (model, optimizer, gradients mode, parameter groups, rank that receives the state)
CASES = [("mlp", "adamw", "sharded", False, 0),          # uneven sizes (biases of 16 and 1)
         ("mlp", "sgd", "reduce_scatter", False, -1),    # momentum; consolidated on the last rank
         ("frozen_layer", "adamw", "averaged", False, 0),  # frozen parameters given to it
         ("gpt", "adamw", "sharded", True, 0),            # groups with their own lr, tied weight
         ("gpt", "sgd", "averaged", True, -1)]


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                                     "lr": 3e-2}]


def _build(name, opt_name, mode, groups, seed=0, trainable_only=False):
    model = make_model(name, seed=seed)
    inner = model
    if mode == "averaged":
        model = DataParallelOverlapped(model, bucket_cap_mb=0.002)
    cls, kw = OPTIMIZERS[opt_name]
    params = _groups(inner) if groups else list(inner.parameters())
    if trainable_only:
        params = [p for p in params if p.requires_grad]
    opt = ShardedOptimizer(params, cls, gradients=mode, bucket_cap_mb=0.002, **kw)
    return model, inner, opt


def _steps(name, model, opt, steps) -> list[dict]:
    out = []
    for step in steps:
        local_backward(name, model, step)
        opt.step()
        opt.zero_grad()
        out.append(param_state(model))
    return out


def _share(obj, src: int):
    """What rank ``src`` saved with torch.save, as every rank reads it back with torch.load."""
    buf = [None]
    if dist.get_rank() == src:
        f = io.BytesIO()
        torch.save(obj, f)
        buf = [f.getvalue()]
    dist.broadcast_object_list(buf, src=src)
    return torch.load(io.BytesIO(buf[0]), weights_only=True)


def _single(name, opt_name, groups, steps, start_state=None):
    """One process on the global batch: (optimizer state dict, parameters) after ``steps``."""
    model = make_model(name)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(_groups(model) if groups else model.parameters(), **kw)
    if start_state is not None:
        model.load_state_dict(start_state[0])
        opt.load_state_dict(start_state[1])
    for step in steps:
        loss_of(name, model, *global_batch(name, step)).backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict(), param_state(model)


def _state_diff(a: dict, b: dict) -> float:
    """Largest difference between two optimizer state dicts (inf if their structure differs)."""
    if a["state"].keys() != b["state"].keys() or len(a["param_groups"]) != len(b["param_groups"]):
        return float("inf")
    worst = 0.0
    for i in a["state"]:
        if a["state"][i].keys() != b["state"][i].keys():
            return float("inf")
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            if not isinstance(v, torch.Tensor) or v.shape != w.shape:
                return float("inf")
            # A consolidated state lives on the CPU; an optimizer's own on its parameters' device.
            diff = v.double().cpu() - w.double().cpu()
            worst = max(worst, diff.abs().max().item() if v.numel() else 0)
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        if any(ga[k] != gb[k] for k in ga.keys() & gb.keys()):
            return float("inf")
    return worst


def _resume(case) -> dict:
    name, opt_name, mode, groups, to = case
    to = to % dist.get_world_size()
    model, inner, opt = _build(name, opt_name, mode, groups)
    straight = _steps(name, model, opt, range(SAVED_AT + MORE))
    model, inner, opt = _build(name, opt_name, mode, groups)
    _steps(name, model, opt, range(SAVED_AT))
    opt.consolidate_state_dict(to=to)
    ckpt = _share({"model": inner.state_dict(), "optim": opt.state_dict()}
                  if dist.get_rank() == to else None, src=to)
    model2, inner2, opt2 = _build(name, opt_name, mode, groups, seed=1)  # other weights
    inner2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    resumed = _steps(name, model2, opt2, range(SAVED_AT, SAVED_AT + MORE))
    exact = all(torch.equal(a[k], b[k]) for a, b in zip(straight[SAVED_AT:], resumed) for k in a)
    resume_diff = max((a[k] - b[k]).abs().max().item()
                      for a, b in zip(straight[SAVED_AT:], resumed) for k in a)
    single_sd, _ = _single(name, opt_name, groups, range(SAVED_AT))
    vs_single = _state_diff(ckpt["optim"], single_sd)
    # The checkpoint, loaded into one process, continues as one process would. (A plain
    # optimizer's load keeps the dict's step tensors and counts on in them: give it a copy.)
    _, single_end = _single(name, opt_name, groups, range(SAVED_AT + MORE))
    _, loaded_end = _single(name, opt_name, groups, range(SAVED_AT, SAVED_AT + MORE),
                            start_state=copy.deepcopy((ckpt["model"], ckpt["optim"])))
    return {"exact": exact, "resume_diff": resume_diff, "vs_single": vs_single,
            "single_resumed": max((single_end[k] - loaded_end[k]).abs().max().item()
                                  for k in single_end),
            "n_state": len(ckpt["optim"]["state"])}


def _torch_zero(name, opt_name) -> dict:
    """Our consolidated state against torch's ZeroRedundancyOptimizer's (trainable parameters)."""
    cls, kw = OPTIMIZERS[opt_name]
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(make_model(name)))
    zero = ZeroRedundancyOptimizer([p for p in ddp.parameters() if p.requires_grad],
                                   optimizer_class=cls, **kw)
    _steps(name, ddp, zero, range(SAVED_AT))
    zero.consolidate_state_dict(to=0)
    model, _, opt = _build(name, opt_name, "averaged", False, trainable_only=True)
    _steps(name, model, opt, range(SAVED_AT))
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() != 0:
        return {}
    ours, theirs = opt.state_dict(), zero.state_dict()
    return {"diff": _state_diff(ours, theirs), "n_state": len(theirs["state"]),
            "group_keys": sorted(theirs["param_groups"][0].keys() - {"params"}
                                 - ours["param_groups"][0].keys())}


def _errors() -> dict:
    out = {}
    model, _, opt = _build("mlp", "sgd", "sharded", False)
    _steps("mlp", model, opt, range(1))
    calls = {"not_consolidated": opt.state_dict}
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        saved = opt.state_dict()  # fine right after consolidating
        _steps("mlp", model, opt, range(1, 2))
        calls["stale"] = opt.state_dict
        # Same number of tensors, other shapes ("averaged": its construction is local).
        narrow = ShardedOptimizer(MLP(hidden=8).parameters(), torch.optim.SGD, lr=0.1,
                                  momentum=0.9)
        calls["wrong_model"] = lambda: narrow.load_state_dict(saved)
    else:
        _steps("mlp", model, opt, range(1, 2))
        calls["other_rank"] = opt.state_dict
    calls["bad_rank"] = lambda: opt.consolidate_state_dict(to=dist.get_world_size())
    for key, call in calls.items():
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def checkpoint_checks() -> dict:
    """Every multi-rank check of this file on one rank."""
    out = {"resume": {f"{c[0]}/{c[1]}/{c[2]}": _resume(c) for c in CASES}}
    out["torch_zero"] = {f"{n}/{o}": _torch_zero(n, o) for n, o in
                         (("mlp", "adamw"), ("frozen_layer", "sgd"), ("gpt", "adamw"))}
    out["errors"] = _errors()
    return out


def test_key_bias_gradient_is_rounding_noise():
    """The gradient AdamW would amplify: zero in exact arithmetic, noise in float32."""
    model = make_model("gpt")
    loss_of("gpt", model, *global_batch("gpt", 0)).backward()
    width = model.blocks[0].attn.qkv.bias.numel() // 3
    for block in model.blocks:
        grad = block.attn.qkv.bias.grad
        key, query = grad[width:2 * width].abs().max().item(), grad[:width].abs().max().item()
        assert key < 1e-9 and query > 1e-6, (key, query)   # noise, then a real gradient


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, dpcourse.run(checkpoint_checks, world_size=request.param,
                                       backend="gloo")


def test_resume_equals_the_uninterrupted_run_exactly(results):
    for r in results[1]:
        assert all(v["exact"] for v in r["resume"].values()), r["resume"]


def test_consolidated_state_is_a_single_process_optimizer_state(results):
    for r in results[1]:
        for case, v in r["resume"].items():
            assert v["n_state"] > 0, case
            assert v["vs_single"] < TOL, (case, v)
            assert v["single_resumed"] < TOL, (case, v)  # one process can resume from it


def test_consolidated_state_equals_torch_zero_redundancy_optimizer(results):
    r = results[1][0]
    for case, v in r["torch_zero"].items():
        assert v["n_state"] > 0 and v["diff"] < TOL, (case, v)


def test_clear_errors(results):
    for rank, r in enumerate(results[1]):
        e = r["errors"]
        assert "consolidate_state_dict" in e["not_consolidated"]
        assert e["bad_rank"].startswith("ValueError") and "to must be" in e["bad_rank"]
        if rank == 0:
            assert e["stale"].startswith("RuntimeError") and "step(s) old" in e["stale"]
            assert e["wrong_model"].startswith("ValueError") and "same model" in e["wrong_model"]
        else:
            assert "consolidate_state_dict(to=r)" in e["other_rank"]


@pytest.mark.gpu(2)
def test_nccl_checkpoint_resumes_and_is_a_single_process_state():
    for r in dpcourse.run(_nccl_resume, world_size=2, backend="nccl"):
        for case, v in r.items():
            # Some CUDA backward kernels (embedding) add with atomics: not bit-exact run to run.
            assert v["n_state"] > 0 and v["resume_diff"] < 1e-5, (case, v)
            assert v["vs_single"] < 1e-4 and v["single_resumed"] < 1e-4, (case, v)


def _nccl_resume() -> dict:
    """The resume cases over NCCL, models and batches on this rank's GPU."""
    import sys

    import zero_helpers

    dev = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(dev)
    with on_device(dev, sys.modules[__name__], zero_helpers):
        return {f"{c[0]}/{c[1]}/{c[2]}": _resume(c) for c in CASES}
