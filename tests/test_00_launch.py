"""dpcourse.run: results, output relay, loopback-only rendezvous, concurrent launches, bad input.

Rank functions live at module level so that the worker processes can import
them by reference (tests/ is on sys.path); assertions run in the parent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import psutil
import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse import RankError

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

LINES = 20000  # ~1.5 MB per stream and rank: far more than a pipe buffer (64 KiB)


def _listening(pid: int) -> list[tuple[str, int]]:
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
                  if c.status == psutil.CONN_LISTEN)


def report(offset, *, scale):
    """Print a lot on both streams, all-reduce, and describe the rank's surroundings."""
    rank = dist.get_rank()
    for i in range(LINES):
        print(f"out {rank} {i:05d} " + "x" * 60)
        print(f"err {rank} {i:05d}", file=sys.stderr)
    sys.stdout.write("no newline at the end")  # must not glue to the next rank's line
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {
        "rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "value": offset + scale * rank, "sum": t, "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
        "launcher_listens": _listening(os.getppid()), "rank_listens": _listening(os.getpid()),
    }


@pytest.fixture(scope="module")
def reports():
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        results = dpcourse.run(report, 10, scale=100, world_size=2, backend="gloo", timeout=120)
    return results, out.getvalue(), err.getvalue()


def test_results_come_back_in_rank_order(reports):
    results, _, _ = reports
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["value"] for r in results] == [10, 110]
    for r in results:
        assert r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["env"]["RANK"] == str(r["rank"]) and r["env"]["WORLD_SIZE"] == "2"
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
        torch.testing.assert_close(r["sum"], torch.full((3,), 3.0))  # 1 + 2
        assert r["sum"].device.type == "cpu"
        assert r["threads"] == max(1, (os.cpu_count() or 1) // 2)


def test_output_of_each_rank_is_relayed_in_order(reports):
    _, out, err = reports
    for rank in (0, 1):
        mine = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] out ")]
        assert mine == [f"[rank {rank}] out {rank} {i:05d} " + "x" * 60 for i in range(LINES)]
        mine = [line for line in err.splitlines() if line.startswith(f"[rank {rank}] err ")]
        assert mine == [f"[rank {rank}] err {rank} {i:05d}" for i in range(LINES)]
        assert f"[rank {rank}] no newline at the end" in out.splitlines()


def test_rendezvous_and_gloo_listen_on_loopback_only(reports):
    results, _, _ = reports
    # The launcher's TCPStore is its only listening socket during the run.
    launcher = results[0]["launcher_listens"]
    assert launcher and all(ip == "127.0.0.1" for ip, _ in launcher), launcher
    for r in results:
        assert r["rank_listens"] and all(ip == "127.0.0.1" for ip, _ in r["rank_listens"])
    # Nothing is left listening once the run is over.
    assert _listening(os.getpid()) == []


def port_and_sum(tag):
    t = torch.ones(2)
    dist.all_reduce(t)
    return tag, int(os.environ["MASTER_PORT"]), t


def test_two_launches_at_once_do_not_collide():
    out = {}

    def launch(world_size):
        out[world_size] = dpcourse.run(port_and_sum, f"ws{world_size}", world_size=world_size,
                                       backend="gloo", timeout=120)

    threads = [threading.Thread(target=launch, args=(ws,)) for ws in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [1, 2]
    for ws, results in out.items():
        assert len(results) == ws
        assert {tag for tag, _, _ in results} == {f"ws{ws}"}
        for _, _, t in results:
            torch.testing.assert_close(t, torch.full((2,), float(ws)))
    assert out[1][0][1] != out[2][0][1]  # separate rendezvous ports


def lock_on_rank_1():
    return threading.Lock() if dist.get_rank() == 1 else 0


def test_result_that_cannot_be_sent_back():
    with pytest.raises(RankError) as info:
        dpcourse.run(lock_on_rank_1, world_size=2, backend="gloo", timeout=60)
    assert info.value.rank == 1
    assert "cannot be sent back" in str(info.value)
    assert "Return tensors, numbers, strings, lists or dicts" in str(info.value)


def test_function_the_workers_cannot_import():
    # A function pickled by reference to a module that exists only in this process
    # (cloudpickle sends importable functions by name).
    ghost = types.ModuleType("dpcourse_ghost_module")
    exec("def f():\n    return 1\n", ghost.__dict__)  # noqa: S102 - a module made here
    sys.modules[ghost.__name__] = ghost
    try:
        with pytest.raises(RankError) as info:
            dpcourse.run(ghost.f, world_size=1, backend="gloo", timeout=60)
    finally:
        del sys.modules[ghost.__name__]
    msg = str(info.value)
    assert info.value.phase == "load" and "ModuleNotFoundError" in msg
    assert "dpcourse_ghost_module" in msg and "define it in the notebook" in msg


def noop():
    return None


_LOCK = threading.Lock()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"world_size": 0}, ValueError, ["world_size must be at least 1, got 0"]),
    ({"world_size": -2}, ValueError, ["at least 1"]),
    ({"world_size": 2.0}, TypeError, ["world_size must be an int"]),
    ({"world_size": True}, TypeError, ["world_size must be an int"]),
    ({"backend": "mpi"}, ValueError, ["unknown backend 'mpi'", "'gloo'", "'nccl'"]),
    ({"backend": "nccl", "world_size": torch.cuda.device_count() + 1}, ValueError,
     ["one GPU per rank", "backend='gloo'"]),
    ({"timeout": 0}, ValueError, ["timeout must be a positive number of seconds"]),
    ({"timeout": -5}, ValueError, ["positive number"]),
    ({"timeout": None}, ValueError, ["positive number"]),
    ({"timeout": "60"}, ValueError, ["positive number"]),
], ids=["ws0", "ws-2", "ws-float", "ws-bool", "backend", "nccl-too-many", "t0", "t-neg",
        "t-none", "t-str"])
