"""Record on GPUs what lesson 16 cannot show on CPU ranks: HSDP over NCCL, and torch.compile with DDP.

``python -m dpcourse.bench.record_torch_tools --out DIR`` starts one rank per GPU (2 or 4)
and writes ``DIR/lesson16-<N>x-<gpu>.json`` with the machine named. It measures, each
rank on its own GPU:

* **sharding**: GPT-2 small in bf16 under torch DDP and under ``fully_shard`` on every
  2-D mesh ``(replicate, shard)`` whose sizes multiply to N (``(1, N)`` is plain FSDP,
  ``(N, 1)`` replicates whole weights): median step time of interleaved steps, peak
  memory, the weight bytes each rank holds, and the collectives of one step (op,
  the group's ranks, bytes), read by :func:`dpcourse.torch_tools.trace_collectives`;
* **checkpointing**: the same FSDP step with every block under activation
  checkpointing: peak memory and step time against the step without;
* **compile**: a smaller GPT under torch DDP, eager and ``torch.compile``'d with and
  without ``torch._dynamo.config.optimize_ddp`` (DDPOptimizer): the graphs the
  compiler received (one per bucket-sized piece when DDPOptimizer splits), first-step
  compile seconds and the median step time.

``--config tiny`` is a dry run on CPU ranks (gloo) for checking the script anywhere.
Read the file with :func:`dpcourse.bench.recorded.load_recording` (``"16"``).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from dpcourse.torch_tools import trace_collectives

def meshes(world_size: int) -> list[tuple[int, int]]:
    """Every ``(replicate, shard)`` pair whose product is ``world_size``, plain FSDP first."""
    return [(world_size // s, s) for s in range(world_size, 0, -1) if world_size % s == 0]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(variant, cfg, device, checkpointing=False):
    """Return ``(model, step)`` for ``"ddp"`` or ``"RxS"`` (fully_shard on that mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dpcourse.bench.workload import adamw, autocast_dtype, make_step
    from dpcourse.models import GPT, random_tokens

    with torch.device(device):
        model = GPT(cfg, seed=0)
    low = autocast_dtype(device)
    if variant == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        amp = low
    else:
        r, s = (int(x) for x in variant.split("x"))
        mesh = init_device_mesh(device.type, (r, s), mesh_dim_names=("replicate", "shard"))
        if checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        amp = None
    idx, targets = (t.to(device) for t in random_tokens(BATCH[device.type], cfg, seed=dist.get_rank()))
    return model, make_step(model, adamw(model.parameters(), device), idx, targets, amp)


def _local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in model.parameters())


def _peak(step, device, steps=3) -> int | None:
    if device.type != "cuda":
        for _ in range(steps):
            step()
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    for _ in range(steps):
        step()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


BATCH = {"cuda": 4, "cpu": 2}


def sharding_rank(cfg, iters: int) -> dict:
    """DDP and fully_shard on every 2-D mesh: step time, peak memory, collectives of one step."""
    from dpcourse.bench.timing import summarize, time_interleaved
    from dpcourse.device import rank_device

    device = rank_device()
    variants = ["ddp"] + [f"{r}x{s}" for r, s in meshes(dist.get_world_size())]
    rows, steps = {}, {}
    for v in variants:
        model, step = _build(v, cfg, device)
        peak = _peak(step, device)
        events = []
        with trace_collectives(events):
            step()
        _sync(device)
        rows[v] = dict(variant=v, peak_bytes=peak, param_bytes_local=_local_bytes(model),
                       collectives=events)
        steps[v] = step
    times = time_interleaved(steps, warmup=1, iters=iters)
    for v in variants:
        rows[v].update(summarize(times[v]))
    ckpt = {}
    for on in (False, True):
        steps.clear()
        model, step = _build(f"1x{dist.get_world_size()}", cfg, device, checkpointing=on)
        ckpt[on] = dict(checkpointing=on, peak_bytes=_peak(step, device),
                        **summarize(time_interleaved({"s": step}, warmup=1, iters=iters)["s"]))
        del model, step
    return {"sharding": list(rows.values()), "checkpointing": list(ckpt.values())}


