"""Graded exercises: checks that compare the learner's code with torch, and an autograder.

In a notebook::

    from dpcourse.grading import check
    check("ring_all_reduce", ring_all_reduce)

runs the learner's function on several ranks and shows which criteria passed,
with a hint for each failure. ``dpcourse grade exercises/`` executes notebooks
headless and collects every check's result into a score table.
"""

from dpcourse.grading.checks import available_checks, check
from dpcourse.grading.guards import DelegationError
from dpcourse.grading.report import GRADE_FILE_ENV, CheckResult, CriterionResult

__all__ = ["check", "available_checks", "CheckResult", "CriterionResult", "DelegationError",
           "GRADE_FILE_ENV"]