def test_bad_settings_are_explained(kwargs, error, words):
    with pytest.raises(error) as info:
        dpcourse.run(noop, **kwargs)
    for w in words:
        assert w in str(info.value)


def test_unsendable_function_or_argument_is_explained(tmp_path):
    with pytest.raises(TypeError) as info:
        dpcourse.run(lambda: _LOCK.locked() or threading.Lock() is _LOCK, world_size=1)
    assert "cannot be sent to the worker processes" in str(info.value)
    assert "inside the function" in str(info.value)
    with open(tmp_path / "data.txt", "w") as f, pytest.raises(TypeError) as info:
        dpcourse.run(noop_with_arg, f, world_size=1)
    assert "'noop_with_arg' or its arguments cannot be sent" in str(info.value)
    with pytest.raises(TypeError, match="needs a function"):
        dpcourse.run("not a function", world_size=1)


def noop_with_arg(x):
    return None


def cuda_sum():
    t = torch.ones(2, device=f"cuda:{dist.get_rank()}")
    dist.all_reduce(t)
    return dist.get_backend(), torch.cuda.current_device(), t


@pytest.mark.gpu(1)
def test_nccl_launch_after_cuda_is_initialised_here():
    torch.zeros(1, device="cuda")  # CUDA now initialised in the launching process
    assert torch.cuda.is_initialized()
    n = min(2, torch.cuda.device_count())
    results = dpcourse.run(cuda_sum, world_size=n, backend="nccl", timeout=120)
    for rank, (backend, device, t) in enumerate(results):
        assert backend == "nccl" and device == rank
        torch.testing.assert_close(t, torch.full((2,), float(n)))


def test_worker_entry_point_imports_nothing_heavy():
    """A rank's only heavy import is torch (when it joins the group): starting is ~1 s, not more."""
    code = ("import sys, dpcourse.launch.worker; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'numpy', 'matplotlib', 'ipywidgets', 'IPython', 'cloudpickle'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


TEARDOWN = """
import atexit, sys
import torch, torch.distributed as dist
from dpcourse.launch.teardown import destroy_and_exit
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
atexit.register(print, "interpreter finalized")
print("summed", t.tolist())  # not flushed here: a pipe buffers it
if sys.argv[1] == "broken":
    def broken():
        raise RuntimeError("destroy failed")
    dist.destroy_process_group = broken
destroy_and_exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("case, code, status", [("ok", 0, 0), ("ok", 5, 5), ("broken", 0, 1)])
def test_destroy_and_exit_flushes_and_skips_finalization(case, code, status):
    """A rank ends with its output flushed, its status kept, atexit skipped, a failed destroy shown."""
    proc = subprocess.run([sys.executable, "-c", TEARDOWN, case, str(code)], capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    assert proc.returncode == status, proc.stderr[-2000:]
    assert "summed [1.0, 1.0, 1.0]" in proc.stdout
    assert "interpreter finalized" not in proc.stdout
    assert ("destroy failed" in proc.stderr) == (case == "broken")
