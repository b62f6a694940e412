"""The registry of exercise checks, numbered like the lessons (``ex04_ring`` grades lesson 04).

Every check is an :class:`Exercise` whose verdicts the grader reaches in its own
process; add one by listing its class in ``REGISTRY``.
"""

from __future__ import annotations

from dpcourse.grading.checks.base import Exercise, CaseVerdict
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
from dpcourse.grading.checks.ex12_nvlink_kernels import NvlinkKernels
from dpcourse.grading.checks.ex13_sharded_step import ShardedStep
from dpcourse.grading.checks.ex14_fsdp_hooks import FSDPHooks
from dpcourse.grading.checks.ex15_debugging import DebuggingFixes
from dpcourse.grading.checks.ex16_torch_tools import ClipSharded

REGISTRY: dict[str, type[Exercise]] = {c.name: c for c in (
    UnevenAllGather, NaiveDDP, RingAllReduce, AssignBuckets, OverlappedDDP, NoSync, RingCost,
    MeanGradient, BuffersUnused, HalvingDoubling, FirstBucket, ArrivalOrderDDP, TokenWeighted,
    CheckpointResume, JoinShadow, ErrorFeedbackHook, NvlinkKernels, ShardedStep, FSDPHooks,
    DebuggingFixes, ClipSharded)}

__all__ = ["REGISTRY", "Exercise", "CaseVerdict", "available_checks", "get_spec", "for_notebook"]


def available_checks() -> list[str]:
    """Return the names ``check()`` accepts, in lesson order."""
    return sorted(REGISTRY, key=lambda n: (REGISTRY[n].exercise, n))


def get_spec(name: str):
    """Return a fresh instance of the check called ``name``.

    Args:
        name: e.g. ``"ring_all_reduce"``.
    """
    if name in REGISTRY:
        return REGISTRY[name]()
    raise ValueError(f"unknown check {name!r}: choose one of {', '.join(available_checks())}.")


def for_notebook(filename: str) -> list[Exercise]:
    """Return the checks that grade a notebook, by its lesson number (``04_ring.ipynb``)."""
    prefix = filename.split("_", 1)[0]
    return [get_spec(n) for n in available_checks() if REGISTRY[n].exercise == prefix]
