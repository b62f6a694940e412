"""Criteria that measure what they claim: bytes counted exactly, every step judged, torch's
helpers caught where the exercise's rule differs from theirs.

Each planted mistake (tests/planted/) passed a looser version of its criterion; here it fails
that criterion with the hint for its cause, while the solution keeps full marks.
"""

import pathlib

import pytest
import torch

from dpcourse.grading import check, oracles
from dpcourse.grading.checks import get_spec
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract
from planted import ddp_bugs, overlap_reset_bugs, ring_bugs, ring_left_bugs
from test_exercises_transfer import solution  # noqa: F401 - the fixture that loads a solution


def _planted(module, check_name: str, sizes: tuple, **roles):
    spec = get_spec(check_name)
    spec.world_sizes = sizes  # fewer rounds than the grader runs: enough to show the mistake
    cells, _ = extract([("<planted>", pathlib.Path(module.__file__).read_text())])
    return run_check(spec, cells, dict(spec.roles, **roles), timeout=30)


def _failed_with(result, criterion: str, detail: str, hint: str) -> None:
    c = result.criterion(criterion)
    assert not c.passed and detail in c.detail and hint in c.hint, c


# -- the oracles' counts ----------------------------------------------------------------------

@pytest.mark.parametrize("numel, world_size", [(0, 3), (1, 4), (5, 4), (9, 4), (12, 3), (7, 2)])
def test_the_rings_bytes_are_its_chunks_and_add_up_to_two_n_minus_one_tensors(numel, world_size):
    """Every chunk but one goes out in each half; over all ranks, 2 (N - 1) tensors' worth."""
    per_rank = [oracles.ring_sent_bytes(numel, world_size, r, 4) for r in range(world_size)]
    assert sum(per_rank) == 2 * (world_size - 1) * numel * 4
    if numel % world_size == 0:  # even chunks: every rank sends 2 (N - 1) / N of the tensor
        assert set(per_rank) == {2 * (world_size - 1) * numel // world_size * 4}
    assert oracles.ring_sent_bytes(9, 4, 0, 4) == (18 - 3 - 0) * 4  # owns 3, left one holds 0


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_halving_doubling_bytes_add_up_to_what_a_ring_sends_in_all(world_size):
    nbytes = 8 * 64
    sent = oracles.halving_doubling_sent_bytes(nbytes, world_size)
    assert len(sent) == world_size and sum(sent) == 2 * (world_size - 1) * nbytes
    assert oracles.halving_doubling_sent_bytes(nbytes, 3) == [nbytes, nbytes, 2 * nbytes]


# -- exercise 04: bytes per rank, exactly -----------------------------------------------------

@pytest.mark.timeout(300)
def test_a_ring_that_pads_its_chunks_fails_the_byte_count_on_odd_lengths_only():
    """It sends 2 (N - 1) padded chunks: more than the ring's chunks where N does not divide."""
    result = _planted(ring_left_bugs, "ring_all_reduce", (3,), main="ring_all_reduce_padded")
    assert result.criterion("matches_all_reduce").passed
    assert result.criterion("awkward_lengths").passed
    _failed_with(result, "bandwidth_optimal", "chunks padded", "padded to the first chunk's")
    assert "shape (3,)" not in result.criterion("bandwidth_optimal").detail  # 3 divides evenly


@pytest.mark.timeout(300)
def test_chunk_bounds_from_tensor_split_fail_on_the_hidden_lengths():
    """tensor_split cuts 5 elements on 4 ranks as 2, 1, 1, 1; the ring's layout as 2, 2, 1, 0."""
    assert [len(t) for t in torch.arange(5).tensor_split(4)] == [2, 1, 1, 1]
    assert [oracles.chunk_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    result = _planted(ring_left_bugs, "ring_all_reduce", (2,), main="ring_all_reduce_leftward",
                      chunk_bounds="chunk_bounds_tensor_split")
    _failed_with(result, "chunk_bounds_correct", "an even split", "dist.reduce_scatter_tensor")


@pytest.mark.timeout(300)
def test_sending_the_whole_tensor_to_everyone_fails_both_byte_criteria():
    """On 3 ranks it sends 2 tensors per rank, which the old bound (p's share + one copy)
    allowed; the fold sends 1, 1 and 2."""
    result = _planted(ring_bugs, "halving_doubling", (3, 4), main="all_reduce_to_everyone")
    assert result.criterion("matches_all_reduce").passed
    assert result.criterion("log_rounds").passed  # one round: latency is not its fault
    _failed_with(result, "bytes_other_sizes", "halving-doubling sends", "several others")
    _failed_with(result, "bandwidth_power_of_two", "halving-doubling sends", "every other rank")
    assert result.points <= 0.7 * result.max_points


@pytest.mark.timeout(600)
def test_the_exercise_04_solutions_keep_full_marks(solution):
    sol = solution("04_ring_all_reduce.ipynb")
    for result in (check("halving_doubling", sol.halving_doubling_all_reduce, quiet=True),
                   check("ring_all_reduce", sol.ring_all_reduce, chunk_bounds=sol.chunk_bounds,
                         reduce_scatter=sol.ring_reduce_scatter,
                         all_gather=sol.ring_all_gather, quiet=True)):
        assert result.failed() == [], {c.name: c.detail for c in result.criteria
                                       if not c.passed}


# -- exercises 03 and 06: every step's gradients ------------------------------------------------

@pytest.mark.timeout(300)
def test_gradients_averaged_in_the_first_step_only_fail_grads_averaged():
    result = check("naive_ddp", ddp_bugs.NaiveFirstStepOnly, quiet=True)
    _failed_with(result, "grads_averaged", "step 1", "Every step must average anew")
    assert "one_all_reduce_per_parameter" in result.failed()


@pytest.mark.timeout(300)
def test_a_step_that_issues_no_all_reduce_fails_grads_averaged_with_the_reset_hint():
    """The per-bucket count is never reset: step 1's buckets never complete, nothing is sent."""
    result = check("overlapped_ddp", overlap_reset_bugs.OverlappedNoReset, quiet=True)
    _failed_with(result, "grads_averaged", "step 1",
                 "not started afresh in finish_gradient_synchronization")


@pytest.mark.timeout(300)
def test_the_exercise_03_and_06_solutions_keep_full_marks(solution):
    for notebook, name, cls in (("03_naive_ddp.ipynb", "naive_ddp", "NaiveDDP"),
                                ("06_overlap.ipynb", "overlapped_ddp", "OverlappedDDP")):
        result = check(name, getattr(solution(notebook), cls), quiet=True)
        assert result.failed() == [], {c.name: c.detail for c in result.criteria
                                       if not c.passed}
