"""The grader: solutions score full marks, stubs zero, planted bugs fail the criterion they name,
and no notebook can hang the grader, outlive it, or write its own score.

Planted wrong solutions (tests/planted/*_bugs.py) go through the learner's ``check``;
planted notebooks (tests/planted/notebooks.py) through ``dpcourse grade``.
"""

import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import nbformat
import psutil
import pytest
import torch

from dpcourse.grading import CheckResult, CriterionResult, check, make_exercises
from dpcourse.grading.checks import REGISTRY, get_spec
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract, policy_findings
from planted import ddp_bugs, notebooks, pure_bugs, ring_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2  # exercise 12 graded


def _failed(result: CheckResult) -> set:
    return set(result.failed())


def _leftovers(marker: str) -> list:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GRADER_TEST_MARKER") == marker:
                found.append(p.cmdline())
        except psutil.Error:
            continue
    return found


def _write(folder: pathlib.Path, name: str, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / name)


def _grade(tmp_path, *args, timeout=900) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", "grade", *map(str, args),
                           "--json", str(out)], capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list(tmp.iterdir()), f"left in the temp dir: {list(tmp.iterdir())}"
    return proc, json.loads(out.read_text())


# -- planted bugs through the learner's check(), each caught by a named criterion -------------

def _ring(fn, sizes=(2, 3)):
    spec = get_spec("ring_all_reduce")
    spec.world_sizes = sizes  # fewer ranks than the grader uses: enough to show each bug
    cells, _ = extract([("<planted>", pathlib.Path(ring_bugs.__file__).read_text())])
    return run_check(spec, cells, dict(spec.roles, main=fn.__name__), timeout=10)


def test_ring_with_wrong_chunk_index_fails_matches_all_reduce_and_earns_nothing_else():
    result = _ring(ring_bugs.ring_all_reduce_wrong_chunk)
    assert "matches_all_reduce" in _failed(result)
    assert "wrong chunks on rank" in result.criterion("matches_all_reduce").detail
    for name in ("in_place", "ring_neighbours_only", "bandwidth_optimal", "no_deadlock",
                 "no_delegation"):  # no credit for structure around a wrong result
        assert result.criterion(name).detail.startswith("not credited"), name
    assert result.points == 0


def test_a_collective_does_not_exist_in_the_ring_exercise():
    result = _ring(ring_bugs.ring_all_reduce_delegating, sizes=(2,))
    detail = result.criterion("matches_all_reduce").detail
    assert "torch.distributed.all_reduce is not available" in detail
    assert "send, recv, isend, irecv" in detail
    assert result.points == 0


def test_calling_the_reference_fails_no_delegation_and_scores_zero():
    result = _ring(ring_bugs.ring_all_reduce_calls_reference)
    assert "dpcourse.comm" in result.criterion("no_delegation").detail
    assert result.points == 0


def test_deadlocking_ring_is_described_in_bounded_time_and_leaves_no_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    spec = get_spec("ring_all_reduce")
    spec.world_sizes = (2,)
    cells, _ = extract([("<planted>", pathlib.Path(ring_bugs.__file__).read_text())])
    result = run_check(spec, cells, dict(spec.roles, main="ring_all_reduce_deadlock"), timeout=4)
    detail = result.criterion("no_deadlock").detail
    assert "not finished after 4 s" in detail
    assert "rank 0" in detail and "waiting in recv from rank 1" in detail
    assert time.monotonic() - t0 < 4 + 60  # startup of two ranks on a loaded machine included
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_every_hidden_collective_is_absent_at_run_time(monkeypatch):
    """Without the static scan, each way around the exercise still fails inside the rank."""
    source = notebooks.RING_FORGERIES.replace(
        '    rank, n = dist.get_rank(), dist.get_world_size()',
        '        else:\n            tensor.fill_(float("nan"))  # an escape worked\n'
        '    rank, n = dist.get_rank(), dist.get_world_size()')
    source = source.replace('''        lambda: exec(open(importlib.import_module("dpcourse.comm.ring").__file__).read(), {}),
''', "")  # running the reference's text is plain copying: only the scan refuses it
    import dpcourse.grading.runner as runner

    monkeypatch.setattr(runner, "policy_findings", lambda *a, **k: [])
    spec = get_spec("ring_all_reduce")
    spec.world_sizes = (2,)
    result = run_check(spec, [("<cell 0>", "import sys\n" + source)], spec.roles, timeout=20)
    detail = result.criterion("matches_all_reduce").detail
    assert "nan" not in detail.lower(), detail  # no escape succeeded
    assert "max |diff|" in detail  # dummy traffic does not make a sum


