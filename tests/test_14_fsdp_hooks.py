"""Exercise 14 (the hooks of one FSDP unit): the solution scores full marks, the stub nothing,
each planted mistake fails the criterion that names it, and the grader's expected collectives
are what lesson 14's FullyShardedDataParallel issues under CommTrace.
"""

import pathlib
import sys

import pytest
import torch

import dpcourse
from dpcourse.grading import check, make_exercises
from dpcourse.grading.checks import get_spec
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract, from_notebook
from notebook_helpers import notebook_module
from planted import fsdp_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = "14_fsdp.ipynb"


@pytest.fixture
def solution(tmp_path):
    """The solution notebook's code cells (without the check call) as a module from a file."""
    yield notebook_module(ROOT / "solutions" / NOTEBOOK, tmp_path / "solution_14.py")
    del sys.modules["solution_14"]


def _two_ranks(bug):
    """Grade ``bug`` (a class of tests/planted/fsdp_bugs.py) on 2 ranks only (faster)."""
    spec = get_spec("fsdp_hooks")
    spec.world_sizes = (2,)
    cells, _ = extract([("<planted>", pathlib.Path(fsdp_bugs.__file__).read_text())])
    return run_check(spec, cells, {"main": bug.__name__})


def test_solution_passes_every_criterion_on_2_and_3_ranks(solution):
    result = check("fsdp_hooks", solution.UnitHooks, quiet=True)
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}
    assert result.score == 1.0


def test_unmodified_exercise_scores_zero():
    import nbformat

    nb = nbformat.read(ROOT / "exercises" / NOTEBOOK, as_version=4)
    cells, _ = extract(from_notebook(nb))
    spec = get_spec("fsdp_hooks")
    result = run_check(spec, cells, spec.roles)
    assert result.score == 0
    assert any("not implemented yet: Exercise 14." in n for n in result.notes)


def test_forgetting_the_backward_gather_is_stopped_before_a_crash_and_named():
    result = _two_ranks(fsdp_bugs.NoBackwardGather)
    crit = result.criterion("gathers_before_backward")
    assert not crit.passed and "started its backward" in crit.detail
    assert "holds no memory" in crit.detail and "output" in crit.hint
    assert "matches_single_process" in result.failed()
    assert result.criterion("gathers_before_forward").passed  # the forward was right
    # backward's collectives never ran: not credited on the forward's evidence alone
    assert "not checked" in result.criterion("collectives_as_fsdp").detail


def test_a_new_buffer_for_backward_does_not_reach_what_autograd_saved():
    result = _two_ranks(fsdp_bugs.NewBufferForBackward)
    assert "gathers_before_backward" in result.failed()
    assert "autograd never saw" in result.criterion("gathers_before_backward").hint


def test_a_missing_division_shows_the_world_size_as_ratio():
    result = _two_ranks(fsdp_bugs.SummedNotAveraged)
    crit = result.criterion("reduce_scatters_gradients")
    assert not crit.passed and "ratio 2" in crit.detail
    assert "ratio equal to the world size" in crit.hint
    assert "matches_single_process" in result.failed()
    # the gathers are judged against what the shards held, so they are not blamed
    assert result.criterion("gathers_before_forward").passed
    assert result.criterion("gathers_before_backward").passed


def test_an_all_reduce_instead_of_a_reduce_scatter_fails_only_the_collectives():
    result = _two_ranks(fsdp_bugs.AllReduceThenSlice)
    assert set(result.failed()) == {"collectives_as_fsdp"}
    crit = result.criterion("collectives_as_fsdp")
    assert "got all_reduce" in crit.detail and "twice the bytes" in crit.hint


def test_never_freeing_trains_right_but_fails_both_frees():
    result = _two_ranks(fsdp_bugs.NeverFrees)
    assert set(result.failed()) == {"frees_after_forward", "frees_after_backward"}
    assert "still held" in result.criterion("frees_after_backward").detail


def _reference_collectives(seed):
    from dpcourse.comm import CommTrace
    from dpcourse.fsdp import FullyShardedDataParallel
    from dpcourse.grading.checks import ex14_fsdp_hooks as ex

    model = ex.make_model(seed)
    fsdp = FullyShardedDataParallel(model, units=[getattr(model, u) for u in ex.UNITS],
                                    prefetch=False)
    x, y = torch.randn(ex.BATCH, ex.IN), torch.randn(ex.BATCH, ex.OUT)
    with CommTrace() as trace:
        out = fsdp(x)
        trace.mark("backward")
        torch.nn.functional.mse_loss(out, y).backward()
    split = dict(trace.marks)["backward"]
    return [[(e.op, e.nbytes) for e in trace.events if (e.start < split) == (phase == "forward")]
            for phase in ("forward", "backward")]


@pytest.mark.parametrize("world_size", [2])
def test_expected_collectives_are_what_lesson_14s_fsdp_issues(world_size):
    from dpcourse.grading import oracles
    from dpcourse.grading.checks import ex14_fsdp_hooks as ex
    from dpcourse.grading.checks.fsdp_verdicts import compare_collectives

    got = dpcourse.run(_reference_collectives, 0, world_size=world_size, backend="gloo")[0]
    units = [[(sum(torch.Size(s).numel() for s in shapes), k) for _, shapes, k in u]
             for u in ex.layout()]
    want = oracles.fsdp_step_collectives(units, world_size)
    for phase, events in zip(("forward", "backward"), got):
        assert compare_collectives(events, want[phase]) == "", (phase, events)


def test_hints_name_causes_without_handing_over_code():
    import re

    from dpcourse.grading.checks.ex14_fsdp_hooks import FSDPHooks

    code = re.compile(r"\w\(|\s=\s|%|\*\*|>=|\bdist\.\w|\.\w+\(")  # as in test_grading.py
    spec = FSDPHooks()
    hints = [c.hint for c in spec.criteria] + [spec.explain(t) for t in (
        "rank 0 was killed by signal SIGSEGV", "all_gather_into_tensor: the output tensor has "
        "no memory")]
    for hint in hints:
        assert hint and not code.search(hint), hint


def test_exercise_is_generated_and_the_lesson_links_it():
    assert (ROOT / "exercises" / NOTEBOOK).read_text() == make_exercises.render(
        str(ROOT / "solutions" / NOTEBOOK))
    assert f"../exercises/{NOTEBOOK}" in (ROOT / "lessons" / "_build" / "14_fsdp.txt").read_text()


def test_freeing_a_buffer_before_its_gather_finished_is_an_error_with_a_hint():
    result = _two_ranks(fsdp_bugs.FreesBeforeWait)
    crit = result.criterion("gathers_before_forward")
    assert not crit.passed and "has no memory" in crit.detail
    assert "freed before the collective had finished" in crit.hint
    assert result.score == 0


def test_a_rank_that_crashes_in_torch_is_a_failed_check_not_a_hang():
    import time

    t0 = time.monotonic()
    result = _two_ranks(fsdp_bugs.ReadsFreedWeights)
    assert time.monotonic() - t0 < 120  # startup on a loaded machine included; no timeout
    crit = result.criterion("gathers_before_forward")
    assert not crit.passed and "killed by signal" in crit.detail
    assert "memory had been freed" in crit.hint
    assert result.score == 0
