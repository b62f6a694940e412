"""``dpcourse grade``: check the output paths first, grade, print the table, write the files."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

from dpcourse.argtypes import UsageError


def _exit_on_termination() -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit``, so that the grader's clean-up runs: its
    kernels and ranks live in sessions of their own, which a signal to the grader misses."""
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
    """Refuse, before minutes of grading, an output path that could not be written afterwards."""
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


def grade_notebooks(args: argparse.Namespace) -> int:
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
