"""A hostile notebook graded in a class folder changes nobody else's grade, and nothing else.

Black-box, through ``dpcourse grade``: a small class folder (honest solutions, an
unchanged exercise, one hostile notebook whose kernel and ranks attack the other
submissions, site-packages, the course package, the grader's ``--json``, the
answers, and the process table) is graded in one call, and the honest notebooks
alone (without the hostile one) in another. The attack and the helpers are in
``tests/grade_folder_experiment.py``, which runs the 30-notebook version.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grade_folder_experiment as gx  # noqa: E402

# honest_notebook() indices: exercise 01's solution (10/10) and exercise 01 unchanged (0/10).
HONEST = (0, 3)

# Two grading calls at once; on a loaded 2-core machine they take minutes, so the limit
# is the subprocesses' own (900 s), not the suite's default.
pytestmark = [pytest.mark.skipif(gx.shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed"),
              pytest.mark.timeout(1000)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade the honest notebooks without the hostile one, and the whole folder, at once."""
    work = tmp_path_factory.mktemp("class")
    marker = f"hostile{os.getpid()}x{int(time.time())}"
    folder, canary, outs = (str(work / d) for d in ("class", "canary", "out"))
    os.makedirs(canary)
    os.makedirs(os.path.join(outs, "folder"))
    json_path = os.path.join(outs, "folder", "grades.json")
    built = gx.build_class(folder, HONEST, canary, json_path, marker, forks=200)
    honest = {sub: what for sub, (_, what) in built["honest"].items()}
    hostile_sub = built["hostile"][0]
    reference = os.path.join(str(work), "reference")
    for sub in honest:
        shutil.copytree(os.path.join(folder, sub), os.path.join(reference, sub))

    sites = gx.site_folders()
    # The checkout (package, solutions/) is edited by others meanwhile: a change there counts
    # when it holds the hostile code's marker (it appends one to every file it can write).
    roots = {"class folder": (folder, True), **{f"site {s}": (s, False) for s in sites}}
    before = {k: gx.tree_state(r, c) for k, (r, c) in roots.items()}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        alone = pool.submit(gx.grade, [reference], os.path.join(outs, "reference.json"), limit=900)
        together = pool.submit(gx.grade, [folder], json_path, limit=900)
        alone, together = alone.result(), together.result()
    after = {k: gx.tree_state(r, c) for k, (r, c) in roots.items()}
    time.sleep(2)
    survivors = gx.processes_with(marker)
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    solutions = os.path.join(gx.REPO, "solutions")
    marked = gx.marked_files([gx.PACKAGE, solutions, *sites, folder, outs], marker,
                             skip=(built["hostile"][1],))
    gx.undo_marks([p for p in marked if not p.startswith(folder)], marker)
    return {"honest": honest, "hostile": hostile_sub, "alone": alone, "together": together,
            "changed": {k: gx.changed(before[k], after[k]) for k in roots}, "marked": marked,
            "canary": sorted(os.listdir(canary)), "survivors": survivors}


def test_honest_notebooks_score_as_without_the_hostile_one(graded):
    assert graded["alone"]["rc"] == 0, graded["alone"]["output"][-3000:]
    assert graded["together"]["rc"] == 0, graded["together"]["output"][-3000:]
    alone, together = gx.verdicts(graded["alone"]["json"]), gx.verdicts(graded["together"]["json"])
    assert set(alone) == set(graded["honest"])
    for sub in graded["honest"]:
        assert together.get(sub) == alone[sub], (sub, graded["honest"][sub])
    # The comparison has teeth: the class holds full marks and a zero.
    points = sorted(alone[s]["points"] for s in alone)
    assert points[0] == 0 and points[-1] == 10, points


def test_hostile_notebook_gets_a_clear_result_and_its_attacks_ran(graded):
    result = gx.verdicts(graded["together"]["json"]).get(graded["hostile"])
    assert result is not None and result["status"] and result["checks"], result
    assert result["checks"]["mean_gradient"]["max_points"] == 10
    reports = gx.hostile_reports(graded["together"]["json"], graded["hostile"])
    kernel = reports["kernel"]
    # The attack ran in the kernel and in the ranks (else nothing was shown here).
    assert kernel and any("forked" in line for line in kernel), kernel
    assert any(isinstance(r, list) and any("forked" in line for line in r)
               for r in reports["ranks"]), reports["ranks"]
    breaches = [line for rep in [kernel] + [r for r in reports["ranks"] if isinstance(r, list)]
                for line in rep if line.startswith("BREACH")]
    assert breaches == []
    for what in ("append a cell to", "plant ", "append to ", "read ", "write the grader's --json"):
        assert any(line.startswith("blocked " + what) for line in kernel), (what, kernel)


def test_no_file_outside_the_scratch_changed(graded):
    assert graded["changed"] == {k: [] for k in graded["changed"]}
    assert graded["marked"] == []  # no file of the checkout, site-packages or outputs holds its marker
    assert graded["canary"] == []  # nothing it wrote reached a folder outside the sandbox


def test_no_process_of_the_hostile_notebook_survives(graded):
    assert graded["survivors"] == []


def test_grading_the_folder_finishes_within_a_bound(graded):
    # The folder holds one notebook more than the reference; a hostile notebook that hung
    # the grader would run into the subprocess limit (rc "timed out") or far past this.
    assert graded["together"]["rc"] != "timed out"
    assert graded["together"]["wall_s"] < 2 * graded["alone"]["wall_s"] + 2 * gx.TIMEOUT