BY_THE_CLASS = {  # the module refuses these names; its class still holds the functions
    "all_reduce": "type(dist).all_reduce(dist, tensor)",
    "all_gather_into_tensor": "type(dist).all_gather_into_tensor(dist, torch.empty("
                              "dist.get_world_size() * tensor.numel()), tensor)",
}


@pytest.mark.parametrize("op", sorted(BY_THE_CLASS))
def test_the_relay_refuses_a_collective_whatever_name_called_it(monkeypatch, op):
    """The exercise's allow-list is applied where the operation arrives: at the grader's relay."""
    import dpcourse.grading.runner as runner

    monkeypatch.setattr(runner, "policy_findings", lambda *a, **k: [])  # past the scan too
    source = ("import torch\nimport torch.distributed as dist\n\n\n"
              f"def ring_all_reduce(tensor, group=None):\n    {BY_THE_CLASS[op]}\n")
    spec = get_spec("ring_all_reduce")
    spec.world_sizes = (2,)
    result = run_check(spec, [("<cell 0>", source)], spec.roles, timeout=20)
    detail = result.criterion("matches_all_reduce").detail
    assert f"torch.distributed.{op} is not available to graded code" in detail, detail
    assert result.points == 0


def test_the_relay_computes_nothing_the_exercise_does_not_allow():
    """A refused operation fails the round before any rank gets a reply."""
    import socket

    from dpcourse.grading.relay import MessageRelay, Round, allowed_ops
    from dpcourse.grading.shim import COLLECTIVES, P2P

    pairs = [socket.socketpair() for _ in range(2)]
    out = Round(2, [None, None], [[], []])
    relay = MessageRelay([a for a, _ in pairs], out, stack=None, allowed=allowed_ops(P2P),
                         why="Use send and recv.")
    for rank in range(2):
        relay.handle(rank, {"t": "coll", "op": "all_reduce", "id": 1, "reduce": "sum"},
                     [torch.ones(3)])
    assert out.failure is not None and "all_reduce is not available" in out.failure.text
    assert not out.events[0] and not out.events[1]  # not recorded as done, not computed
    pairs[0][1].setblocking(False)
    with pytest.raises(BlockingIOError):  # no reply was sent
        pairs[0][1].recv(1)
    assert allowed_ops(COLLECTIVES) == {"all_reduce", "broadcast", "barrier"}
    assert {"send", "recv"} <= allowed_ops(P2P) and "all_reduce" not in allowed_ops(P2P)


def test_naive_ddp_planted_bugs(tmp_path):
    no_divide = check("naive_ddp", ddp_bugs.NaiveNoDivide, quiet=True)
    assert "grads_averaged" in _failed(no_divide)
    assert "ratio 2" in no_divide.criterion("grads_averaged").detail  # the sum over 2 ranks
    assert "summed but not averaged" in no_divide.criterion("grads_averaged").hint  # its cause
    assert no_divide.criterion("initial_broadcast").passed
    assert 0 < no_divide.points < 2
    no_broadcast = check("naive_ddp", ddp_bugs.NaiveNoBroadcast, quiet=True)
    assert {"initial_broadcast", "matches_torch_ddp"} <= _failed(no_broadcast)
    wraps = check("naive_ddp", ddp_bugs.WrapsTorchDDP, quiet=True)
    assert "DistributedDataParallel" in wraps.criterion("no_delegation").detail
    assert wraps.points == 0


def test_overlap_and_no_sync_planted_bugs():
    serial = check("overlapped_ddp", ddp_bugs.ForwardOrderSerialised, quiet=True)
    assert {"buckets_in_reverse_order", "no_serialising_wait"} <= _failed(serial)
    assert serial.criterion("matches_torch_ddp").passed  # right numbers, wrong structure
    reduces = check("no_sync", ddp_bugs.NoSyncStillReduces, quiet=True)
    assert "no_collective_inside_no_sync" in _failed(reduces)
    assert "inside no_sync" in reduces.criterion("no_collective_inside_no_sync").detail
    assert "syncs_once_per_step" in _failed(reduces)


