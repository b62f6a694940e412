"""Generate exercises/ from solutions/: every solution region becomes a stub.

In a solution notebook, the code a learner must write sits between two marker
lines inside a function body::

    def ring_all_reduce(tensor, group=None):
        \"\"\"Sum ``tensor`` in place over all ranks.\"\"\"
        ### BEGIN SOLUTION
        ring_reduce_scatter(tensor, group)
        ring_all_gather(tensor, group)
        ### END SOLUTION

The exercise keeps the signature and docstring and gets
``raise NotImplementedError("Exercise 04.3: write ring_all_reduce")`` instead,
numbered by notebook and by region. Outputs are cleared, so learners start
from a clean notebook. A cell tagged ``solution`` (e.g. the discussion after a
check, which names the answer) stays in the solution only. Run ``python -m dpcourse.grading.make_exercises`` after
editing a solution; ``--check`` only reports whether exercises/ is up to date.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
SOLUTION_TAG = "solution"
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)\s*\(")


def stub_source(source: str, label: str, first: int) -> tuple[str, int]:
    """Replace each solution region of one cell's ``source``; return the new source and the count.

    Args:
        source: the cell's code.
        label: the notebook's number, e.g. ``"04"``.
        first: the number of the first region in this cell (regions count per notebook).

    Returns:
        ``(new_source, regions_replaced)``.
    """
    out, count, inside, last_def = [], 0, False, "this function"
    for lineno, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if (m := _DEF.match(line)) and not inside:
            last_def = m.group(1)
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"line {lineno}: {BEGIN} inside another solution region.")
            indent = line[: len(line) - len(line.lstrip())]
            if not indent:
                raise ValueError(f"line {lineno}: put solution regions inside a function body, so "
                                 "the exercise keeps its signature and docstring.")
            out.append(f'{indent}raise NotImplementedError("Exercise {label}.{first + count}: '
                       f'write {last_def}")')
            count, inside = count + 1, True
        elif stripped == END:
            if not inside:
                raise ValueError(f"line {lineno}: {END} without a matching {BEGIN}.")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"a {BEGIN} has no matching {END}.")
    return "\n".join(out), count


def generate(solution_path: str):
    """Return the exercise notebook (an ``nbformat`` node) generated from ``solution_path``.

    Args:
        solution_path: e.g. ``"solutions/04_ring.ipynb"``; its number prefix labels the exercises.
    """
    import nbformat

    nb = nbformat.read(solution_path, as_version=4)
    label = os.path.basename(solution_path).split("_", 1)[0]
    exercise = copy.deepcopy(nb)
    exercise.cells = [c for c in exercise.cells if SOLUTION_TAG not in c.metadata.get("tags", [])]
    region = 1
    for i, cell in enumerate(exercise.cells):
        if cell.cell_type != "code":
            continue
        try:
            cell.source, n = stub_source(cell.source, label, region)
        except ValueError as exc:
            raise ValueError(f"{solution_path}, cell {i}: {exc}") from None
        region += n
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    if region == 1:
        raise ValueError(f"{solution_path} has no {BEGIN} region: nothing to turn into an "
                         "exercise.")
    return exercise


def render(solution_path: str) -> str:
    """Return the exercise notebook for ``solution_path`` as the exact text written to disk."""
    import nbformat

    return nbformat.writes(generate(solution_path)) + "\n"


def pairs(solutions_dir: str, exercises_dir: str) -> list[tuple[str, str]]:
    """Return ``(solution, exercise)`` paths for every notebook in ``solutions_dir``."""
    names = sorted(n for n in os.listdir(solutions_dir) if n.endswith(".ipynb"))
    return [(os.path.join(solutions_dir, n), os.path.join(exercises_dir, n)) for n in names]


def stale(solutions_dir: str = "solutions", exercises_dir: str = "exercises") -> list[str]:
    """Return the exercise notebooks that are missing or differ from what the solutions generate."""
    out = []
    for sol, ex in pairs(solutions_dir, exercises_dir):
        if not os.path.exists(ex) or open(ex).read() != render(sol):
            out.append(ex)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.grading.make_exercises",
                                     description="Generate exercises/ from solutions/.")
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--exercises", default="exercises")
    parser.add_argument("--check", action="store_true", help="only report stale exercises")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.solutions, args.exercises)
        for path in bad:
            print(f"stale: {path} (run python -m dpcourse.grading.make_exercises)")
        return 1 if bad else 0
    os.makedirs(args.exercises, exist_ok=True)
    for sol, ex in pairs(args.solutions, args.exercises):
        with open(ex, "w") as f:
            f.write(render(sol))
        print(f"{sol} -> {ex}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
