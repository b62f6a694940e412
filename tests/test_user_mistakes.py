"""What a mistake with the launcher, the wrappers or the command line gets: one clear message.

Each test pins one row of docs/mistakes.md ("Launcher, wrappers and command line").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpcourse
from dpcourse import cli
from dpcourse.launch import resources, workdir

pytestmark = pytest.mark.usefixtures("no_leaked_processes")


def _returns_one() -> int:
    return 1


# -- the launcher ----------------------------------------------------------------------------

def test_nccl_without_gpus_names_the_gpu_count(monkeypatch):
    monkeypatch.setattr("dpcourse.device.visible_gpus", lambda: 0)
    with pytest.raises(ValueError, match=r"'nccl' needs one GPU per rank, .* 0 visible GPU"):
        dpcourse.resolve_backend("nccl")
    with pytest.raises(ValueError, match="0 visible GPU"):
        dpcourse.run(_returns_one, backend="nccl")  # before: [] and no word


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1])
def test_timeout_must_be_finite_and_positive(timeout):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"positive number of seconds \(finite\)"):
        dpcourse.run(_returns_one, world_size=1, timeout=timeout)
    assert time.monotonic() - start < 5  # refused before any rank started


def test_more_ranks_than_cores_warns(monkeypatch):
    monkeypatch.setattr(resources.os, "cpu_count", lambda: 1)
    with pytest.warns(RuntimeWarning, match=r"2 ranks on 1 CPU core"):
        assert dpcourse.run(_returns_one, world_size=2, backend="gloo") == [1, 1]


def test_ranks_that_do_not_fit_in_memory_are_refused_unless_overridden(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 300 * 2**20)
    monkeypatch.delenv(resources.SKIP_MEMORY_CHECK_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"2 ranks need about .* DPCOURSE_SKIP_MEMORY_CHECK=1"):
        dpcourse.run(_returns_one, world_size=2, backend="gloo")
    monkeypatch.setenv(resources.SKIP_MEMORY_CHECK_ENV, "1")
    assert dpcourse.run(_returns_one, world_size=2, backend="gloo") == [1, 1]


def _workdirs_of(pid: int) -> list[str]:
    tmp = tempfile.gettempdir()
    return [os.path.join(tmp, n) for n in os.listdir(tmp)
            if n.startswith(f"{workdir.WORKDIR_PREFIX}{pid}-")]


def _guard_of(launcher_pid: int) -> int:
    """The pid of the launch's guard process (:mod:`dpcourse.launch.guard`)."""
    import psutil

    guards = [child.pid for child in psutil.Process(launcher_pid).children()
              if any(arg.endswith("guard.py") for arg in child.cmdline())]
    assert len(guards) == 1, f"expected one guard process, found {guards}"
    return guards[0]


def _launcher_with_its_payload_written() -> subprocess.Popen:
    """A process whose ``dpcourse.run`` has written its work directory's payload."""
    code = ("import time, dpcourse; "
            "dpcourse.run(time.sleep, 120, world_size=1, backend='gloo', timeout=300)")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(os.path.exists(os.path.join(d, "payload.pkl"))
                  for d in _workdirs_of(launcher.pid)):
        if time.monotonic() > deadline:
            launcher.kill()
            launcher.wait()
            pytest.fail("the launcher never wrote its payload")
        time.sleep(0.2)
    return launcher


def test_work_dir_of_a_launcher_killed_alone_is_removed_by_its_guard():
    launcher = _launcher_with_its_payload_written()
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60
    while _workdirs_of(launcher.pid):
        assert time.monotonic() < deadline, "the guard left the killed launcher's directory"
        time.sleep(0.1)


def test_work_dir_of_a_killed_launcher_is_removed_by_the_next_launch():
    """When the guard is killed too (the OOM killer, a container stopped), the next launch
    removes the directory."""
    launcher = _launcher_with_its_payload_written()
    try:
        # The guard first, so that nothing is left to clean up: the directory stays.
        os.kill(_guard_of(launcher.pid), signal.SIGKILL)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    stale = _workdirs_of(launcher.pid)
    assert stale and all(os.path.isdir(d) for d in stale)
    dpcourse.run(_returns_one, world_size=1, backend="gloo")
    assert not any(os.path.exists(d) for d in stale)


# -- the wrappers ----------------------------------------------------------------------------

def _different_model(kind: str, impl: str) -> str:
    rank = dist.get_rank()
    if kind == "shapes":
        model = nn.Linear(4, 3 if rank == 0 else 5)
    elif kind == "count":
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 if rank == 0 else 3)])
    elif kind == "transposed":  # the same number of elements: gloo would sum it without a word
        model = nn.Linear(4, 6) if rank == 0 else nn.Linear(6, 4)
    else:  # frozen on one rank only
        model = nn.Linear(4, 4)
        model.bias.requires_grad_(rank == 0)
    if impl == "ours":
        from dpcourse.ddp import DataParallelOverlapped

        DataParallelOverlapped(model)
    else:
        nn.parallel.DistributedDataParallel(model)
    return "wrapped"