def compile_rank(cfg, iters: int, bucket_cap_mb: float) -> dict:
    """torch DDP eager, compiled with DDPOptimizer, and compiled without it."""
    import torch._dynamo

    from dpcourse.bench.timing import summarize, time_interleaved
    from dpcourse.bench.workload import adamw, autocast_dtype, make_step
    from dpcourse.device import rank_device
    from dpcourse.models import GPT, random_tokens

    device = rank_device()
    idx, targets = (t.to(device) for t in random_tokens(BATCH[device.type], cfg, seed=dist.get_rank()))
    rows, steps = {}, {}
    for name, optimize in (("eager", None), ("compiled, DDPOptimizer", True),
                           ("compiled, one graph", False)):
        torch._dynamo.reset()
        with torch.device(device):
            model = GPT(cfg, seed=0)
        ids = [device.index] if device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
        graphs = []
        run = ddp
        if optimize is not None:
            torch._dynamo.config.optimize_ddp = optimize

            def counting(gm, example_inputs, graphs=graphs):
                graphs.append(sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
                if device.type != "cuda":  # the CPU dry run checks the graphs, not the kernels
                    return gm.forward
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)

            run = torch.compile(ddp, backend=counting)
        step = make_step(run, adamw(model.parameters(), device), idx, targets, autocast_dtype(device))
        t0 = time.perf_counter()
        for _ in range(2):  # compiles forward and backward
            step()
        _sync(device)
        rows[name] = dict(variant=name, optimize_ddp=optimize, first_two_steps_s=time.perf_counter() - t0,
                          graphs=len(graphs), placeholders_per_graph=list(graphs), all_graphs=graphs,
                          ddp_buckets=ddp._get_ddp_logging_data().get("num_buckets_reduced"))
        steps[name] = step
    times = time_interleaved(steps, warmup=1, iters=iters)
    for name, row in rows.items():
        row.update(summarize(times[name]))
        row["graphs_after_timing"] = len(row.pop("all_graphs"))  # more: recompiled while timed
    torch._dynamo.config.optimize_ddp = True
    return {"compile": list(rows.values()), "bucket_cap_mb": bucket_cap_mb}


def main(argv=None) -> int:
    """Record lesson 16's GPU measurements into ``--out`` (one JSON file)."""
    import argparse

    import dpcourse
    from dpcourse.bench.records import to_json
    from dpcourse.bench.report import environment, slug
    from dpcourse.models import GPTConfig, gpt2_small

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("docs", "results"))
    parser.add_argument("--config", choices=("gpt2_small", "tiny"), default="gpt2_small",
                        help="tiny: a dry run on CPU ranks over gloo")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    os.environ.update(NCCL_NVLS_ENABLE="0")  # no NVLink multicast on shared machines
    t0 = time.perf_counter()
    if args.config == "tiny":
        cfg, small, device, ranks = GPTConfig(64, 32, 2, 2, 32), GPTConfig(64, 32, 2, 2, 32), "cpu", 4
        cap = 1.0
    else:
        cfg, device, ranks = gpt2_small(), "auto", torch.cuda.device_count()
        if ranks < 2:
            parser.error(f"this machine has {ranks} GPU(s): the recording needs 2 or more "
                         "(--config tiny runs on CPU ranks).")
        small, cap = GPTConfig(n_layer=4), 25.0
    plan = dpcourse.plan_ranks(ranks, device=device)
    print(plan, flush=True)
    env = environment(plan.backend, plan.world_size)
    record = {"environment": env, "plan": str(plan),
              "model": (f"sharding and checkpointing: GPT {cfg}, bf16 compute "
                        "(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for fully_shard, "
                        f"bf16 autocast for DDP), fused AdamW, {BATCH['cuda']} x {cfg.block_size} "
                        f"tokens per rank; compile: GPT {small}, torch DDP, bucket_cap_mb={cap}")}
    # By module name, not as __main__'s functions: the ranks import them instead of unpickling code.
    from dpcourse.bench import record_torch_tools as here

    out = dpcourse.run(here.sharding_rank, cfg, args.iters, world_size=plan.world_size, device=device, timeout=300)
    record["sharding"] = [r["sharding"] for r in out]
    record["checkpointing"] = [r["checkpointing"] for r in out]
    print(f"sharding done ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = dpcourse.run(here.compile_rank, small, args.iters, cap, world_size=plan.world_size, device=device,
                       timeout=300)
    record["compile"] = [r["compile"] for r in out]
    record["bucket_cap_mb"] = cap
    record["seconds"] = time.perf_counter() - t0
    gpu = slug(env["gpus"][0]) if plan.backend == "nccl" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"lesson16-{plan.world_size}x-{gpu}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=to_json)
    print(f"wrote {path} in {record['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
