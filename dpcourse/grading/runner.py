"""Run a check on the learner's definitions and turn the grader's judgement into a report.

Used by ``dpcourse grade`` (definitions from the notebook file) and by the learner's
``check(...)`` (from the cells the kernel ran). Either way the grader picks the world
sizes and fresh random cases, the learner's code runs in ranks started here, and every
verdict is reached in this process from the ranks' outputs and the grader's own record
of their messages.
"""

from __future__ import annotations

import base64
import inspect
import os
import random
import secrets
import sys
import tempfile
import time
from unittest import mock

from dpcourse.grading.checks import Exercise, CaseVerdict, available_checks, get_spec
from dpcourse.grading.criteria import NO_DEADLOCK, NO_DELEGATION, NOT_IMPLEMENTED
from dpcourse.grading.report import CheckResult, CriterionResult, show, strip_ansi
from dpcourse.grading.submission import defined_names, extract, policy_findings, stub_message
from dpcourse.grading.world import Failure, World

__all__ = ["check", "available_checks", "run_check"]

SKIP_ENV = "DPCOURSE_GRADING_KERNEL"  # set in dpcourse grade's kernel: check() defers to it
STARTUP_TIMEOUT = 90.0  # starting Python and torch in every rank; slow on a loaded machine


STUB_HINT = ("Your code reached a part that is not written yet (the note above names it): write "
             "it, then grade again. The criteria are judged once the code runs through.")


def _merge(spec: Exercise, names: dict, defined: set, records: list[CaseVerdict],
           failure: tuple[int | None, Failure] | None, findings: list[str]) -> list[CriterionResult]:
    told, hung = "", False
    if failure is not None:  # what stopped the run: where (unless it hung), what, traceback
        ws, why = failure
        hung = why.kind == "timeout"
        told = strip_ansi(("" if hung or not ws else f"world size {ws}: ") + why.text
                          + (f"\n{why.traceback}" if why.traceback else ""))
    stopped = told.splitlines()[0] if told else ""
    results: dict[str, CriterionResult] = {}
    for c in spec.criteria:
        seen = [r for r in records if r.criterion == c.name]
        bad = [r for r in seen if not r.passed]
        ok = False
        if c.requires and names.get(c.requires) not in defined:
            detail = (f"your notebook defines no `{spec.roles[c.requires]}` (a def at the top "
                      "level of a cell)")
        elif c.name == NO_DELEGATION.name and findings:
            detail = "your code " + "; ".join(findings)
        elif bad:
            detail = (f"{bad[0].case}: " if bad[0].case and bad[0].case not in bad[0].detail
                      else "") + bad[0].detail
        elif failure is None:
            ok = bool(seen) or c.name in (NO_DELEGATION.name, NO_DEADLOCK.name)
            detail = "" if ok else "not checked: no case of this criterion ran"
        elif c.name == NO_DEADLOCK.name:
            detail = told if hung else f"not checked: {stopped}"
        elif c.name == spec.criteria[0].name and not hung:
            detail = told
        else:
            detail = f"{'checked only in part' if seen else 'not checked'}: {stopped}"
        results[c.name] = CriterionResult(c.name, c.description, ok, detail, "", c.weight, c.gate)
    for c in spec.criteria:  # credit only where the result it depends on is right
        r = results[c.name]
        blocked = [n for n in c.needs if not results[n].passed]
        if r.passed and blocked:
            r.passed, r.gate = False, False  # not earned, but nothing was refused either
            r.detail = f"not credited: counts once {', '.join(blocked)} passes"
        elif not r.passed and not r.detail.startswith(
                ("not checked", "checked only in part", "not credited")):
            # A run stopped at a stub, whichever part it is: this criterion's own hint
            # would name a cause the learner's code never reached.
            extra = spec.explain(r.detail)
            r.hint = (STUB_HINT if failure is not None and why.exc_type == NOT_IMPLEMENTED
                      else f"{extra} {c.hint}".strip() if extra and extra not in c.hint
                      else c.hint)
    return list(results.values())


