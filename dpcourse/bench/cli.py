"""``dpcourse bench allreduce|ddp``: run a benchmark, print a table, write JSON and a plot.

Where the files go: ``--out DIR``; without it, ``docs/results/`` when the command
runs from the root of the dpcourse checkout (where the recorded results live, see
docs/benchmarks.md), and elsewhere the command asks for ``--out`` before running
anything, rather than creating ``docs/results/`` in whatever directory it runs from.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

from dpcourse.argtypes import (UsageError, comma_list, nonnegative_int, nonnegative_mib,
                               positive_int, positive_seconds)
from dpcourse.launch.env import slow_link  # also imported from here by notebooks

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """Parse ``"4096"``, ``"4K"``, ``"64KiB"``, ``"1M"``, ``"1G"`` (binary units) into bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 4096, 4K, 64KiB, 1M, 1G)")
    size = int(float(m.group(1)) * UNITS[m.group(2).upper()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"a message size must be at least 1 byte, got {text!r}")
    return size


def size_range(lo: int, hi: int, factor: int = 2) -> list[int]:
    """Return ``lo, lo*factor, ...`` up to ``hi`` (inclusive)."""
    if lo < 1 or hi < lo or factor < 2:
        raise ValueError(
            f"need 1 <= min size <= max size and factor >= 2, got {lo}, {hi}, {factor}.")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks (default: one per GPU on a machine with 2 or more, else 2)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: nccl when every rank gets its own GPU, else gloo on CPU")
    p.add_argument("--iters", type=positive_int, default=None, help="timed trials per candidate")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed calls per candidate")
    p.add_argument("--slow-link", action="store_true",
                   help="NCCL over sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), "
                   "like a slow network")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="directory for JSON and plots, created if missing (default: "
                   "docs/results when run from the dpcourse checkout's root; elsewhere required)")
    p.add_argument("--no-plot", action="store_true", help="write JSON only")
    p.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds before the run counts as hung")


def add_parser(sub) -> None:
    """Add ``bench allreduce`` and ``bench ddp`` to the ``dpcourse`` command's subparsers."""
    bench = sub.add_parser("bench", help="all-reduce bandwidth and DDP step-time benchmarks",
                           description="Run a benchmark on local ranks, print a table and write "
                           "JSON and a plot (see --out).")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK",
                                 help="allreduce or ddp; BENCHMARK --help tells more")

    p = kinds.add_parser("allreduce", help="sweep message sizes: hand-built rings vs the library")
    _common(p)
    p.add_argument("--sizes", type=comma_list(parse_size), default=None,
                   help="comma-separated sizes, e.g. 4K,1M,256M (overrides --min/--max-size)")
    p.add_argument("--min-size", type=parse_size, default=4 * 2**10, help="default 4K")
    p.add_argument("--max-size", type=parse_size, default=None,
                   help="default 1G on GPU, 64M on CPU")
    p.add_argument("--impls", type=comma_list(str), default=["library", "ring"],
                   help="comma-separated: library, ring, naive; on GPUs joined by NVLink also "
                   "one_shot, two_shot, two_shot_symm, torch_one_shot, torch_two_shot "
                   "(dpcourse.comm.kernels.bench_impls)")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float16", "bfloat16", "float64"],
                   help="element type of the reduced tensors (default float32)")
    p.add_argument("--calls-per-trial", type=positive_int, default=1,
                   help="back-to-back calls timed together per trial (default 1: one call "
                   "after a barrier, its latency; e.g. 20: how fast queued calls complete)")
    p.set_defaults(func=run_allreduce)

    p = kinds.add_parser("ddp", help="step time of the data-parallel wrappers vs torch DDP")
    _common(p)
    p.add_argument("--config", default="auto", choices=["auto", "gpt2_small", "tiny"],
                   help="model: GPT-2 small on GPU, tiny on CPU by default")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per rank (default 8)")
    p.add_argument("--bucket-cap-mb", type=nonnegative_mib, default=25.0,
                   help="bucket size of the bucketed and overlapped wrappers (default 25)")
    p.add_argument("--variants", type=comma_list(str),
                   default=["local", "naive", "bucketed", "overlapped", "torch_ddp"],
                   help="also: zero1, zero2, fsdp, torch_fsdp (sharded data parallelism); "
                   "on GPUs joined by NVLink overlapped_one_shot, overlapped_two_shot (our "
                   "wrapper with the NVLink kernels) and the same with _comm_stream (the kernels "
                   "on a communication stream); a kernel variant ending in _<N>_blocks caps "
                   "the kernel's grid at N blocks")
    p.add_argument("--sweep-caps", type=comma_list(nonnegative_mib), default=[0, 1, 5, 25, 100],
                   help="bucket sizes (MiB) for the bucket sweep; empty string to skip it")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "none"],
                   help="autocast: auto is bf16 on GPUs that support it, none on CPU")
    p.set_defaults(func=run_ddp)


