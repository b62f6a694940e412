"""Processes a rank starts: DataLoader workers and subprocesses work there, and none outlives the launch.

A rank is where a learner's training loop runs, so it must behave like any Python
process: ``DataLoader(num_workers=2)`` forks workers, ``subprocess.run`` starts a
program. When the launch ends (returned, failed, or the launching process was
killed), every process the ranks started ends too and nothing is left in the
temporary directory or in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from proc_helpers import describe, wait_gone

import dpcourse
from dpcourse import RankError
from dpcourse.launch import workdir

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_with_workers():
    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)  # fork on Linux
    total = torch.zeros(1)
    for (batch,) in loader:
        total += batch.sum()
    dist.all_reduce(total)
    return total.item()


def test_dataloader_with_worker_processes_in_a_rank():
    # Before the fix a forked worker deadlocked and the launch timed out as a "hang".
    start = time.monotonic()
    assert dpcourse.run(load_with_workers, world_size=2, backend="gloo", timeout=90) == [240.0] * 2
    assert time.monotonic() - start < 90


def test_dataloader_workers_in_a_rank_under_a_long_temporary_directory(tmp_path):
    # A worker hands each batch to the rank over an AF_UNIX socket made in the launch's work
    # directory; under a long TMPDIR its path would pass the 108-byte limit, the batch would
    # never arrive and the rank would wait for it until the launch timed out.
    long_tmp = tmp_path / ("t" * (workdir.SOCKET_PATH_MAX - len(str(tmp_path))))
    long_tmp.mkdir()
    code = ("import dpcourse, test_rank_children as t; "
            "print(dpcourse.run(t.load_with_workers, world_size=2, backend='gloo', timeout=60))")
    env = dict(os.environ, TMPDIR=str(long_tmp),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[240.0, 240.0]"
    assert os.listdir(long_tmp) == []  # the work directory went to /tmp, and went


def run_a_program():
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1])", "hello"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_subprocess_in_a_rank():
    assert dpcourse.run(run_a_program, world_size=2, backend="gloo", timeout=90) == ["hello"] * 2


def test_rank_stdin_is_empty():
    """A rank's stdin is /dev/null: reading it returns at once, it never takes the launcher's pipe."""
    assert dpcourse.run(lambda: sys.stdin.read(), world_size=2, backend="gloo",
                        timeout=60) == ["", ""]


LAUNCHER = """
import os, subprocess, sys, time
import torch, torch.distributed as dist
import dpcourse

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor([float(i)])

def start_children_then_wait(mode, go):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    loader = iter(torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=2))
    next(loader)  # the two workers are running
    print(f"started {os.getpid()} {child.pid}", flush=True)
    if mode == "fail" and dist.get_rank() == 1:
        while not os.path.exists(go):  # the test has seen every process: fail now
            time.sleep(0.05)
        raise ValueError("failed with workers running")
    time.sleep(600)  # stopped by the launcher

try:
    dpcourse.run(start_children_then_wait, sys.argv[1], sys.argv[2], world_size=2, backend="gloo",
                 timeout=600)
except dpcourse.RankError as exc:
    print("RankError", exc.message, flush=True)
