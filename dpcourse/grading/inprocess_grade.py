"""``dpcourse grade``'s path to an in-process check: the grader picks the definitions and the process.

The check (:mod:`dpcourse.grading.inprocess`) runs beside the learner's code, so
the grader runs it only in a process of its own (:func:`grade_main`, started
here in its own session and killed with everything it started), on the
definitions the notebook's own ``check(...)`` call names, after the static
scan; the result comes back through a pipe only the grader reads and is rebuilt
from the check's own criteria.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from dpcourse.grading import procs
from dpcourse.grading.criteria import NO_DEADLOCK as DEAD, NO_DELEGATION as DELEG
from dpcourse.grading.inprocess import load_spec, spec_path
from dpcourse.grading.report import CheckResult, CriterionResult, strip_ansi
from dpcourse.grading.submission import load, policy_findings


def _check_call_names(cells: list[tuple[str, str]], sources: list[tuple[str, str]],
                      name: str) -> dict | None:
    """``{role: notebook name}`` from the notebook's own ``check(name, f, key=g)`` call."""
    found = None
    for _, source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "check" and len(node.args) >= 2
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == name
                    and isinstance(node.args[1], ast.Name)):
                found = {"main": node.args[1].id}
                found.update({k.arg: k.value.id for k in node.keywords
                              if k.arg and isinstance(k.value, ast.Name)})
    return found


def not_here_for_grader(spec) -> str | None:
    """What this machine lacks to grade ``spec``, and where to grade it instead; or ``None``.

    Asked in the grader's own process (its view of the GPUs, not the notebook's): a
    notebook cannot make its check count as not graded, nor as graded.
    """
    lack = getattr(spec, "unavailable_here", lambda: None)()
    if not lack:
        return None
    return (f"{lack}. No points were given or taken: grade the exercise {spec.exercise} "
            f"notebooks again with dpcourse grade on a machine with {spec.needs}.")


def grade_in_process(spec, cells: list[tuple[str, str]], sources: list[tuple[str, str]],
                     problems: list[str] | None = None, timeout: float = 900.0,
                     sandbox=None) -> CheckResult:
    """Grade a check that still runs beside the learner's code, in a process of the grader's.

    The definitions come from the notebook's cells (after the static scan); the
    check picks its own world sizes; the result comes back through a pipe only
    this process reads and is rebuilt here from the check's own criteria.

    Args:
        timeout: seconds the whole check may take (``dpcourse grade --timeout``).
        sandbox: a :class:`~dpcourse.grading.sandbox.Sandbox` the check's process (and
            the ranks it starts, which share it) runs in, or ``None``.
    """
    why = not_here_for_grader(spec)
    if why:  # decided here, before anything of the notebook is loaded or any rank started
        return CheckResult.not_graded_here(spec, why)
    t0 = time.perf_counter()
    allowed = [c for c in spec.criteria] + [DELEG] + ([DEAD] if spec.in_rank else [])
    notes = list(problems or []) + list(spec.notes) + [
        "in-process check: it runs beside your code; the grader runs it in a process of its "
        "own on the definitions from your notebook"]

    def zero(why: str) -> CheckResult:
        return CheckResult(spec.name, spec.exercise, spec.title, [
            CriterionResult(c.name, c.description, False, why, "") for c in allowed],
            spec.points, time.perf_counter() - t0, notes)

    names = _check_call_names(cells, sources, spec.name)
    if names is None:
        return zero(f"the notebook never calls check({spec.name!r}, ...) on a definition")
    findings = policy_findings(cells, list(names.values()), getattr(spec, "allowed_imports", {}),
                               spec.forbid_torch_ddp)
    if findings:
        result = zero("not run: your code uses what graded code may not use (see no_delegation)")
        result.criterion(DELEG.name).detail = "your code " + "; ".join(findings)
        return result
    read, write = os.pipe()
    before = {p.pid for p in procs.psutil.Process().children()}
    scratch = tempfile.mkdtemp(prefix=f"dpcourse-{spec.name}-")
    argv = [sys.executable, "-m", "dpcourse.grading.inprocess_grade", str(write)]
    if sandbox is not None:
        argv = sandbox.command(argv, scratch, {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, pass_fds=(write,), cwd=scratch,
                            start_new_session=True)
    os.close(write)
    try:
        proc.stdin.write(json.dumps({"spec": spec_path(spec), "cells": cells,
                                     "names": names}).encode())
        proc.stdin.close()
        proc.wait(timeout=timeout)
        with os.fdopen(read, "rb") as f:
            raw = f.read(1 << 22)
        got = json.loads(raw or b"{}")
    except subprocess.TimeoutExpired:
        got = {"error": f"the check did not finish within the time limit ({timeout:g} s)"}
    except (ValueError, OSError) as exc:
        got = {"error": f"the check did not finish ({type(exc).__name__})"}
    finally:
        procs.kill_tree([proc.pid])
        procs.kill_new_children(before)
        shutil.rmtree(scratch, ignore_errors=True)
    if "criteria" not in got:
        return zero(strip_ansi(str(got.get("error", "the check returned nothing"))))
    by_name = {c.get("name"): c for c in got["criteria"] if isinstance(c, dict)}
    criteria = []
    for c in allowed:
        r = by_name.get(c.name)
        if r is None:
            criteria.append(CriterionResult(c.name, c.description, False, "not checked", ""))
        else:
            criteria.append(CriterionResult(c.name, c.description, r.get("passed") is True,
                                            str(r.get("detail", ""))[:2000],
                                            "" if r.get("passed") is True else c.hint))
    notes += [strip_ansi(str(n))[:500] for n in got.get("notes", [])[:5]]
    return CheckResult(spec.name, spec.exercise, spec.title, criteria, spec.points,
                       time.perf_counter() - t0, notes)


def grade_main(fd: int) -> None:
    """``dpcourse grade``'s process for one in-process check: definitions in, result out.

    Reads ``{"spec", "cells", "names"}`` (JSON) from stdin, loads the kept cells,
    runs the check with its own world sizes and writes the result (JSON) to ``fd``,
    a pipe only the grader reads.
    """
    from dpcourse.grading.inprocess_run import run_check

    setup = json.loads(sys.stdin.read())
    spec = load_spec(setup["spec"])
    out = os.fdopen(fd, "w")
    try:
        objs = load(setup["cells"], setup["names"], dict(vars(__import__("builtins"))))
        extras = {k: v for k, v in objs.items() if k != "main" and v is not None}
        result = run_check(spec, objs["main"], extras)
        out.write(json.dumps(result.to_dict()))
    except BaseException as exc:  # noqa: BLE001 - the learner's top-level code
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    out.close()
    os._exit(0)


if __name__ == "__main__":
    grade_main(int(sys.argv[1]))
