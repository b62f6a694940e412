"""Exercises 04 and 09 ask for a transfer of their lesson, and hints follow their cause.

Exercise 04's ring turns left (lesson 04's turns right); exercise 09 prices an
all-reduce lesson 09 gave no formula for. Each solution passes its check, each
unchanged exercise scores 0, and each planted mistake fails the criterion that
names it, with a hint that agrees with the case the report shows. The same holds
for the hints of exercises 06 (a per-step count never reset) and 08 (the rank
whose generator state was lost, and what graded code may call).
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


def _ring_with(sizes, **roles):
    spec = get_spec("ring_all_reduce")
    spec.world_sizes = sizes
    cells, _ = extract([("<planted>", pathlib.Path(ring_left_bugs.__file__).read_text())])
    return run_check(spec, cells, dict(spec.roles, main="ring_all_reduce_leftward", **roles),
                     timeout=20)


def test_an_even_split_is_not_the_lessons_chunks():
    """Chunks of lengths differing by one fail chunk_bounds, and the halves cut with them."""
    result = _ring_with((3,), chunk_bounds="chunk_bounds_even_split",
                        reduce_scatter="ring_reduce_scatter_even_split")
    bounds = result.criterion("chunk_bounds_correct")
    assert not bounds.passed and "an even split" in bounds.detail
    assert "dist.reduce_scatter_tensor" in bounds.hint and "only the last ones" in bounds.hint
    halves = result.criterion("reduce_scatter_owns_chunk_r")
    assert not halves.passed and "chunk_bounds fails too" in halves.hint
    assert result.criterion("matches_all_reduce").passed


def test_chunks_past_the_end_get_the_clipping_hint():
    result = _ring_with((2,), chunk_bounds="chunk_bounds_unclipped")
    bounds = result.criterion("chunk_bounds_correct")
    assert not bounds.passed and "past the tensor's end" in bounds.detail
    assert "stop at its end" in bounds.hint


# -- 09: the price of the halving-doubling all-reduce ---------------------------------------

def _replay(per_rank: list, alpha: float, beta: float) -> float:
    """The time the traced messages take when each exchange costs alpha + its bytes * beta.

    An exchange is what one rank posts together and waits for (a send, a receive, or both
    with one partner); it starts once both partners have finished their previous one, and
    ends when the larger direction has arrived.
    """
    queues = []
    for events in per_rank:
        groups = []
        for op, nbytes, start, end, peer in events:
            if not groups or start > groups[-1]["end"]:
                groups.append({"peer": peer, "sent": 0, "end": end})
            group = groups[-1]
            assert group["peer"] == peer, "one exchange talks to one partner"
            group["sent" if op in ("send", "isend") else "received"] = \
                group.get("sent" if op in ("send", "isend") else "received", 0) + nbytes
            group["end"] = max(group["end"], end)
        queues.append(groups)
    clock = [0.0] * len(queues)
    while any(queues):
        for a, queue in enumerate(queues):
            if not queue:
                continue
            b = queue[0]["peer"]
            if queues[b] and queues[b][0]["peer"] == a:
                nbytes = max(queue[0]["sent"], queues[b][0]["sent"])
                clock[a] = clock[b] = max(clock[a], clock[b]) + alpha + nbytes * beta
                queue.pop(0)
                queues[b].pop(0)
                break
        else:
            raise AssertionError("the traced exchanges do not pair up")
    return max(clock)


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:.* ranks on .* CPU core")  # more ranks than cores is the point
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
def test_the_halving_doubling_price_is_what_its_messages_take(solution, world_size):
    """The check's model against exercise 04's solution, traced on real ranks and replayed."""
    import cloudpickle

    import dpcourse
    from dpcourse.grading.checks.ex09_cost_model import halving_doubling_time

    sol = solution("04_ring_all_reduce.ipynb")
    cloudpickle.register_pickle_by_value(sol)
    numel = 64  # a multiple of every p here: halves are exact

    def traced():
        import torch

        from dpcourse.comm import CommTrace

        x = torch.ones(numel)
        with CommTrace() as trace:
            sol.halving_doubling_all_reduce(x)
        assert torch.equal(x, torch.full((numel,), float(world_size)))
        return [(e.op, e.nbytes, e.start, e.end, e.peer) for e in trace.events]

    per_rank = dpcourse.run(traced, world_size=world_size, backend="gloo")
    for alpha, beta in ((1e-5, 1e-9), (0.0, 1.0), (1.0, 0.0), (3e-6, 4e-11)):
        assert _replay(per_rank, alpha, beta) == pytest.approx(
            halving_doubling_time(4 * numel, world_size, alpha, beta), rel=1e-12)


@pytest.mark.timeout(300)
def test_cost_solution_passes_every_criterion(solution):
    sol = solution("09_cost_model.ipynb")
    result = check("ring_cost", sol.ring_all_reduce_time, bytes_per_rank=sol.ring_bytes_per_rank,
                   halving_doubling=sol.halving_doubling_time, quiet=True)
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


def test_unchanged_cost_exercise_scores_zero():
    spec = get_spec("ring_cost")
    result = run_check(spec, _exercise_cells("09_cost_model.ipynb"), spec.roles)
    assert result.points == 0


HD_OWN = {"halving_doubling_power_of_two", "halving_doubling_other_sizes"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slip, failed, why, hint", [
    ("hd_halving_only", HD_OWN, "the halving rounds alone", "doubling rounds"),
    ("hd_log_of_n", {"halving_doubling_other_sizes"}, "log2 N rounds among all N ranks",
     "rounds come in whole numbers"),
    ("hd_no_handoff", {"halving_doubling_other_sizes"}, "without the ranks that sit out",
     "leaves out the ranks that sit out"),
    ("hd_ring", HD_OWN, "the ring's time", "Your time is the ring's")])
def test_each_slip_fails_its_criterion_with_the_hint_of_its_cause(slip, failed, why, hint):
    from planted import cost_bugs

    result = check("ring_cost", cost_bugs.ring_all_reduce_time,
                   bytes_per_rank=cost_bugs.ring_bytes_per_rank,
                   halving_doubling=getattr(cost_bugs, slip), quiet=True)
    assert set(result.failed()) == failed
    for name in failed:
        criterion = result.criterion(name)
        assert why in criterion.detail and hint in criterion.hint, (name, criterion)
    assert 0 < result.points < result.max_points


@pytest.mark.timeout(300)
def test_the_ring_alone_earns_only_part_1():
    from planted import cost_bugs

    result = check("ring_cost", cost_bugs.ring_all_reduce_time,
                   bytes_per_rank=cost_bugs.ring_bytes_per_rank, quiet=True)
    assert set(result.failed()) == HD_OWN
    assert result.points <= 0.5 * result.max_points


# -- 08: the message about what graded code may call, and hints that name the failing rank --

def _checkpoint(save, load):
    from planted import checkpoint_rng_bugs as bugs

    return check("checkpoint_resume", getattr(bugs, save), load_checkpoint=getattr(bugs, load),
                 quiet=True)


@pytest.mark.timeout(300)
def test_an_object_collective_is_refused_with_what_the_exercise_offers():
    result = _checkpoint("save_with_object_gather", "load_checkpoint")
    detail = result.criterion("rank_0_writes").detail
    assert "all_gather_object is not available" in detail
    assert "does not communicate" not in detail and "all_reduce, broadcast and barrier" in detail
    assert "put what a rank must share into a tensor" in result.criterion("rank_0_writes").hint


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save, load, why, hint", [
    ("save_checkpoint", "load_without_rng", "rank 0: ", "Rank 0 resumed with the generator "
     "state a new process starts with"),
    ("save_checkpoint", "load_mirrored_rng", "rank 0: ", "Rank 0 resumed with rank 1's"),
    ("save_rank_0_state_for_all", "load_checkpoint", "rank 1: ", "Rank 1 resumed with rank 0's")])
def test_the_generator_hint_names_the_rank_that_failed_and_why(save, load, why, hint):
    rng = _checkpoint(save, load).criterion("restores_each_ranks_rng")
    assert not rng.passed and rng.detail.startswith(why) and hint in rng.hint, rng
    assert "other than 0" not in rng.hint


# -- 06: a count that is never reset is named as such -----------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, cls, criteria", [
    ("overlapped_ddp", "OverlappedNoReset",
     ("matches_torch_ddp", "one_all_reduce_per_bucket", "buckets_in_reverse_order",
      "starts_during_backward")),
    ("arrival_order", "ArrivalOrderNoReset",
     ("matches_torch_ddp", "buckets_follow_arrival", "starts_during_backward"))])
def test_a_per_step_count_never_reset_gets_the_reset_hint(name, cls, criteria):
    from planted import overlap_reset_bugs

    result = check(name, getattr(overlap_reset_bugs, cls), quiet=True)
    for criterion in criteria:
        c = result.criterion(criterion)
        assert not c.passed and "issued exactly the right all-reduces" in c.detail, c
        assert "not started afresh in finish_gradient_synchronization" in c.hint, c
        assert "registration order" not in c.hint, c


@pytest.mark.timeout(300)
def test_the_overlap_solution_still_passes_and_gets_no_reset_hint(solution):
    sol = solution("06_overlap.ipynb")
    for name, cls in (("overlapped_ddp", sol.OverlappedDDP),
                      ("arrival_order", sol.ArrivalOrderDDP)):
        result = check(name, cls, quiet=True)
        assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}
