"""Start the graded rank processes, serve their sockets round by round, and stop them.

The grader holds one end of a socket pair per rank, the ranks' only way to reach each other;
:class:`~dpcourse.grading.relay.MessageRelay` carries their messages. Under ``dpcourse grade``
each rank runs in a sandbox of its own (:mod:`dpcourse.grading.sandbox`): no network, a
scratch folder no other rank sees, and its socket an inherited file descriptor.

The processes themselves are the launcher's (:mod:`dpcourse.launch`): its work directory
(removed by the next launch or check should this process be killed outright), its rank
environment, its way to start a rank in a session of its own and to kill and reap a tree.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time

from dpcourse.grading import wire
from dpcourse.grading.relay import Failure, MessageRelay, Round, allowed_ops
from dpcourse.launch import reaper
from dpcourse.launch.env import worker_env
from dpcourse.launch.errors import signal_name
from dpcourse.launch.procs import Guard, start_rank
from dpcourse.launch.workdir import make_workdir

# Of the grader's environment, a rank gets only these. The machine's GPU settings (e.g.
# NVLink multicast switched off) hold for graded GPU ranks too.
_RANK_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_VISIBLE_DEVICES",
             "NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def _rank_env(tmp: str) -> dict:
    env = worker_env(keep=_RANK_ENV)
    env.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TMPDIR=tmp)
    return env


def _reported_error(rank: int, header: dict) -> Failure:
    """Return the error ``rank`` reported (its ``"error"`` message): the learner's code raised."""
    return Failure("error", str(header.get("text", "")), rank, str(header.get("exc_type", "")),
                   str(header.get("traceback", "")))