def run_check(spec: Exercise, cells: list[tuple[str, str]], names: dict, *,
              timeout: float | None = None,
              problems: list[str] | None = None, pickled: str | None = None,
              sandbox=None) -> CheckResult:
    """Run ``spec`` on the learner's kept ``cells`` and return the judged :class:`CheckResult`.

    Args:
        spec: the check.
        cells: ``(label, source)`` from :func:`dpcourse.grading.submission.extract`.
        names: ``{role: name in the notebook}`` of the definitions to grade.
        timeout: seconds per round before the ranks count as hung (default: the check's).
        problems: notes about cells that could not be read.
        pickled: the objects by value (base64 cloudpickle) instead of ``cells``, for a
            ``check()`` on objects whose source cannot be found.
        sandbox: the :class:`~dpcourse.grading.sandbox.Sandbox` each rank runs in, or ``None``.
    """
    t0 = time.perf_counter()
    notes = list(problems or []) + list(spec.notes)
    if pickled:
        defined, findings, stub = set(names.values()), [], None
    else:
        defined = defined_names(cells)
        findings = policy_findings(cells, list(names.values()), spec.allowed_imports,
                                   spec.forbid_torch_ddp)
        stub = stub_message(cells, names["main"])
    present = {role: name for role, name in names.items() if name in defined}
    records: list[CaseVerdict] = []
    failure = None
    if "main" not in present:
        failure = (None, Failure("error", f"your notebook defines no `{names['main']}` (a def or "
                                 "class at the top level of a cell)."))
    elif findings:  # the gate fails: don't run code that reaches past the exercise
        failure = (None, Failure("error", "not run: your code uses what graded code may not use "
                                 "(see no_delegation)"))
    elif stub is not None:  # it would raise at its first call: no need to start ranks
        failure = (None, Failure("error", f"your code raised: NotImplementedError: {stub}", None,
                                 NOT_IMPLEMENTED))
    else:
        rng = random.Random(secrets.randbits(64))  # cases no notebook can know in advance
        sizes = spec.world_sizes or (1,)
        setup = {"check": spec.name, "cells": cells, "names": present, "pickled": pickled}
        with World(max(sizes), setup, label=spec.name, sandbox=sandbox,
                   shared_folder=spec.shared_folder, dist_api=spec.dist_api,
                   dist_why=spec.dist_why) as world:
            why = world.wait_ready(STARTUP_TIMEOUT)
            if why is not None:
                failure = (None, why)
            for ws in sizes if why is None else ():
                with mock.patch.object(tempfile, "tempdir", world.shared or tempfile.tempdir):
                    inputs = spec.make_inputs(rng, ws)
                rnd = world.run_round(ws, inputs, timeout or spec.timeout)
                if rnd.failure is not None:
                    failure = (ws if spec.world_sizes else None, rnd.failure)
                    break
                records += spec.judge(ws, inputs, rnd.outputs, rnd.events)
    if failure is not None and failure[1].exc_type == NOT_IMPLEMENTED:
        notes.insert(0, f"not implemented yet: {failure[1].text.split(': ', 2)[-1]}")
    criteria = _merge(spec, present, defined, records, failure, findings)
    return CheckResult(spec.name, spec.exercise, spec.title or spec.name, criteria, spec.points,
                       time.perf_counter() - t0, notes)


def _sources_of(obj) -> list[tuple[str, str]]:
    """The code the learner ran: the kernel's cells in order, or the file ``obj`` comes from."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):  # e.g. a kernel kept as text
        raise TypeError(f"{obj!r} travels by value")
    module = getattr(obj, "__module__", None)
    if module == "__main__":
        try:
            from IPython import get_ipython

            ip = get_ipython()
        except ImportError:
            ip = None
        if ip is not None and "In" in ip.user_ns:
            return [(f"<In [{i}]>", src) for i, src in enumerate(ip.user_ns["In"]) if src]
    mod = sys.modules.get(module or "")
    if mod is None:
        raise ValueError(f"check() could not find the source of {obj!r}: define it with def or "
                         "class in a notebook cell or a .py file.")
    return [(f"<{getattr(mod, '__file__', module)}>", inspect.getsource(mod))]


def check(name: str, obj, *, timeout: float | None = None, quiet: bool = False,
          **extras) -> CheckResult:
    """Check the learner's ``obj`` on the grader's cases, as ``dpcourse grade`` does; show and
    return the :class:`~dpcourse.grading.report.CheckResult`.

    Never raises because of the learner's code: an exception, a hang or a
    ``NotImplementedError`` becomes failed criteria.

    Args:
        name: which exercise, e.g. ``"ring_all_reduce"`` (see :func:`available_checks`).
        obj: the learner's function or class (defined with ``def``/``class``).
        timeout: seconds per round before the ranks count as hung (default: the check's).
        quiet: don't display the report (it is still returned).
        **extras: the check's further definitions under other names, e.g.
            ``chunk_bounds=my_bounds``.
    """
    spec = get_spec(name)
    if os.environ.get(SKIP_ENV) == "1":
        # Inside `dpcourse grade`'s kernel: the grader runs this check itself, afterwards.
        result = CheckResult(spec.name, spec.exercise, spec.title, [], spec.points, 0.0,
                             ["not run here: dpcourse grade runs this check on your definitions"])
    elif lack := spec.unavailable_here():  # e.g. GPU kernels on a laptop: neither pass nor fail
        result = CheckResult.not_graded_here(spec, f"{lack}. Run this notebook on a machine "
                                             f"with {spec.needs} to have it checked.")
    else:
        result = run_check(spec, timeout=timeout, **_definitions(spec, obj, extras))
    if not quiet:
        show(result)
    return result


def _definitions(spec: Exercise, obj, extras: dict) -> dict:
    """``run_check``'s ``cells``, ``names``, ``problems`` and ``pickled`` for ``check(...)``."""
    roles = spec.roles
    unknown = set(extras) - (set(roles) - {"main"})
    if unknown:
        raise TypeError(f"check({spec.name!r}) got unexpected keyword(s) {sorted(unknown)}; it "
                        f"accepts {sorted(set(roles) - {'main'}) or 'none'}.")
    names = dict(roles)
    for role, value in [("main", obj), *extras.items()]:
        label = getattr(value, "__name__", "") or getattr(value, "name", "")  # or a kernel's
        if not label.isidentifier():
            raise ValueError(f"check({spec.name!r}): {role} must be a function or class defined "
                             f"with def/class (got {value!r}).")
        names[role] = label
    try:
        cells, problems = extract(_sources_of(obj))
        return {"cells": cells, "names": names, "problems": problems}
    except (OSError, TypeError, ValueError):  # built by exec, say: send the objects by value
        import cloudpickle

        objs = {"main": obj, **extras}
        return {"cells": [], "names": {role: role for role in objs}, "problems": [],
                "pickled": base64.b64encode(cloudpickle.dumps(objs)).decode()}
