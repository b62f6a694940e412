"""Graded exercises: the learner's quick ``check(...)`` and the instructor's ``dpcourse grade``.

In a notebook, ``check("ring_all_reduce", ring_all_reduce)`` runs the grader's cases on
the learner's definitions and shows which criteria passed. ``dpcourse grade`` does the
same for whole notebooks, with the kernel, the ranks and the cases all owned by the grader.

Adding an exercise's check (lesson NN):
1. Write ``grading/checks/exNN_topic.py`` with a subclass of ``checks.Exercise``: ``name``,
   ``exercise="NN"``, ``defines`` (the notebook names graded: main first), ``criteria``
   (weights; ``needs=`` for criteria that only count once the result is right).
2. ``make_inputs(rng, world_size)`` builds fresh per-rank cases; ``rank_run`` calls the
   learner's code in a rank (no answers there); ``judge`` compares in the grader's process.
3. Put the expected values in ``grading/oracles.py`` (never imported by ranks), written
   independently of the reference package.
4. Add the class to ``REGISTRY`` in ``grading/checks/__init__.py``; add a solution
   notebook (``solutions/NN_topic.ipynb``) calling ``check(name, fn)``, run make_exercises,
   and add a planted wrong solution to ``tests/planted/`` that fails the criterion it names.
"""

from __future__ import annotations

import importlib

__all__ = ["check", "available_checks", "CheckResult", "CriterionResult"]


def __getattr__(name):
    # Lazy: a graded rank imports dpcourse.grading.shim without the rest of the grader.
    if name not in __all__:
        raise AttributeError(f"module 'dpcourse.grading' has no attribute {name!r}")
    module = "runner" if name in ("check", "available_checks") else "report"
    return getattr(importlib.import_module(f"dpcourse.grading.{module}"), name)
