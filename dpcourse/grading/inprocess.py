"""In-process checks: the check runs beside the learner's code, in the same rank processes.

The form of the exercises whose checks are not written as
:class:`dpcourse.grading.checks.Exercise` (whose verdicts are reached outside the
learner's processes). Here a check's cases and records live in the ranks with
the learner's objects, so the result is cooperative: ``check(...)`` in a
notebook uses it as is, and ``dpcourse grade`` runs it only in a process of its
own on definitions taken from the notebook, after the static scan, and
validates what comes back. Port a check to ``Exercise`` to make it structural.

This module holds what a check is (:class:`CheckSpec`) and what it records
with (:class:`RankRecorder`); :mod:`dpcourse.grading.inprocess_run` runs it and
merges the records into a report; :mod:`dpcourse.grading.inprocess_grade` is
``dpcourse grade``'s path to it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os

from dpcourse.grading.criteria import NO_DEADLOCK, NO_DELEGATION, NOT_IMPLEMENTED, Criterion


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
        needs: the hardware the check runs on, when it needs more than CPUs (e.g. "at least
            2 NVLink-connected GPUs"); :meth:`unavailable_here` says when this machine lacks it.
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
    needs = ""

    def unavailable_here(self) -> str | None:
        """Return what this machine lacks to run the check (a sentence), or ``None`` if nothing.

        Asked in the process that decides to run the check (the grader's, or the
        notebook's for ``check(...)``), before any of the learner's code is loaded.
        """
        return None

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


class MemoryRecorder(RankRecorder):
    """The in-process twin of :class:`RankRecorder`, for pure checks: records kept in a list."""

    def __init__(self):
        super().__init__(path="", world_size=1)
        self.records: list[dict] = []

    def _write(self, record: dict) -> None:
        self.records.append(dict(record, world_size=1, rank=0))
