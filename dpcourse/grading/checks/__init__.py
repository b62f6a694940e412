"""The registry of exercise checks, numbered like the lessons (``ex04_ring`` grades lesson 04)."""

from __future__ import annotations

from dpcourse.grading.checks.base import Exercise, Record
from dpcourse.grading.checks.ex02_collectives import CollectiveSemantics
from dpcourse.grading.checks.ex03_naive_ddp import NaiveDDP
from dpcourse.grading.checks.ex04_ring import RingAllReduce
from dpcourse.grading.checks.ex05_bucketing import AssignBuckets
from dpcourse.grading.checks.ex06_overlap import OverlappedDDP
from dpcourse.grading.checks.ex07_no_sync import NoSync
from dpcourse.grading.checks.ex09_cost_model import RingCost

REGISTRY: dict[str, type[Exercise]] = {c.name: c for c in (
    CollectiveSemantics, NaiveDDP, RingAllReduce, AssignBuckets, OverlappedDDP, NoSync, RingCost)}

__all__ = ["REGISTRY", "Exercise", "Record", "available_checks", "get_spec", "for_notebook"]


def available_checks() -> list[str]:
    """Return the names ``check()`` accepts, in lesson order."""
    return sorted(REGISTRY, key=lambda n: (REGISTRY[n].exercise, n))


def get_spec(name: str) -> Exercise:
    """Return the check called ``name``.

    Args:
        name: e.g. ``"ring_all_reduce"``.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown check {name!r}: choose one of {', '.join(available_checks())}.")
    return REGISTRY[name]()


def for_notebook(filename: str) -> list[Exercise]:
    """Return the checks that grade a notebook, by its lesson number (``04_ring.ipynb``)."""
    prefix = filename.split("_", 1)[0]
    return [get_spec(n) for n in available_checks() if REGISTRY[n].exercise == prefix]
