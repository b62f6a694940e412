"""``dpcourse grade``: grade exercise notebooks with the grader, not the notebook, in charge.

Each notebook runs in a kernel the grader owns (:mod:`~dpcourse.grading.executor`) inside
the sandbox (:mod:`~dpcourse.grading.sandbox`), killed with all it started at the time
limit; a dead kernel or a malformed notebook scores zero and grading carries on. Without
the sandbox (``--no-sandbox``, said on every result) a file of the course package that the
notebook changed is put back and the notebook scores zero. Each check then runs on the
definitions from the cells that ran (never the calls), in fresh ranks with the grader's
world sizes and cases (:mod:`~dpcourse.grading.runner`); verdicts are reached in this
process and nothing the notebook writes is read as a result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from unittest import mock

import dpcourse
from dpcourse.argtypes import UsageError
from dpcourse.grading import sandbox as sandboxing
from dpcourse.grading.checks import for_notebook
from dpcourse.grading.executor import Execution, execute
from dpcourse.grading.report import NOT_GRADED_STATUS, CheckResult, CriterionResult, strip_ansi
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract, from_notebook
from dpcourse.launch import reaper

NOT_SANDBOXED = "not sandboxed"


def _walk(root: str) -> dict[str, bytes]:
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError), open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


class PackageSnapshot:
    """The bytes of every file under the package (or ``root``), taken now."""

    def __init__(self, root: str | None = None):
        self.root = root or os.path.dirname(os.path.abspath(dpcourse.__file__))
        self.files = _walk(self.root)

    def restore(self) -> list[str]:
        """Put back what changed since the snapshot; return the source files that had changed."""
        now, changed = _walk(self.root), []
        for rel in sorted(set(now) | set(self.files)):
            was, path = self.files.get(rel), os.path.join(self.root, rel)
            if now.get(rel) == was:
                continue
            if "__pycache__" not in rel:
                changed.append(rel)
            elif rel not in now:
                continue
            if was is None or "__pycache__" in rel:
                # A cache may be forged to match its source's size and time: drop any
                # written since (Python compiles the source again on the next import).
                with contextlib.suppress(OSError):
                    os.remove(path)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with contextlib.suppress(OSError):  # a file the notebook made read-only
                os.chmod(path, 0o644)
            with open(path, "wb") as f:
                f.write(was)
        return changed


def collect(paths: list[str]) -> list[tuple[str, str]]:
    """Return ``(path, submission)`` for every notebook under ``paths``, in name order."""
    found = []
    for p in paths:
        if os.path.isdir(p):
            mine = sorted(os.path.join(folder, n) for folder, _, names in os.walk(p)
                          if not any(part.startswith(".") and part != "." for part in
                                     os.path.relpath(folder, p).split(os.sep))
                          for n in names if n.endswith(".ipynb"))
            if not mine:
                raise UsageError(f"no notebooks (*.ipynb) in folder {p!r}.")
            found += mine
        elif not os.path.isfile(p):
            raise UsageError(f"no notebook or folder at {p!r}.")
        elif not p.endswith(".ipynb"):
            raise UsageError(f"{p!r} is not a notebook: give .ipynb files or folders of them.")
        else:
            found.append(p)
    return [(f, os.path.basename(os.path.dirname(os.path.abspath(f)))) for f in found]


@contextlib.contextmanager
def _private_tempdir():
    """Send every temp file of this run (ours, torch's caches) to one folder, removed at the end."""
    run_tmp = tempfile.mkdtemp(prefix="dpcourse-grade-run-")
    try:
        with mock.patch.dict(os.environ, TMPDIR=run_tmp), \
                mock.patch.object(tempfile, "tempdir", run_tmp):
            yield run_tmp
    finally:
        shutil.rmtree(run_tmp, ignore_errors=True)


def not_here_for_grader(spec) -> str | None:
    """What this machine lacks to grade ``spec`` and where to grade it instead, or ``None``
    (asked in the grader's own process: a notebook cannot change the answer)."""
    lack = spec.unavailable_here()
    return lack and (f"{lack}. No points were given or taken: grade the exercise "
                     f"{spec.exercise} notebooks again with dpcourse grade on a machine with "
                     f"{spec.needs}.")


def _zero(spec, why: str) -> CheckResult:
    return CheckResult(spec.name, spec.exercise, spec.title, [
        CriterionResult(c.name, c.description, False, f"not graded: {why}", "", c.weight, c.gate)
        for c in spec.criteria], spec.points, 0.0, [why])


def grade_notebook(path: str, text: str, timeout: float, snapshot,
                   sandbox=None) -> tuple[dict, list, object]:
    """Grade one notebook (its ``text`` read before any notebook ran), in ``sandbox`` if given."""
    import nbformat

    name = os.path.basename(path)
    specs = for_notebook(name)
    t0 = time.perf_counter()
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # noqa: BLE001 - malformed JSON, wrong schema
        why = f"the notebook could not be read ({type(exc).__name__}: {str(exc)[:200]})"
        info = {"status": "unreadable", "message": strip_ansi(why)}
        return info, [_zero(s, why) for s in specs], None
    blocked = {s.name: why for s in specs if (why := not_here_for_grader(s))}
    if specs and len(blocked) == len(specs):
        # Nothing of it can be graded on this machine: the notebook is not run at all.
        info = {"status": NOT_GRADED_STATUS, "message": "; ".join(dict.fromkeys(blocked.values())),
                "changed_files": [], "cell_seconds": 0.0, "seconds": 0.0}
        return info, [CheckResult.not_graded_here(s, blocked[s.name]) for s in specs], None
    run = execute(nb, timeout, sandbox) if specs else Execution("ok", None, "no exercise check for it")
    changed = snapshot.restore() if snapshot is not None else []
    info = {"status": run.status, "message": run.message, "changed_files": changed,
            "cell_seconds": round(run.cell_seconds, 1)}
    if changed:
        why = (f"the notebook changed the course package on disk ({', '.join(changed[:3])}); "
               "the files were put back and this notebook scores zero")
        info.update(status="tampered", message=why)
        return info, [_zero(s, why) for s in specs], run.executed
    cells, problems = extract(from_notebook(nb, before=run.stop if run.status != "ok" else None))
    results = []
    for spec in specs:
        if spec.name in blocked:
            results.append(CheckResult.not_graded_here(spec, blocked[spec.name]))
            continue
        result = run_check(spec, cells, spec.roles, problems=problems, sandbox=sandbox)
        if sandbox is None:
            result.notes.insert(0, f"{NOT_SANDBOXED}: the grader was asked to run this "
                                "notebook's code with its own rights (--no-sandbox)")
        if run.status != "ok":
            result.notes.insert(0, f"the notebook stopped early ({run.status}: {run.message}); "
                                "only definitions from the cells before that were graded")
        results.append(result)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info, results, run.executed


def grade(paths: list[str], timeout: float = 600.0, feedback: str | None = None,
          sandbox: bool = True) -> dict:
    """Grade every notebook in ``paths`` (files, or folders searched recursively).

    Args:
        paths: notebooks or folders.
        timeout: seconds of cell time allowed per notebook.
        feedback: folder for one feedback notebook (and HTML) per graded notebook.
        sandbox: run the notebook's code (kernel and ranks) in the sandbox
            (:mod:`~dpcourse.grading.sandbox`); where it cannot run, :class:`UsageError`
            says why. ``False`` (the instructor's ``--no-sandbox``) runs it with the
            grader's own rights, and marks every notebook and row ``"sandboxed": false``.

    Returns:
        ``{"notebooks": [...], "results": [...], "points": p, "max_points": m,
        "not_graded_points": n}``: ``m`` counts only the checks graded here; ``n`` is the
        maximum of those this machine could not run (each row's ``not_graded`` says why).
    """
    from dpcourse.grading import gradebook

    if not (timeout > 0 and timeout != float("inf")):
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout:g}.")
    files = collect(paths)
    texts = {}
    for path, _ in files:  # read all first: a notebook may delete or edit a later one
        try:
            with open(path, encoding="utf-8") as f:
                texts[path] = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            texts[path] = f"<unreadable: {exc}>"
    if sandbox and (why := sandboxing.unavailable()) is not None:
        raise UsageError(f"graded code cannot be sandboxed on this machine: {why}. Without "
                         "the sandbox a notebook runs with your rights (your files, the "
                         "network, the grader itself); to grade anyway, pass --no-sandbox "
                         f"and every score is marked \"{NOT_SANDBOXED}\".")
    # Sandboxed code cannot reach the package on disk; without the sandbox, whatever a
    # notebook changes there is noticed and put back after it.
    snapshot = None if sandbox else PackageSnapshot()
    notebooks, rows = [], []
    with reaper.subreaper(), _private_tempdir(), (
            sandboxing.prepared() if sandbox else contextlib.nullcontext()) as box:
        for path, submission in files:
            info, results, executed = grade_notebook(path, texts[path], timeout, snapshot, box)
            name = os.path.basename(path)
            notebooks.append(dict(info, notebook=name, path=path, submission=submission,
                                  sandboxed=box is not None))
            status = "graded" if info["status"] == "ok" else info["status"]
            rows += [dict(r.to_dict(), notebook=name, submission=submission,
                          status=NOT_GRADED_STATUS if r.not_graded else status,
                          sandboxed=box is not None) for r in results]
            if feedback:
                gradebook.write_feedback(feedback, submission, name, executed, texts[path],
                                         info, results)
    # A check this machine could not run is left out of the maximum, not counted as 0 of
    # its points: a learner's total stays a share of what was graded, and the points still
    # to grade elsewhere are reported beside it (not_graded_points).
    return {"notebooks": notebooks, "results": rows, "sandboxed": bool(sandbox),
            "points": round(sum(r["points"] for r in rows), 1),
            "max_points": sum(gradebook.counted_max(r) for r in rows),
            "not_graded_points": sum(r["max_points"] - gradebook.counted_max(r) for r in rows)}


def _exit_on_termination() -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit``, so that the grader's clean-up runs: its
    kernels and ranks live in sessions of their own, which a signal to the grader misses."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def main(args: argparse.Namespace) -> int:
    """Run ``dpcourse grade``: grade, print the table, write the files asked for; 2 on bad input."""
    from dpcourse.grading import gradebook

    gradebook.check_outputs(args)
    _exit_on_termination()
    try:
        report = grade(args.paths, timeout=args.timeout, feedback=args.feedback,
                       sandbox=not args.no_sandbox)
    except UsageError as exc:
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