@pytest.mark.parametrize("kind, detail", [
    ("shapes", r"weight has shape \(3, 4\) on rank 0 but \(5, 4\) on rank 1"),
    ("count", r"rank 0 has 4 parameters but rank 1 has 6 \(the first without a match: '2.weight'\)"),
    ("transposed", r"weight has shape \(6, 4\) on rank 0 but \(4, 6\) on rank 1"),
])
def test_different_models_on_the_ranks_are_refused_at_construction_as_torch_ddp_does(kind, detail):
    with pytest.raises(dpcourse.RankError, match="the ranks wrap different models: " + detail) as ours:
        dpcourse.run(_different_model, kind, "ours", world_size=2, backend="gloo", timeout=60)
    assert ours.value.exc_type == "RuntimeError"
    with pytest.raises(dpcourse.RankError) as theirs:  # torch DDP: also at construction
        dpcourse.run(_different_model, kind, "torch", world_size=2, backend="gloo", timeout=60)
    assert theirs.value.exc_type == "RuntimeError"


def test_a_parameter_frozen_on_one_rank_only_is_refused_at_construction():
    with pytest.raises(dpcourse.RankError,
                       match="bias has requires_grad True on rank 0 but False on rank 1"):
        dpcourse.run(_different_model, "frozen", "ours", world_size=2, backend="gloo", timeout=60)


def _backward_on_rank_0_only() -> None:
    from dpcourse.ddp import DataParallelOverlapped

    model = DataParallelOverlapped(nn.Linear(8, 8), bucket_cap_mb=0)
    if dist.get_rank() == 0:
        model(torch.ones(2, 8)).sum().backward()  # waits for rank 1's all-reduces forever


def test_a_hang_in_an_async_wait_names_the_wait_and_its_collective():
    with pytest.raises(dpcourse.RankTimeoutError) as err:
        dpcourse.run(_backward_on_rank_0_only, world_size=2, backend="gloo", timeout=10)
    line = next(ln for ln in str(err.value).splitlines() if ln.startswith("  rank 0:"))
    assert "waiting in `work.wait()`" in line and "all_reduce" in line, line
    assert "async_op=True" in line and "test_user_mistakes.py" in line, line
    assert "not inside a torch.distributed call" not in line


# -- the command line ------------------------------------------------------------------------

USER_ERRORS = [
    ["bench", "allreduce", "--world-size", "0"],
    ["bench", "allreduce", "--timeout", "-1"],
    ["bench", "allreduce", "--timeout", "inf"],
    ["bench", "allreduce", "--min-size", "0"],
    ["bench", "allreduce", "--sizes", "0"],
    ["bench", "allreduce", "--sizes", "2"],
    ["bench", "allreduce", "--min-size", "1M", "--max-size", "4K"],
    ["bench", "allreduce", "--iters", "0"],
    ["bench", "allreduce", "--num-pipeline-chunks", "x"],
    ["bench", "allreduce", "--impls", "bogus"],
    ["bench", "allreduce", "--backend", "nccl", "--world-size", "64"],
    ["bench", "ddp", "--variants", "bogus"],
    ["bench", "ddp", "--bucket-cap-mb", "-1"],
    ["bench", "ddp", "--batch-size", "0"],
    ["demo", "--world-size", "0"],
    ["demo", "--steps", "0"],
    ["grade", "nonexistent.ipynb"],
    ["grade", "/etc/passwd"],
    ["grade", "--timeout", "-1", "nonexistent.ipynb"],
    ["launch", "--nproc-per-node", "0", "train.py"],
]


def _torchelastic_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("torchelastic_")}


@pytest.mark.parametrize("argv", USER_ERRORS, ids=" ".join)
def test_a_command_line_mistake_is_one_line_exit_2_and_leaves_nothing(argv, tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    before = _torchelastic_dirs()
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse exits itself
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []  # no results folder, no files
    assert _torchelastic_dirs() <= before


def _raises_inside_a_rank() -> None:
    raise ValueError("a mistake inside the rank")


def test_an_error_raised_inside_a_rank_is_shown_once(monkeypatch, capsys):
    import argparse

    monkeypatch.setattr(cli, "build_parser", lambda: _one_command_parser(argparse))
    assert cli.main(["fail"]) == 1
    err = capsys.readouterr().err
    assert err.count("rank 0 raised ValueError: a mistake inside the rank") == 1
    assert err.count("Traceback") == 1  # the rank's own, not a second one around it


def _one_command_parser(argparse):
    parser = argparse.ArgumentParser(prog="dpcourse")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fail").set_defaults(
        func=lambda args: dpcourse.run(_raises_inside_a_rank, world_size=1, backend="gloo"))
    return parser