def _backend(args: argparse.Namespace) -> tuple[str, int]:
    """``(backend, world_size)`` for ``--backend`` and ``--world-size``, or a one-line UsageError.

    Also refuses, before anything runs, ranks that would not fit in memory and an
    unusable ``--out`` (see :func:`out_dir`), which it replaces with the directory to use.
    """
    import dpcourse
    from dpcourse.launch.resources import check_resources

    args.out = out_dir(args.out)
    try:
        backend, world_size = dpcourse.resolve_backend(args.backend, args.world_size)
        check_resources(world_size, backend)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--backend/--world-size: {exc}") from None
    return backend, world_size


def _in_checkout(cwd: str) -> bool:
    """Whether ``cwd`` is the root of the dpcourse checkout (its pyproject names dpcourse)."""
    try:
        with open(os.path.join(cwd, "pyproject.toml")) as f:
            named = re.search(r'^name\s*=\s*"dpcourse"', f.read(), re.MULTILINE)
    except OSError:
        return False
    return bool(named) and os.path.isdir(os.path.join(cwd, "docs"))


def out_dir(out: str | None, cwd: str | None = None) -> str:
    """Return the directory the results go to, or raise a UsageError saying why it cannot be used.

    Args:
        out: ``--out`` as given (created here if missing); ``None`` means docs/results
            in the dpcourse checkout's root, and is refused elsewhere.
        cwd: the directory the command runs in (default: the current one).
    """
    cwd = os.getcwd() if cwd is None else cwd
    if out is None:
        if not _in_checkout(cwd):
            raise UsageError("--out: say where to write the results (e.g. --out results); "
                             "without --out they go to docs/results only when the command runs "
                             "from the root of the dpcourse checkout")
        return os.path.join(cwd, "docs", "results")
    path = os.path.join(cwd, out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out: {out} is a file, not a directory; give a directory (created "
                         "if missing) for the JSON and plots")
    try:  # now, not after a run of many minutes
        os.makedirs(path, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path)  # noqa: SIM115 - closed at once
        probe.close()
    except OSError as exc:
        raise UsageError(f"--out: cannot write into {out} ({exc.strerror}); give another "
                         "directory") from None
    return out


def _check_names(flag: str, names: list[str], allowed: tuple[str, ...],
                 accepts=lambda name: False) -> None:
    """Raise a UsageError for a name neither in ``allowed`` nor taken by ``accepts``, or none."""
    wrong = [n for n in names if n not in allowed and not accepts(n)]
    if wrong or not names:
        raise UsageError(f"{flag}: unknown {', '.join(map(repr, wrong)) or 'empty list'}; "
                         f"choose from {', '.join(allowed)}")


def _name(kind: str, rows: list[dict], backend: str, world_size: int, slow: bool) -> str:
    from dpcourse.bench.report import slug

    device = rows[0]["device"] if rows else "unknown"
    return f"{kind}-{backend}-{world_size}x-{slug(device)}" + ("-slowlink" if slow else "")


def _plot(make):
    try:
        import matplotlib

        matplotlib.use("Agg")
        return make()
    except ImportError:
        return None


def run_allreduce(args: argparse.Namespace) -> int:
    import torch

    import dpcourse
    from dpcourse.bench.allreduce import allreduce_sweep
    from dpcourse.bench.report import environment, write_results
    from dpcourse.formatting import format_bytes, format_seconds, format_table

    from dpcourse.bench.allreduce import allreduce_impls
    from dpcourse.comm.kernels.bench_impls import kernel_impls

    backend, world_size = _backend(args)
    _check_names("--impls", args.impls, tuple(allreduce_impls()) + tuple(kernel_impls()))
    max_size = args.max_size or (2**30 if backend == "nccl" else 64 * 2**20)
    try:
        sizes = args.sizes or size_range(args.min_size, max_size)
    except ValueError as exc:
        raise UsageError(f"--min-size/--max-size: {exc}") from None
    element = getattr(torch, args.dtype).itemsize
    if min(sizes) < element:
        raise UsageError(f"--sizes/--min-size: {min(sizes)} B is less than one {args.dtype} "
                         f"element ({element} B); use sizes of at least {element} B")
    settings = dict(sizes=sizes, impls=args.impls, iters=args.iters or 20, warmup=args.warmup,
                    dtype=args.dtype, slow_link=args.slow_link,
                    calls_per_trial=args.calls_per_trial)
    with slow_link(args.slow_link):
        env = environment(backend, world_size)
        rows = dpcourse.run(allreduce_sweep, sizes, args.impls, world_size=world_size,
                            backend=backend, timeout=args.timeout, warmup=args.warmup,
                            iters=settings["iters"], dtype=getattr(torch, args.dtype),
                            calls_per_trial=args.calls_per_trial)[0]
    table = [{"impl": r["impl"], "size": format_bytes(r["nbytes"]),
              "median": format_seconds(r["median_s"]),
              "IQR": f"{format_seconds(r['p25_s'])}..{format_seconds(r['p75_s'])}",
              "algbw GB/s": f"{r['algbw'] / 1e9:.3g}", "busbw GB/s": f"{r['busbw'] / 1e9:.3g}",
              "vs library": f"{r['vs_library']:.3f}" if r["vs_library"] is not None else ""} for r in rows]
    per_trial = (f", {args.calls_per_trial} back-to-back calls per trial"
                 if args.calls_per_trial > 1 else "")
    print(f"all-reduce, {world_size} ranks, {backend}, {rows[0]['device']}, {args.dtype}"
          + per_trial)
    print(format_table(table))

    def figure():
        from dpcourse.plots import plot_bandwidth

        slow = ", slow link" if args.slow_link else ""
        return plot_bandwidth(rows, metric="busbw", title=f"all-reduce bus bandwidth: "
                              f"{world_size}x {rows[0]['device']} ({backend}{slow})")

    fig = None if args.no_plot else _plot(figure)
    paths = write_results(args.out, _name("allreduce", rows, backend, world_size, args.slow_link),
                          {"benchmark": "allreduce", "environment": env, "settings": settings,
                           "rows": rows}, fig)
    print("wrote " + ", ".join(paths))
    return 0


def run_ddp(args: argparse.Namespace) -> int:
    import dpcourse
    from dpcourse.bench.ddp import ddp_benchmark
    from dpcourse.bench.report import environment, write_results
    from dpcourse.formatting import format_table

    from dpcourse.bench.ddp import KERNEL_VARIANTS, SHARDED, VARIANTS, kernel_variant

    backend, world_size = _backend(args)
    _check_names("--variants", args.variants, VARIANTS + SHARDED + KERNEL_VARIANTS,
                 accepts=lambda name: kernel_variant(name) is not None)
    common = dict(config=args.config, batch_size=args.batch_size, warmup=args.warmup,
                  iters=args.iters or 10, amp=args.amp)
    settings = dict(common, variants=args.variants, bucket_cap_mb=args.bucket_cap_mb,
                    sweep_caps=args.sweep_caps, slow_link=args.slow_link)
    run = dict(world_size=world_size, backend=backend, timeout=args.timeout)
    with slow_link(args.slow_link):
        env = environment(backend, world_size)
        rows, sweep = dpcourse.run(ddp_benchmark, args.variants, args.sweep_caps,
                                   bucket_cap_mb=args.bucket_cap_mb, **common, **run)[0]
    cols = ["variant", "bucket_cap_mb", "n_buckets", "median_s", "p25_s", "p75_s",
            "vs_torch_ddp", "efficiency", "tokens_per_s"]
    if any(r.get("peak_bytes_per_rank") for r in rows):  # GPU runs of torch_ddp / sharded variants
        cols.append("peak_bytes_per_rank")
    r0 = rows[0]
    print(f"training step, {world_size} ranks, {backend}, {r0['device']}, GPT {r0['config']} "
          f"({r0['params']:,} params), batch {r0['batch_size']}x{r0['seq_len']}, amp {r0['amp']}")
    print(format_table(rows, cols))
    if sweep:
        print("\nbucket-size sweep (ratios within each bucket size)")
        print(format_table(sweep, cols))

    def figure():
        from dpcourse.plots import plot_bucket_sweep

        # torch DDP does not report its bucket count: leave those points unlabelled.
        points = [{k: v for k, v in r.items() if v is not None} for r in sweep]
        return plot_bucket_sweep(points, series_key="variant", title=f"step time vs bucket size: "
                                 f"{world_size}x {r0['device']}")

    fig = None if args.no_plot or not sweep else _plot(figure)
    paths = write_results(args.out, _name("ddp", rows, backend, world_size, args.slow_link),
                          {"benchmark": "ddp", "environment": env, "settings": settings,
                           "rows": rows, "bucket_sweep": sweep}, fig)
    print("wrote " + ", ".join(paths))
    return 0
