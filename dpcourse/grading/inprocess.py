"""In-process checks: the check runs beside the learner's code, in the same rank processes.

The engine of the exercises not yet moved to :mod:`dpcourse.grading.checks`
(whose verdicts are reached outside the learner's processes). Here a check's
cases and records live in the ranks with the learner's objects, so the result
is cooperative: ``check(...)`` in a notebook uses it as is, and ``dpcourse
grade`` runs it only in a process of its own on definitions taken from the
notebook, after the static scan, and validates what comes back
(:func:`grade_main`). Port a check to ``checks/`` to make it structural.

One launch per world size runs every criterion of the check. The learner's
objects travel as one cloudpickle payload that each rank unpickles only after
the reference implementations are switched off (:mod:`dpcourse.grading.guards`).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import json
import os
import tempfile
import time

from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.grading.criteria import NO_DEADLOCK, NO_DELEGATION, NOT_IMPLEMENTED, Criterion
from dpcourse.grading.guards import forbid, static_references
from dpcourse.grading.report import CheckResult, CriterionResult


class RankRecorder:
    """Record criterion outcomes on one rank, to a JSON-lines file the launcher reads.

    Args:
        path: the file to append to (one per rank and launch).
        world_size: the launch's world size, stored with every record.
    """

    def __init__(self, path: str, world_size: int):
        self.path, self.world_size = path, world_size

    def _write(self, record: dict) -> None:
        record["world_size"] = self.world_size
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # the rank may be killed right after (a hang)

    def record(self, criterion: str, passed: bool, detail: str = "", case: str = "") -> bool:
        """Record one case of ``criterion``; return ``passed``.

        Args:
            criterion: the criterion's name.
            passed: whether the case held.
            detail: what was observed when it did not.
            case: a short description of the case (e.g. ``"length 5"``).
        """
        self._write({"criterion": criterion, "passed": bool(passed), "detail": detail,
                     "case": case})
        return passed

    @contextlib.contextmanager
    def case(self, criterion: str, case: str = ""):
        """Run learner code for one case; on an exception record a failure, then re-raise.

        The launcher sees the re-raised error at once and stops the other ranks, so
        the learner gets the traceback instead of a hang on the ranks that did not fail.

        Args:
            criterion: the criterion this case belongs to.
            case: a short description of the case.
        """
        self._write({"begin": criterion, "case": case})
        try:
            yield
        except BaseException as exc:
            name = type(exc).__name__
            if name == "DelegationError":
                self.record(NO_DELEGATION.name, False, str(exc), case)
            detail = (f"not implemented yet ({exc})" if name == NOT_IMPLEMENTED
                      else f"raised {name}: {exc}")
            self.record(criterion, False, detail, case)
            raise


class CheckSpec:
    """Base class of a check: its criteria, where it runs, and the cases it runs.

    Subclasses set the class attributes and implement :meth:`run` (and :meth:`prepare`
    for the expected values, which :meth:`run` obtains with ``reference.get()``).

    Attributes:
        name: the name passed to ``check()``.
        exercise: the exercise label shown in reports, e.g. ``"04"``.
        title: a human title.
        criteria: the criteria specific to this check (``no_delegation`` and, for
            multi-rank checks, ``no_deadlock`` are added automatically).
        world_sizes: one launch per world size (multi-rank checks).
        in_rank: False for pure functions, which are checked in the calling process.
        forbidden: dotted paths of the reference objects switched off during the check.
        forbid_torch_ddp: also switch off torch DDP.
        timeout: seconds per launch before the ranks count as hung.
        notes: lines shown under every report of this check.
    """

    name = ""
    exercise = ""
    title = ""
    criteria: tuple[Criterion, ...] = ()
    world_sizes: tuple[int, ...] = (2,)
    in_rank = True
    forbidden: tuple[str, ...] = ()
    forbid_torch_ddp = True
    timeout = 30.0
    points = 10.0
    notes: tuple[str, ...] = ()

    def active_criteria(self, extras: dict) -> list[Criterion]:
        """Return the criteria that apply when ``extras`` are given (order of the report)."""
        own = [c for c in self.criteria if c.requires is None or c.requires in extras]
        return own + [NO_DELEGATION] + ([NO_DEADLOCK] if self.in_rank else [])

    def prepare(self, rec) -> object:
        """Compute the expected values on a rank (e.g. a torch DDP run); see :class:`Reference`."""
        return None

    def run(self, rec, learner, extras: dict, reference: "Reference") -> None:
        """Run every case, recording outcomes with ``rec.record`` inside ``rec.case`` blocks."""
        raise NotImplementedError


class Reference:
    """The expected values of a check, computed on first use (``get()``) and then kept.

    Computed lazily so that an unimplemented exercise fails at once, before the
    reference run (torch DDP's start-up alone costs seconds); the guard on torch
    DDP is lifted only for that run.
    """

    def __init__(self, spec: CheckSpec, rec, guard=None):
        self._spec, self._rec, self._guard = spec, rec, guard
        self._value, self._done = None, False

    def get(self):
        """Return the expected values, computing them on the first call."""
        if not self._done:
            if self._guard is None:
                self._value = self._spec.prepare(self._rec)
            else:
                with self._guard.reference_allowed():
                    self._value = self._spec.prepare(self._rec)
            self._done = True
        return self._value


def spec_path(spec) -> str:
    """``"module:Class"`` of a check, to rebuild it in another process without a registry."""
    return f"{type(spec).__module__}:{type(spec).__qualname__}"


def load_spec(path: str) -> "CheckSpec":
    """Return a fresh instance of the check at ``"module:Class"``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)()