def test_pure_planted_bugs_fail_their_criteria():
    # exercise 05's planted mistakes: tests/test_exercise_05_transfer.py
    no_latency = check("ring_cost", pure_bugs.ring_time_no_latency, quiet=True)
    assert "latency_term" in _failed(no_latency)
    assert "one after another" in no_latency.criterion("latency_term").hint


# -- notebooks through dpcourse grade ---------------------------------------------------------

def _expected_status(nb: dict) -> str:
    """A notebook runs to the end, except exercise 12's without 2 GPUs: it is not run at all."""
    return "ok" if TWO_GPUS or not nb["notebook"].startswith("12_") else "not graded"


@pytest.mark.timeout(900)  # whole folders of notebooks, each in its own kernel
def test_solutions_score_full_marks_with_every_output(tmp_path):
    fb, csv_path, lms = tmp_path / "feedback", tmp_path / "grades.csv", tmp_path / "lms.csv"
    proc, report = _grade(tmp_path, ROOT / "solutions", "--csv", csv_path, "--lms-csv", lms,
                          "--feedback", fb)
    graded = [r for r in report["results"] if not r["not_graded"]]
    every = 10 * len(REGISTRY)
    full = every if TWO_GPUS else every - 10  # without 2 GPUs exercise 12 is not graded
    assert all(nb["status"] == _expected_status(nb) for nb in report["notebooks"]), \
        report["notebooks"]
    assert len(report["results"]) == len(REGISTRY) and len(graded) == full // 10
    for row in graded:
        assert row["passed"] == row["total"] > 0, (row["check"], [
            (c["name"], c["detail"]) for c in row["criteria"] if not c["passed"]])
    assert report["points"] == report["max_points"] == full
    assert report["not_graded_points"] == every - full
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == sum(r["total"] for r in graded) + len(report["results"]) - len(graded)
    # rows are rounded to 0.01 points, and a check's rows still add up to its points
    assert abs(sum(float(r["points"]) for r in rows if r["points"]) - full) < 1e-6
    lms_rows = list(csv.reader(lms.open()))
    assert lms_rows[0][:2] == ["Student", "ID"]
    assert lms_rows[1][lms_rows[0].index("Total")] == f"{full:.1f}"
    feedback = nbformat.read(fb / "solutions" / "04_ring_all_reduce.feedback.ipynb", as_version=4)
    assert "Grading report" in feedback.cells[0].source
    assert (fb / "solutions" / "04_ring_all_reduce.feedback.html").stat().st_size > 1000


@pytest.mark.timeout(900)  # whole folders of notebooks, each in its own kernel
def test_exercises_run_through_and_score_zero(tmp_path):
    _, report = _grade(tmp_path, ROOT / "exercises")
    assert all(nb["status"] == _expected_status(nb) for nb in report["notebooks"]), \
        report["notebooks"]
    assert {r["check"] for r in report["results"]} == set(REGISTRY)  # every check, once
    graded = [r for r in report["results"] if not r["not_graded"]]
    assert len(graded) == len(REGISTRY) - (0 if TWO_GPUS else 1)
    for row in graded:
        assert row["points"] == 0 and row["total"] > 0, row
    assert all(any("not implemented yet" in n for n in r["notes"]) for r in graded)


