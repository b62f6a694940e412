"""``dpcourse grade``: grade exercise notebooks with the grader, not the notebook, in charge.

For each notebook:

1. Run it top to bottom in a kernel the grader owns (:mod:`~dpcourse.grading.executor`,
   its own session, private temp and runtime dirs), in a sandbox
   (:mod:`~dpcourse.grading.sandbox`) that sees no network, no other file of the grader's
   and no other submission, and writes only to a scratch folder of its own. At the time limit the kernel and
   everything it started (ranks, detached children) are killed; a dead kernel or a
   malformed notebook scores zero and grading carries on.
2. Without the sandbox, put back any file of the course package the notebook changed
   on disk (in the sandbox it cannot change them).
3. Take the learner's definitions from the cells that ran (``def``, ``class``,
   imports, plain values; never the calls) and run each check for the notebook's
   lesson number in fresh rank processes (:mod:`~dpcourse.grading.runner`), with the
   grader's world sizes and fresh random cases. Verdicts are reached in this process.

Nothing the notebook writes (files, environment, its own ``check`` calls) is read
as a result. Where the sandbox cannot run, grading is refused unless the instructor
asks for it without one (``sandbox=False``, ``--no-sandbox``); every result then
says "not sandboxed".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

from dpcourse.grading import procs, sandbox as sandboxing
from dpcourse.argtypes import UsageError
from dpcourse.grading.checks import for_notebook
from dpcourse.grading.report import NOT_GRADED_STATUS, CheckResult, CriterionResult, strip_ansi
from dpcourse.grading.runner import SKIP_ENV, run_check
from dpcourse.grading.submission import extract

KERNEL_START = 60.0  # seconds for the kernel to come up, on top of the notebook's time limit


@dataclass
class Execution:
    """How a notebook's run ended."""

    status: str          # ok, error, timeout, died, unreadable
    stop: int | None     # index of the cell that failed or was running, if any
    message: str
    executed: object = None  # the executed notebook (nbformat), if any
    cell_seconds: float = 0.0  # from the kernel being ready to the end of the run


def collect(paths: list[str]) -> list[tuple[str, str]]:
    """Return ``(path, submission)`` for every notebook under ``paths``, in name order."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for folder, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(folder, n) for n in names if n.endswith(".ipynb")]
            if not found:
                raise UsageError(f"no notebooks (*.ipynb) in folder {p!r}.")
            out += [(f, os.path.basename(os.path.dirname(os.path.abspath(f))))
                    for f in sorted(found)]
        elif os.path.isfile(p):
            if not p.endswith(".ipynb"):
                raise UsageError(f"{p!r} is not a notebook: give .ipynb files or folders of them.")
            out.append((p, os.path.basename(os.path.dirname(os.path.abspath(p)))))
        else:
            raise UsageError(f"no notebook or folder at {p!r}.")
    return out


NOT_SANDBOXED = "not sandboxed"


def _kernel_env(scratch: str) -> dict:
    """The kernel's whole environment inside the sandbox (its home and temp are its own)."""
    return {"JUPYTER_PLATFORM_DIRS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1", SKIP_ENV: "1",
            "IPYTHONDIR": os.path.join(scratch, ".ipython"),
            "MPLCONFIGDIR": os.path.join(scratch, ".mpl"),
            "JUPYTER_RUNTIME_DIR": os.path.join(scratch, ".runtime")}


