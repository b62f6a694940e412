"""Lesson 14's capacity measurement: the FSDP variant built from the meta device.

``build_variant("fsdp", ..., from_meta=True)`` must train, must initialise the GPT with
its own distributions, and must never hold more than the shards plus one unit (and the
small root unit) while it is built; the variants built normally must stay as they were.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.bench.sharded import build_variant
from dpcourse.bench.workload import make_step
from dpcourse.fsdp import CPUMemoryPeak
from dpcourse.models import GPT, GPTConfig, random_tokens

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=32)
CPU = torch.device("cpu")


def _std(t: torch.Tensor) -> float:
    return t.float().std().item()


def _meta_variant() -> dict:
    with CPUMemoryPeak() as mem:
        model, opt, amp, params = build_variant("fsdp", CFG, CPU, from_meta=True)
    fulls = [[4 * dist.get_world_size() * f.chunk for f in u.flats] for u in model.units]
    full = model.gather_full_params()
    names = list(full)
    residual = [n for n in names if n.endswith(("attn.proj.weight", "mlp.2.weight"))]
    plain = [n for n in names if n.endswith("weight") and "ln" not in n and n not in residual
             and full[n].numel() >= 1024]  # wpe (256 numbers) would be a noisy estimate
    idx, targets = random_tokens(2, CFG, seed=dist.get_rank())
    before = [p.detach().clone() for p in params]
    _, loss = model(idx, targets)
    step = make_step(model, opt, idx, targets, amp)
    step()
    return {
        "peak": mem.peak_bytes, "shards": sum(4 * p.numel() for p in model.parameters()),
        "root": sum(fulls[0]), "largest_unit": max(sum(f) for f in fulls[1:]),
        "model": 4 * GPT(CFG, seed=0).num_parameters(), "amp": amp,
        "names": names, "n_residual": len(residual),
        "finite": all(torch.isfinite(t).all().item() for t in full.values()),
        "residual_std": [_std(full[n]) for n in residual],
        "plain_std": [_std(full[n]) for n in plain],
        "ln_weights_one": all(torch.equal(full[n], torch.ones_like(full[n]))
                              for n in names if ".ln" in n and n.endswith("weight")
                              or n.startswith("ln_f.weight")),
        "biases_zero": all(not full[n].any() for n in names if n.endswith("bias")),
        "loss": loss.item(),
        "moved": all(not torch.equal(a, b) for a, b in zip(before, params, strict=True)
                     if a.numel()),
        "same_on_ranks": _same_on_ranks(full),
    }


def _same_on_ranks(full: dict) -> bool:
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    return torch.equal(flat, other)


def _full_of(variant: str, model) -> dict:
    if variant == "fsdp":
        return model.gather_full_params()
    inner = getattr(model, "module", model)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in inner.named_parameters()}


def _normal_variants() -> dict:
    ref = dict(GPT(CFG, seed=0).named_parameters())
    out = {}
    for v in ("torch_ddp", "zero1", "zero2", "fsdp", "torch_fsdp"):
        model, *_ = build_variant(v, CFG, CPU)
        full = _full_of(v, model)
        out[v] = full.keys() == ref.keys() and all(torch.equal(full[n], ref[n]) for n in ref)
    try:
        build_variant("torch_ddp", CFG, CPU, from_meta=True)
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def capacity_checks() -> dict:
    """Every check of this file on one rank."""
    return {"meta": _meta_variant(), "normal": _normal_variants()}


@pytest.fixture(scope="module")
def results():
    return dpcourse.run(capacity_checks, world_size=2, backend="gloo")


def test_meta_built_fsdp_trains_a_step(results):
    for r in results:
        m = r["meta"]
        assert m["finite"] and m["amp"] is None, m
        assert 3.0 < m["loss"] < 5.0, m  # about log(64) = 4.16 for a freshly initialised GPT
        assert m["moved"], m
        assert m["same_on_ranks"], m


def test_meta_build_uses_the_gpt_initialisation(results):
    m = results[0]["meta"]
    assert m["n_residual"] == 2 * CFG.n_layer and len(m["plain_std"]) > 2 * CFG.n_layer, m
    residual = 0.02 / (2 * CFG.n_layer) ** 0.5
    # 1,024 to 4,096 draws per matrix: the sample standard deviation is within 5 %.
    assert all(abs(s / residual - 1) < 0.1 for s in m["residual_std"]), m
    assert all(abs(s / 0.02 - 1) < 0.1 for s in m["plain_std"]), m
    assert m["ln_weights_one"] and m["biases_zero"], m


def test_meta_build_holds_the_shards_and_one_unit(results):
    for r in results:
        p = r["meta"]
        one_unit = p["peak"] - p["shards"]
        # The shards, one unit at a time, and the root unit (embeddings, final LayerNorm)
        # held until the end: its modules come first and last in module order.
        assert 0.99 * p["largest_unit"] <= one_unit <= 1.01 * (p["largest_unit"] + p["root"]), p
        assert p["peak"] < p["model"], p  # the whole model never exists on a rank


def test_other_variants_are_built_as_before(results):
    for r in results:
        n = r["normal"]
        assert all(n[v] for v in ("torch_ddp", "zero1", "zero2", "fsdp", "torch_fsdp")), n
        assert n["refused"] and "from_meta" in n["refused"] and "fsdp" in n["refused"], n
