"""Exercises 07 and 08 judge what their criteria claim.

07: each parameter's gradient, by identity, all-reduced exactly once per step, after the
step's last backward; a count of elements let a summed copy, a second reduction and a sync
on the first micro-batch through. 08: the file each rank finds when save_checkpoint
returns, with rank 0's torch.save stopped halfway until the other ranks have returned or
wait for it; a look for the file 0.3 s after a sleep let a rank that returned early through.
The watch sits where torch.save opens its file, so it sees a ``save`` imported from torch
before it began, which a replaced ``torch.save`` did not (that honest save failed closed).

Each planted mistake (tests/planted/sync_write_bugs.py) passed the old criterion; here it
fails it with the hint for its cause, while the solutions keep full marks.
"""

import pytest

from dpcourse.grading import check
from planted import sync_write_bugs as bugs
from test_exercises_transfer import _assert_all_passed, solution  # noqa: F401 - the fixture
from test_grading_criteria import _failed_with


# -- 07, part 1: the wrapper's hooks -----------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_hook_that_sums_a_copy_of_the_gradient_fails_syncs_once_per_step():
    """Six all-reduces of the right sizes per step, none of them of a param.grad."""
    result = check("no_sync", bugs.HookedDDPReducesACopy, quiet=True)
    _failed_with(result, "syncs_once_per_step", "0.weight 0, 0.bias 0",
                 "not p.grad: the sum lands in the new tensor")
    assert "6 all-reduce(s) of tensors that are no parameter's .grad" in \
        result.criterion("syncs_once_per_step").detail


# -- 07, part 2: the learner's accumulation loop -----------------------------------------------

@pytest.mark.timeout(300)
def test_a_second_all_reduce_on_top_of_the_wrappers_fails_only_syncs_once_per_step():
    """Averaging averaged gradients again changes no value: only the count shows it."""
    result = check("token_weighted", bugs.accumulate_reducing_again, quiet=True)
    _failed_with(result, "syncs_once_per_step", "0.weight 2", "on top of the wrapper")
    assert "6 of them issued by your code, 6 by the wrapper" in \
        result.criterion("syncs_once_per_step").detail
    assert [c for c in result.failed() if c not in ("no_delegation", "no_deadlock")] == \
        ["syncs_once_per_step"]


@pytest.mark.timeout(300)
def test_syncing_on_the_first_micro_batch_fails_syncs_once_per_step_with_its_cause():
    """One all-reduce per parameter, but of the first micro-batch's gradient only."""
    result = check("token_weighted", bugs.accumulate_syncing_first, quiet=True)
    _failed_with(result, "syncs_once_per_step", "during backward call 1 of the step's 3",
                 "was not the step's last")
    assert not result.criterion("matches_single_process").passed


@pytest.mark.timeout(600)
def test_the_exercise_07_solutions_keep_full_marks(solution):
    sol = solution("07_gradient_accumulation.ipynb")
    _assert_all_passed(check("no_sync", sol.HookedDDP, quiet=True))
    _assert_all_passed(check("token_weighted", sol.accumulation_step, quiet=True))


# -- 08: the file when save_checkpoint returns -------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("save, seen", [
    ("save_without_barrier_slow_peers", "rank 1: save_checkpoint returned while"),
    ("save_rewritten_after_barrier", "rank 1: save_checkpoint returned while the path held")])
def test_a_rank_that_returns_before_the_last_write_ends_fails_rank_0_writes(save, seen):
    """Rank 1 returns without waiting for the end of rank 0's last torch.save: it sees half a
    file (or the earlier one), whatever the timing, and everything else is right."""
    result = check("checkpoint_resume", getattr(bugs, save),
                   load_checkpoint=bugs.load_checkpoint, quiet=True)
    _failed_with(result, "rank_0_writes", seen,
                 "Rank 1 returned from save_checkpoint while rank 0 was still writing")
    own = {c.name for c in result.criteria} - {"no_delegation", "no_deadlock"}
    assert set(result.failed()) & own == {"rank_0_writes"}


@pytest.mark.timeout(300)
def test_the_exercise_08_solution_keeps_full_marks(solution):
    sol = solution("08_real_training_run.ipynb")
    _assert_all_passed(check("checkpoint_resume", sol.save_checkpoint,
                             load_checkpoint=sol.load_checkpoint, quiet=True))


@pytest.mark.timeout(300)
def test_a_save_imported_from_torch_before_the_watch_scores_what_the_solution_scores():
    """``from torch import save`` binds torch.save before the check starts watching: the watch
    still sees rank 0 write, stops it halfway, and the honest save keeps full marks."""
    result = check("checkpoint_resume", bugs.save_with_save_imported_from_torch,
                   load_checkpoint=bugs.load_checkpoint, quiet=True)
    _assert_all_passed(result)


@pytest.mark.parametrize("how", ["torch.save", "imported save", "torch.serialization.save",
                                 "legacy format"])
def test_the_save_watch_stops_every_way_of_reaching_torch_save_halfway(tmp_path, how):
    """Asked of torch itself, in one process: every name for torch.save, and its legacy
    format, opens the file through the openers the watch replaces; the file is half written
    while the watch holds, whole after, and reads back as what was saved."""
    import io

    import torch
    from torch import save  # bound before the watch begins, as a notebook's import is

    from dpcourse.grading.checks.checkpoint_watch import WatchedSaves, file_state

    path, state = str(tmp_path / "ckpt.pt"), {"w": torch.arange(1000.0), "step": 3}
    seen = []
    saving = {"torch.save": lambda: torch.save(state, path),
              "imported save": lambda: save(state, path),
              "torch.serialization.save": lambda: torch.serialization.save(state, path),
              "legacy format": lambda: torch.save(state, path,
                                                  _use_new_zipfile_serialization=False)}[how]
    with WatchedSaves(hold=lambda: seen.append(file_state(path)) or []) as watch:
        saving()
        torch.save(state, io.BytesIO())  # counted, not held: no file to stop
    whole = file_state(path)
    assert len(watch.calls) == 2 and watch.calls[0] == path and [w["file"] for w in
                                                                  watch.writes] == [path]
    assert len(seen) == 1 and seen[0]["size"] == whole["size"] // 2 > 0
    assert watch.writes[0]["size"] == whole["size"] and watch.writes[0]["digest"] == \
        whole["digest"]
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    # the watch is gone: torch.save writes straight through again
    saving()
    assert file_state(path)["digest"] and len(watch.calls) == 2


@pytest.mark.timeout(300)
def test_the_solution_notebook_with_save_imported_from_torch_keeps_full_marks():
    """As the grader loads a notebook: its cells run in each rank with the graded imports, so
    ``from torch import save`` binds torch.save when the cell runs, before the check watches."""
    import pathlib

    import nbformat

    from dpcourse.grading.checks import get_spec
    from dpcourse.grading.runner import run_check
    from dpcourse.grading.submission import extract, from_notebook

    nb = nbformat.read(pathlib.Path(__file__).parent.parent / "solutions" /
                       "08_real_training_run.ipynb", as_version=4)
    sources = [(label, src.replace("import torch.distributed as dist\n",
                                   "import torch.distributed as dist\nfrom torch import save\n")
                .replace("torch.save(", "save(")) for label, src in from_notebook(nb)]
    assert sum("from torch import save" in s for _, s in sources) == 1
    assert sum(" save({" in s for _, s in sources) == 1 and not any("torch.save(" in s
                                                                   for _, s in sources)
    cells, problems = extract(sources)
    spec = get_spec("checkpoint_resume")
    _assert_all_passed(run_check(spec, cells, spec.roles, problems=problems))
