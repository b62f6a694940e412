"""Graded code runs in a sandbox: it cannot reach the grader, the checkout, other submissions,
the network or other ranks, and the grader reaps and bounds what it starts.

Each attack below is one a notebook or a rank could make as the grader's own user; each
prints ``BROKE`` where it gets through, which the assertions refuse.
"""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import uuid

import nbformat
import pytest

from dpcourse.grading import sandbox, wire
from dpcourse.grading.world import World

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_SANDBOX = sandbox.unavailable()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=str(NO_SANDBOX))

# Run in the kernel of a graded notebook: every attempt prints BLOCKED or BROKE.
ATTACKS = r'''
import ctypes, os, socket, sys
def attempt(name, fn):
    try:
        fn()
        print("BROKE", name)
    except Exception as exc:
        print("BLOCKED", name, type(exc).__name__)

def write(path):
    with open(path, "a") as f:
        f.write("# planted\n")

def read(path):
    with open(path, "rb") as f:
        f.read(10)

import dpcourse
attempt("package", lambda: write(os.path.join(os.path.dirname(dpcourse.__file__), "grading",
                                             "checks", {planted!r})))
attempt("checkout", lambda: write(os.path.join({root!r}, "dpcourse", "grading", "checks",
                                              {planted!r})))
attempt("solutions", lambda: read(os.path.join({root!r}, "solutions", {solution!r})))
attempt("pth", lambda: write(os.path.join({site!r}, {pth!r})))
attempt("submission", lambda: read({other!r}))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=5).close())
attempt("internet", lambda: socket.create_connection(("1.1.1.1", 53), timeout=5).close())
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))

def ancestors():
    pid, found = os.getpid(), []
    while pid > 1:
        with open(f"/proc/{{pid}}/status") as f:
            pid = int([l.split()[1] for l in f if l.startswith("PPid:")][0])
        if pid > 1:
            found.append(pid)
    return found

def grader():
    for pid in ancestors():
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            cmd = f.read()
        if b"dpcourse.cli" in cmd or b"dpcourse.grading.executor" in cmd:
            return pid
    raise LookupError("no ancestor of this kernel is the grader")

attempt("proc", grader)

def ptrace():
    libc = ctypes.CDLL(None, use_errno=True)
    pid = grader()
    if libc.ptrace(16, pid, 0, 0) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
    libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH

attempt("ptrace", ptrace)
'''


