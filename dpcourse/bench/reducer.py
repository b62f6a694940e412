"""Record on GPUs what lessons 10 and 11 measure: hooks, first bucket, rebuild, memory, loss curves.

``python -m dpcourse.bench.reducer OUT_DIR`` runs two launches of 2 ranks
(NVLink, then NCCL over sockets as a slow link) and writes
``lesson11-<N>x-<gpu>.json`` with:

* ``step``: GPT-2 small step times (bf16 autocast, fp32 gradients, fused AdamW,
  8 x 1024 tokens per rank), interleaved in one run: torch DDP with its
  defaults (25 MiB buckets, a 1 MiB first bucket, rebuild), torch DDP with the
  bf16 hook, and ``DataParallelOverlapped`` plain, with ``first_bucket_mb=1`` and
  ``rebuild_buckets=True``, and with the fp16, bf16 and PowerSGD hooks;
* ``memory``: peak GPU memory of a step with and without ``gradient_as_bucket_view``;
* ``curves`` (slow link only): 200 steps of lesson 08's character GPT with each
  hook, losses averaged over ranks.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from dpcourse.bench.timing import device_name, summarize, time_interleaved
from dpcourse.bench.workload import adamw, autocast_dtype, gpt_config, make_step
from dpcourse.device import rank_device

CURVE_STEPS = int(os.environ.get("DPCOURSE_CURVE_STEPS", 200))
ITERS = int(os.environ.get("DPCOURSE_ITERS", 12))


def _hook(name: str):
    """``(state, hook)`` for a hook name; a new state per model (PowerSGD keeps per-model state)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)
        return state, powerSGD_hook.powerSGD_hook
    return None, {"fp16": default_hooks.fp16_compress_hook,
                  "bf16": default_hooks.bf16_compress_hook}[name]


def build(variant: str, model, device):
    """Wrap ``model`` as ``variant`` names it, e.g. ``"overlapped+bf16"`` or ``"torch_ddp"``."""
    from torch.nn.parallel import DistributedDataParallel

    from dpcourse.ddp import DataParallelOverlapped

    kind, _, hook = variant.partition("+")
    ids = [device.index] if device.type == "cuda" else None
    if kind == "torch_ddp":
        wrapped = DistributedDataParallel(model, device_ids=ids)  # all of torch's defaults
    elif kind == "torch_ddp_view":
        wrapped = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    elif kind == "overlapped":
        wrapped = DataParallelOverlapped(model)
    elif kind == "overlapped_first_rebuild":
        wrapped = DataParallelOverlapped(model, first_bucket_mb=1.0, rebuild_buckets=True)
    elif kind == "overlapped_copy":
        wrapped = DataParallelOverlapped(model, gradient_as_bucket_view=False)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    if hook:
        wrapped.register_comm_hook(*_hook(hook))
    return wrapped


def _gpt_step(variant: str, batch_size: int = 8):
    from dpcourse.models import GPT, random_tokens

    device = rank_device()
    _, cfg = gpt_config("auto", device)
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=dist.get_rank()))
    model = GPT(cfg, seed=0).to(device)
    wrapped = build(variant, model, device)
    return make_step(wrapped, adamw(model.parameters(), device), idx, targets,
                     autocast_dtype(device))


def step_times(variants, iters: int = ITERS) -> list[dict]:
    """Time one GPT step per variant, interleaved; call on every rank."""
    steps = {v: _gpt_step(v) for v in variants}
    times = time_interleaved(steps, warmup=3, iters=iters)
    rows = [dict(variant=v, **summarize(times[v])) for v in variants]
    base = {r["variant"]: r["median_s"] for r in rows}
    for r in rows:
        r["vs_torch_ddp"] = r["median_s"] / base["torch_ddp"]
        r["vs_overlapped"] = r["median_s"] / base["overlapped"]
    return rows


