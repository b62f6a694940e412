"""Run a function on several ranks from a notebook, a script or a test.

``dpcourse.run(fn, *args)`` starts one fresh Python process per rank, joins
them into a process group and returns what each rank's ``fn`` returned. It is
built so that the usual ways multi-process code fails in Jupyter cannot reach
the learner:

* the function travels by value (cloudpickle), so a function defined in a
  notebook cell works, and workers are fresh interpreters (never forked), so
  CUDA initialised in the notebook does not matter;
* rendezvous is a TCP store owned by the launching process on loopback, bound
  to a port the operating system picked: two launches never collide;
* a rank that raises, dies or hangs stops every rank, and the error names the
  rank and shows its traceback (or, for a hang, where each rank was waiting);
* a worker exits by itself when the launching process dies.
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from dpcourse.errors import RankDiedError, RankError, RankTimeoutError

DEFAULT_TIMEOUT = 120.0
LOOPBACK = "127.0.0.1"


def resolve_backend(backend: str = "auto", world_size: int | None = None) -> tuple[str, int]:
    """Pick the backend and world size the way :func:`run` does.

    Args:
        backend: ``"auto"`` (nccl when every rank can have its own GPU, else gloo),
            ``"gloo"`` or ``"nccl"``.
        world_size: number of ranks; ``None`` means one per GPU with nccl, else 2.

    Returns:
        ``(backend, world_size)``.
    """
    import torch

    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'gloo' (CPU) or 'nccl' (GPU).")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}.")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= 1 and (world_size is None or world_size <= gpus) else "gloo"
    if world_size is None:
        world_size = gpus if backend == "nccl" else 2
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: world_size={world_size} but "
            f"{gpus} GPU(s) are visible. Use world_size<={gpus}, or backend='gloo' to run on CPU."
        )
    return backend, world_size


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    stack: list = field(default_factory=list)
    done: bool = False


def _user_frames(dump: str) -> str:
    """Keep the main thread of a faulthandler dump, without the launcher's own frames."""
    if "Current thread" in dump:
        dump = dump[dump.index("Current thread"):]
    keep = [line for line in dump.splitlines()
            if "dpcourse/_worker.py" not in line and "<frozen runpy>" not in line]
    return "\n".join(keep)


def _pump(rank: int, stream, name: str, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put((rank, name, line))
    stream.close()


def _serialize_call(fn, args, kwargs) -> bytes:
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"run() needs a function to call on every rank, got {type(fn).__name__}.")
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"the function {getattr(fn, '__name__', fn)!r} or its arguments cannot be sent to the "
            f"worker processes ({type(exc).__name__}: {exc}). Pass plain data (tensors, numbers, "
            "lists, dicts) and create open files, locks, generators or process groups inside the "
            "function instead."
        ) from exc


