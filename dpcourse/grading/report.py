"""Results of a check (what ``check(...)`` returns and ``dpcourse grade`` collects).

:meth:`CheckResult.said` decides what a result says (headline, one line per criterion, why
and hint of a failure, notes); text, HTML and Markdown differ only in markup. Points are the
weighted share of criteria credited, never more than the maximum.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

NOT_GRADED = "not graded on this machine"  # the outcome of a check this machine cannot run
NOT_GRADED_STATUS = "not graded"  # dpcourse grade's status of such a result (and its notebook)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def strip_ansi(text: str) -> str:
    """Remove terminal colour and cursor codes (IPython tracebacks carry them)."""
    return _ANSI.sub("", text)


@dataclass
class CriterionResult:
    """The outcome of one criterion: for a failure, ``detail`` (what was observed in the first
    failing case) and ``hint`` (the likely mistake); ``gate``: a failure scores the check zero."""

    name: str
    description: str
    passed: bool
    detail: str = ""
    hint: str = ""
    weight: float = 1.0
    gate: bool = False

    def __post_init__(self):
        self.detail, self.hint = strip_ansi(self.detail), strip_ansi(self.hint)

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "passed": self.passed,
                "weight": self.weight, "detail": self.detail, "hint": self.hint}


@dataclass
class CheckResult:
    """The outcome of a check: every criterion, a score and points.

    ``not_graded``: why this machine could not run the check (e.g. it needs GPUs), or
    ``None``. Such a result has no criteria and no points, and ``dpcourse grade`` leaves
    its ``max_points`` out of the totals.
    """

    check: str
    exercise: str
    title: str
    criteria: list[CriterionResult] = field(default_factory=list)
    max_points: float = 10.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    not_graded: str | None = None

    @classmethod
    def not_graded_here(cls, spec, why: str) -> "CheckResult":
        """The result of check ``spec`` that this machine cannot run, saying ``why``."""
        return cls(spec.name, spec.exercise, spec.title or spec.name, [], spec.points,
                   not_graded=why)

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.criteria)

    @property
    def total(self) -> int:
        return len(self.criteria)

    @property
    def score(self) -> float:
        """Weighted fraction of criteria passed, between 0 and 1 (0 when a gate failed)."""
        weight = sum(c.weight for c in self.criteria)
        if self.not_graded or not weight or any(c.gate and not c.passed for c in self.criteria):
            return 0.0
        return min(1.0, max(0.0, sum(c.weight for c in self.criteria if c.passed) / weight))

    @property
    def points(self) -> float:
        """Points earned: ``max_points`` times :attr:`score`, rounded to 0.1."""
        return min(self.max_points, round(self.max_points * self.score, 1))

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def criterion(self, name: str) -> CriterionResult:
        """Return the criterion called ``name`` (``KeyError`` naming the others if none)."""
        for c in self.criteria:
            if c.name == name:
                return c
        raise KeyError(f"check {self.check!r} has no criterion {name!r}; it has "
                       f"{[c.name for c in self.criteria]}.")

    def failed(self) -> list[str]:
        return [c.name for c in self.criteria if not c.passed]

    def to_dict(self) -> dict:
        """Return the result as a JSON-ready dict (what the autograder stores)."""
        return {"check": self.check, "exercise": self.exercise, "title": self.title,
                "passed": self.passed, "total": self.total, "points": self.points,
                "max_points": self.max_points, "seconds": round(self.seconds, 2),
                "criteria": [c.to_dict() for c in self.criteria],
                "notes": [strip_ansi(n) for n in self.notes],
                "not_graded": strip_ansi(self.not_graded) if self.not_graded else None}

    # -- what the result says, then each format's markup ---------------------------
    def headline(self) -> str:
        """Return the one-line summary, e.g. ``ring_all_reduce (Exercise 04): 5/7 criteria``."""
        if self.not_graded:
            return (f"{self.title} (Exercise {self.exercise}): {NOT_GRADED} "
                    f"(its {self.max_points:g} points are not counted)")
        verdict = "all passed" if self.all_passed else f"{self.total - self.passed} failed"
        return (f"{self.title} (Exercise {self.exercise}): {self.passed}/{self.total} criteria "
                f"passed, {verdict}, {self.points:g}/{self.max_points:g} points "
                f"[{self.seconds:.1f} s]")

    def said(self) -> tuple[list[tuple[CriterionResult, list[tuple[str, str]]]],
                            list[tuple[str, str]]]:
        """Return ``(rows, notes)``: each criterion with the ``(label, text)`` lines its failure
        shows (``why``, ``hint``), and the result's ``(label, text)`` notes."""
        # A run that stopped at a stub: its note says it all, per-criterion causes would not.
        stub = any(n.startswith("not implemented yet") for n in self.notes)
        rows = [(c, [] if c.passed or stub else
                 [(label, text.strip()) for label, text in (("why", c.detail), ("hint", c.hint))
                  if text.strip()]) for c in self.criteria]
        notes = [("why", strip_ansi(self.not_graded))] if self.not_graded else []
        return rows, notes + [("note", strip_ansi(n)) for n in self.notes]

    def __str__(self) -> str:
        rows, notes = self.said()
        width = max((len(c.name) for c in self.criteria), default=0)
        lines = [self.headline()]
        for c, extra in rows:
            lines.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  "
                         f"{c.description}")
            for label, text in extra:
                for i, line in enumerate(text.splitlines()):
                    lines.append(f"        {label + ':' if i == 0 else ' ' * (len(label) + 1)} "
                                 f"{line}")
        lines += [f"  {label}: {text}" for label, text in notes]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows, notes = self.said()
        color = ("#57606a" if self.not_graded else "#1a7f37" if self.all_passed else "#cf222e")
        cells = "".join(
            f"<tr><td style='text-align:center'><span style='color:"
            f"{'#1a7f37' if c.passed else '#cf222e'}'>&#{10004 if c.passed else 10008};</span>"
            f"</td><td><code>{html.escape(c.name)}</code></td>"
            f"<td style='text-align:left'>{html.escape(c.description)}"
            + "".join(f"<div style='margin-top:2px'><b>{label}:</b> <span style='white-space:"
                      f"pre-wrap'>{html.escape(text)}</span></div>" for label, text in extra)
            + "</td></tr>" for c, extra in rows)
        lines = "".join(f"<div style='color:#57606a'>"
                        f"{html.escape(text if label == 'note' else f'{label}: {text}')}</div>"
                        for label, text in notes)
        return (f"<div><div style='font-weight:bold;color:{color}'>{html.escape(self.headline())}"
                f"</div><table style='border-collapse:collapse'>{cells}</table>{lines}</div>")

    def markdown(self) -> str:
        """Return the result as a Markdown section (the feedback notebook's)."""
        rows, notes = self.said()
        lines = [f"## {self.headline()}", ""]
        if rows:
            lines += ["| | criterion | weight | what it checks |", "|---|---|---|---|"]
            lines += [f"| {'PASS' if c.passed else 'FAIL'} | `{c.name}` | {c.weight:g} | "
                      f"{c.description} |" for c, _ in rows] + [""]
        for c, extra in rows:
            lines += [f"- **{c.name}**: {_md(text)}" if label == "why" else
                      f"  - {label}: {_md(text)}" for label, text in extra]
        return "\n".join(lines + [f"- {label}: {_md(text)}" for label, text in notes] + [""])

    def _ipython_display_(self) -> None:
        # check() already showed this report in the same cell: don't show it twice.
        ip = _ipython()
        if ip is None or getattr(self, "_shown_at", None) != ip.execution_count:
            _display(self)


def _md(text: str) -> str:
    return text.replace("\n", " <br> ").replace("|", "\\|")


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _display(result: CheckResult) -> None:
    from IPython.display import display

    display({"text/plain": str(result), "text/html": result._repr_html_()}, raw=True)


def show(result: CheckResult) -> None:
    """Display ``result`` now: HTML in Jupyter, plain text in a terminal."""
    ip = _ipython()
    if type(ip).__name__ == "ZMQInteractiveShell":
        _display(result)
    else:
        print(result, flush=True)
    if ip is not None:
        result._shown_at = ip.execution_count
