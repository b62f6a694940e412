"""``dpcourse doctor``: what this machine offers, and the ranks :func:`dpcourse.run` would start."""

from __future__ import annotations

import argparse
import os
import platform


def doctor(args: argparse.Namespace) -> int:
    """Print what this machine offers: versions, devices, backends, and what run() would pick."""
    import torch
    import torch.distributed as dist

    from dpcourse.launch import plan_ranks

    rows = [
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("cpu cores", str(os.cpu_count())),
        ("distributed", str(dist.is_available())),
        ("gloo", str(dist.is_gloo_available())),
        ("nccl", str(dist.is_nccl_available())),
        ("cuda available", str(torch.cuda.is_available())),
    ]
    if torch.cuda.is_available():
        rows.append(("cuda runtime", str(torch.version.cuda)))
        if dist.is_nccl_available():
            rows.append(("nccl version", ".".join(map(str, torch.cuda.nccl.version()))))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB"))
    default = plan_ranks()
    rows.append(("dpcourse.run default", str(default)))
    rows.append(("a lesson's 4 ranks", str(plan_ranks(4))))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.check:
        import dpcourse

        def hello() -> int:
            import torch.distributed as d

            t = torch.ones(1, device="cuda" if d.get_backend() == "nccl" else "cpu")
            d.all_reduce(t)
            return int(t.item())

        try:
            sums = dpcourse.run(hello, timeout=60)
        except (dpcourse.RankError, dpcourse.RankDiedError, dpcourse.RankTimeoutError) as exc:
            print(f"{'all_reduce check':<{width}}  FAILED\n{exc}")
            return 1
        ok = all(s == default.world_size for s in sums)
        print(f"{'all_reduce check':<{width}}  {'ok' if ok else 'WRONG'} ({sums})")
        return 0 if ok else 1
    return 0
