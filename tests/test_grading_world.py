"""The grader's ranks are started, named and stopped by the launcher's process runtime.

:class:`dpcourse.grading.world.World` makes its folder with
:func:`dpcourse.launch.workdir.make_workdir`, builds the rank environment with
:func:`dpcourse.launch.env.worker_env` (keeping only what a graded rank needs) and starts each
rank with :func:`dpcourse.launch.procs.start_rank`; these tests check what that gives.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from dpcourse.grading import world as world_mod
from dpcourse.grading.world import World
from dpcourse.launch import workdir
from dpcourse.launch.env import package_root, worker_env

SETUP = {"check": "mean_gradient", "cells": [("<cell 0>", "def x():\n    return 1\n")],
         "names": {"main": "x"}, "pickled": None}


@pytest.fixture
def short_tmp(monkeypatch):
    """A temporary directory short enough for a work directory's socket paths."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="dpw-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.setattr(workdir, "SHORT_TEMP_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_worker_env_keeps_only_the_named_variables_when_asked(monkeypatch):
    monkeypatch.setenv("DPCOURSE_TEST_SECRET", "s3cret")
    monkeypatch.setenv("NCCL_TEST_SETTING", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    everything = worker_env()
    assert everything["DPCOURSE_TEST_SECRET"] == "s3cret"  # the launcher's default: all of ours
    assert everything["PYTHONPATH"] == os.pathsep.join([package_root(), "/elsewhere"])
    kept = worker_env(keep=("PATH", "NCCL_"))
    assert "DPCOURSE_TEST_SECRET" not in kept
    assert kept["NCCL_TEST_SETTING"] == "1" and kept["PATH"] == os.environ["PATH"]
    assert kept["PYTHONPATH"] == package_root() and kept["PYTHONUNBUFFERED"] == "1"
    # Other NCCL_ variables may be set here by earlier tests (the kernels set NCCL_NVLS_ENABLE).
    ours = {"PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME"}
    assert set(kept) <= ours | {k for k in os.environ if k.startswith("NCCL_")}


def test_a_labelled_workdir_is_still_recognised_as_stale(short_tmp):
    tmp_path = short_tmp
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{workdir.WORKDIR_PREFIX}{dead.pid}-check-abcdefgh"
    stale.mkdir()
    mine = workdir.make_workdir("check")  # which first removes the stale one
    assert os.path.basename(mine).startswith(f"{workdir.WORKDIR_PREFIX}{os.getpid()}-check-")
    assert not stale.exists()
    assert workdir.clean_stale_workdirs() == []  # ours stays: our process is alive
    assert os.path.isdir(mine)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/environ")
@pytest.mark.timeout(300)
def test_world_ranks_get_the_launch_runtime_and_leave_nothing(short_tmp, monkeypatch):
    tmp_path = short_tmp
    monkeypatch.setenv("DPCOURSE_TEST_SECRET", "s3cret")
    monkeypatch.setenv("NCCL_TEST_SETTING", "1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{workdir.WORKDIR_PREFIX}{dead.pid}-ring-abcdefgh"  # a killed grader's
    stale.mkdir()
    with World(2, SETUP, label="w") as world:
        assert world.wait_ready(240) is None
        assert not stale.exists()
        assert os.path.dirname(world.tmp) == str(tmp_path)
        assert os.path.basename(world.tmp).startswith(f"{workdir.WORKDIR_PREFIX}{os.getpid()}-w-")
        pids = [p.pid for p in world.procs]
        for rank, pid in enumerate(pids):
            proc = psutil.Process(pid)
            env = proc.environ()
            assert "DPCOURSE_TEST_SECRET" not in env  # nothing of the grader's own settings
            assert env["NCCL_TEST_SETTING"] == "1"  # the machine's GPU settings do hold
            assert env["TMPDIR"] == proc.cwd() == os.path.join(world.tmp, f"rank{rank}")
            assert os.getsid(pid) == pid != os.getsid(0)  # a session of its own
        # A signal Python has no name for (a real-time one) is still reported, by number.
        unnamed = signal.SIGRTMIN + 6
        os.kill(pids[1], unnamed)
        assert f"rank 1 was killed by signal {int(unnamed)} during" in world._died(1).text
        os.kill(pids[0], signal.SIGSEGV)
        assert "rank 0 was killed by signal SIGSEGV during" in world._died(0).text
        folder = world.tmp
    assert not os.path.exists(folder)
    left = {p.pid for p in psutil.Process().children()}
    assert not left & set(pids)  # killed and reaped: no zombie left behind
    for pid in pids:
        assert not psutil.pid_exists(pid)


def test_world_has_no_spawner_of_its_own():
    """World starts its ranks with the launcher's start_rank (the trust tests patch that path)."""
    assert world_mod.start_rank.__module__ == "dpcourse.launch.procs"
    assert not hasattr(world_mod, "tempfile")


HANGING_GRADER = '''
import sys, time
from dpcourse.grading.world import World
setup = {"check": "mean_gradient", "cells": [("<cell 0>", "import time\\nwhile True:\\n"
         "    time.sleep(0.05)\\n")], "names": {"main": "x"}, "pickled": None}
world = World(1, setup, label="k")
print(world.procs[0].pid, world.tmp, flush=True)
time.sleep(600)
'''


@pytest.mark.timeout(300)
def test_a_killed_grader_leaves_no_rank_and_no_work_directory(short_tmp):
    """A rank stuck in the learner's top-level code never reads its socket again: without the
    launcher's guard it would outlive a grader killed outright (SIGKILL)."""
    env = dict(os.environ, TMPDIR=str(short_tmp), PYTHONPATH=package_root())
    grader = subprocess.Popen([sys.executable, "-c", HANGING_GRADER], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid_text, folder = grader.stdout.readline().split()
        rank = psutil.Process(int(pid_text))
        assert rank.is_running()
    finally:
        grader.kill()
        grader.wait()
        grader.stdout.close()
    gone, alive = psutil.wait_procs([rank], timeout=60)
    assert not alive, alive
    for _ in range(100):  # the guard removes the folder once the ranks' groups are gone
        if not os.path.exists(folder):
            break
        time.sleep(0.1)
    assert not os.path.exists(folder)
