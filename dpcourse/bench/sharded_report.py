"""Run the sharded benchmarks on this machine's GPUs and write one JSON per measurement.

Usage: ``python -m dpcourse.bench.sharded_report OUT_DIR [--skip-capacity] [--steps-only]``.
Writes ``zero-fsdp-<N>x-<gpu>.json`` (step time and memory per variant and rank),
``fsdp-timeline-<N>x-<gpu>.json`` and ``capacity-<N>x-<gpu>.json`` into OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import dpcourse
from dpcourse.bench.report import environment, slug


def _write(out_dir: str, name: str, payload: dict) -> str:
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print("wrote", path)
    return path


def main(argv=None) -> int:
    """Run the step-time/memory comparison, the FSDP timeline and (optionally) the capacity search."""
    from dpcourse.bench.capacity import model_capacity
    from dpcourse.bench.fsdp_timeline import fsdp_timeline
    from dpcourse.bench.sharded import sharded_step_times

    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--steps-only", action="store_true",
                    help="only the step-time and memory comparison (no timeline, no capacity)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    world = torch.cuda.device_count()
    env = environment("nccl", world)
    tag = f"{world}x-{slug(torch.cuda.get_device_name(0))}"
    stages = [("zero-fsdp", "rows_per_rank", sharded_step_times, {"iters": args.iters})]
    if not args.steps_only:
        stages.append(("fsdp-timeline", "per_rank", fsdp_timeline, {}))
    if not (args.skip_capacity or args.steps_only):
        stages.append(("capacity", "per_rank", model_capacity, {}))
    failed = 0
    for name, key, fn, kwargs in stages:
        try:  # one failing measurement must not cost the others
            result = dpcourse.run(fn, world_size=world, backend="nccl", timeout=600, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported, and the exit code says so
            print(f"{name} failed: {exc}")
            failed += 1
            continue
        _write(args.out_dir, f"{name}-{tag}", {"benchmark": name, "environment": env, key: result})
    return 1 if failed else 0



def load_sharded_results(stem: str, results_dir=None) -> dict:
    """Load one recorded file of this benchmark, e.g. ``"zero-fsdp-2x-nvidia-h200"``.

    Args:
        stem: file name without ``.json``.
        results_dir: where it is (default: the repository's ``docs/results``).

    Returns:
        The file's dict, plus ``"file"`` (its name) and ``"hardware"`` (one line naming the GPUs).
    """
    import pathlib

    from dpcourse.bench.recorded import RESULTS, hardware

    path = (pathlib.Path(results_dir) if results_dir is not None else RESULTS) / f"{stem}.json"
    with open(path) as f:
        data = json.load(f)
    data["file"] = path.name
    data["hardware"] = hardware(data.get("environment", {}))
    return data


if __name__ == "__main__":
    raise SystemExit(main())
