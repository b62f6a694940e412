"""Run an in-process check (:mod:`dpcourse.grading.inprocess`) and merge what its ranks recorded.

One launch per world size runs every criterion of the check. The learner's
objects travel as one cloudpickle payload that each rank unpickles only after
the reference implementations are switched off (:mod:`dpcourse.grading.guards`).
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time

from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.grading.criteria import NO_DEADLOCK, NO_DELEGATION, NOT_IMPLEMENTED, Criterion
from dpcourse.grading.guards import forbid, static_references
from dpcourse.grading.inprocess import (CheckSpec, MemoryRecorder, RankRecorder, Reference,
                                        load_spec, spec_path)
from dpcourse.grading.report import CheckResult, CriterionResult


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
