"""What a learner sees when ranks fail: an exception, a death, a hang, Ctrl-C, a dead launcher.

Every test also checks that no worker process is left behind (``no_leaked_processes``)
and the caller stays usable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from proc_helpers import live_children, wait_gone

import dpcourse
from dpcourse import RankDiedError, RankError, RankTimeoutError
from dpcourse.launch.procs import Launch
from dpcourse.launch.workdir import LaunchSpec
from dpcourse.launch.launcher import _loopback_store, _serialize_call

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

HANG_TIMEOUT = 3.0


def raise_on_rank_1():
    t = torch.ones(2)
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 is inside all_reduce by now
        raise ValueError("bad batch on rank 1")
    dist.all_reduce(t)  # waits for rank 1, which never comes
    return t


def test_rank_raises():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        dpcourse.run(raise_on_rank_1, world_size=2, backend="gloo", timeout=120)
    err = info.value
    assert time.monotonic() - start < 60  # reported when it happened, not at the timeout
    assert (err.rank, err.exc_type, err.message) == (1, "ValueError", "bad batch on rank 1")
    msg = str(err)
    assert msg.startswith("rank 1 raised ValueError: bad batch on rank 1")
    assert 'raise ValueError("bad batch on rank 1")' in msg and "in raise_on_rank_1" in msg
    assert "worker.py" not in msg  # the traceback starts at the learner's function
    # The cause is reported, not the peer's echo of it.
    assert "onnection" not in msg and "rank 0" not in msg


def kill_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    t = torch.ones(2)
    dist.all_reduce(t)
    return t


def test_rank_killed_by_a_signal():
    with pytest.raises(RankDiedError) as info:
        dpcourse.run(kill_rank_1, world_size=2, backend="gloo", timeout=120)
    assert info.value.rank == 1 and info.value.returncode == -signal.SIGKILL
    assert "rank 1 was killed by SIGKILL (9)" in str(info.value)
    assert "out-of-memory" in str(info.value)


def abort_while_shutting_down():
    # Stand-in for the gloo abort at interpreter exit: the rank returns its result,
    # then its process dies while tearing the process group down.
    dist.destroy_process_group = lambda *a, **k: os.abort()
    return dist.get_rank()


def test_rank_that_fails_after_returning_is_reported():
    with pytest.raises(RankDiedError) as info:
        dpcourse.run(abort_while_shutting_down, world_size=2, backend="gloo", timeout=120)
    assert info.value.returned and info.value.returncode == -signal.SIGABRT
    assert "returned its result, but then its process was killed by SIGABRT" in str(info.value)


def uneven_batches():
    batches = 3 if dist.get_rank() == 0 else 2  # rank 0 has one more batch than rank 1
    for _ in range(batches):
        grad = torch.ones(4)
        dist.all_reduce(grad)  # line named in the timeout message
    return batches


def mismatched_calls():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.recv(t, src=0)
    return t


def python_loop_on_rank_1():
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.01)
    dist.barrier()


def ok():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _line_of(fn, text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _hang(fn) -> RankTimeoutError:
    with pytest.raises(RankTimeoutError) as info:
        dpcourse.run(fn, world_size=2, backend="gloo", timeout=HANG_TIMEOUT)
    return info.value


def test_uneven_batches_time_out_naming_the_waiting_rank():
    err = _hang(uneven_batches)
    assert (err.waiting, err.finished) == ([0], [1])
    msg = str(err)
    line = _line_of(uneven_batches, "dist.all_reduce(grad)")
    assert msg.startswith(f"timed out after {HANG_TIMEOUT:g} s: rank(s) 0 were still waiting "
                          "(rank(s) 1 had returned).")
    assert ("rank 0: in torch.distributed all_reduce (a collective or point-to-point call), "
            f"called from test_faults.py:{line} in uneven_batches") in msg
    assert "--- where rank 0 was waiting" in msg and f"line {line} in uneven_batches" in msg
    assert "Every worker has been stopped" in msg
    # The caller is still usable.
    assert dpcourse.run(ok, world_size=2, backend="gloo") == [2.0, 2.0]


def test_mismatched_calls_time_out_showing_both_calls():
    err = _hang(mismatched_calls)
    assert (err.waiting, err.finished) == ([0, 1], [])
    msg = str(err)
    assert "rank 0: in torch.distributed all_reduce" in msg
    assert "rank 1: in torch.distributed recv" in msg


def test_rank_stuck_in_python_code_is_told_apart_from_a_collective():
    err = _hang(python_loop_on_rank_1)
    msg = str(err)
    assert "rank 0: in torch.distributed barrier" in msg
    line = _line_of(python_loop_on_rank_1, "time.sleep(0.01)")
    assert (f"rank 1: running Python code at test_faults.py:{line} in python_loop_on_rank_1 "
            "(not inside a torch.distributed call") in msg


def pid_then_sleep():
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(600)


def test_workers_exit_when_their_stdin_closes():
    """The portable parent-death signal: EOF on stdin (the launcher is still alive here)."""
    store = _loopback_store()
    spec = LaunchSpec(call=_serialize_call(pid_then_sleep, (), {}), world_size=2, backend="gloo",
                      host="127.0.0.1", port=store.port, prefix="t", timeout=60.0,
                      pg_timeout=60.0, sys_path=list(sys.path))
    launch = Launch(spec, 60.0, prefix_output=True)
    try:
        launch.start()
        deadline = time.monotonic() + 120
        while not launch.joined() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launch.joined()
        for proc in launch.procs:
            proc.stdin.close()
        codes = [proc.wait(timeout=30) for proc in launch.procs]
        assert codes == [3, 3]  # EXIT_PARENT_DIED
    finally:
        launch.stop()
        del store


LAUNCHER = """
import os, time, dpcourse

