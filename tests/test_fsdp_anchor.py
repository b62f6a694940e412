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
