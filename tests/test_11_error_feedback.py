"""Exercise 11: a bf16 communication hook with error feedback, and its check.

The solution passes every criterion; the generated exercise scores nothing; each
planted mistake (tests/planted/hook_bugs.py) fails the criteria of its cause with
a detail that names it. The check's reference for the first step
(``oracles.compress_hook``) is held against torch DDP running torch's own
``bf16_compress_hook``, and the solution is run under torch DDP and our wrappers.
"""

import itertools
import pathlib
import sys

import pytest
import torch

import dpcourse
from dpcourse.grading import check, oracles
from feedback_helpers import STEPS, hook_under_reducers
from notebook_helpers import notebook_module
from planted import hook_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent
OWN = {"first_step_is_torchs_hook", "sends_bf16", "keeps_residual", "compresses_corrected_gradient",
       "residual_is_what_was_lost", "returns_reduced", "tracks_uncompressed"}


def _load(tmp_path, folder: str):
    """A notebook's code cells (without check calls) as a module read from a file."""
    return notebook_module(ROOT / folder / "11_inside_the_reducer.ipynb",
                           tmp_path / f"{folder}_11.py")


@pytest.fixture
def solution(tmp_path):
    yield _load(tmp_path, "solutions")
    sys.modules.pop("solutions_11", None)


def test_solution_passes_every_criterion(solution):
    result = check("error_feedback_hook", solution.error_feedback_hook, quiet=True)
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


def test_the_exercise_scores_nothing(tmp_path):
    exercise = _load(tmp_path, "exercises")
    try:
        result = check("error_feedback_hook", exercise.error_feedback_hook, quiet=True)
    finally:
        sys.modules.pop("exercises_11", None)
    assert result.points == 0 and set(result.failed()) >= OWN


@pytest.mark.parametrize("bug, failed, says", [
    (hook_bugs.no_feedback, {"keeps_residual", "residual_is_what_was_lost", "tracks_uncompressed"},
     "nothing stored"),
    (hook_bugs.residual_in_bf16, {"keeps_residual", "residual_is_what_was_lost"}, "bfloat16"),
    (hook_bugs.residual_before_division, {"residual_is_what_was_lost"}, "before the division"),
    (hook_bugs.feedback_added_twice, {"compresses_corrected_gradient", "residual_is_what_was_lost"},
     "added twice"),
    (hook_bugs.positional_residual, {"compresses_corrected_gradient", "residual_is_what_was_lost"},
     "before the buckets were rebuilt")])
def test_mistakes_fail_the_criteria_of_their_cause(bug, failed, says):
    result = check("error_feedback_hook", bug, quiet=True)
    got = set(result.failed()) & OWN
    # doubled feedback still drifts less than no feedback, sometimes by 2x: not asserted either way
    assert got - {"tracks_uncompressed"} == failed - {"tracks_uncompressed"}, got
    assert failed <= got
    assert "first_step_is_torchs_hook" not in got  # with a zero residual each equals torch's hook
    details = " ".join(c.detail for c in result.criteria if c.name in failed)
    assert says in details, details
    assert 0 < result.points < result.max_points
    weights = {c.name: c.weight for c in result.criteria}
    kept = sum(weights.values()) - sum(weights[n] for n in got)  # exactly these points lost
    assert result.points == round(result.max_points * kept / sum(weights.values()), 1)


def test_a_residual_kept_by_bucket_index_fails_only_on_the_rebuilt_step():
    """The check's buckets are rebuilt after the first step, as torch DDP's are."""
    result = check("error_feedback_hook", hook_bugs.positional_residual, quiet=True)
    for name in ("compresses_corrected_gradient", "residual_is_what_was_lost"):
        failing = [c for c in result.criteria if c.name == name and not c.passed]
        assert failing, name
        for c in failing:  # the first step matches; the one after the rebuild does not
            assert "step 1," in c.detail and "step 0," not in c.detail, c.detail


@pytest.fixture(scope="module", params=[2, 3])
def reducers(request, tmp_path_factory):
    import cloudpickle

    sol = _load(tmp_path_factory.mktemp("sol"), "solutions")
    cloudpickle.register_pickle_by_value(sol)  # the ranks cannot import the notebook's module
    try:
        return request.param, dpcourse.run(hook_under_reducers, sol.error_feedback_hook,
                                           world_size=request.param, backend="gloo")
    finally:
        cloudpickle.unregister_pickle_by_value(sol)
        sys.modules.pop("solutions_11", None)


def test_first_step_reference_is_torch_ddp_with_its_bf16_hook(reducers):
    ws, out = reducers
    for i in range(len(out[0]["local"])):
        grads = [out[r]["local"][i] for r in range(ws)]
        # The grader's all-reduce adds in rank order. gloo's ring starts each chunk's sum at
        # another rank, and bf16 addition rounds at every step: each element must equal the
        # reference with the ranks added in one of the orders.
        orders = torch.stack([oracles.compress_hook([grads[r] for r in order], torch.bfloat16)
                              for order in itertools.permutations(range(ws))])
        for r in range(ws):
            got = out[r]["torch_hook"]["grads"][0][i]
            assert (orders == got).any(0).all()
            if ws == 2:  # one addition: no order to choose
                assert torch.equal(got, orders[0])
            # the solution, with its zero residual, under torch DDP: torch's hook exactly
            assert torch.equal(out[r]["ddp"]["grads"][0][i], got)


def test_solution_runs_the_same_under_torch_ddp_and_our_wrappers(reducers):
    ws, out = reducers
    for r in range(ws):
        for kind in ("overlapped", "bucketed"):
            for step in range(STEPS):
                for a, b in zip(out[r][kind]["params"][step], out[r]["ddp"]["params"][step]):
                    if ws == 2:
                        assert torch.equal(a, b), (kind, step)
                    else:  # torch's first-step layout puts gloo's ring chunks elsewhere: the bf16
                        # sums add in other orders (see above), 1 bf16 step of a gradient x lr
                        assert torch.allclose(a, b, rtol=0, atol=1e-3 * (step + 1)), (kind, step)
        # later steps differ from torch's hook: the residual is fed back
        assert any(not torch.equal(a, b) for a, b in zip(out[r]["ddp"]["grads"][-1],
                                                         out[r]["torch_hook"]["grads"][-1]))


def test_under_torch_ddp_the_residual_is_kept_per_bucket_in_float32(reducers):
    ws, out = reducers
    for r in range(ws):
        numel = sum(g.numel() for g in out[r]["local"])
        for kept in out[r]["residuals"]:
            assert list(kept) == [0]  # one bucket for this small model
            assert kept[0].dtype == torch.float32 and kept[0].numel() == numel
            assert kept[0].any()
            # what bfloat16 lost stays below half a step of bfloat16 of the gradient's scale
            assert kept[0].abs().max() < 2 ** -8 * 4


def test_a_residual_kept_by_position_lands_on_other_parameters_after_torchs_rebuild():
    out = dpcourse.run(hook_under_reducers, hook_bugs.positional_residual, world_size=2,
                       backend="gloo")
    for r in range(2):
        ours, ddp = out[r]["overlapped"]["params"], out[r]["ddp"]["params"]
        assert all(torch.equal(a, b) for a, b in zip(ours[0], ddp[0]))  # before the rebuild
        assert not all(torch.equal(a, b) for a, b in zip(ours[1], ddp[1]))