def pid_then_sleep():  # defined in __main__: travels by value
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(600)

dpcourse.run(pid_then_sleep, world_size=2, backend="gloo", timeout=600)
"""


def test_workers_exit_when_the_launcher_is_killed():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        pids = []
        for line in launcher.stdout:
            if "] pid " in line:
                pids.append(int(line.split()[-1]))
            if len(pids) == 2:
                break
        assert len(pids) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert wait_gone(pids, timeout=15) == []
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


KERNEL_SETUP = """
import os, time
import torch, torch.distributed as dist
import dpcourse

def hello(n):
    t = torch.ones(n)
    dist.all_reduce(t)
    print(f"hello from rank {dist.get_rank()}")
    return t.sum().item()

def stuck():
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(600)
"""


def _execute(kc, code: str, timeout: float = 180, on_output=None):
    """Run a cell; return (reply content, text printed to stdout, stderr)."""
    msg_id = kc.execute(code)
    out, err = [], []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            (out if msg["content"]["name"] == "stdout" else err).append(msg["content"]["text"])
            if on_output:
                on_output("".join(out))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:  # skip replies to earlier requests (e.g. wait_for_ready's kernel_info)
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(out), "".join(err)


def test_jupyter_kernel_cell_functions_output_and_interrupt():
    jupyter_client = pytest.importorskip("jupyter_client")
    import psutil

    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=os.path.dirname(os.path.abspath(__file__)))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        reply, _, _ = _execute(kc, KERNEL_SETUP)
        assert reply["status"] == "ok", reply
        # A function defined in a cell works, and what the ranks print lands in the cell.
        reply, out, _ = _execute(kc, "print(dpcourse.run(hello, 3, world_size=2, backend='gloo'))")
        assert reply["status"] == "ok", reply
        assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
        assert "[6.0, 6.0]" in out

        # Interrupt a long run once both ranks are in their function.
        kernel = psutil.Process(km.provisioner.process.pid)

        def interrupt_when_started(text):
            if text.count("] pid ") == 2 and not interrupted:
                interrupted.append(True)
                km.interrupt_kernel()

        interrupted = []
        reply, out, _ = _execute(kc, "dpcourse.run(stuck, world_size=2, backend='gloo')",
                                 on_output=interrupt_when_started)
        assert interrupted and reply["status"] == "error"
        assert reply["ename"] == "KeyboardInterrupt"
        pids = [int(line.split()[-1]) for line in out.splitlines() if "] pid " in line]
        assert len(pids) == 2 and wait_gone(pids, timeout=5) == []
        assert live_children(kernel) == []

        # The kernel still works.
        reply, out, _ = _execute(kc, "print(dpcourse.run(hello, 1, world_size=2, backend='gloo'))")
        assert reply["status"] == "ok", reply
        assert "[2.0, 2.0]" in out
        assert live_children(kernel) == []
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


SOAK_MAX, SOAK_SECONDS, SOAK_MIN = 100, 45.0, 5


def collectives_then_tensors(i):
    rank = dist.get_rank()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.arange(10.0) * i if rank == 0 else torch.zeros(10)
    dist.broadcast(b, src=0)
    return t, b  # tensors gloo worked on, returned: the setting of the abort at exit


def test_soak_up_to_100_launches_leave_nothing_behind(monkeypatch, record_property):
    """Up to 100 two-rank launches in a row: as many as fit in 45 s (at least 5).

    100 do not fit in a minute on two cores: a launch costs two fresh interpreters
    importing torch (~1.3 s of CPU each, nothing else measurable), so about 25 fit
    on two idle cores. Over all of them: every launch returns the right tensors
    after gloo collectives (no abort at worker exit, nothing retried), and
    afterwards no process, listening socket, file descriptor, thread or temporary
    directory is left.
    """
    import tempfile
    import threading

    import psutil

    import dpcourse.launch.workdir

    workdirs, real_mkdtemp = [], tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        workdirs.append(real_mkdtemp(*args, **kwargs))
        return workdirs[-1]

    monkeypatch.setattr(dpcourse.launch.workdir.tempfile, "mkdtemp", mkdtemp)
    me = psutil.Process()
    dpcourse.run(collectives_then_tensors, 0, world_size=2, backend="gloo")  # warm imports
    fds, threads = me.num_fds(), threading.active_count()
    start, n = time.monotonic(), 0
    while n < SOAK_MAX and (n < SOAK_MIN or time.monotonic() - start < SOAK_SECONDS):
        n += 1
        results = dpcourse.run(collectives_then_tensors, n, world_size=2, backend="gloo")
        for t, b in results:
            torch.testing.assert_close(t, torch.full((1000,), 3.0))
            torch.testing.assert_close(b, torch.arange(10.0) * n)
    elapsed = time.monotonic() - start
    record_property("launches", n)
    record_property("seconds_per_launch", round(elapsed / n, 2))
    print(f"{n} launches, {elapsed / n:.2f} s each")
    assert live_children() == []
    assert [c for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN] == []
    assert me.num_fds() == fds
    assert threading.active_count() == threads
    assert len(workdirs) == n + 1 and not any(os.path.exists(d) for d in workdirs)
