"""Record on GPUs what lessons 05, 06, 08 and 09 measure, as JSON files the lessons draw from.

A laptop cannot show overlap or link bandwidth, so the lessons show the CPU
measurement of the learner's own run beside numbers recorded once on GPUs.
``python -m dpcourse.bench.lessons OUT_DIR`` runs every measurement in three
launches (2 ranks over NVLink, 2 ranks over sockets as a slow link, 1 rank)
and writes ``lessonNN-<N>x-<gpu>.json`` for NN = 05, 06, 08, 09 (each with the
environment), plus rank 0's Chrome traces of the profiled steps. What each
launch measures lives in :mod:`~dpcourse.bench.messages` and
:mod:`~dpcourse.bench.step_parts`.
``--timelines`` records only lesson 06's per-rank timelines (``timelines.json``).
Read the files with :func:`dpcourse.bench.recorded.load_recording`.

Model: GPT-2 small (about 124 M parameters, fp32 weights and gradients, bf16
autocast), 8 sequences of 1024 tokens per rank, fused AdamW, as ``dpcourse
bench ddp`` measures it.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from dpcourse.bench.allreduce import allreduce_sweep
from dpcourse.bench.ddp import ddp_step_times
from dpcourse.bench.messages import gpt2_grad_messages, many_small_messages
from dpcourse.bench.records import to_json
from dpcourse.bench.step_parts import profile_step, step_parts
from dpcourse.bench.timing import device_name
from dpcourse.device import rank_device
from dpcourse.launch.env import SLOW_LINK_ENV, slow_link

CONFIG = "auto"  # GPT-2 small on GPU, a tiny GPT on CPU (a dry run of this script)


def nvlink_rank(out_dir: str) -> dict:
    """Everything measured over the fast link (2 ranks); call on every rank."""
    from dpcourse.bench.steps import ddp_step_sweep

    out = {"device": device_name(rank_device()), "world_size": dist.get_world_size()}
    out["many_small_messages"] = many_small_messages(2**18)
    out["gpt2_grad_messages"] = gpt2_grad_messages()
    out["bucket_sweep"] = []
    for cap in (0, 1, 5, 25, 100):
        out["bucket_sweep"] += ddp_step_times(("bucketed", "overlapped", "torch_ddp"),
                                              config=CONFIG, bucket_cap_mb=cap, iters=10)
    out["variants"] = ddp_step_times(("local", "naive", "bucketed", "overlapped", "torch_ddp"),
                                     config=CONFIG, bucket_cap_mb=25, iters=20)
    out["step_parts"] = step_parts()
    out["timeline"] = {v: profile_step(v, out_dir=os.path.join(out_dir, "nvlink"))
                       for v in ("bucketed", "overlapped")}
    sizes = [2**k for k in range(10, 29, 2)]
    out["allreduce_sweep"] = allreduce_sweep(sizes, impls=("library", "ring"), warmup=3, iters=15)
    out["mlp_step_sweep"] = ddp_step_sweep(bucket_caps=(0, 1, 4, 16), iters=10)
    return out


def slow_rank(out_dir: str) -> dict:
    """What the slow link (NCCL over sockets) changes (2 ranks); call on every rank."""
    out = {"device": device_name(rank_device()), "world_size": dist.get_world_size()}
    out["variants"] = ddp_step_times(("local", "naive", "bucketed", "overlapped", "torch_ddp"),
                                     config=CONFIG, bucket_cap_mb=25, iters=10)
    out["step_parts"] = step_parts(iters=10)
    out["timeline"] = {"overlapped": profile_step("overlapped", out_dir=os.path.join(out_dir, "slow"))}
    sizes = [2**k for k in range(10, 27, 2)]
    out["allreduce_sweep"] = allreduce_sweep(sizes, impls=("library",), warmup=2, iters=8)
    return out


def timeline_rank(out_dir: str, variants=("bucketed", "overlapped")) -> dict:
    """Profile one step of each variant; every rank returns its own GPU timeline."""
    return {v: profile_step(v, out_dir=out_dir) for v in variants}


def one_rank() -> dict:
    """The same step on one GPU: the throughput(1) of scaling efficiency."""
    return {"variants": ddp_step_times(("local",), config=CONFIG, iters=20)}


def record_timelines(out_dir: str, env: dict) -> int:
    """Record every rank's timeline of one step, over the fast and the slow link."""
    import dpcourse

    out = {"environment": env, "what": "per-rank GPU timelines of one GPT-2 small step"}
    out["nvlink"] = dpcourse.run(timeline_rank, os.path.join(out_dir, "nvlink"), world_size=2,
                                 timeout=300)
    with slow_link(True):  # the ranks inherit the environment: NCCL over sockets
        out["slow_link"] = dpcourse.run(timeline_rank, os.path.join(out_dir, "slow"),
                                        world_size=2, timeout=300)
    with open(os.path.join(out_dir, "timelines.json"), "w") as f:
        json.dump(out, f, default=to_json)
    return 0