def _rank_main(check_path: str, payload: bytes, progress_dir: str) -> bool:
    """Run on every rank: switch the references off, load the learner's code, run the cases."""
    import cloudpickle
    import torch.distributed as dist

    spec = load_spec(check_path)
    ws, rank = dist.get_world_size(), dist.get_rank()
    rec = RankRecorder(os.path.join(progress_dir, f"ws{ws}_rank{rank}.jsonl"), ws)
    with forbid(spec.forbidden, spec.forbid_torch_ddp) as guard:
        # Unpickled only now: `from dpcourse... import X` in a cell resolves to the stand-in.
        objs = cloudpickle.loads(payload)
        spec.run(rec, objs["main"], objs["extras"], Reference(spec, rec, guard))
    return True


class MemoryRecorder(RankRecorder):
    """The in-process twin of :class:`RankRecorder`, for pure checks: records kept in a list."""

    def __init__(self):
        super().__init__(path="", world_size=1)
        self.records: list[dict] = []

    def _write(self, record: dict) -> None:
        self.records.append(dict(record, world_size=1, rank=0))


def _read_records(progress_dir: str) -> list[dict]:
    records = []
    for path in sorted(glob.glob(os.path.join(progress_dir, "ws*_rank*.jsonl"))):
        rank = int(path.rsplit("_rank", 1)[1].split(".")[0])
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        records.append(dict(json.loads(line), rank=rank))
                    except json.JSONDecodeError:
                        pass  # a line cut short by a kill
    return records


def _learner_frames(stack: str, keep: int = 2) -> str:
    """Where a hung rank was: the torch call it sat in and the innermost frames of learner code."""
    from dpcourse.launch.stacks import main_thread_frames

    frames = main_thread_frames(stack)
    skip = ("site-packages/torch", "dpcourse/grading/", "dpcourse/launch/", "<frozen",
            "/threading.py")
    own = [f for f in frames if not any(s in f[0] for s in skip)]
    torch_calls = [f[2] for f in frames if "site-packages/torch" in f[0]]
    waiting = f"in torch.distributed {torch_calls[0]}, called from " if torch_calls and own else ""
    return waiting + "; ".join(f'File "{f}", line {n} in {fn}' for f, n, fn in own[:keep]) \
        if own else ""


def _describe_failure(err: BaseException, ws: int, records: list[dict]) -> tuple[str, str]:
    """Return ``(kind, text)`` for a launch that did not finish: kind is timeout/error/died."""
    if isinstance(err, RankTimeoutError):
        where = []
        for rank in err.waiting:
            begins = [r for r in records if r.get("rank") == rank and r["world_size"] == ws
                      and "begin" in r]
            doing = f" in {begins[-1]['begin']} ({begins[-1]['case']})" if begins else ""
            frames = _learner_frames(err.stacks.get(rank, ""))
            where.append(f"rank {rank} was waiting{doing}" + (f"\n  {frames}" if frames else ""))
        return "timeout", (f"world size {ws}: timed out after {err.timeout:g} s; rank(s) "
                           f"{', '.join(map(str, err.waiting))} were still waiting.\n"
                           + "\n".join(where))
    if isinstance(err, RankError):
        if err.exc_type == NOT_IMPLEMENTED:
            return "error", f"not implemented yet: {err.message}"
        tail = "\n".join(err.remote_traceback.strip().splitlines()[-4:])
        return "error", (f"world size {ws}: rank {err.rank} raised {err.exc_type}: "
                         f"{err.message}\n{tail}")
    if isinstance(err, RankDiedError):
        return "error", f"world size {ws}: rank {err.rank} died (exit status {err.returncode})."
    return "error", f"{type(err).__name__}: {err}"