class _Launch:
    """One launch: processes, output relay, result collection, cleanup."""

    def __init__(self, spec: dict, timeout: float, prefix_output: bool):
        self.spec, self.timeout, self.prefix_output = spec, timeout, prefix_output
        self.workdir = tempfile.mkdtemp(prefix="dpcourse-")
        self.lines: queue.Queue = queue.Queue()
        self.ranks: list[_Rank] = []
        self.threads: list[threading.Thread] = []
        self.collecting_stacks = False

    def start(self) -> None:
        with open(os.path.join(self.workdir, "payload.pkl"), "wb") as f:
            pickle.dump(self.spec, f)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        for rank in range(self.spec["world_size"]):
            proc = subprocess.Popen(
                [sys.executable, "-m", "dpcourse._worker", self.workdir, str(rank)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, errors="replace", env=env, cwd=os.getcwd(),
                # Own session: a terminal Ctrl-C reaches only us, and we stop the
                # ranks ourselves; killpg also takes any process a rank started.
                start_new_session=True,
            )
            self.ranks.append(_Rank(rank, proc))
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                t = threading.Thread(target=_pump, args=(rank, stream, name, self.lines), daemon=True)
                t.start()
                self.threads.append(t)

    def relay(self, show: bool = True) -> None:
        """Print what the ranks wrote (from the calling thread, so Jupyter shows it in the cell)."""
        while True:
            try:
                rank, name, line = self.lines.get_nowait()
            except queue.Empty:
                return
            r = self.ranks[rank]
            if name == "stderr":
                r.stderr_tail.append(line)
                if self.collecting_stacks:
                    r.stack.append(line)
                    continue
            if show:
                stream = sys.stdout if name == "stdout" else sys.stderr
                stream.write(f"[rank {rank}] {line}" if self.prefix_output else line)

    def read_result(self, rank: int) -> dict | None:
        path = os.path.join(self.workdir, f"rank{rank}.result")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def _scan(self) -> tuple[list, list]:
        errors, died = [], []
        for r in self.ranks:
            code = r.proc.poll()
            if code is None or r.done:
                continue
            res = self.read_result(r.rank)
            if res is None:
                died.append(r)
            elif res["ok"] and code == 0:
                r.done = True
            elif res["ok"]:
                died.append(r)  # returned, but the process then failed: still a real failure
            else:
                errors.append((res["time"], r.rank, res))
        return errors, died

    def failure(self) -> BaseException | None:
        """The error to report if some rank failed: the cause, not the echo on its peers."""
        errors, died = self._scan()
        if not errors and not died:
            return None
        # A rank that raised or died makes its peers fail too ("connection reset"):
        # give the cause a moment to be reaped, then prefer a dead rank, else the first error.
        time.sleep(0.3)
        more_errors, more_died = self._scan()
        errors, died = errors + more_errors, died + more_died
        self.relay(show=False)
        if died:
            r = died[0]
            return RankDiedError(r.rank, r.proc.returncode, "".join(r.stderr_tail))
        _, rank, res = min(errors, key=lambda e: e[:2])
        return RankError(rank, res["type"], res["message"], res["traceback"])

    def dump_stacks(self) -> dict[int, str]:
        """Ask every unfinished rank for its Python stacks (faulthandler on SIGUSR1)."""
        waiting = [r for r in self.ranks if r.proc.poll() is None]
        self.relay()
        self.collecting_stacks = True
        for r in waiting:
            try:
                r.proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            time.sleep(0.05)
            self.relay(show=False)
        return {r.rank: _user_frames("".join(r.stack)) for r in waiting}

    def stop(self) -> None:
        """Kill every rank (and anything it started) and release all resources."""
        for r in self.ranks:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    r.proc.kill()
        for r in self.ranks:
            r.proc.wait()
            if r.proc.stdin:
                r.proc.stdin.close()
        for t in self.threads:
            t.join(timeout=2)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def wait(self) -> list:
        deadline = time.monotonic() + self.timeout
        while True:
            self.relay()
            err = self.failure()
            if err is not None:
                raise err
            if all(r.done for r in self.ranks):
                self.relay()
                return [self.read_result(r.rank)["value"] for r in self.ranks]
            if time.monotonic() > deadline:
                stacks = self.dump_stacks()
                waiting = sorted(stacks)
                finished = [r.rank for r in self.ranks if r.rank not in stacks]
                raise RankTimeoutError(waiting, finished, self.timeout, stacks)
            time.sleep(0.02)


def run(fn, *args, world_size: int | None = None, backend: str = "auto",
        timeout: float = DEFAULT_TIMEOUT, prefix_output: bool = True, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a fresh process group; return per-rank results.

    Args:
        fn: the function each rank calls. It may be defined in a notebook cell; it
            runs after ``torch.distributed`` is initialised, so it can call
            ``dist.get_rank()`` and collectives directly.
        *args, **kwargs: passed to ``fn`` on every rank (sent by value).
        world_size: number of ranks; default one per GPU with nccl, else 2.
        backend: ``"auto"`` (nccl when every rank gets its own GPU, else gloo),
            ``"gloo"`` or ``"nccl"``. With nccl, rank ``r`` uses ``cuda:r``.
        timeout: seconds before a run that has not finished is treated as a hang.
        prefix_output: prefix what each rank prints with ``[rank r]``.

    Returns:
        A list with one entry per rank: what ``fn`` returned there, tensors moved to CPU.

    Raises:
        RankError: a rank raised; names the rank and carries its traceback.
        RankDiedError: a rank's process ended without a result (e.g. killed by a signal).
        RankTimeoutError: ranks still running after ``timeout`` s; names them and shows their stacks.
    """
    backend, world_size = resolve_backend(backend, world_size)
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    call = _serialize_call(fn, args, kwargs)

    import torch.distributed as dist

    # The launching process owns the rendezvous: bound to loopback on a port the
    # OS chose, so nothing outside this machine can join and launches never collide.
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    spec = {"call": call, "world_size": world_size, "backend": backend, "host": LOOPBACK,
            "port": store.port, "prefix": "dpcourse", "timeout": float(timeout),
            "sys_path": list(sys.path)}
    launch = _Launch(spec, float(timeout), prefix_output)
    try:
        launch.start()
        return launch.wait()
    finally:
        launch.stop()
        del store