def main(argv=None) -> int:
    """Record everything (or, with ``--timelines``, lesson 06's timelines) into OUT_DIR."""
    import argparse

    import dpcourse
    from dpcourse.bench.report import environment, slug

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join("docs", "results"))
    parser.add_argument("--timelines", action="store_true",
                        help="record only lesson 06's per-rank GPU timelines, both links")
    args = parser.parse_args(argv)
    out_dir = args.out_dir
    os.environ.update(NCCL_NVLS_ENABLE="0")  # no NVLink multicast on shared machines
    backend, world_size = dpcourse.resolve_backend("auto", 2)
    env = environment(backend, world_size)
    record = {"model": "GPT-2 small, fp32 weights and gradients, bf16 autocast, fused AdamW, "
                       "8 x 1024 tokens per rank", "environment": env}
    if args.timelines:
        return record_timelines(out_dir, env)
    results = dpcourse.run(nvlink_rank, out_dir, world_size=2, timeout=400)
    record["nvlink"] = dict(results[0], timeline={v: [r["timeline"][v] for r in results]
                                                  for v in results[0]["timeline"]})
    print("fast link done", flush=True)
    record["one_gpu"] = dpcourse.run(one_rank, world_size=1, timeout=200)[0]
    print("one GPU done", flush=True)
    with slow_link(True):  # the ranks inherit the environment: NCCL over sockets
        results = dpcourse.run(slow_rank, out_dir, world_size=2, timeout=400)
    record["slow_link"] = dict(results[0], timeline={v: [r["timeline"][v] for r in results]
                                                     for v in results[0]["timeline"]})
    record["slow_link"]["nccl_env"] = dict(SLOW_LINK_ENV)
    gpu = slug(env.get("gpus", ["cpu"])[0]) if backend == "nccl" else "cpu"
    nv, slow, one = record["nvlink"], record["slow_link"], record["one_gpu"]
    head = {k: record[k] for k in ("model", "environment")}
    per_lesson = {
        "05": {"many_small_messages": nv["many_small_messages"],
               "gpt2_grad_messages": nv["gpt2_grad_messages"], "bucket_sweep": nv["bucket_sweep"]},
        "06": {"nvlink": {k: nv[k] for k in ("variants", "step_parts", "timeline")},
               "slow_link": {k: slow[k] for k in ("variants", "step_parts", "timeline")}},
        "08": {"one_gpu": one["variants"], "nvlink": nv["variants"], "slow_link": slow["variants"]},
        "09": {"allreduce_sweep": nv["allreduce_sweep"], "mlp_step_sweep": nv["mlp_step_sweep"],
               "slow_link_allreduce_sweep": slow["allreduce_sweep"]},
    }
    os.makedirs(out_dir, exist_ok=True)
    for lesson, data in per_lesson.items():
        path = os.path.join(out_dir, f"lesson{lesson}-{world_size}x-{gpu}.json")
        with open(path, "w") as f:
            json.dump(dict(head, lesson=lesson, **data), f, default=to_json)
        print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
