"""The graded exercises: solutions score full marks, stubs score zero, planted bugs are caught.

Planted wrong solutions (tests/planted/) go straight through ``check`` (no
notebook), and each must fail the criterion that names its mistake. The
notebooks go through ``dpcourse grade`` once for solutions/, once for exercises/.
"""

import json
import pathlib
import subprocess
import sys
import types

import psutil
import pytest
import torch

from dpcourse.grading import CheckResult, CriterionResult, check
from dpcourse.grading import make_exercises
from dpcourse.grading.checks_pure import expected_buckets
from dpcourse.grading.guards import static_references
from dpcourse.grading.report import GRADE_FILE_ENV
from planted import ddp_bugs, pure_bugs, ring_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _failed(result: CheckResult) -> set:
    return set(result.failed())


def load_solution(name: str) -> types.ModuleType:
    """Execute a solution notebook's code cells (without its check calls) as a module."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    # Not importable, so its functions travel by value, as a notebook's do.
    module = types.ModuleType(f"solution_{name[:2]}")
    for cell in nb.cells:
        if cell.cell_type == "code" and "check(" not in cell.source:
            exec(compile(cell.source, name, "exec"), module.__dict__)
    return module


# -- planted bugs, each caught by a named criterion ------------------------------------

def test_ring_with_wrong_chunk_index_fails_matches_all_reduce():
    result = check("ring_all_reduce", ring_bugs.ring_all_reduce_wrong_chunk, world_sizes=(3,),
                   quiet=True)
    assert "matches_all_reduce" in _failed(result)
    assert "wrong chunks on rank" in result.criterion("matches_all_reduce").detail
    # the structure is a correct ring: only the arithmetic of the indices is wrong
    for name in ("uses_only_point_to_point", "ring_neighbours_only", "bandwidth_optimal",
                 "no_deadlock", "no_delegation"):
        assert result.criterion(name).passed, name


def test_ring_that_calls_all_reduce_fails_uses_only_point_to_point():
    result = check("ring_all_reduce", ring_bugs.ring_all_reduce_delegating, world_sizes=(2,),
                   quiet=True)
    assert "uses_only_point_to_point" in _failed(result)
    assert "all_reduce" in result.criterion("uses_only_point_to_point").detail
    assert result.criterion("matches_all_reduce").passed  # right numbers, wrong mechanism


def test_ring_that_calls_the_reference_fails_no_delegation():
    result = check("ring_all_reduce", ring_bugs.ring_all_reduce_calls_reference, world_sizes=(2,),
                   quiet=True)
    assert "no_delegation" in _failed(result)
    assert "dpcourse.comm" in result.criterion("no_delegation").detail


def test_deadlocking_ring_fails_no_deadlock_in_bounded_time_and_leaves_no_process():
    result = check("ring_all_reduce", ring_bugs.ring_all_reduce_deadlock, world_sizes=(2,),
                   timeout=8, quiet=True)
    detail = result.criterion("no_deadlock").detail
    assert "no_deadlock" in _failed(result)
    assert "rank(s) 0, 1 were still waiting" in detail
    assert "ring_bugs.py" in detail and "recv" in detail  # where each rank was stuck
    assert result.seconds < 8 + 15
    assert not psutil.Process().children(recursive=True)


def test_naive_ddp_without_divide_fails_grads_averaged():
    result = check("naive_ddp", ddp_bugs.NaiveNoDivide, quiet=True)
    assert "grads_averaged" in _failed(result)
    assert "ratio 2" in result.criterion("grads_averaged").detail  # world size 2: twice the mean
    assert result.criterion("initial_broadcast").passed


def test_naive_ddp_without_broadcast_fails_initial_broadcast():
    result = check("naive_ddp", ddp_bugs.NaiveNoBroadcast, quiet=True)
    assert "initial_broadcast" in _failed(result)
    assert "matches_torch_ddp" in _failed(result)


def test_wrapping_torch_ddp_fails_no_delegation():
    result = check("naive_ddp", ddp_bugs.WrapsTorchDDP, quiet=True)
    assert "no_delegation" in _failed(result)
    assert "DistributedDataParallel" in result.criterion("no_delegation").detail


def test_forward_order_buckets_with_serialising_wait_are_caught():
    result = check("overlapped_ddp", ddp_bugs.ForwardOrderSerialised, quiet=True)
    assert {"buckets_in_reverse_order", "no_serialising_wait"} <= _failed(result)
    assert result.criterion("matches_torch_ddp").passed  # numerically right, structurally wrong


def test_all_reduce_inside_no_sync_fails_no_collective_inside_no_sync():
    result = check("no_sync", ddp_bugs.NoSyncStillReduces, quiet=True)
    assert "no_collective_inside_no_sync" in _failed(result)
    assert "inside no_sync" in result.criterion("no_collective_inside_no_sync").detail


def test_summed_micro_batch_losses_fail_grads_averaged_over_micro_batches():
    solution = load_solution("07_no_sync.ipynb")
    result = check("no_sync", solution.HookedDDP, train_step=ddp_bugs.accumulation_step_sum,
                   quiet=True)
    assert "grads_averaged_over_micro_batches" in _failed(result)
    assert result.criterion("no_collective_inside_no_sync").passed


def test_pure_planted_bugs_fail_their_criteria():
    assert "reverse_order" in _failed(check("assign_buckets", pure_bugs.assign_buckets_forward,
                                            quiet=True))
    assert _failed(check("assign_buckets", pure_bugs.assign_buckets_elements, quiet=True)) == {
        "counts_bytes_not_elements"}
    assert "latency_term" in _failed(check("ring_cost", pure_bugs.ring_time_no_latency,
                                           quiet=True))


# -- notebooks through the autograder -------------------------------------------------

def _grade(folder: str, tmp_path) -> dict:
    out = tmp_path / f"{folder}.json"
    proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", "grade", str(ROOT / folder),
                           "--json", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "total:" in proc.stdout
    return json.loads(out.read_text())


def test_every_solution_scores_full_marks(tmp_path):
    report = _grade("solutions", tmp_path)
    assert all(nb["status"] == "ok" for nb in report["notebooks"]), report["notebooks"]
    assert len(report["results"]) >= 7
    for row in report["results"]:
        assert row["passed"] == row["total"] > 0, (row["check"], [
            (c["name"], c["detail"]) for c in row["criteria"] if not c["passed"]])
    assert report["points"] == report["max_points"]


def test_every_exercise_runs_through_and_scores_zero(tmp_path):
    report = _grade("exercises", tmp_path)
    assert all(nb["status"] == "ok" for nb in report["notebooks"]), report["notebooks"]
    assert {r["check"] for r in report["results"]} == {
        "mean_gradient", "collective_semantics", "ring_all_reduce", "halving_doubling",
        "naive_ddp", "naive_ddp_complete",
        "assign_buckets", "first_bucket", "overlapped_ddp", "arrival_order", "no_sync",
        "token_weighted", "checkpoint_resume", "ring_cost", "sharded_step"}
    for row in report["results"]:
        assert row["status"] == "graded" and row["total"] > 0 and row["points"] == 0, row
    assert any("not implemented yet" in n for r in report["results"] for n in r["notes"])


def test_grader_scores_a_failing_notebook_zero_and_continues(tmp_path):
    import nbformat

    bad = nbformat.read(ROOT / "exercises" / "09_cost_model.ipynb", as_version=4)
    bad.cells.insert(1, nbformat.v4.new_code_cell("raise RuntimeError('broken cell')"))
    (tmp_path / "nbs").mkdir()
    nbformat.write(bad, tmp_path / "nbs" / "01_broken.ipynb")
    good = nbformat.read(ROOT / "solutions" / "05_bucketing.ipynb", as_version=4)
    nbformat.write(good, tmp_path / "nbs" / "02_fine.ipynb")
    from dpcourse.grading.autograde import grade, score_table

    report = grade([str(tmp_path / "nbs")], timeout=120)
    rows = {r["check"]: r for r in report["results"]}
    assert report["notebooks"][0]["status"] == "error"
    assert "broken cell" in report["notebooks"][0]["message"]
    assert rows["ring_cost"]["points"] == 0 and rows["ring_cost"]["total"] == 6
    assert rows["ring_cost"]["status"].startswith("not graded")
    assert rows["assign_buckets"]["points"] == rows["assign_buckets"]["max_points"]
    assert "01_broken.ipynb: error" in score_table(report)


# -- framework pieces ---------------------------------------------------------------

def test_stub_keeps_signature_and_docstring_and_numbers_regions():
    source = ('def f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n    return x\n'
              '    ### END SOLUTION\n'
              '\nclass A:\n    def g(self):\n        ### BEGIN SOLUTION\n        pass\n'
              '        ### END SOLUTION\n')
    out, n = make_exercises.stub_source(source, "04", 3)
    assert n == 2
    assert out.splitlines()[:3] == ['def f(x):', '    """Doc."""',
                                    '    raise NotImplementedError("Exercise 04.3: write f")']
    assert '        raise NotImplementedError("Exercise 04.4: write g")' in out
    assert "return x" not in out and "pass" not in out
    for broken in ("    ### BEGIN SOLUTION\n", "### BEGIN SOLUTION\nx\n### END SOLUTION\n",
                   "    ### END SOLUTION\n"):
        with pytest.raises(ValueError):
            make_exercises.stub_source(broken, "01", 1)


def test_report_renders_text_html_and_json():
    result = CheckResult("demo", "04", "Demo", [
        CriterionResult("ok_one", "holds", True),
        CriterionResult("bad_one", "does not hold", False, "got 2, expected 1", "divide <by> N")])
    text, html = str(result), result._repr_html_()
    assert "1/2 criteria" in text and "FAIL  bad_one" in text and "hint: divide <by> N" in text
    assert "bad_one" in html and "divide &lt;by&gt; N" in html
    assert json.loads(json.dumps(result.to_dict()))["points"] == 5.0
    assert result.score == 0.5 and result.failed() == ["bad_one"]


def test_check_appends_to_the_grade_file(tmp_path, monkeypatch):
    path = tmp_path / "grades.jsonl"
    monkeypatch.setenv(GRADE_FILE_ENV, str(path))
    solution = load_solution("09_cost_model.ipynb")
    result = check("ring_cost", solution.ring_all_reduce_time,
                   bytes_per_rank=solution.ring_bytes_per_rank, quiet=True)
    assert result.all_passed
    line = json.loads(path.read_text().splitlines()[-1])
    assert line["check"] == "ring_cost" and line["passed"] == line["total"] == 6


def test_check_rejects_unknown_names_and_keywords():
    with pytest.raises(ValueError, match="unknown check"):
        check("ring_allreduce", lambda t: None)
    with pytest.raises(TypeError, match="unexpected keyword"):
        check("ring_cost", lambda *a: 0, bytes_sent=lambda *a: 0)


def test_static_scan_finds_a_captured_reference():
    from dpcourse.comm import ring_all_reduce as reference

    def mine(t, group=None):
        reference(t)

    assert static_references(mine, ("dpcourse.comm.ring.ring_all_reduce",)) == [
        "mine refers to dpcourse.comm.ring.ring_all_reduce"]


def test_bucket_rule_of_the_check_is_the_reference_rule():
    from dpcourse.ddp import assign_buckets

    for sizes, dtype, cap in [([100, 200, 300, 400, 500], torch.float32, 4000 / 2**20),
                              ([3, 1, 4, 1, 5], torch.float32, 0.0),
                              ([64] * 5, torch.float16, 200 / 2**20),
                              ([2**18, 7, 2**17, 2**17, 10], torch.float32, 1.0)]:
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
        assert expected_buckets(params, cap) == assign_buckets(params, cap)
