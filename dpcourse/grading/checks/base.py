"""What every exercise's check provides, split by where each part runs.

- :meth:`Exercise.make_inputs` runs in the grader: fresh random cases per run.
- :meth:`Exercise.rank_run` runs in a graded rank: it calls the learner's code on
  this rank's inputs and returns the outputs; it never sees an expected value.
- :meth:`Exercise.judge` runs in the grader: it compares the outputs (and the
  grader's record of every message) with :mod:`dpcourse.grading.oracles`.

When a criterion can fail for several causes, :func:`follow_causes` picks the hint
for the cause of the first failing case the report shows, so the hint never
contradicts the why-line above it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from dpcourse.grading.criteria import Criterion, first_mismatch


@dataclass
class CaseVerdict:
    """One case of one criterion, as judged by the grader."""

    criterion: str
    passed: bool
    detail: str = ""
    case: str = ""


class Exercise:
    """Base class of a check.

    Attributes:
        name: the name passed to ``check()``.
        exercise: the lesson number, e.g. ``"04"``; also the notebook prefix it grades.
        title: a human title.
        defines: ``(role, name in the notebook)`` pairs; the first role is ``"main"``.
        criteria: what is verified, with weights.
        world_sizes: one round per world size; ``()`` for a pure function (one process).
        dist_api: the torch.distributed functions graded code may call (see ``shim``).
        dist_why: what to say when it asks for another one.
        allowed_imports: ``{module: {names}}`` of the course package graded code may import.
        forbid_torch_ddp: refuse any mention of torch DDP.
        timeout: seconds per round before the ranks count as hung.
        shared_folder: the ranks see one folder in common (a shared disk, for a checkpoint
            rank 0 writes and every rank reads); while ``make_inputs`` runs it is
            ``tempfile``'s folder. Otherwise ranks share nothing on disk.
        points: the check's maximum.
        notes: lines shown under every report.
        verdicts: the grader's module (ranks cannot import it) whose ``judge(world_size,
            inputs, outputs, events)`` is this check's :meth:`judge`, if it has one.
        needs: the hardware the check runs on, when it needs more than CPUs (e.g. "at least
            2 NVLink-connected GPUs"); :meth:`unavailable_here` says when this machine lacks it.
        error_hints: ``(phrases, hint)`` pairs, most specific first, for :meth:`explain`.
    """

    name = ""
    exercise = ""
    title = ""
    defines: tuple[tuple[str, str], ...] = ()
    criteria: tuple[Criterion, ...] = ()
    world_sizes: tuple[int, ...] = ()
    dist_api: tuple[str, ...] = ()
    dist_why = "Graded code for this exercise does not communicate."
    allowed_imports: dict = {}
    forbid_torch_ddp = True
    timeout = 30.0
    shared_folder = False
    points = 10.0
    notes: tuple[str, ...] = ()
    verdicts = ""
    needs = ""
    error_hints: tuple[tuple[tuple[str, ...], str], ...] = ()

    def unavailable_here(self) -> str | None:
        """Return what this machine lacks to run the check (a sentence), or ``None``.

        Asked in the process that decides to run the check (the grader's, or the
        notebook's for ``check(...)``), before any of the learner's code is loaded.
        """
        return None

    @property
    def roles(self) -> dict:
        """``{role: notebook name}`` for the definitions this check grades."""
        return dict(self.defines)

    def make_inputs(self, rng, world_size: int) -> list:
        """Return one input object per rank (dicts of tensors and JSON values)."""
        raise NotImplementedError

    @staticmethod
    def rank_run(link, learner: dict, inputs) -> object:
        """Call the learner's definitions (``learner[role]``) on ``inputs``; return outputs."""
        raise NotImplementedError

    def judge(self, world_size: int, inputs: list, outputs: list,
              events: list) -> list[CaseVerdict]:
        """Compare every rank's ``outputs`` (and message ``events``) with the oracles."""
        if not self.verdicts:
            raise NotImplementedError
        import importlib

        module = importlib.import_module(self.verdicts)
        recs = module.judge(world_size, inputs, outputs, events)
        if hasattr(module, "cause"):  # a hint for the cause the grader saw (follow_causes)
            follow_causes(self, recs, lambda rec: module.cause(self, world_size, rec))
        return recs

    def explain(self, text: str) -> str:
        """Return a hint for an error the learner's code raised, or ``""``.

        The hint is that of the first ``error_hints`` pair whose phrases all occur in ``text``.
        """
        return next((hint for phrases, hint in self.error_hints
                     if all(phrase in text for phrase in phrases)), "")


def begin(link, case: str) -> None:
    """Tell the grader which case this rank starts now (for messages and hang reports)."""
    link.send({"t": "begin", "case": case})


def clone_all(tensors) -> list:
    """Detached copies of ``tensors``, ``None`` where there is no tensor (a missing gradient)."""
    return [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in tensors]


def compare(criterion: str, names, got, want, tol, case: str = "",
            where: str = "") -> CaseVerdict:
    """Return ``criterion``'s record of tensors ``got`` against ``want``, to ``tol``.

    It fails when one of them differs, with ``where`` followed by
    :func:`~dpcourse.grading.criteria.first_mismatch`'s line for the first that does.
    """
    bad = first_mismatch(names, got, want, tol)
    return CaseVerdict(criterion, not bad, f"{where}{bad}", case)


def returned(value) -> object:
    """What a rank reports of a learner's return value: a copy of a tensor, else its type's name."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else type(value).__name__


def events_of(events: list, case: str) -> list:
    """The events a rank produced while running ``case``."""
    return [e for e in events if e.get("case") == case and e["op"] != "begin"]


def describe_ops(ops, empty: str = "nothing") -> str:
    """``"all_reduce of 8 bytes, broadcast of 4 bytes"`` for ``(op, bytes)`` pairs, or ``empty``."""
    return ", ".join(f"{op} of {n} bytes" for op, n in ops) or empty


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
