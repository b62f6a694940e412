"""What every exercise's check provides, split by where each part runs.

- :meth:`Exercise.make_inputs` runs in the grader: fresh random cases per run.
- :meth:`Exercise.rank_run` runs in a graded rank: it calls the learner's code on
  this rank's inputs and returns the outputs; it never sees an expected value.
- :meth:`Exercise.judge` runs in the grader: it compares the outputs (and the
  grader's record of every message) with :mod:`dpcourse.grading.oracles`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpcourse.grading.criteria import Criterion


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
        needs: the hardware the check runs on, when it needs more than CPUs (e.g. "at least
            2 NVLink-connected GPUs"); :meth:`unavailable_here` says when this machine lacks it.
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
    needs = ""

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

    def judge(self, world_size: int, inputs: list, outputs: list, events: list) -> list[CaseVerdict]:
        """Compare every rank's ``outputs`` (and message ``events``) with the oracles."""
        raise NotImplementedError

    def explain(self, text: str) -> str:
        """Return a hint for an error the learner's code raised, or ``""``."""
        return ""


def begin(link, case: str) -> None:
    """Tell the grader which case this rank starts now (for messages and hang reports)."""
    link.send({"t": "begin", "case": case})


def events_of(events: list, case: str) -> list:
    """The events a rank produced while running ``case``."""
    return [e for e in events if e.get("case") == case and e["op"] != "begin"]
