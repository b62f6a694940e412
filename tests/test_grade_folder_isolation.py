"""A hostile notebook graded in a class folder changes nobody else's grade, and nothing else.

Black-box, through ``dpcourse grade``: a small class folder (honest solutions, an
unchanged exercise, one hostile notebook whose kernel and ranks attack the other
submissions, site-packages, the course package, the grader's ``--json``, the
answers, and the process table; one that tries the network; one that ptraces what
it can see and looks for the grader's environment) is graded in one call, and the
honest notebooks alone (without the hostile ones) in another. The attacks and the
helpers are in ``tests/grade_folder_experiment.py`` and
``tests/planted/sandbox_attacks.py``; the experiment runs the 30-notebook version.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grade_folder_experiment as gx  # noqa: E402
from planted import sandbox_attacks  # noqa: E402

from dpcourse.grading import sandbox  # noqa: E402

# honest_notebook() indices: exercise 01's solution (10/10) and exercise 01 unchanged (0/10).
HONEST = (0, 3)

# Two grading calls at once; on a loaded 2-core machine they take minutes, so the limit
# is the subprocesses' own (900 s), not the suite's default.
pytestmark = [pytest.mark.skipif(gx.shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed"),
              pytest.mark.timeout(1000)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade the honest notebooks without the hostile ones, and the whole folder, at once."""
    work = tmp_path_factory.mktemp("class")
    marker = f"hostile{os.getpid()}x{int(time.time())}"
    with gx.outside_ends(str(work), marker) as (listeners, outside, env):
        out = _grade_class(work, marker, outside, env)
        out["attacks"] = gx.attack_results(out["together"]["json"], out["built"]["attacks"],
                                           listeners)
    out["outside"] = outside
    return out


