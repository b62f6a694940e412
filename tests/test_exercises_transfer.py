"""Transfer exercises and the graded exercises of lessons 01 and 08.

Each reference solution (from solutions/) passes every criterion of its check;
each planted wrong answer (tests/planted/transfer_bugs.py) fails the criterion
that names its mistake, and its hint speaks of that mistake.
"""

import pathlib
import types

import pytest

from dpcourse.grading import check
from planted import transfer_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_solution(name: str) -> types.ModuleType:
    """Execute a solution notebook's code cells (without its check calls) as a module."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    module = types.ModuleType(f"solution_{name[:2]}")  # not importable: travels by value
    for cell in nb.cells:
        if cell.cell_type == "code" and "check(" not in cell.source:
            exec(compile(cell.source, name, "exec"), module.__dict__)
    return module


def _assert_all_passed(result):
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


# -- 04: all-reduce in log2(N) rounds ---------------------------------------------------

def test_halving_doubling_solution_passes_every_criterion():
    solution = load_solution("04_ring_all_reduce.ipynb")
    _assert_all_passed(check("halving_doubling", solution.halving_doubling_all_reduce,
                             quiet=True))


def test_ring_is_right_but_fails_log_rounds():
    result = check("halving_doubling", transfer_bugs.all_reduce_ring, world_sizes=(4, 5),
                   quiet=True)
    assert set(result.failed()) == {"log_rounds"}
    assert "sent 6 messages, at most 4" in result.criterion("log_rounds").detail


def test_whole_tensor_swaps_fail_bandwidth_on_a_power_of_two():
    result = check("halving_doubling", transfer_bugs.all_reduce_recursive_doubling_power_of_two,
                   world_sizes=(4,), quiet=True)
    assert set(result.failed()) == {"bandwidth_power_of_two"}
    assert "half" in result.criterion("bandwidth_power_of_two").hint
