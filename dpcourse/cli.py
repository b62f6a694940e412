"""The ``dpcourse`` command: ``doctor``, ``launch``, ``demo`` and friends.

Each subcommand lives in the module that owns its concept; this file only
parses arguments and dispatches, importing heavy modules lazily so that
``dpcourse --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import tempfile

from dpcourse.argtypes import (Parser, UsageError, notebook_path, positive_int,
                               positive_seconds)


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


def _has_any(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _check_nproc(argv: list[str]) -> None:
    """Refuse a ``--nproc-per-node`` torchrun would reject only after creating its temp dirs."""
    for i, a in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if a == flag or a.startswith(flag + "="):
                value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
                if value not in ("auto", "cpu", "gpu", "xpu") and not (value.isdigit() and int(value) >= 1):
                    raise UsageError(f"launch: {flag} must be a whole number >= 1, or auto, cpu "
                                     f"or gpu, got {value!r}")
            if a == "--":
                return


def torchrun_command(argv: list[str]) -> list[str]:
    """Build the torchrun command for ``dpcourse launch``: torchrun's own arguments pass through.

    When nothing says how many processes or where to meet, start as many as
    :func:`dpcourse.run` would (one per GPU on a machine with 2 or more, else 2:
    see :func:`dpcourse.launch.ranks.plan_ranks`) and meet through a standalone
    rendezvous on this host.
    """
    from dpcourse.launch.ranks import plan_ranks

    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if not _has_any(argv, "--nproc-per-node", "--nproc_per_node"):
        cmd.append(f"--nproc-per-node={plan_ranks().world_size}")
    multi_node = _has_any(argv, "--nnodes", "--rdzv-endpoint", "--rdzv_endpoint",
                          "--master-addr", "--master_addr", "--standalone")
    if not multi_node:
        cmd.append("--standalone")
    return cmd + argv


def launch(args: argparse.Namespace) -> int:
    """Run torchrun with the arguments of ``dpcourse launch``; return its exit status.

    torchrun runs inside this process (the command printed is its equivalent):
    torch is imported once for the agent instead of once here and once more in
    a torchrun process. Note that torchrun's rendezvous stores listen on every
    network interface, also with ``--standalone``; ``dpcourse.run`` keeps its
    store on loopback.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    _check_nproc(args.torchrun_args)
    cmd = torchrun_command(args.torchrun_args)
    print("+ " + " ".join(cmd), file=sys.stderr)
    try:
        torchrun_main(cmd[3:])  # after "python -m torch.distributed.run"
    except ChildFailedError:
        return 1  # torchrun has already printed which rank failed and why
    return 0