def _env(work: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPCOURSE_")}
    for key, sub in (("TMPDIR", "tmp"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "mpl")):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
        env[key] = os.path.join(work, sub)
    env.update(JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
    env[SKIP_ENV] = "1"  # the notebook's own check() calls defer to the grader
    return env


def _progress(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def execute(nb, timeout: float, sandbox=None) -> Execution:
    """Run notebook ``nb`` in an owned kernel; kill everything at ``timeout`` s of cell time.

    With ``sandbox`` (a :class:`~dpcourse.grading.sandbox.Sandbox`) the kernel runs in it,
    its scratch folder the notebook's working directory.
    """
    import nbformat

    work = tempfile.mkdtemp(prefix="dpcourse-grade-")
    src, dst, progress = (os.path.join(work, n) for n in ("in.ipynb", "out.ipynb", "progress"))
    run_dir = os.path.join(work, "run")
    os.makedirs(run_dir)
    nbformat.write(nb, src)
    argv = [sys.executable, "-m", "dpcourse.grading.executor", src, dst, progress]
    if sandbox is not None:
        argv.append(json.dumps({"bwrap": sandbox.bwrap, "package": sandbox.package,
                                "disable_userns": sandbox.disable_userns,
                                "env": _kernel_env(run_dir)}))
    before = {p.pid for p in psutil.Process().children()}
    proc = None
    try:
        with open(os.path.join(work, "executor.log"), "wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=run_dir, env=_env(work), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)
        started, deadline = time.monotonic(), None
        while True:
            lines = _progress(progress)
            if deadline is None and "ready" in lines:
                deadline = time.monotonic() + timeout
            if proc.poll() is not None:
                break
            now = time.monotonic()
            if deadline is None and now - started > KERNEL_START:
                return Execution("error", None, f"the kernel did not start within "
                                 f"{KERNEL_START:g} s")
            if deadline is not None and now > deadline:
                running = [int(ln.split()[1]) for ln in lines if ln.startswith("start ")]
                cell = running[-1] if running else None
                procs.kill_tree([proc.pid])
                procs.kill_new_children(before)
                return Execution("timeout", cell, f"cell {cell} was still running at the time "
                                 f"limit ({timeout:g} s); it and everything it started were "
                                 "stopped", _read(dst), time.monotonic() - deadline + timeout)
            procs.reap(keep=before | {proc.pid})  # orphans the notebook left, as they end
            time.sleep(0.1)
        spent = time.monotonic() - deadline + timeout if deadline is not None else 0.0
        lines = _progress(progress)
        end = [ln for ln in lines if ln.startswith("end ")]
        running = [int(ln.split()[1]) for ln in lines if ln.startswith("start ")]
        if not end:
            cell = running[-1] if running else None
            return Execution("died", cell, f"the notebook's process ended during cell {cell} "
                             "(killed?)", _read(dst), spent)
        _, status, index, *message = end[-1].split(" ", 3)
        message = strip_ansi(message[0] if message else "")
        if status == "ok":
            return Execution("ok", None, "", _read(dst), spent)
        return Execution(status, int(index), f"cell {index}: {message}", _read(dst), spent)
    finally:
        if proc is not None:
            procs.kill_tree([proc.pid])
        procs.kill_new_children(before)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _private_tempdir():
    """Send every temp file of this run (ours, torch's caches) to one folder, removed at the end."""
    run_tmp = tempfile.mkdtemp(prefix="dpcourse-grade-run-")
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = run_tmp, run_tmp
    try:
        yield run_tmp
    finally:
        tempfile.tempdir = old_dir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(run_tmp, ignore_errors=True)


def _read(path: str):
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001 - a notebook cut short, or overwritten by the kernel
        return None


def not_here_for_grader(spec) -> str | None:
    """What this machine lacks to grade ``spec``, and where to grade it instead; or ``None``.

    Asked in the grader's own process (its view of the GPUs, not the notebook's): a
    notebook cannot make its check count as not graded, nor as graded.
    """
    lack = spec.unavailable_here()
    if not lack:
        return None
    return (f"{lack}. No points were given or taken: grade the exercise {spec.exercise} "
            f"notebooks again with dpcourse grade on a machine with {spec.needs}.")


def _zero(spec, why: str) -> CheckResult:
    return CheckResult(spec.name, spec.exercise, spec.title, [
        CriterionResult(c.name, c.description, False, f"not graded: {why}", "",
                        getattr(c, "weight", 1.0), getattr(c, "gate", False))
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
    stop = run.stop if run.status != "ok" else None
    sources = [(f"<cell {i}>", c.source) for i, c in enumerate(nb.cells)
               if c.cell_type == "code" and (stop is None or i < stop)]
    cells, problems = extract(sources)
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
    from dpcourse.grading.integrity import PackageSnapshot

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
    with procs.subreaper(), _private_tempdir(), (
            sandboxing.prepared() if sandbox else contextlib.nullcontext()) as box:
        for path, submission in files:
            info, results, executed = grade_notebook(path, texts[path], timeout, snapshot, box)
            name = os.path.basename(path)
            notebooks.append(dict(info, notebook=name, path=path, submission=submission,
                                  sandboxed=box is not None))
            for r in results:
                status = ("graded" if info["status"] == "ok" else info["status"])
                rows.append(dict(r.to_dict(), notebook=name, submission=submission,
                                 status=NOT_GRADED_STATUS if r.not_graded else status,
                                 sandboxed=box is not None))
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