def _grade_class(work, marker: str, outside: dict, env: dict) -> dict:
    folder, canary, outs = (str(work / d) for d in ("class", "canary", "out"))
    os.makedirs(canary)
    os.makedirs(os.path.join(outs, "folder"))
    json_path = os.path.join(outs, "folder", "grades.json")
    built = gx.build_class(folder, HONEST, canary, json_path, marker, forks=200,
                           outside=outside)
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
        alone = pool.submit(gx.grade, [reference], os.path.join(outs, "reference.json"),
                            limit=900, env=env)
        together = pool.submit(gx.grade, [folder], json_path, limit=900, env=env)
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
                             skip=(built["hostile"][1],
                                   *(p for _, p in built["attacks"].values())))
    gx.undo_marks([p for p in marked if not p.startswith(folder)], marker)
    return {"honest": honest, "hostile": hostile_sub, "alone": alone, "together": together,
            "built": built,
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
    assert gx.breaches(reports) == []
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


def _reports(graded, kind: str) -> list[list[str]]:
    """The kernel's and the ranks' reports of the ``kind`` attack notebook (kernel first)."""
    found = graded["attacks"][kind]
    result = found["result"]
    # Graded through its channel, after its attacks: the ranks' reports came back that way.
    assert result is not None and result["checks"]["mean_gradient"]["max_points"] == 10, result
    assert found["kernel_report"], found
    ranks = [r for r in found["rank_reports"] if isinstance(r, list)]
    assert ranks, found["rank_reports"]
    assert found["breaches_reported"] == [], found["breaches_reported"]
    return [found["kernel_report"], *ranks]


def test_network_attempts_reach_nothing_outside_and_the_notebook_is_still_graded(graded):
    outside = graded["outside"]
    # The listeners answer from outside the sandbox (their control round), and nothing
    # the notebooks sent reached them.
    assert len(outside["control"]) == len(outside["tcp"]) + len(outside["udp"]) + 2
    assert graded["attacks"]["listeners_reached"] == []
    for report in _reports(graded, "network"):
        text = "\n".join(report)
        for host, port in outside["tcp"]:  # 127.0.0.1 and this machine's other addresses
            assert f"blocked tcp connect to {host}:{port} " in text, (host, text)
        for what in ("blocked connect to the abstract Unix socket",
                     f"blocked connect to the unix socket {outside['unix_paths'][0]} ",
                     f"blocked dns lookup of {gx.INDEX_HOST} ",
                     f"blocked http request to the package index {outside['index_url']} "):
            assert what in text, (what, text)
        if outside["nameserver"]:
            assert f"blocked dns query straight to the name server {outside['nameserver']}" in text
        for ip in outside["index_ips"]:
            assert f"blocked tcp connect to the package index's address {ip}:443 " in text


def test_ptrace_attaches_to_no_process_outside_the_sandbox(graded):
    outside_pids = graded["outside"]["outside_pids"]
    for report in _reports(graded, "ptrace"):
        text = "\n".join(report)
        for pid in outside_pids:  # the test's own process and its parent, by their pids
            for how in ("PTRACE_SEIZE", "PTRACE_ATTACH"):
                assert f"blocked {how} the outside pid {pid} " in text, (pid, text)
            assert f"blocked signal the outside pid {pid} " in text, (pid, text)
        # Inside, it sees only its own sandbox: bubblewrap's pid 1, which holds no fd
        # it does not hold itself but bubblewrap's exit-status eventfd (see the test
        # below; a kernel holds eventfds of its own, which read the same), and no
        # trace of the grader's environment.
        inside = [line for line in report if line.startswith("pid ")]
        assert inside and all(line.startswith("pid 1 bwrap:") for line in inside), inside
        for line in inside:
            beyond = ast.literal_eval(line.split("fds beyond its own: ", 1)[1])
            assert set(beyond) <= {"anon_inode:[eventfd]"}, line
        assert "no trace of the grader's environment" in text or "blocked read /proc/1/mem" in text


# Run in a sandbox as a rank is started: what bubblewrap's pid 1 shows and holds, then
# (where ptrace rules let it take that fd) what writing bubblewrap's eventfd does.
INIT_PROBE = r'''
import ctypes, json, os, sys, time
def fds(pid):
    out = {}
    for f in os.listdir("/proc/%d/fd" % pid):
        try:
            out[f] = os.readlink("/proc/%d/fd/%s" % (pid, f))
        except OSError:  # the fd listdir itself used, closed meanwhile
            pass
    return out
mine, init = set(fds(os.getpid()).values()), fds(1)
print(json.dumps({"environ": open("/proc/1/environ", "rb").read().decode(errors="replace"),
                  "beyond": sorted(set(init.values()) - mine)}), flush=True)
(fd,) = [int(f) for f, link in init.items() if link == "anon_inode:[eventfd]"]
libc = ctypes.CDLL(None, use_errno=True)
got = libc.syscall(438, os.pidfd_open(1), fd, 0)  # pidfd_getfd: needs ptrace rights on pid 1
if got < 0:
    print(json.dumps({"getfd_errno": ctypes.get_errno()}), flush=True)
    sys.exit(0)
os.write(got, (42 + 1).to_bytes(8, "little"))  # bwrap reports (value - 1) as the exit status
time.sleep(30)
print(json.dumps({"survived": True}), flush=True)
'''


@pytest.mark.skipif(sandbox.unavailable() is not None, reason=str(sandbox.unavailable()))
def test_bubblewraps_pid_1_holds_nothing_of_the_grader(tmp_path):
    """pid 1 inside is bwrap, whose /proc/1/environ showed the grader's environment (the
    kernel's held every variable of the grader and JPY_PARENT_PID) until bwrap was started
    with an empty one; its only fd beyond the sandboxed process's own is the eventfd
    through which it reports the exit status, and writing that ends the sandbox at once,
    as exiting does: no way out."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "probe.py").write_text(INIT_PROBE)
    mine, theirs = socket.socketpair()  # a rank's channel, as World passes it
    env = dict(os.environ, GRADER_SECRET="s3cret-of-the-grader", JPY_PARENT_PID=str(os.getpid()))
    with sandbox.prepared() as box, mine, theirs:
        t0 = time.monotonic()
        proc = subprocess.run(box.command([sys.executable, "probe.py"], str(scratch)),
                              pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, env=env, timeout=120,
                              start_new_session=True)
        seconds = time.monotonic() - t0
    lines = [gx.json.loads(ln) for ln in proc.stdout.splitlines()]
    assert lines and "environ" in lines[0], (proc.stdout, proc.stderr)
    assert "s3cret-of-the-grader" not in lines[0]["environ"]
    assert "JPY_PARENT_PID" not in lines[0]["environ"]
    assert lines[0]["environ"] == ""
    assert lines[0]["beyond"] == ["anon_inode:[eventfd]"], lines[0]
    if len(lines) > 1 and "getfd_errno" in lines[1]:  # ptrace rules (Yama) forbid taking it
        assert lines[1]["getfd_errno"] in (1, 38), lines  # EPERM, ENOSYS
    else:
        assert proc.returncode == 42 and len(lines) == 1, (proc.returncode, lines, proc.stderr)
        assert seconds < 25  # it did not sleep its 30 s: the sandbox ended with the write