def peak_memory(variants=("overlapped", "overlapped_copy", "torch_ddp", "torch_ddp_view")):
    """Peak GPU memory (bytes) of two training steps per variant, one variant at a time."""
    out = {}
    device = rank_device()
    for v in variants:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step = _gpt_step(v)
        step()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            out[v] = torch.cuda.max_memory_allocated(device)
        del step
    return out


def loss_curve(hook: str | None, steps: int = CURVE_STEPS) -> list[float]:
    """Lesson 08's run (character GPT on the Zen of Python) for ``steps`` steps; mean loss per step."""
    from torch.utils.data import DataLoader

    from dpcourse.data import ShardedSampler
    from dpcourse.ddp import DataParallelOverlapped
    from dpcourse.models import GPT, GPTConfig
    from dpcourse.realdata import CharVocab, char_dataset, zen_of_python

    device = rank_device()
    text = zen_of_python()
    vocab = CharVocab.from_text(text)
    cfg = GPTConfig(vocab_size=len(vocab), block_size=32, n_layer=2, n_head=2, n_embd=48)
    data = char_dataset(text, cfg.block_size, vocab)
    sampler = ShardedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    model = DataParallelOverlapped(GPT(cfg, seed=0).to(device), bucket_cap_mb=0.05)
    if hook:
        model.register_comm_hook(*_hook(hook))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3 * dist.get_world_size())
    losses, epoch = [], 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = model(x.to(device), y.to(device))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
            if len(losses) == steps:
                break
        epoch += 1
    return losses


STEP_VARIANTS = ("torch_ddp", "overlapped", "overlapped_first_rebuild", "torch_ddp+bf16",
                 "overlapped+bf16", "overlapped+fp16", "overlapped+powersgd")


def link_rank(slow: bool) -> dict:
    """Everything measured over one link (2 ranks); call on every rank."""
    out = {"device": device_name(rank_device()), "world_size": dist.get_world_size()}
    cpu = rank_device().type != "cuda"  # a dry run: torch refuses its bf16 hook without CUDA
    out["step"] = step_times([v for v in STEP_VARIANTS if not (cpu and v == "torch_ddp+bf16")])
    if not slow:
        out["memory"] = peak_memory()
    else:
        out["curves"] = {h or "fp32": loss_curve(h) for h in (None, "bf16", "fp16", "powersgd")}
    return out


def main(out_dir: str) -> int:
    import dpcourse
    from dpcourse.bench.cli import slow_link
    from dpcourse.bench.report import environment, slug

    backend, world_size = dpcourse.resolve_backend("auto", 2)
    env = environment(backend, world_size)
    record = {"what": "GPU recordings shown by lessons 10 and 11",
              "model": "GPT-2 small, fp32 weights and gradients, bf16 autocast, fused AdamW, "
                       "8 x 1024 tokens per rank; curves: lesson 08's character GPT",
              "environment": env}
    gpu = slug(env.get("gpus", ["cpu"])[0]) if backend == "nccl" else "cpu"
    path = os.path.join(out_dir, f"lesson11-{world_size}x-{gpu}.json")

    def save():  # after each launch: a cut-short run keeps what it measured
        with open(path, "w") as f:
            json.dump(record, f, indent=1, default=str)

    record["nvlink"] = dpcourse.run(link_rank, False, world_size=2, timeout=300)[0]
    save()
    print("fast link done", flush=True)
    with slow_link(True):
        record["slow_link"] = dpcourse.run(link_rank, True, world_size=2, timeout=300)[0]
        record["slow_link"]["nccl_env"] = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    save()
    for link in ("nvlink", "slow_link"):
        for r in record[link]["step"]:
            print(f"{link:9s} {r['variant']:26s} {r['median_s'] * 1e3:8.1f} ms "
                  f"x{r['vs_torch_ddp']:.3f} torch  x{r['vs_overlapped']:.3f} overlapped")
    print("memory", record["nvlink"].get("memory"))
    print("final losses", {k: sum(v[-20:]) / 20 for k, v in record["slow_link"]["curves"].items()})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
