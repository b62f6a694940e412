"""The tuned fully_shard anchor of the benchmarks: torchtitan's settings, asked of torch on gloo."""

import torch
import torch.distributed as dist

import dpcourse


def _tuned_vs_plain():
    from torch.distributed.tensor import DTensor

    from dpcourse.bench.sharded import build_variant
    from dpcourse.models import random_tokens, tiny

    cfg = tiny()
    device = torch.device("cpu")
    idx, targets = random_tokens(2, cfg, seed=dist.get_rank())
    params, held = {}, {}
    for variant in ("torch_fsdp", "torch_fsdp_tuned"):
        model, opt, _, _ = build_variant(variant, cfg, device)
        for _ in range(2):
            loss = model(idx, targets)[1]
            if variant == "torch_fsdp_tuned" and not held:
                # After forward: which weights does torch keep gathered (not a DTensor shard)?
                held = {"root": not isinstance(model.wte.weight, DTensor),
                        "first block": not isinstance(model.blocks[0].attn.qkv.weight, DTensor),
                        "last block": not isinstance(model.blocks[-1].attn.qkv.weight, DTensor)}
            loss.backward()
            opt.step()
            opt.zero_grad()
        params[variant] = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    return {"diff": (params["torch_fsdp"] - params["torch_fsdp_tuned"]).abs().max().item(),
            "held": held}


def test_tuned_fully_shard_keeps_root_and_last_block_gathered_and_trains_like_the_plain_one():
    out = dpcourse.run(_tuned_vs_plain, world_size=2, backend="gloo")
    for rank in out:
        # The settings change where weights live between forward and backward, not the maths.
        assert rank["diff"] < 1e-6, rank
        assert rank["held"] == {"root": True, "first block": False, "last block": True}, rank


def test_gpu_busy_merges_overlapping_kernels_and_fsdp_ranges_group_by_kind():
    from dpcourse.bench.fsdp_anchor import fsdp_host_ranges, gpu_busy

    events = [{"cat": "kernel", "ts": 0, "dur": 1000}, {"cat": "kernel", "ts": 500, "dur": 1000},
              {"cat": "gpu_memcpy", "ts": 4000, "dur": 1000}, {"cat": "cpu_op", "ts": 0, "dur": 9000},
              {"ph": "X", "name": "FSDP::pre_forward (blocks.0)", "dur": 2000},
              {"ph": "X", "name": "FSDP::pre_forward (blocks.1)", "dur": 1000},
              {"ph": "X", "name": "FSDP::backward_prefetch for blocks.3", "dur": 500}]
    assert gpu_busy(events) == {"span_ms": 5.0, "busy_ms": 2.5}
    assert fsdp_host_ranges(events) == {"FSDP::pre_forward": 3.0, "FSDP::backward_prefetch": 0.5}
    assert gpu_busy([]) == {"span_ms": 0.0, "busy_ms": 0.0}


def _fully_shard_forward_hooks():
    import inspect

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    model = torch.nn.Linear(4, 4)
    fully_shard(model)
    # Which callables does the module run before and after its forward, and are they Python?
    hooks = {}
    for kind, table in (("pre", model._forward_pre_hooks), ("post", model._forward_hooks)):
        hooks[kind] = [{"is_state_method": isinstance(getattr(h, "__self__", None), FSDPState),
                        "name": getattr(h, "__name__", repr(h)),
                        "python": inspect.isfunction(getattr(h, "__func__", h)),
                        "file": inspect.getsourcefile(inspect.unwrap(getattr(h, "__func__", h)))}
                       for h in table.values()]
    return hooks


def test_fully_shard_hooks_are_python_functions():
    """Lesson 14: "FSDP2's per-group hooks run as Python functions". fully_shard registers
    FSDPState's _pre_forward and _post_forward as the module's forward hooks; they call each
    FSDPParamGroup's pre_forward and post_forward, and all of these are Python functions."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for hook in (FSDPState._pre_forward, FSDPState._post_forward, FSDPState._root_pre_forward,
                 FSDPParamGroup.pre_forward, FSDPParamGroup.post_forward):
        assert inspect.isfunction(hook), hook
        assert inspect.getsourcefile(inspect.unwrap(hook)).endswith(".py"), hook
    for rank in dpcourse.run(_fully_shard_forward_hooks, world_size=2, backend="gloo",
                             device="cpu"):
        for kind, name in (("pre", "_pre_forward"), ("post", "_post_forward")):
            assert len(rank[kind]) == 1, rank
            hook = rank[kind][0]
            assert hook["is_state_method"] and hook["name"] == name and hook["python"], rank
            assert hook["file"].endswith("_fully_shard/_fsdp_state.py"), rank