def _exit_on_termination() -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit``, so that the grader's clean-up runs.

    Every kernel and rank the grader starts lives in its own session: a signal sent
    to the grader alone never reaches them. Left to the default action, ``kill``
    would end the grader without its ``finally`` blocks and leave them all running.
    """
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def _writable_dir(path: str) -> str | None:
    """Why files cannot be created in directory ``path``, or None if they can."""
    if not os.path.isdir(path):
        return f"{path} is not a directory" if os.path.exists(path) else f"{path} does not exist"
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror})"
    return None


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before grading starts, an output path that could not be written afterwards.

    Grading takes minutes per notebook; a typo in ``--json`` must not cost them.
    """
    for flag in ("--json", "--csv", "--lms-csv"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is None:
            continue
        if os.path.isdir(path):
            raise UsageError(f"grade: {flag} {path} is a directory; give a file name")
        why = _writable_dir(os.path.dirname(os.path.abspath(path)))
        if why:
            raise UsageError(f"grade: {flag} {path} cannot be written: {why}")
    if args.feedback is not None:
        if os.path.exists(args.feedback) and not os.path.isdir(args.feedback):
            raise UsageError(f"grade: --feedback {args.feedback} is a file; give a directory")
        existing = os.path.abspath(args.feedback)
        while not os.path.exists(existing):  # created with its missing parents
            existing = os.path.dirname(existing)
        why = _writable_dir(existing)
        if why:
            raise UsageError(f"grade: --feedback {args.feedback} cannot be written: {why}")


def grade(args: argparse.Namespace) -> int:
    """Run ``dpcourse grade``: grade, print the table, write the files asked for; 2 on bad input."""
    from dpcourse.grading import autograde, gradebook

    check_outputs(args)
    _exit_on_termination()
    try:
        report = autograde.grade(args.paths, timeout=args.timeout, feedback=args.feedback,
                                 sandbox=not args.no_sandbox)
    except autograde.UsageError as exc:
        print(f"dpcourse grade: error: {exc}", file=sys.stderr)
        return 2
    print(gradebook.score_table(report))
    for flag, path, write in (("--json", args.json, gradebook.write_json),
                              ("--csv", args.csv, gradebook.write_csv),
                              ("--lms-csv", args.lms_csv, gradebook.write_lms_csv)):
        if path:
            write(report, path)
            print(f"{flag}: written to {path}")
    if args.feedback:
        print(f"--feedback: one .feedback.ipynb and .html per notebook in {args.feedback}")
    return 0


def demo(args: argparse.Namespace) -> int:
    from dpcourse import demo as demo_mod

    return demo_mod.cli(args)


DESCRIPTION = ("The dpcourse command: check this machine (doctor), run a script on several "
               "processes (launch), train a small model data-parallel (demo), grade exercise "
               "notebooks (grade) and measure communication (bench).")


def version() -> str:
    """dpcourse's version, from the installed package's metadata (the source's if not installed)."""
    from importlib import metadata

    try:
        return metadata.version("dpcourse")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        import dpcourse

        return dpcourse.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dpcourse", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dpcourse {version()}",
                        help="print dpcourse's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands below; COMMAND --help tells more")

    p = sub.add_parser("doctor", help="report devices, backends and versions",
                       description="Report Python, torch, the backends and GPUs, and how many "
                       "ranks dpcourse.run would start here, and why.")
    p.add_argument("--check", action="store_true", help="also run a 1-element all-reduce")
    p.set_defaults(func=doctor)

    p = sub.add_parser(
        "launch", help="run a script on several processes via torchrun",
        description="Run a training script via torchrun. Every argument is torchrun's: "
        "e.g. dpcourse launch --nproc-per-node 2 train.py. Without --nproc-per-node, one "
        "process per GPU (2 on CPU); without --nnodes/--rdzv-endpoint, a standalone rendezvous. "
        "torchrun's rendezvous ports listen on every network interface (--standalone too): "
        "on an untrusted network, firewall them.")
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, metavar="TORCHRUN_ARGS",
                   help="torchrun's options, the script and the script's arguments")
    p.set_defaults(func=launch)

    p = sub.add_parser(
        "demo", help="train a small model data-parallel and compare with torch DDP",
        description="Train identical copies of a small MLP with each of dpcourse's data-parallel "
        "wrappers and with torch's DistributedDataParallel, and print the global loss and the "
        "largest parameter difference from torch DDP after each step.")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks (default: one per GPU on a machine with 2 or more, else 2 on CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: nccl when every rank gets its own GPU, else gloo on CPU")
    p.add_argument("--steps", type=positive_int, default=20,
                   help="training steps (default 20)")
    p.set_defaults(func=demo)

    from dpcourse.bench.cli import add_parser as add_bench_parser  # argparse only, no torch

    add_bench_parser(sub)

    p = sub.add_parser(
        "grade", help="grade exercise notebooks: the grader runs its own checks on them",
        description="Run each notebook in a kernel the grader owns (killed at --timeout), take "
        "the learner's definitions from it, and run the grader's checks on them in fresh "
        "processes with fresh random cases. Folders are searched recursively; a notebook's "
        "folder name is its submission ID.")
    p.add_argument("paths", nargs="+", type=notebook_path,
                   help="notebooks or folders of notebooks")
    p.add_argument("--json", metavar="FILE", help="write the full results as JSON")
    p.add_argument("--csv", metavar="FILE", help="write one row per submission and criterion")
    p.add_argument("--lms-csv", metavar="FILE", help="write one row per submission, one column "
                   "per exercise (Canvas / Moodle gradebook import)")
    p.add_argument("--feedback", metavar="DIR", help="write a feedback notebook and HTML page "
                   "per notebook")
    p.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds of cell time per notebook (default 600)")
    p.add_argument("--no-sandbox", action="store_true", help="run the notebooks' code with "
                   "your own rights where the sandbox (bubblewrap) cannot run; every score is "
                   "marked \"not sandboxed\"")
    p.set_defaults(func=grade)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``dpcourse`` command; return its exit status (2: the command line was wrong)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
            # argparse's REMAINDER refuses leading options such as --nproc-per-node:
            # hand everything after "launch" to torchrun untouched.
            rest = argv[2:] if argv[1:2] == ["--"] else argv[1:]
            return int(launch(argparse.Namespace(torchrun_args=rest)) or 0)
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as exc:  # a value the parser could not judge alone
        print(f"dpcourse: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # A rank raised, died or hung: its message already names the rank and carries
        # the rank's own traceback; a second, local traceback around it adds nothing.
        from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError

        if isinstance(exc, (RankError, RankDiedError, RankTimeoutError)):
            print(f"dpcourse: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
