"""What the bucket-assignment checks (05) share: a case's parameters, the buckets coming back.

A case is ``{"sizes", "dtype"}``: the number of elements of each parameter and
their dtype's name. The rank builds zero parameters of those sizes, calls the
learner's assignment, and returns the buckets as plain lists of indices, which
the grader judges against the case's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import CaseVerdict

DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def zero_params(sizes, dtype: str, frozen=()) -> list[nn.Parameter]:
    """Zero parameters of ``sizes`` elements of ``dtype``; those at ``frozen`` need no gradient."""
    return [nn.Parameter(torch.zeros(n, dtype=DTYPES[dtype]), requires_grad=i not in frozen)
            for i, n in enumerate(sizes)]


def case_nbytes(case: dict) -> list[int]:
    """Bytes of each parameter of a case."""
    return [n * DTYPES[case["dtype"]].itemsize for n in case["sizes"]]


def index_lists(got) -> list | dict:
    """The learner's buckets as lists of ints, or ``{"type": ...}`` when they are not lists."""
    try:
        return [[int(i) for i in b] for b in got]
    except TypeError:
        return {"type": type(got).__name__}


def not_index_lists(got, criterion: str, case: str) -> CaseVerdict | None:
    """A failed record when the learner's buckets did not come back as lists, else ``None``."""
    if isinstance(got, list):
        return None
    return CaseVerdict(criterion, False, f"expected a list of lists of indices, got {got['type']}",
                       case)
