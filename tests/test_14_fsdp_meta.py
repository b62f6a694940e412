"""Lesson 14: a model built on the meta device, materialised by FSDP one unit at a time.

Equality with the normally built model holds when construction draws its random
numbers only through each layer's ``reset_parameters()``, layers in registration
order, from the same generator state: true of every model here (GPT blocks with
torch's default initialisation, a tied output layer, frozen layers, BatchNorm).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpcourse
from dpcourse.data import shard_batch
from dpcourse.fsdp import CPUMemoryPeak, FullyShardedDataParallel
from dpcourse.models import MLP, Block, GPTConfig
from ddp_helpers import global_batch
from fixture_models import BatchNormMLP, TiedEmbeddingModel

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
SEED, STEPS = 5, 3
TOL_FP32 = 3e-5  # as test_14_fsdp: only the order of additions differs from one process
# SGD with momentum, not AdamW: with torch's default initialisation the gradient of the key
# part of the qkv bias is zero up to rounding (softmax ignores a constant added to every
# key), and Adam divides that rounding noise by its own size, turning a 1e-9 difference in
# summation order into a 4e-3 difference in the weights (seen on 2 gloo ranks, with the
# model built normally just as with the meta build).
OPTIMIZER = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


class TiedBlocks(nn.Module):
    """Embedding, GPT blocks, LayerNorm, and an output layer tied to the embedding.

    Every weight comes from its layer's ``reset_parameters()`` (torch's default
    initialisation); block 0's first LayerNorm and block 1's attention are frozen.
    """

    def __init__(self, cfg: GPTConfig = CFG, n_layer: int = 3):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied after construction, as GPT-2 does
        self.blocks[0].ln1.requires_grad_(False)
        self.blocks[1].attn.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of (B, T) token ids."""
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


BUILDERS = {"tied_blocks": TiedBlocks, "mlp": lambda: MLP(seed=None),
            "tied": lambda: TiedEmbeddingModel(seed=None),
            "batchnorm": lambda: BatchNormMLP(seed=None)}


def _normal(name):
    torch.manual_seed(SEED)
    return BUILDERS[name]()


def _meta(name, **kwargs):
    with torch.device("meta"):
        model = BUILDERS[name]()
    torch.manual_seed(SEED)  # what the normal build started from
    return FullyShardedDataParallel(model, **kwargs)


def _same_as_normal(name) -> dict:
    """Shard for shard, and buffer for buffer, against the same model built normally."""
    ref, meta = FullyShardedDataParallel(_normal(name)), _meta(name)
    shards = [torch.equal(a, b) and a.requires_grad == b.requires_grad
              for a, b in zip(ref.parameters(), meta.parameters(), strict=True)]
    buffers = [torch.equal(a, b) for a, b in zip(ref.module.buffers(), meta.module.buffers(),
                                                   strict=True)]
    full, normal = meta.gather_full_params(), _normal(name)
    named = dict(normal.named_parameters())  # a tied weight once, under its first name
    return {"shards": shards, "buffers": buffers, "n_shards": len(shards),
            "full_equal": full.keys() == named.keys()
            and all(torch.equal(full[n], named[n]) for n in full)}


def _training() -> float:
    """Train the meta-built FSDP model and one process on the whole batch; largest difference."""
    model = _meta("tied_blocks")
    opt = OPTIMIZER[0](model.parameters(), **OPTIMIZER[1])
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = []
    for step in range(STEPS):
        x, y = (shard_batch(t, rank, world) for t in global_batch("gpt", step))
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        ours.append(model.gather_full_params())
    solo = _normal("tied_blocks")
    ref, opt = [], OPTIMIZER[0](solo.parameters(), **OPTIMIZER[1])
    for step in range(STEPS):
        solo(*global_batch("gpt", step)).backward()
        opt.step()
        opt.zero_grad()
        ref.append({n: p.detach().clone() for n, p in solo.named_parameters()})
    return max((a[n] - b[n]).abs().max().item() for a, b in zip(ours, ref) for n in a)


