"""Run graded code on ranks the grader starts, and carry every message between them.

The grader process holds one end of a socket pair per rank; ranks have no
other way to reach each other through torch.distributed (see
:mod:`dpcourse.grading.shim`). Under ``dpcourse grade`` each rank runs in a
sandbox of its own (:mod:`dpcourse.grading.sandbox`): no network, and a scratch
folder no other rank sees; its end of the socket pair is an inherited file
descriptor, which needs no network. This module starts and stops the ranks and reads
their sockets; :mod:`dpcourse.grading.relay` delivers point-to-point messages,
computes collectives, counts each rank's bytes and keeps the order of
everything a rank did, so structure is judged from the grader's own record.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

from dpcourse.grading import procs, wire
from dpcourse.grading.relay import Failure, MessageRelay, Round, allowed_ops

_KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT", "CUDA_VISIBLE_DEVICES")
# The machine's GPU settings (e.g. NVLink multicast switched off) hold for graded GPU ranks too.
_KEEP_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def _env(tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k in _KEEP_ENV or k.startswith(_KEEP_PREFIXES)}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.update(PYTHONPATH=package_root, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TMPDIR=tmp, PYTHONUNBUFFERED="1")
    return env


class World:
    """``size`` rank processes that load the learner's definitions once and run rounds.

    Args:
        size: how many rank processes (the largest world size of the check).
        setup: the message each rank gets first (check name, source cells, names).
        label: used in temp-dir names.
        sandbox: a :class:`~dpcourse.grading.sandbox.Sandbox` to start each rank in (with a
            scratch folder of its own), or ``None`` for plain processes (the learner's
            own ``check()``).
        shared_folder: also give every rank one folder in common, ``self.shared``.
        dist_api, dist_why: the torch.distributed functions the exercise allows, and what
            to say about another one: the relay refuses any other operation.
    """

    def __init__(self, size: int, setup: dict, label: str = "check", sandbox=None,
                 shared_folder: bool = False, dist_api=(), dist_why: str = ""):
        self.allowed, self.why = allowed_ops(dist_api), dist_why
        self.tmp = tempfile.mkdtemp(prefix=f"dpcourse-{label}-")
        self.procs, self.socks, self.readers, self.logs = [], [], [], []
        self.sandboxed = sandbox is not None
        self.shared = None
        if shared_folder:  # the one folder every rank sees (the check asked for a shared disk)
            self.shared = os.path.join(self.tmp, "shared")
            os.makedirs(self.shared)
        for rank in range(size):
            mine, theirs = socket.socketpair()
            # The log stays in the grader's folder: the rank writes it through its stdout.
            log = open(os.path.join(self.tmp, f"rank{rank}.log"), "wb")
            scratch = os.path.join(self.tmp, f"rank{rank}")
            os.makedirs(scratch)
            argv = [sys.executable, "-m", "dpcourse.grading.rank", str(theirs.fileno())]
            env = _env(scratch)
            if sandbox is not None:
                argv = sandbox.command(argv, scratch, {k: v for k, v in env.items()
                                                       if k not in ("PYTHONPATH", "TMPDIR")},
                                       shared=(self.shared,) if self.shared else ())
            proc = subprocess.Popen(
                argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, cwd=scratch, start_new_session=True)
            theirs.close()
            log.close()
            mine.settimeout(10.0)
            mine.sendall(wire.encode(dict(setup, t="setup", rank=rank)))
            self.procs.append(proc)
            self.socks.append(mine)
            self.readers.append(wire.Reader())
        self.loaded = [False] * size

    def _arrivals(self, ranks, deadline: float):
        """Yield each rank of ``ranks`` that has bytes to read, until ``deadline`` passes."""
        sel = selectors.DefaultSelector()
        for rank in ranks:
            sel.register(self.socks[rank], selectors.EVENT_READ, rank)
        try:
            while (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(min(left, 0.5)):
                    yield key.data
        finally:
            sel.close()

    def _read(self, rank: int, bufsize: int) -> list | Failure:
        """Return the messages from ``rank`` now complete (maybe none), or why it stopped."""
        try:
            data = self.socks[rank].recv(bufsize)
        except OSError:
            data = b""
        if not data:
            return self._died(rank)
        try:
            return self.readers[rank].feed(data)
        except wire.ProtocolError as exc:
            return Failure("error", f"rank {rank} sent a message the grader does not accept "
                           f"({exc}).", rank, "ProtocolError")

    def wait_ready(self, timeout: float) -> Failure | None:
        """Wait until every rank has loaded the definitions; return why not, or None."""
        ready = [False] * len(self.procs)
        with contextlib.closing(self._arrivals(range(len(ready)),
                                               time.monotonic() + timeout)) as arrivals:
            for rank in arrivals:
                got = self._read(rank, 1 << 16)
                if isinstance(got, Failure):
                    return got
                for header, _ in got:
                    kind = header.get("t")
                    if kind == "error":
                        return Failure("error", str(header.get("text", "")), rank,
                                       str(header.get("exc_type", "")),
                                       str(header.get("traceback", "")))
                    if kind != "ready":
                        return Failure("error", f"rank {rank} sent {str(kind)!r} before loading",
                                       rank, "ProtocolError")
                    ready[rank] = True
                if all(ready):
                    return None
        late = [r for r in range(len(ready)) if not ready[r]]
        return Failure("timeout", f"rank(s) {', '.join(map(str, late))} did not load your "
                       f"definitions within {timeout:g} s (top-level code that does not finish?).")

    # -- rounds ---------------------------------------------------------------
    def run_round(self, world_size: int, inputs: list, timeout: float) -> Round:
        """Run one round on ranks ``0..world_size-1``, each given ``inputs[rank]``."""
        t0 = time.monotonic()
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
        state = MessageRelay(self.socks, out, self.stack, self.allowed, self.why)
        with contextlib.closing(self._arrivals(range(world_size), t0 + timeout)) as arrivals:
            for rank in arrivals:
                got = self._read(rank, 1 << 20)
                if isinstance(got, Failure):
                    out.failure = got
                    break
                try:
                    for header, tensors in got:
                        state.handle(rank, header, tensors)
                        if out.failure is not None:
                            break
                except (wire.ProtocolError, KeyError, TypeError, ValueError) as exc:
                    out.failure = Failure("error", f"rank {rank} sent a message the grader does "
                                          f"not accept ({exc}).", rank, "ProtocolError")
                if out.failure is not None or state.finished():
                    break
            else:  # the deadline passed
                out.failure = state.timeout_failure(timeout)
        out.seconds = time.monotonic() - t0
        return out

    def _died(self, rank: int) -> Failure:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        what = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and
                code < 0 else f"exited with status {code}" if code is not None
                else "closed its connection")
        tail = self.log_tail(rank)
        return Failure("died", f"rank {rank} {what} during the check."
                       + (f"\nlast output of rank {rank}:\n{tail}" if tail else ""), rank)

    def log_tail(self, rank: int, lines: int = 6) -> str:
        try:
            with open(os.path.join(self.tmp, f"rank{rank}.log"), "rb") as f:
                text = f.read()[-4000:].decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def stack(self, rank: int) -> str:
        """Ask rank ``rank`` for its Python stack (faulthandler on SIGUSR1) and return the dump."""
        path = os.path.join(self.tmp, f"rank{rank}.log")
        pid = self.procs[rank].pid
        if self.sandboxed:  # the rank's pid in the grader's view, below bubblewrap's
            pid = procs.find_below(pid, "dpcourse.grading.rank") or pid
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
        """Stop every rank (and anything they started) and remove the temp dir."""
        for sock in self.socks:
            try:
                sock.close()
            except OSError:
                pass
        procs.kill_tree([p.pid for p in self.procs])
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


