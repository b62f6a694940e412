"""Exercises 04 and 09 ask for a transfer of their lesson, and every hint follows its cause.

Exercise 04's ring turns left (lesson 04's turns right); exercise 09 prices an
all-reduce lesson 09 gave no formula for. Each solution passes its check, each
unchanged exercise scores 0, and each planted mistake fails the criterion that
names it, with a hint that agrees with the case the report shows.
"""

import pathlib
import sys

import nbformat
import pytest

from dpcourse.grading import check
from dpcourse.grading.checks import get_spec
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract
from notebook_helpers import notebook_module
from planted import ring_left_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def solution(tmp_path):
    """Load a solution notebook's code cells (without its check calls) as a module from a file."""
    def load(name: str):
        return notebook_module(ROOT / "solutions" / name, tmp_path / f"texts_{name[:2]}.py")
    yield load
    for name in [n for n in sys.modules if n.startswith("texts_")]:
        del sys.modules[name]


def _exercise_cells(name: str) -> list:
    nb = nbformat.read(ROOT / "exercises" / name, as_version=4)
    cells, _ = extract([(f"<cell {i}>", c.source) for i, c in enumerate(nb.cells)
                        if c.cell_type == "code"])
    return cells


def _passed(result) -> set:
    return {c.name for c in result.criteria if c.passed}


# -- 04: the leftward ring ------------------------------------------------------------------

def _ring(name, sizes=(2, 3)):
    spec = get_spec("ring_all_reduce")
    spec.world_sizes = sizes  # fewer ranks than the grader uses: enough to show each mistake
    cells, _ = extract([("<planted>", pathlib.Path(ring_left_bugs.__file__).read_text())])
    return run_check(spec, cells, dict(spec.roles, main=name), timeout=20)


RING_OWN = {"matches_all_reduce", "awkward_lengths", "in_place", "ring_neighbours_only",
            "bandwidth_optimal", "no_delegation", "no_deadlock"}


@pytest.mark.timeout(300)
def test_leftward_ring_solution_passes_every_criterion(solution):
    sol = solution("04_ring_all_reduce.ipynb")
    result = check("ring_all_reduce", sol.ring_all_reduce, chunk_bounds=sol.chunk_bounds,
                   reduce_scatter=sol.ring_reduce_scatter, all_gather=sol.ring_all_gather,
                   quiet=True)
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


def test_unchanged_ring_exercise_scores_zero():
    spec = get_spec("ring_all_reduce")
    result = run_check(spec, _exercise_cells("04_ring_all_reduce.ipynb"), spec.roles)
    assert result.points == 0 and "NotImplementedError" in \
        result.criterion("matches_all_reduce").detail


@pytest.mark.timeout(300)
def test_a_planted_leftward_ring_passes_the_ring_criteria():
    """The reference for the planted ones: turning left with the right schedule passes."""
    assert RING_OWN <= _passed(_ring("ring_all_reduce_leftward"))


@pytest.mark.timeout(300)
def test_lesson_04s_ring_copied_sums_right_but_turns_the_wrong_way():
    result = _ring("ring_all_reduce_rightward")
    assert RING_OWN - _passed(result) == {"ring_neighbours_only", "bandwidth_optimal"}
    neighbours = result.criterion("ring_neighbours_only")
    assert "send to rank 1" in neighbours.detail and "the way lesson 04's ring turns" in \
        neighbours.detail
    assert "turns right, like lesson 04's" in neighbours.hint
    assert result.criterion("bandwidth_optimal").detail.startswith("not credited")
    assert result.points < 0.7 * result.max_points


@pytest.mark.timeout(300)
def test_lesson_04s_schedule_on_the_leftward_ring_pairs_the_wrong_chunks():
    """On 2 ranks both ways round are the same ring; on 3 the chunks of a message disagree."""
    result = _ring("ring_all_reduce_lesson_schedule")
    match = result.criterion("matches_all_reduce")
    assert "world size 3" in match.detail and "into a buffer of" in match.detail
    assert "picked different chunks" in match.hint and "dtype" not in match.hint
    assert result.points == 0


@pytest.mark.timeout(300)
def test_wrong_sums_get_the_hint_of_their_pattern_and_short_lengths_are_not_blamed():
    result = _ring("ring_all_reduce_shifted", sizes=(3,))
    match = result.criterion("matches_all_reduce")
    assert "wrong chunks on rank" in match.detail
    if "(all of them)" in match.detail:
        assert match.hint.startswith("Every chunk is wrong")
    else:
        assert match.hint.startswith("Some chunks are right and others wrong")
    awkward = result.criterion("awkward_lengths")  # failing too, for the same reason
    assert not awkward.passed and "regular lengths fail too" in awkward.hint
    assert "Only lengths that N does not divide" not in awkward.hint


@pytest.mark.timeout(300)
def test_an_averaged_ring_is_told_it_is_n_times_off():
    result = _ring("ring_all_reduce_averaged")
    match = result.criterion("matches_all_reduce")
    assert "times too small or too large" in match.detail
    assert "N times off" in match.hint and "does not average" in match.hint


@pytest.mark.timeout(300)
def test_only_short_tensors_failing_get_the_short_tensor_hint():
    result = _ring("ring_all_reduce_short_skipped")
    assert result.criterion("matches_all_reduce").passed
    awkward = result.criterion("awkward_lengths")
    assert not awkward.passed and "smaller than the world size" in awkward.hint
    assert "regular lengths fail too" not in awkward.hint