def _peak() -> dict:
    """Bytes alive at most while FSDP builds 8 blocks from meta, against building them first."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32)
    with torch.device("meta"):
        meta_model = TiedBlocks(cfg, n_layer=8)
    with CPUMemoryPeak() as meta_mem:
        fsdp = FullyShardedDataParallel(meta_model)
    with CPUMemoryPeak() as eager_mem:
        FullyShardedDataParallel(TiedBlocks(cfg, n_layer=8))
    fulls = [[4 * dist.get_world_size() * f.chunk for f in u.flats] for u in fsdp.units]
    return {"meta": meta_mem.peak_bytes, "eager": eager_mem.peak_bytes,
            "shards": sum(4 * p.numel() for p in fsdp.parameters()),
            "root": sum(fulls[0]), "largest_unit": max(sum(f) for f in fulls[1:]),
            "model": sum(4 * p.numel() for p in TiedBlocks(cfg, n_layer=8).parameters())}


class Scale(nn.Module):
    """A layer with its own parameter and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


class ScaledLinear(nn.Linear):
    """A Linear with a buffer its reset_parameters() does not know about."""

    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("scale", torch.arange(4.0))


def _error_of(call) -> str | None:
    try:
        call()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _errors() -> dict:
    def meta(build):
        with torch.device("meta"):
            return build()

    def linears_only(m):
        if isinstance(m, nn.Linear):
            m.reset_parameters()

    def boom(m):
        raise KeyError("no init for this layer")

    partly = meta(lambda: MLP(seed=None))
    partly[0] = nn.Linear(8, 16)
    return {
        "no_reset": _error_of(lambda: FullyShardedDataParallel(
            meta(lambda: nn.Sequential(nn.Linear(4, 4), Scale())))),
        "forgot_param": _error_of(lambda: FullyShardedDataParallel(
            meta(lambda: TiedBlocks()), param_init_fn=linears_only)),
        "forgot_buffer": _error_of(lambda: FullyShardedDataParallel(
            meta(lambda: nn.Sequential(ScaledLinear(), nn.Linear(4, 4))))),
        "init_raises": _error_of(lambda: FullyShardedDataParallel(
            meta(lambda: MLP(seed=None)), param_init_fn=boom)),
        "partly": _error_of(lambda: FullyShardedDataParallel(partly)),
        "not_meta": _error_of(lambda: FullyShardedDataParallel(
            MLP(seed=None), param_init_fn=linears_only)),
        # After the failures, the ranks still agree: a collective completes.
        "still_in_step": _error_of(lambda: dist.barrier()),
    }


def meta_checks() -> dict:
    """Every multi-rank check of this file on one rank."""
    return {"same": {name: _same_as_normal(name) for name in BUILDERS},
            "training": _training(), "peak": _peak(), "errors": _errors()}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, dpcourse.run(meta_checks, world_size=request.param, backend="gloo")


def test_meta_build_equals_the_normal_build_shard_for_shard(results):
    for r in results[1]:
        for name, s in r["same"].items():
            assert s["n_shards"] > 0 and all(s["shards"]), (name, s)
            assert all(s["buffers"]) and s["full_equal"], (name, s)
    assert results[1][0]["same"]["batchnorm"]["buffers"]  # BatchNorm's statistics came too


def test_training_from_meta_equals_one_process(results):
    for r in results[1]:
        assert r["training"] < TOL_FP32, r["training"]


def test_construction_peak_is_one_unit_plus_the_shards(results):
    for r in results[1]:
        p = r["peak"]
        # Measured by the CPU allocator: the shards plus one unit at a time, and the small
        # root unit (embedding, final LayerNorm), held until the end: its modules come
        # first and last in module order.
        one_unit = p["meta"] - p["shards"]
        assert 0.99 * p["largest_unit"] <= one_unit <= 1.01 * (p["largest_unit"] + p["root"]), p
        assert p["meta"] < p["model"] <= p["eager"], p  # building first holds the whole model


def test_clear_errors_on_every_rank(results):
    for rank, r in enumerate(results[1]):
        e = r["errors"]
        assert e["no_reset"].startswith("ValueError") and "reset_parameters" in e["no_reset"]
        assert "param_init_fn=" in e["no_reset"] and "Scale" in e["no_reset"]
        assert e["forgot_param"].startswith("RuntimeError")
        assert "blocks.0.ln2.weight" in e["forgot_param"]
        assert "buffer 'scale'" in e["forgot_buffer"]
        assert "KeyError" in e["init_raises"] and "no init" in e["init_raises"]
        assert e["partly"].startswith("ValueError") and "partly" in e["partly"]
        assert e["not_meta"].startswith("ValueError") and "meta" in e["not_meta"]
        assert e["still_in_step"] is None
        if rank:
            assert e["forgot_param"].startswith("RuntimeError: rank 0:")
