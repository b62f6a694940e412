"""The registry of exercise checks, numbered like the lessons (``ex04_ring`` grades lesson 04).

``REGISTRY`` holds the checks whose verdicts the grader reaches in its own process
(this package). ``IN_PROCESS`` names, by ``"module:Class"``, the exercises whose
checks still run beside the learner's code (:mod:`dpcourse.grading.inprocess`);
they are imported only when asked for.
"""

from __future__ import annotations

from dpcourse.grading.checks.base import Exercise, Record
from dpcourse.grading.checks.ex01_mean_gradient import MeanGradient
from dpcourse.grading.checks.ex02_collectives import UnevenAllGather
from dpcourse.grading.checks.ex03_buffers_unused import BuffersUnused
from dpcourse.grading.checks.ex03_naive_ddp import NaiveDDP
from dpcourse.grading.checks.ex04_halving_doubling import HalvingDoubling
from dpcourse.grading.checks.ex04_ring import RingAllReduce
from dpcourse.grading.checks.ex05_bucketing import AssignBuckets
from dpcourse.grading.checks.ex05_first_bucket import FirstBucket
from dpcourse.grading.checks.ex06_arrival_order import ArrivalOrderDDP
from dpcourse.grading.checks.ex06_overlap import OverlappedDDP
from dpcourse.grading.checks.ex07_no_sync import NoSync
from dpcourse.grading.checks.ex07_token_weighted import TokenWeighted
from dpcourse.grading.checks.ex08_checkpoint import CheckpointResume
from dpcourse.grading.checks.ex09_cost_model import RingCost
from dpcourse.grading.checks.ex10_join import JoinShadow
from dpcourse.grading.checks.ex11_error_feedback import ErrorFeedbackHook
from dpcourse.grading.checks.ex14_fsdp_hooks import FSDPHooks

REGISTRY: dict[str, type[Exercise]] = {c.name: c for c in (
    UnevenAllGather, NaiveDDP, RingAllReduce, AssignBuckets, OverlappedDDP, NoSync, RingCost,
    MeanGradient, BuffersUnused, HalvingDoubling, FirstBucket, ArrivalOrderDDP, TokenWeighted,
    CheckpointResume, JoinShadow, ErrorFeedbackHook, FSDPHooks)}

IN_PROCESS: dict[str, str] = {
    "nvlink_kernels": "dpcourse.grading.checks.ex12_nvlink_kernels:NvlinkKernels",
    "sharded_step": "dpcourse.grading.checks.ex13_sharded_step:ShardedStep",
}

__all__ = ["REGISTRY", "Exercise", "Record", "available_checks", "get_spec", "for_notebook"]


def _exercise(name: str) -> str:
    if name in REGISTRY:
        return REGISTRY[name].exercise
    return get_spec(name).exercise


def available_checks() -> list[str]:
    """Return the names ``check()`` accepts, in lesson order."""
    return sorted([*REGISTRY, *IN_PROCESS], key=lambda n: (_exercise(n), n))


def get_spec(name: str):
    """Return the check called ``name`` (an :class:`Exercise`, or an in-process ``CheckSpec``).

    Args:
        name: e.g. ``"ring_all_reduce"``.
    """
    if name in REGISTRY:
        return REGISTRY[name]()
    if name in IN_PROCESS:
        from dpcourse.grading.inprocess import load_spec

        return load_spec(IN_PROCESS[name])
    raise ValueError(f"unknown check {name!r}: choose one of {', '.join(available_checks())}.")


def for_notebook(filename: str) -> list[Exercise]:
    """Return the checks that grade a notebook, by its lesson number (``04_ring.ipynb``)."""
    prefix = filename.split("_", 1)[0]
    return [get_spec(n) for n in available_checks() if _exercise(n) == prefix]
