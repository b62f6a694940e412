"""The ``dpcourse`` command: ``doctor``, ``launch``, ``demo``, ``bench`` and ``grade``.

This file builds the parser and dispatches. Each subcommand lives in its own
module (:mod:`dpcourse.doctor`, :mod:`dpcourse.launch.torchrun`,
:mod:`dpcourse.demo`, :mod:`dpcourse.bench.cli`, :mod:`dpcourse.grading.autograde`),
imported only when its command runs, so that ``dpcourse --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dpcourse.argtypes import Parser, UsageError, notebook_path, positive_int, positive_seconds


def _command(module: str, name: str):
    """Return a command that imports ``module`` only when it runs, then calls its ``name(args)``."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return run


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
    p.set_defaults(func=_command("dpcourse.doctor", "doctor"))

    p = sub.add_parser(
        "launch", help="run a script on several processes via torchrun",
        description="Run a training script via torchrun. Every argument is torchrun's: "
        "e.g. dpcourse launch --nproc-per-node 2 train.py. Without --nproc-per-node, one "
        "process per GPU (2 on CPU); without --nnodes/--rdzv-endpoint, a standalone rendezvous. "
        "torchrun's rendezvous ports listen on every network interface (--standalone too): "
        "on an untrusted network, firewall them.")
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, metavar="TORCHRUN_ARGS",
                   help="torchrun's options, the script and the script's arguments")
    p.set_defaults(func=_command("dpcourse.launch.torchrun", "launch"))

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
    p.set_defaults(func=_command("dpcourse.demo", "cli"))

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
    p.set_defaults(func=_command("dpcourse.grading.autograde", "main"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``dpcourse`` command; return its exit status (2: the command line was wrong)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
            # argparse's REMAINDER refuses leading options such as --nproc-per-node:
            # hand everything after "launch" to torchrun untouched.
            rest = argv[2:] if argv[1:2] == ["--"] else argv[1:]
            launch = _command("dpcourse.launch.torchrun", "launch")
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