class World:
    """``size`` rank processes that load the learner's definitions once and run rounds.

    Args:
        size: how many rank processes (the largest world size of the check).
        setup: the message each rank gets first (check name, source cells, names).
        label: used in the work directory's name.
        sandbox: the :class:`~dpcourse.grading.sandbox.Sandbox` each rank starts in (with a
            scratch folder of its own), or ``None`` (the learner's own ``check()``).
        shared_folder: also give every rank one folder in common, ``self.shared``.
        dist_api, dist_why: the torch.distributed functions the exercise allows (the relay
            refuses any other operation), and what to say about another one.
    """

    def __init__(self, size: int, setup: dict, label: str = "check", sandbox=None,
                 shared_folder: bool = False, dist_api=(), dist_why: str = ""):
        self.allowed, self.why = allowed_ops(dist_api), dist_why
        self.tmp = make_workdir(label)
        self.procs, self.socks, self.readers, self.logs = [], [], [], []
        self.sandboxed = sandbox is not None
        # The one folder every rank sees, where the check asks for a shared disk.
        self.shared = os.path.join(self.tmp, "shared") if shared_folder else None
        self.guard: Guard | None = None
        try:
            self.guard = Guard(self.tmp)  # stops the ranks should this process be killed
            if self.shared:
                os.makedirs(self.shared)
            for rank in range(size):
                self._start(rank, setup, sandbox)
        except BaseException:
            self.close()
            raise

    def _start(self, rank: int, setup: dict, sandbox) -> None:
        mine, theirs = socket.socketpair()
        # The log stays in the grader's folder: the rank writes it through its stdout.
        self.logs.append(os.path.join(self.tmp, f"rank{rank}.log"))
        log = open(self.logs[rank], "wb")
        scratch = os.path.join(self.tmp, f"rank{rank}")
        os.makedirs(scratch)
        argv = [sys.executable, "-m", "dpcourse.grading.rank", str(theirs.fileno())]
        env = _rank_env(scratch)
        if sandbox is not None:
            argv = sandbox.command(argv, scratch, {k: v for k, v in env.items()
                                                   if k not in ("PYTHONPATH", "TMPDIR")},
                                   shared=(self.shared,) if self.shared else ())
        self.socks.append(mine)
        self.readers.append(wire.Reader())
        try:
            self.procs.append(start_rank(argv, env, scratch, pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT))
        finally:
            theirs.close()
            log.close()
        self.guard.watch(self.procs[rank].pid)
        mine.settimeout(10.0)
        mine.sendall(wire.encode(dict(setup, t="setup", rank=rank)))

    def _serve(self, ranks, deadline: float, handle, finished, on_timeout) -> Failure | None:
        """Hand each message from ``ranks`` to ``handle(rank, header, tensors)``; return the first
        :class:`Failure` (``handle``'s, a rank's error or its end), None once ``finished()``
        holds, or ``on_timeout()`` at ``deadline``."""
        with selectors.DefaultSelector() as sel:
            for rank in ranks:
                sel.register(self.socks[rank], selectors.EVENT_READ, rank)
            while (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(min(left, 0.5)):
                    rank = key.data
                    try:
                        data = self.socks[rank].recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        return self._died(rank)
                    try:
                        for header, tensors in self.readers[rank].feed(data):
                            failure = (_reported_error(rank, header) if header.get("t") == "error"
                                       else handle(rank, header, tensors))
                            if failure is not None:
                                return failure
                    except (wire.ProtocolError, KeyError, TypeError, ValueError) as exc:
                        return Failure("error", f"rank {rank} sent a message the grader does "
                                       f"not accept ({exc}).", rank, "ProtocolError")
                    if finished():
                        return None
        return on_timeout()

    def wait_ready(self, timeout: float) -> Failure | None:
        """Wait until every rank has loaded the definitions; return why not, or None."""
        ready: set[int] = set()

        def handle(rank, header, _):
            kind = header.get("t")
            if kind != "ready":
                return Failure("error", f"rank {rank} sent {str(kind)!r} before loading", rank,
                               "ProtocolError")
            ready.add(rank)
            return None

        def late():
            late = [str(r) for r in range(len(self.procs)) if r not in ready]
            return Failure("timeout", f"rank(s) {', '.join(late)} did not load your definitions "
                           f"within {timeout:g} s (top-level code that does not finish?).")
        return self._serve(range(len(self.procs)), time.monotonic() + timeout, handle,
                           lambda: len(ready) == len(self.procs), late)

    def run_round(self, world_size: int, inputs: list, timeout: float) -> Round:
        """Run one round on ranks ``0..world_size-1``, each given ``inputs[rank]``."""
        deadline = time.monotonic() + timeout
        out = Round(world_size, [None] * world_size, [[] for _ in range(world_size)])
        for rank in range(world_size):
            obj, tensors = wire.pack(inputs[rank])
            try:
                self.socks[rank].sendall(wire.encode(
                    {"t": "round", "rank": rank, "world_size": world_size, "inputs": obj},
                    tensors))
            except OSError:
                out.failure = self._died(rank)
                return out
        relay = MessageRelay(self.socks, out, self.stack, self.allowed, self.why)
        out.failure = self._serve(range(world_size), deadline, relay.handle,
                                  lambda: all(relay.done), lambda: relay.timeout_failure(timeout))
        return out

    def _died(self, rank: int) -> Failure:
        try:
            code = self.procs[rank].wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            what = "closed its connection"
        elif code >= 0:
            what = f"exited with status {code}"
        else:  # "signal SIGSEGV", or "signal 34" for one Python has no name for
            what = f"was killed by signal {signal_name(-code).removeprefix('signal ')}"
        with open(self.logs[rank], "rb") as f:
            tail = "\n".join(f.read()[-4000:].decode("utf-8", "replace").strip().splitlines()[-6:])
        return Failure("died", f"rank {rank} {what} during the check."
                       + (f"\nlast output of rank {rank}:\n{tail}" if tail else ""), rank)

    def stack(self, rank: int) -> str:
        """Ask rank ``rank`` for its Python stack (faulthandler on SIGUSR1) and return the dump."""
        path = self.logs[rank]
        pid = self.procs[rank].pid
        if self.sandboxed:  # the rank's pid in the grader's view, below bubblewrap's
            pid = reaper.find_below(pid, "dpcourse.grading.rank") or pid
        try:
            size = os.path.getsize(path)
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            return ""
        for _ in range(20):
            time.sleep(0.05)
            if os.path.getsize(path) > size:
                break
        time.sleep(0.1)
        with open(path, "rb") as f:
            f.seek(size)
            return f.read().decode("utf-8", "replace")

    def close(self) -> None:
        """Stop every rank (and anything they started), then the guard, and remove the work
        directory."""
        for sock in self.socks:
            sock.close()
        reaper.kill_tree([p.pid for p in self.procs])
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        if self.guard is not None:
            self.guard.done()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
