"""Hints that follow the cause the grader saw, not the most common one.

A criterion's report shows the first failing case ("why") and the criterion's
hint. When a criterion can fail for several causes, a check's ``judge`` picks
the hint for the cause of that first failing case with :func:`follow_causes`,
so the hint never contradicts the why-line above it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from dpcourse.grading.checks.base import Exercise, CaseVerdict


def follow_causes(spec: Exercise, records: list[CaseVerdict],
                  choose: Callable[[CaseVerdict], str]) -> None:
    """Give each criterion the hint ``choose`` returns for its first failing record.

    Call it from ``judge`` with the records of each round, in order: the first
    failing record of a criterion is the one its report shows, so a later round
    never replaces the hint of an earlier one.

    Args:
        spec: the check being judged; its ``criteria`` are replaced on this instance only.
        records: the records of this round, in the order ``judge`` returns them.
        choose: the hint for a failing record, or ``""`` to keep the criterion's own.
    """
    seen = spec.__dict__.setdefault("_hinted", set())
    hints = {}
    for r in records:
        if r.passed or r.criterion in seen:
            continue
        seen.add(r.criterion)
        hint = choose(r)
        if hint:
            hints[r.criterion] = hint
    if hints:
        spec.criteria = tuple(replace(c, hint=hints.get(c.name, c.hint)) for c in spec.criteria)


def failed(spec: Exercise, criterion: str) -> bool:
    """Whether an earlier :func:`follow_causes` call saw ``criterion`` fail."""
    return criterion in spec.__dict__.get("_hinted", set())