def _notebook(path: pathlib.Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def _solution_cells(number: str) -> list[str]:
    (path,) = (ROOT / "solutions").glob(f"{number}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _listener():
    """A TCP port on this machine's loopback, and the list of connections it accepted."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return server, accepted


def _grade(tmp_path, *args, check=True):
    out, tmp = tmp_path / "report.json", tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", "grade", *map(str, args),
                           "--json", str(out)], capture_output=True, text=True, timeout=900,
                          env=env)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@needs_sandbox
@pytest.mark.timeout(900)
def test_a_notebook_reaches_nothing_of_the_grader_and_honest_work_keeps_its_score(tmp_path):
    """(a) package, (b) solutions/, (c) network, (d) the grader via /proc and ptrace, (e) a .pth
    in site-packages, (f) another submission: each attempt fails, and both scores stand."""
    planted, pth = f"zz_planted_{uuid.uuid4().hex[:8]}.py", f"zz_planted_{uuid.uuid4().hex[:8]}.pth"
    site = sysconfig.get_paths()["purelib"]
    subs = tmp_path / "subs"
    honest = subs / "alice" / "01_why_data_parallel.ipynb"
    _notebook(honest, _solution_cells("01"))
    server, accepted = _listener()
    attacks = ATTACKS.format(planted=planted, root=str(ROOT), solution=honest.name, site=site,
                             pth=pth, other=str(honest), port=server.getsockname()[1])
    _notebook(subs / "mallory" / "01_why_data_parallel.ipynb",
              [attacks] + _solution_cells("01"))
    try:
        proc, report = _grade(tmp_path, subs, "--feedback", tmp_path / "fb", "--timeout", "300")
    finally:
        server.close()
        leaked = [p for p in (ROOT / "dpcourse" / "grading" / "checks" / planted,
                              pathlib.Path(site) / pth) if p.exists()]
        for p in leaked:
            p.unlink()
    assert not leaked, leaked
    assert not accepted, "a notebook connected to a port on the grader's machine"
    feedback = tmp_path / "fb" / "mallory" / "01_why_data_parallel.feedback.ipynb"
    text = "".join(out.get("text", "") for cell in nbformat.read(feedback, as_version=4).cells
                   if cell.cell_type == "code" for out in cell.get("outputs", []))
    assert "BROKE" not in text, text
    for name in ("package", "checkout", "solutions", "pth", "submission", "tcp", "internet",
                 "dns", "proc", "ptrace"):
        assert f"BLOCKED {name} " in text, (name, text)
    points = {(r["submission"], r["check"]): (r["points"], r["max_points"])
              for r in report["results"]}
    assert points[("alice", "mean_gradient")] == (10, 10), points
    assert points[("mallory", "mean_gradient")] == (10, 10), points  # its exercise is right
    assert report["sandboxed"] is True and all(r["sandboxed"] for r in report["results"])
    assert "not sandboxed" not in proc.stdout


# Run at load time in each of two graded ranks: what it sees of the other rank, of the
# package and of the network, reported as the text of an exception.
RANK_ATTACKS = r'''
import os, socket, time
import dpcourse
seen = []
def attempt(name, fn):
    try:
        fn()
        seen.append("BROKE " + name)
    except Exception as exc:
        seen.append("BLOCKED " + name)
me = "rank-" + str(os.getpid()) + "-" + str(time.time())
places = ["/tmp", "/dev/shm", os.getcwd(), os.path.dirname(os.getcwd())]
for place in places:
    try:
        with open(os.path.join(place, "mark-" + me), "w") as f:
            f.write(me)
    except OSError:
        pass
def others():
    deadline = time.time() + 20
    while time.time() < deadline:
        for place in places:
            try:
                names = [n for root, dirs, files in os.walk(place) for n in files]
            except OSError:
                continue
            if any(n.startswith("mark-") and n != "mark-" + me for n in names):
                return
        time.sleep(0.2)
    raise LookupError("no other rank's file")
attempt("shared-disk", others)
def package():
    with open(os.path.join(os.path.dirname(dpcourse.__file__), "grading", "checks",
                           "zz_rank.py"), "a") as f:
        f.write("# planted\n")
attempt("package", package)
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=5).close())
attempt("oracles", lambda: open(os.path.join(os.path.dirname(dpcourse.__file__), "grading",
                                             "oracles.py")).close())
raise RuntimeError("REPORT " + " | ".join(seen))
'''


@needs_sandbox
@pytest.mark.timeout(300)
def test_ranks_share_no_disk_no_network_and_cannot_write_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    server, accepted = _listener()
    cells = [("<cell 0>", RANK_ATTACKS.format(port=server.getsockname()[1]))]
    setup = {"check": "mean_gradient", "cells": cells, "names": {"main": "x"}, "pickled": None}
    planted = ROOT / "dpcourse" / "grading" / "checks" / "zz_rank.py"
    reports = []
    try:
        with sandbox.prepared() as box, World(2, setup, label="attack", sandbox=box) as world:
            for sock in world.socks:  # each rank's load ends in its report
                sock.settimeout(240)
                header, _ = wire.recv_blocking(sock)
                reports.append(str(header.get("text")))
    finally:
        server.close()
        leaked = planted.exists()
        if leaked:
            planted.unlink()
    assert not accepted
    assert not leaked
    for text in reports:
        assert "REPORT" in text, text
        assert "BROKE" not in text, text
        for name in ("shared-disk", "package", "tcp", "oracles"):
            assert f"BLOCKED {name}" in text, (name, text)


def test_without_the_sandbox_grading_is_refused_and_says_why(tmp_path):
    """No bwrap on PATH: exit 2 with the reason and the flag, before any notebook runs."""
    _notebook(tmp_path / "subs" / "a" / "01_why_data_parallel.ipynb", _solution_cells("01"))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", "grade", str(tmp_path / "subs")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dpcourse grade: error: graded code cannot be sandboxed"), last
    assert "bubblewrap" in last and "--no-sandbox" in last, last
    assert "Traceback" not in proc.stderr and "points" not in proc.stdout


@pytest.mark.timeout(600)
def test_no_sandbox_grades_and_marks_every_score(tmp_path):
    """--no-sandbox, asked for where bwrap is missing: graded, and every score says so."""
    _notebook(tmp_path / "subs" / "a" / "01_why_data_parallel.ipynb", ["x = 1"])
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), PYTHONPATH=str(ROOT))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", "grade", str(tmp_path / "subs"),
                           "--no-sandbox", "--json", str(out), "--csv", str(tmp_path / "r.csv")],
                          capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["sandboxed"] is False
    assert report["results"] and all(r["sandboxed"] is False for r in report["results"])
    assert all(r["notes"][0].startswith("not sandboxed") for r in report["results"])
    table = [ln for ln in proc.stdout.splitlines() if "mean_gradient" in ln]
    assert table and all("(not sandboxed)" in ln for ln in table), proc.stdout
    assert "not sandboxed:" in proc.stdout
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert rows[0].endswith(",sandboxed") and all(r.endswith(",no") for r in rows[1:])


ORPHANS = textwrap.dedent('''
    import json, os, sys, time
    import psutil
    from dpcourse.launch import reaper as procs

    with procs.subreaper():
        before = {p.pid for p in psutil.Process().children()}
        child = os.fork()
        if child == 0:  # forks and exits 3,000 times: every grandchild is handed to us
            for _ in range(3000):
                if os.fork() == 0:
                    os._exit(0)
            os._exit(0)
        os.waitpid(child, 0)
        time.sleep(1.0)
        def zombies():
            return sum(p.status() == psutil.STATUS_ZOMBIE for p in psutil.Process().children())
        adopted = zombies()
        t0 = time.monotonic()
        procs.kill_new_children(before)
        took = time.monotonic() - t0
        print(json.dumps({"adopted": adopted, "left": zombies(), "seconds": took}))
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux's")
@pytest.mark.timeout(300)
def test_adopted_orphans_are_reaped_in_one_quick_sweep():
    proc = subprocess.run([sys.executable, "-c", ORPHANS], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["adopted"] >= 2900, got  # the orphans did come to the grader, as zombies
    assert got["left"] == 0, got
    assert got["seconds"] < 30, got


def test_reaping_leaves_a_child_its_owner_still_waits_for():
    """A caller's Popen keeps its exit status: reap() skips the pids it is told to keep."""
    kept = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    other = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(psutil_status(p.pid) == "zombie" for p in (kept, other)):
            break
        time.sleep(0.1)
    from dpcourse.launch import reaper as procs

    assert procs.reap(keep={kept.pid}) >= 1
    assert psutil_status(other.pid) is None  # reaped
    assert kept.wait(timeout=10) == 7


def psutil_status(pid):
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


HANGING_ZERO_STEP = '''
def zero_step(params, shard_optimizer, group=None):
    while True:
        pass
'''


@needs_sandbox
@pytest.mark.timeout(600)
def test_exercise_13_check_stops_a_hang_at_its_round_limit(tmp_path):
    """Exercise 13's ranks are the grader's like every check's: a hang ends at the round's limit."""
    from dpcourse.grading.checks.ex13_sharded_step import ShardedStep

    _notebook(tmp_path / "subs" / "a" / "13_zero.ipynb",
              [HANGING_ZERO_STEP, "if False:\n    check('sharded_step', zero_step)"])
    proc, report = _grade(tmp_path, tmp_path / "subs", "--timeout", "12")
    (row,) = [r for r in report["results"] if r["check"] == "sharded_step"]
    assert row["points"] == 0
    details = " ".join(c["detail"] for c in row["criteria"])
    assert f"not finished after {ShardedStep.timeout:g} s" in details, details
    assert "running your code" in details, details
    assert row["seconds"] < ShardedStep.timeout + 90, row["seconds"]  # ranks' start-up included


def test_what_the_sandbox_hides_and_the_rank_blocks_exists():
    """A renamed or merged grader module must not leave a stale name in either list, which
    would hide nothing while the module under its new name stays readable and importable."""
    import importlib.util

    from dpcourse.grading import rank
    from dpcourse.launch.env import package_root

    root = os.path.join(package_root(), "dpcourse")
    assert [p for p in sandbox.GRADER_ONLY if not os.path.isfile(os.path.join(root, p))] == []
    assert [m for m in rank.BLOCKED if importlib.util.find_spec(m) is None] == []