"""


def _start_launcher(mode: str, tmp_path, go: str = "") -> subprocess.Popen:
    """Start a launcher whose ranks start children; in mode "fail" rank 1 raises once ``go`` exists."""
    # A private temporary directory: what the launch leaves there is ours alone.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, mode, go], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _work_dirs(launcher: subprocess.Popen, tmp_path) -> list[str]:
    """What is in the launcher's TMPDIR, and its work directories in /tmp (used instead of a
    TMPDIR whose socket paths would be too long; see dpcourse.launch.workdir)."""
    prefix = f"{workdir.WORKDIR_PREFIX}{launcher.pid}-"
    return os.listdir(tmp_path) + [n for n in os.listdir(workdir.SHORT_TEMP_DIR)
                                   if n.startswith(prefix)]


def _descendants_once_started(launcher: subprocess.Popen, ranks: int = 2) -> list[int]:
    """Wait until every rank has started its children; return the pids of all descendants."""
    started = 0
    for line in launcher.stdout:
        started += "] started " in line
        if started == ranks:
            break
    assert started == ranks
    kids = psutil.Process(launcher.pid).children(recursive=True)
    # Each rank: the rank, 2 DataLoader workers, 1 program; plus the launch's guard.
    assert len(kids) >= 4 * ranks + 1, describe(kids)
    return [p.pid for p in kids]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_ends_everything_the_ranks_started(sig, tmp_path):
    launcher = _start_launcher("wait", tmp_path)
    try:
        pids = _descendants_once_started(launcher)
        launcher.send_signal(sig)  # SIGKILL: kill -9, a Jupyter kernel restart
        launcher.wait()
        left = wait_gone(pids, timeout=20)
        assert left == [], "still running after the launcher died:\n" + describe(
            [psutil.Process(pid) for pid in left if psutil.pid_exists(pid)])
        deadline = time.monotonic() + 10
        while _work_dirs(launcher, tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _work_dirs(launcher, tmp_path) == []  # the work directory went with them
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


def _named_semaphores() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}
    except FileNotFoundError:  # no /dev/shm (not Linux): nothing can be left there
        return set()


def test_failed_run_with_workers_leaves_no_files_and_no_processes(tmp_path, tmp_path_factory):
    # Rank 1 fails only once the test has listed every process: on a loaded machine it could
    # otherwise fail, and the launch end, before the list is taken.
    go = tmp_path_factory.mktemp("signal") / "go"
    launcher = _start_launcher("fail", tmp_path, str(go))
    try:
        pids = _descendants_once_started(launcher)
        go.touch()
        out = launcher.stdout.read()
        assert launcher.wait(timeout=120) == 0
        assert "RankError failed with workers running" in out
        assert wait_gone(pids, timeout=10) == []
        # multiprocessing's socket folders (pymp-*) and the launch's work directory.
        assert _work_dirs(launcher, tmp_path) == []
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


HELD = []  # in a rank: objects kept alive until the launcher stops it


def hold_a_named_semaphore():
    import multiprocessing

    # A spawn-context lock is a named semaphore (/dev/shm/sem.mp-*) that multiprocessing's
    # resource tracker unlinks once every process using it is gone; a rank killed while
    # holding it (with its tracker) would leave the file behind.
    lock = multiprocessing.get_context("spawn").Lock()
    HELD.append(lock)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, lock._semlock.name)
    if dist.get_rank() == 1:
        time.sleep(1.0)
        raise ValueError("failed holding " + " ".join(names))
    time.sleep(600)  # stopped by the launcher while holding the lock


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux's")
def test_failed_run_leaves_no_named_semaphores():
    with pytest.raises(RankError) as info:
        dpcourse.run(hold_a_named_semaphore, world_size=2, backend="gloo", timeout=120)
    names = info.value.message.split()[2:]  # e.g. /mp-1a2b3c4d, one per rank
    assert len(names) == 2 and all(name.startswith("/mp-") for name in names)
    assert [n for n in names if os.path.exists("/dev/shm/sem." + n[1:])] == []


def test_a_launch_without_a_short_enough_temporary_directory_says_to_set_tmpdir(tmp_path,
                                                                                monkeypatch):
    long_tmp = tmp_path / ("t" * (workdir.SOCKET_PATH_MAX - len(str(tmp_path))))
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    monkeypatch.setattr(workdir, "SHORT_TEMP_DIR", str(long_tmp))
    with pytest.raises(RuntimeError, match="Set TMPDIR to a short writable directory"):
        dpcourse.run(os.getpid, world_size=2, backend="gloo")
    assert os.listdir(long_tmp) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's sockaddr_un")
def test_an_af_unix_socket_path_holds_at_most_107_bytes_on_linux(tmp_path):
    import socket

    base = str(tmp_path) + "/"
    for length, fits in ((107, True), (108, False)):
        path = base + "s" * (length - len(base))
        with socket.socket(socket.AF_UNIX) as sock:
            if fits:
                sock.bind(path)
            else:
                with pytest.raises(OSError, match="too long"):
                    sock.bind(path)
    assert workdir.SOCKET_PATH_MAX <= 107