@pytest.mark.skipif(TWO_GPUS, reason="shows what grading does on a machine without 2 GPUs")
@pytest.mark.timeout(600)
def test_exercise_12_is_not_graded_without_two_gpus_and_the_other_check_is(tmp_path):
    """Not 0 points: the reason in every output, its points out of every total, nothing run."""
    folder, fb = tmp_path / "subs" / "alice", tmp_path / "feedback"
    folder.mkdir(parents=True)
    for name in ("09_cost_model.ipynb", "12_nvlink_kernels.ipynb"):
        (folder / name).write_text((ROOT / "solutions" / name).read_text())
    csv_path, lms = tmp_path / "grades.csv", tmp_path / "lms.csv"
    proc, report = _grade(tmp_path, tmp_path / "subs", "--csv", csv_path, "--lms-csv", lms,
                          "--feedback", fb)
    rows = {r["check"]: r for r in report["results"]}
    assert set(rows) == {"ring_cost", "nvlink_kernels"}
    assert rows["ring_cost"]["not_graded"] is None and rows["ring_cost"]["points"] == 10
    skipped = rows["nvlink_kernels"]
    why = skipped["not_graded"]
    assert "this machine has 0" in why and "at least 2 NVLink-connected GPUs" in why, why
    assert "dpcourse grade" in why  # what the instructor does about it
    assert skipped["status"] == "not graded" and skipped["points"] == 0
    assert skipped["criteria"] == [] and skipped["max_points"] == 10
    assert (report["points"], report["max_points"], report["not_graded_points"]) == (10, 10, 10)
    nb12 = next(nb for nb in report["notebooks"] if nb["notebook"].startswith("12"))
    # decided before anything ran: the notebook was not executed, no check process started
    assert nb12["status"] == "not graded" and nb12["cell_seconds"] == 0 and nb12["seconds"] == 0
    assert skipped["seconds"] == 0
    assert "not graded on this machine" in proc.stdout and why in proc.stdout
    assert "total: 10/10 points" in proc.stdout
    crit = [r for r in csv.DictReader(csv_path.open()) if r["check"] == "nvlink_kernels"]
    assert [(r["criterion"], r["points"], r["max_points"], r["detail"]) for r in crit] == [
        ("not_graded", "", "", why)]
    others = [r for r in csv.DictReader(csv_path.open()) if r["check"] == "ring_cost"]
    assert abs(sum(float(r["points"]) for r in others) - 10) < 1e-9
    head, alice = list(csv.reader(lms.open()))
    cells = dict(zip(head, alice))
    assert cells["Exercise 12: All-reduce kernels on NVLink (10)"] == ""  # empty, not 0
    assert float(cells["Exercise 09: " + rows["ring_cost"]["title"] + " (10)"]) == 10
    assert cells["Total"] == "10.0" and why in cells["Not graded"]
    feedback = nbformat.read(fb / "alice" / "12_nvlink_kernels.feedback.ipynb", as_version=4)
    report_md = feedback.cells[0].source
    assert "not graded on this machine" in report_md and "NVLink-connected" in report_md
    assert "FAIL" not in report_md and "did not run to the end" not in report_md