def _merge(spec: CheckSpec, criteria: list[Criterion], records: list[dict],
           failure: tuple[str, str] | None, static: list[str]) -> list[CriterionResult]:
    results = []
    stopped = f"the run stopped early ({failure[1].splitlines()[0]})" if failure else ""
    for c in criteria:
        recs = [r for r in records if r.get("criterion") == c.name]
        bad = [r for r in recs if not r["passed"]]
        if c is NO_DEADLOCK:
            ok = failure is None
            detail = "" if ok else (failure[1] if failure[0] == "timeout"
                                    else f"not checked: {stopped}")
        elif c is NO_DELEGATION and static:
            ok, detail = False, "your code refers to: " + "; ".join(static)
        elif bad:
            r = bad[0]
            where = f"world size {r['world_size']}" + (f", {r['case']}" if r.get("case") else "")
            ok, detail = False, f"{where}: {r['detail']}" if spec.in_rank else \
                (f"{r['case']}: {r['detail']}" if r.get("case") else r["detail"])
            if failure and failure[0] == "error" and r["detail"].startswith("raised"):
                detail += "\n" + "\n".join(failure[1].splitlines()[1:])  # where it raised
        elif failure is not None:
            ok = False
            detail = (f"checked only in part: {stopped}" if recs else f"not checked: {stopped}")
        else:
            # No failing case and the run completed. A criterion with no case at all
            # (no_delegation) holds when nothing was refused.
            ok, detail = True, ""
        # A criterion that never got to run has nothing to hint at: the cause is elsewhere.
        unchecked = detail.startswith(("not checked", "checked only in part"))
        results.append(CriterionResult(c.name, c.description, ok, detail,
                                       "" if ok or unchecked else c.hint))
    return results


def run_check(spec: CheckSpec, obj, extras: dict, *, world_sizes=None, timeout=None,
              backend: str = "auto") -> CheckResult:
    """Run ``spec`` on the learner's ``obj`` (and ``extras``) and return the merged result.

    Args:
        spec: the check.
        obj: the learner's function or class.
        extras: further learner objects the check accepts.
        world_sizes: override the spec's world sizes.
        timeout: seconds per launch before the ranks count as hung.
        backend: passed to :func:`dpcourse.run`.

    Returns:
        The :class:`CheckResult`.
    """
    import cloudpickle

    t0 = time.perf_counter()
    criteria = spec.active_criteria(extras)
    static = static_references({"main": obj, **extras}, spec.forbidden, spec.forbid_torch_ddp)
    failure, records = None, []
    notes = list(spec.notes)
    try:
        payload = cloudpickle.dumps({"main": obj, "extras": extras})
    except Exception as exc:  # noqa: BLE001 - the learner's object cannot travel
        failure = ("error", f"your code could not be sent to the ranks: "
                            f"{type(exc).__name__}: {exc}")
        payload = None
    if payload is not None and spec.in_rank:
        from dpcourse.launch import run
        from dpcourse.launch.resources import expected_oversubscription

        # Odd world sizes may outnumber the cores on purpose: no warning about ranks the
        # learner did not ask for.
        with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as progress, \
                expected_oversubscription():
            for ws in world_sizes or spec.world_sizes:
                try:
                    run(_rank_main, spec_path(spec), payload, progress, world_size=ws, backend=backend,
                        timeout=timeout or spec.timeout)
                except (RankError, RankTimeoutError, RankDiedError) as err:
                    records = _read_records(progress)
                    failure = _describe_failure(err, ws, records)
                    break
            records = _read_records(progress)
    elif payload is not None:
        rec = MemoryRecorder()
        try:
            with forbid(spec.forbidden, spec.forbid_torch_ddp) as guard:
                objs = cloudpickle.loads(payload)
                spec.run(rec, objs["main"], objs["extras"], Reference(spec, rec, guard))
        except Exception as exc:  # noqa: BLE001 - learner code: report, never crash the notebook
            missing = type(exc).__name__ == NOT_IMPLEMENTED
            failure = ("error", f"not implemented yet: {exc}" if missing
                       else f"raised {type(exc).__name__}: {exc}")
        records = rec.records
    if failure and failure[1].startswith("not implemented yet"):
        notes.insert(0, failure[1])
    return CheckResult(spec.name, spec.exercise, spec.title or spec.name,
                       _merge(spec, criteria, records, failure, static), spec.points,
                       time.perf_counter() - t0, notes)


def grade_main(fd: int) -> None:
    """``dpcourse grade``'s process for one in-process check: definitions in, result out.

    Reads ``{"spec", "cells", "names"}`` (JSON) from stdin, loads the kept cells,
    runs the check with its own world sizes and writes the result (JSON) to ``fd``,
    a pipe only the grader reads.
    """
    import sys

    from dpcourse.grading.submission import load

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
    import sys

    grade_main(int(sys.argv[1]))