def test_the_grader_decides_the_skip_and_starts_nothing_for_it(monkeypatch):
    """The grader's own view of the GPUs decides; the graded code cannot turn a run into a skip."""
    import dpcourse.grading.checks.ex12_nvlink_kernels as ex12
    from dpcourse.grading import autograde, world
    from dpcourse.grading.submission import from_notebook, load

    text = (ROOT / "solutions" / "12_nvlink_kernels.ipynb").read_text()
    cells, _ = extract(from_notebook(nbformat.reads(text, as_version=4)))
    spec = get_spec("nvlink_kernels")

    class Started(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Started(args)

    monkeypatch.setattr(ex12, "_gpu_count", lambda: 1)
    monkeypatch.setattr(world.subprocess, "Popen", refuse)  # the subprocess module: any start
    info, results, executed = autograde.grade_notebook("12_nvlink_kernels.ipynb", text, 60, None)
    assert info["status"] == "not graded" and executed is None
    (result,) = results
    assert "this machine has 1" in result.not_graded and result.points == 0
    assert not result.criteria and "not graded on this machine" in str(result)
    # With 2 GPUs in the grader's view it grades: it starts the check's rank.
    monkeypatch.setattr(ex12, "_gpu_count", lambda: 2)
    with pytest.raises(Started):
        run_check(spec, cells, spec.roles)
    # In that rank (here: 0 GPUs, as if the graded code hid them) a skip is a failure.
    inputs = spec.make_inputs(__import__("random").Random(0), 1)[0]
    monkeypatch.setattr(ex12, "_gpu_count", lambda: 0)
    objs = load(cells, spec.roles, dict(vars(__import__("builtins"))))
    assert objs["main"].source.startswith("def one_shot_kernel(")  # @kernel found its text
    with pytest.raises(RuntimeError, match="at least 2 CUDA GPUs"):
        spec.rank_run(None, objs, inputs)


def _kernels_on_gloo(kernels, inputs, wrong_at):
    """Exercise 12's GPU rank on CPU ranks, the learner's kernel replaced by gloo's all-reduce."""
    import torch.distributed as dist

    import dpcourse.comm.kernels.exercise as exercise
    from dpcourse.grading.checks.ex12_nvlink_kernels import gpu_rank

    def all_reduce_with(learner, kind):
        def fn(x):
            dist.all_reduce(x)
            if x.numel() == wrong_at:
                x[-1] += 1  # the last element wrong, alike on every rank: a mask one short
        return fn

    exercise.all_reduce_with = all_reduce_with
    return gpu_rank(kernels, inputs)


@pytest.mark.timeout(600)
def test_exercise_12_is_judged_in_the_grader_from_values_at_its_own_positions(monkeypatch):
    """The GPU ranks return values only; the grader makes the inputs again and judges them."""
    import random

    import dpcourse
    import dpcourse.grading.checks.ex12_nvlink_kernels as ex12
    from dpcourse.comm.kernels.exercise import LearnerKernel

    monkeypatch.setattr(ex12, "_gpu_count", lambda: 2)
    spec = get_spec("nvlink_kernels")
    (inputs,) = spec.make_inputs(random.Random(12), 1)
    assert inputs["world_sizes"] == [2] and len(inputs["offsets"]) == ex12.CALLS
    inputs["offsets"] = inputs["offsets"][:30]  # fewer calls back to back: CPU ranks are slow
    inputs["sampled"] = sorted({s for s in inputs["sampled"] if s < 30} | {29})
    kernel = LearnerKernel("one_shot_kernel", "def one_shot_kernel(x):\n    pass\n")
    for wrong_at, failing in ((None, set()),
                              (4097, {"one_shot_awkward_lengths", "one_shot_back_to_back"}),
                              (300_001, {"one_shot_awkward_lengths", "one_shot_back_to_back"})):
        ranks = dpcourse.run(_kernels_on_gloo, {"one_shot": kernel}, inputs, wrong_at,
                             world_size=2, backend="gloo", device="cpu", timeout=300)
        recs = spec.judge(1, [inputs], [[{"ws": 2, "ranks": ranks}]], [[]])
        assert {r.criterion for r in recs if not r.passed} == failing, wrong_at
        assert {r.criterion for r in recs} >= {f"one_shot_{c.name}" for c in ex12.CRITERIA}


def test_exercise_12_check_in_a_notebook_without_gpus_says_where_to_run_it(capsys, monkeypatch):
    import dpcourse.grading.checks.ex12_nvlink_kernels as ex12
    from dpcourse.comm.kernels.exercise import LearnerKernel

    monkeypatch.setattr(ex12, "_gpu_count", lambda: 1)
    k = LearnerKernel("one_shot_kernel", "def one_shot_kernel(x):\n    pass\n")
    result = check("nvlink_kernels", k, two_shot=k)
    out = capsys.readouterr().out
    assert "not graded on this machine" in out and "this machine has 1" in out
    assert "Run this notebook on a machine with at least 2 NVLink-connected GPUs" in out
    assert result.not_graded and result.points == 0 and result.to_dict()["not_graded"]


@pytest.mark.timeout(900)  # whole folders of notebooks, each in its own kernel
def test_hanging_and_dying_notebooks_are_stopped_and_the_next_is_graded(tmp_path):
    marker = uuid.uuid4().hex
    folder = tmp_path / "nbs"
    for name, cells in (("09_a_sleeps.ipynb", notebooks.sleeps(marker)),
                        ("09_b_busy.ipynb", notebooks.busy_loop(marker)),
                        ("09_c_killed.ipynb", notebooks.kills_its_kernel(marker)),
                        ("09_d_ranks.ipynb", notebooks.launches_ranks_and_hangs(marker)),
                        ("09_e_honest.ipynb", notebooks.honest(self_check=False))):
        _write(folder, name, cells)
    proc, report = _grade(tmp_path, folder, "--timeout", "8")
    status = {nb["notebook"][:4]: nb for nb in report["notebooks"]}
    points = {r["notebook"][:4]: r["points"] for r in report["results"]}
    for key in ("09_a", "09_b", "09_d"):
        assert status[key]["status"] == "timeout", status[key]
        assert status[key]["cell_seconds"] <= 8 + 10, status[key]
    assert status["09_c"]["status"] in ("died", "timeout"), status["09_c"]
    assert points == {"09_a": 0, "09_b": 10, "09_c": 0, "09_d": 0, "09_e": 10}
    assert status["09_e"]["status"] == "ok"
    assert "cell 2 was still running" in status["09_b"]["message"]
    assert not _leftovers(marker)


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["kill", "ctrl-c"])
def test_a_stopped_grader_stops_its_kernel_and_ranks(tmp_path, sig):
    """``kill <grader>`` or Ctrl-C ends the grade and everything it started, not the grader alone."""
    marker = uuid.uuid4().hex
    _write(tmp_path / "nbs", "09_ranks.ipynb", notebooks.launches_ranks_and_hangs(marker))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    # Started as from a terminal: a shell runs a background job (`cmd &`, nohup, a CI
    # runner's script) with SIGINT ignored, a disposition its children inherit, and a
    # grader that ignores Ctrl-C is what such a start asks for.
    grader = subprocess.Popen([sys.executable, "-m", "dpcourse.cli", "grade",
                               str(tmp_path / "nbs"), "--timeout", "600"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 200
        # The notebook's sleeper, its detached grandchild and both ranks are running.
        while len(_leftovers(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_leftovers(marker)) >= 4, _leftovers(marker)
        grader.send_signal(sig)
        # SIGTERM exits through SystemExit(143); an uncaught KeyboardInterrupt re-raises SIGINT.
        assert grader.wait(timeout=60) == (128 + sig if sig == signal.SIGTERM else -sig)
    finally:
        if grader.poll() is None:
            grader.kill()
    assert not _leftovers(marker)


@pytest.mark.timeout(900)  # whole folders of notebooks, each in its own kernel
def test_forged_scores_earn_nothing_and_change_nothing(tmp_path):
    folder = tmp_path / "nbs"
    _write(folder, "03_takeover.ipynb", notebooks.ddp_takeovers())
    _write(folder, "04_forge.ipynb", notebooks.kernel_forgeries())
    _write(folder, "05_disk.ipynb", notebooks.edits_the_grader())
    (folder / "06_malformed.ipynb").write_text("{ this is not a notebook")
    _write(folder, "09_after.ipynb", notebooks.honest())
    report_py = ROOT / "dpcourse" / "grading" / "report.py"
    before = report_py.read_bytes()
    proc, report = _grade(tmp_path, folder, "--timeout", "60")
    rows = {(r["notebook"][:2], r["check"]): r for r in report["results"]}
    status = {nb["notebook"]: nb for nb in report["notebooks"]}
    takeover = {c["name"]: c for c in rows[("03", "naive_ddp")]["criteria"]}
    assert "calls exec()" in takeover["no_delegation"]["detail"]
    assert "imports gc" in takeover["no_delegation"]["detail"]
    # In the sandbox the kernel does not see the grader among its ancestors (its own PID
    # namespace): the forger stops there, before anything else (its ring's escape hatches
    # are refused by the scan: test_scan_refuses_escape_hatches_and_accepts_the_solutions).
    forger = status["04_forge.ipynb"]
    assert forger["status"] == "error" and "StopIteration" in forger["message"], forger
    assert rows[("04", "ring_all_reduce")]["points"] == 0
    # The sandbox shows the kernel its package read-only: the write fails in the cell.
    assert status["05_disk.ipynb"]["status"] == "error", status["05_disk.ipynb"]
    assert "Read-only file system" in status["05_disk.ipynb"]["message"]
    assert report_py.read_bytes() == before
    assert status["06_malformed.ipynb"]["status"] == "unreadable"
    assert rows[("09", "ring_cost")]["points"] == 10  # deleted from disk by 04, graded anyway
    assert all(r["points"] == 0 for key, r in rows.items() if key[0] != "09"), rows.keys()
    assert report["points"] == 10
    json_path = tmp_path / "report.json"
    first = json_path.read_text()
    time.sleep(8)  # the detached rewriter would have fired by now
    assert json_path.read_text() == first


def test_user_errors_exit_2_in_one_line(tmp_path):
    for args in (["grade", "nonexistent.ipynb"], ["grade", "/etc/passwd"],
                 ["grade", str(ROOT / "solutions"), "--timeout", "-1"],
                 ["grade", str(ROOT / "solutions"), "--timeout", "inf"]):
        proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", *args], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("dpcourse grade: error:")


# -- framework pieces ---------------------------------------------------------------------------

def test_scan_refuses_escape_hatches_and_accepts_the_solutions():
    cells, _ = extract([("<cell 1>", notebooks.RING_FORGERIES)])
    found = " ".join(policy_findings(cells, ["ring_all_reduce"]))
    for what in ("__wrapped__", "_get_default_group", "calls exec()", "imports importlib",
                 "imports gc", "calls open()"):
        assert what in found, what
    from dpcourse.grading.checks import for_notebook
    from dpcourse.grading.submission import from_notebook

    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        sources = from_notebook(nbformat.read(path, as_version=4))
        cells, problems = extract(sources)
        assert not problems
        for spec in for_notebook(path.name):
            assert policy_findings(cells, list(spec.roles.values()),
                                   spec.allowed_imports) == [], (path, spec.name)


def test_scan_refuses_private_names_spelled_as_strings_or_imported_by_name():
    """`.x` on a module is refused when private; the same name through getattr or import too."""
    source = ("import torch\nfrom torch.serialization import _open_zipfile_writer\n\n\n"
              "def ring_all_reduce(tensor, group=None):\n"
              "    w = getattr(torch.serialization, '_open_zipfile_writer')\n"
              "    setattr(torch.serialization, '_open_file_like', w)\n"
              "    return _open_zipfile_writer\n")
    cells, _ = extract([("<cell 1>", source)])
    found = policy_findings(cells, ["ring_all_reduce"])
    assert any("imports the private torch.serialization._open_zipfile_writer" in f
               for f in found), found
    assert sum("private or special attribute name" in f for f in found) == 2, found


def test_hints_name_causes_without_handing_over_code():
    """A hint says what the failure shows and why; the code and the formula stay the learner's."""
    import re


    code = re.compile(r"\w\(|\s=\s|%|\*\*|>=|\bdist\.\w|\.\w+\(")
    for name, cls in REGISTRY.items():
        if cls.exercise >= "10":  # lessons 01-09: the exercises that teach the mechanism
            continue
        for c in cls.criteria:
            assert c.hint, (name, c.name)
            assert not code.search(c.hint.replace("no_sync()", "")), (name, c.name, c.hint)


def test_extract_keeps_definitions_at_their_lines_and_drops_calls():
    source = ("import torch\nfrom dpcourse.grading import check\nx = torch.zeros(3)\nN = 4\n\n"
              "def f(t):\n    return t * N\n\ncheck('ring_cost', f)\n%time f(1)\n")
    (label, kept), = extract([("<cell 5>", source)])[0]
    lines = kept.splitlines()
    assert lines[0] == "import torch" and lines[3] == "N = 4" and lines[5] == "def f(t):"
    assert "check" not in kept and "zeros" not in kept and "time" not in kept


def test_points_are_weighted_capped_and_gated():
    crit = [CriterionResult("a", "", True, weight=3), CriterionResult("b", "", False, weight=1)]
    assert CheckResult("x", "01", "X", crit).points == 7.5
    gated = crit + [CriterionResult("no_delegation", "", False, gate=True)]
    assert CheckResult("x", "01", "X", gated).points == 0
    assert CheckResult("x", "01", "X", [CriterionResult("a", "", True, weight=1e9)]).points == 10


def test_gradebook_rows_of_a_check_add_up_to_its_points():
    from dpcourse.grading.gradebook import criterion_points, split_points

    # seven equal criteria: 10/7 each, rounded, would add up to 10.01
    crit = [CriterionResult(str(i), "", i != 3) for i in range(7)]
    row = CheckResult("x", "01", "X", crit).to_dict()
    pts = criterion_points(row)
    assert pts[3] == 0 and abs(sum(pts) - row["points"]) < 1e-9 and row["points"] == 8.6
    assert all(abs(p - 10 / 7) < 0.05 for i, p in enumerate(pts) if i != 3)  # points: to 0.1
    assert abs(sum(split_points(10, [1] * 7)) - 10) < 1e-9
    assert split_points(10, [0, 2, 0, 2]) == [0.0, 5.0, 0.0, 5.0]


def test_report_renders_text_html_and_json_without_ansi():
    result = CheckResult("demo", "04", "Demo", [
        CriterionResult("ok_one", "holds", True),
        CriterionResult("bad_one", "does not hold", False, "\x1b[31mgot 2\x1b[0m", "divide <by> N")])
    text, html = str(result), result._repr_html_()
    assert "1/2 criteria" in text and "FAIL  bad_one" in text and "hint: divide <by> N" in text
    assert "bad_one" in html and "divide &lt;by&gt; N" in html
    assert "\x1b" not in json.dumps(result.to_dict()) and result.to_dict()["points"] == 5.0


def test_check_rejects_unknown_names_keywords_and_lambdas():
    with pytest.raises(ValueError, match="unknown check"):
        check("ring_allreduce", lambda t: None)
    with pytest.raises(TypeError, match="unexpected keyword"):
        check("ring_all_reduce", ring_bugs.ring_all_reduce_wrong_chunk, world_sizes=(1,))
    with pytest.raises(ValueError, match="defined with"):
        check("ring_cost", lambda *a: 0)


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
    for broken in ("    ### BEGIN SOLUTION\n", "### BEGIN SOLUTION\nx\n### END SOLUTION\n",
                   "    ### END SOLUTION\n"):
        with pytest.raises(ValueError):
            make_exercises.stub_source(broken, "01", 1)


def _relay_replies(op: str, inputs: list, **extra) -> list:
    """What the grader's relay sends back to each rank for one collective ``op`` of ``inputs``."""
    from dpcourse.grading import wire
    from dpcourse.grading.relay import MessageRelay, Round

    class Sock:  # the grader's end of a rank's socket: keeps what the relay sends
        def __init__(self):
            self.data = b""

        def sendall(self, data):
            self.data += data

    n = len(inputs)
    socks = [Sock() for _ in range(n)]
    relay = MessageRelay(socks, Round(n, events=[[] for _ in range(n)]), stack=None,
                         allowed={op})
    for rank, x in enumerate(inputs):
        assert relay.handle(rank, {"t": "coll", "op": op, "id": 1, **extra}, [x.clone()]) is None
    return [wire.Reader().feed(sock.data)[0][1][0] for sock in socks]


def test_oracles_agree_with_torch_collectives_ddp_and_the_reference_bucket_rule():
    """The grader's independent answers, and the relay's collectives, are what torch computes."""
    import dpcourse
    from dpcourse.ddp import assign_buckets
    from dpcourse.grading import oracles

    for sizes, dtype, cap in [([100, 200, 300, 400, 500], torch.float32, 4000 / 2**20),
                              ([3, 1, 4, 1, 5], torch.float32, 0.0),
                              ([64] * 5, torch.float16, 200 / 2**20),
                              ([2**18, 7, 2**17, 2**17, 10], torch.float32, 1.0)]:
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
        nbytes = [p.numel() * p.element_size() for p in params]
        assert oracles.buckets(nbytes, cap) == assign_buckets(params, cap)
    got = dpcourse.run(_torch_truth, world_size=3, timeout=120)
    inputs = [torch.arange(6.0) + 10 * r for r in range(3)]
    for op, relay_op, extra in (("all_reduce", "all_reduce", {"reduce": "sum"}),
                                ("reduce_scatter", "reduce_scatter_tensor", {}),
                                ("all_gather", "all_gather_into_tensor", {}),
                                ("broadcast", "broadcast", {"src": 0})):
        replies = _relay_replies(relay_op, inputs, **extra)
        for r in range(3):
            assert torch.equal(got[r][op], replies[r]), (op, r)
    from dpcourse.grading.checks import ddp_common as d

    batches = [[[(x, y)] for x, y in step] for step in got[0]["batches"]]
    ref = oracles.train_one_process(d.make_model, 7, batches, d.sgd)
    for r in range(3):
        for a, b in zip(got[r]["ddp_params"], ref["params"][-1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _torch_truth():
    import torch.distributed as dist
    from torch import nn

    from dpcourse.grading.checks import ddp_common as d

    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6.0) + 10 * rank
    out = {"all_reduce": x.clone()}
    dist.all_reduce(out["all_reduce"])
    out["reduce_scatter"] = torch.empty(2)
    dist.reduce_scatter_tensor(out["reduce_scatter"], x.clone())
    out["all_gather"] = torch.empty(18)
    dist.all_gather_into_tensor(out["all_gather"], x.clone())
    out["broadcast"] = x.clone()
    dist.broadcast(out["broadcast"], 0)
    gen = torch.Generator().manual_seed(3)
    batches = [[(torch.randn(d.BATCH, d.IN, generator=gen), torch.randn(d.BATCH, d.OUT,
                                                                       generator=gen))
                for _ in range(n)] for _ in range(d.STEPS)]
    model = d.make_model(7 + rank)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=d.LR)
    for step in batches:
        opt.zero_grad()
        nn.functional.mse_loss(ddp(step[rank][0]), step[rank][1]).backward()
        opt.step()
    out["ddp_params"] = [p.detach().clone() for p in model.parameters()]
    out["batches"] = batches
    return out
