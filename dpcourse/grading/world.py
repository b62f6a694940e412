"""Run graded code on ranks the grader starts, and carry every message between them.

The grader holds one end of a socket pair per rank; ranks have no other way to
reach each other through torch.distributed (see :mod:`dpcourse.grading.shim`).
Under ``dpcourse grade`` each rank runs in a sandbox of its own
(:mod:`dpcourse.grading.sandbox`): no network, a scratch folder no other rank
sees, and its socket an inherited file descriptor. :class:`World` starts and
stops the ranks and reads their sockets; :class:`MessageRelay` delivers
point-to-point messages, computes collectives, and records per rank, in order,
what it did and how many bytes it sent: the checks judge structure from that record.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from dpcourse.grading import wire
from dpcourse.launch import reaper
from dpcourse.launch.env import package_root
from dpcourse.launch.stacks import main_thread_frames


@dataclass
class Failure:
    """Why a round did not finish: ``kind`` is ``"error"``, ``"timeout"`` or ``"died"``."""

    kind: str
    text: str
    rank: int | None = None
    exc_type: str = ""
    traceback: str = ""

    @classmethod
    def reported(cls, rank: int, header: dict) -> "Failure":
        """The error a rank reported (its ``"error"`` message)."""
        return cls("error", str(header.get("text", "")), rank, str(header.get("exc_type", "")),
                   str(header.get("traceback", "")))


@dataclass
class Round:
    """What one round produced: per-rank outputs and the grader's record of their messages."""

    world_size: int
    outputs: list = field(default_factory=list)
    events: list = field(default_factory=list)   # per rank: list of dicts, in order
    failure: Failure | None = None
    seconds: float = 0.0


_REDUCE = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}


def _reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        out = _REDUCE[op](out, t)
    return out


def allowed_ops(dist_api) -> set[str]:
    """The operations the relay carries for graded code that may use ``dist_api``.

    Applied to the operation as it arrives, whatever name the rank called it by
    (``type(dist).all_reduce`` is refused all the same).
    """
    api = set(dist_api)
    ops = api & {"all_reduce", "broadcast", "barrier", "all_gather_into_tensor",
                 "reduce_scatter_tensor"}
    if api & {"send", "isend", "batch_isend_irecv"}:
        ops.add("send")
    if api & {"recv", "irecv", "batch_isend_irecv"}:
        ops.add("recv")
    return ops


class MessageRelay:
    """Deliver one round's messages and record, per rank, what it did, in order.

    Args:
        socks: the grader's end of each rank's socket.
        out: the round being recorded.
        stack: ``stack(rank)`` returns the rank's Python stack (for hang reports).
        allowed: the operations graded code may issue (:func:`allowed_ops`); any other
            fails the round, and nothing of it is computed or delivered.
        why: what to say when a rank issues another one.
    """

    def __init__(self, socks: list, out: Round, stack, allowed=frozenset(), why: str = ""):
        self.socks, self.stack, self.out, self.ws = socks, stack, out, out.world_size
        self.allowed, self.why = set(allowed), why
        self.mail = collections.defaultdict(collections.deque)   # (src, dst, tag) -> tensors
        self.recvs = [[] for _ in range(self.ws)]                 # pending (src, tag, id)
        self.coll_seq = [0] * self.ws
        self.colls = collections.defaultdict(dict)               # seq -> rank -> (header, t)
        self.done = [False] * self.ws
        self.case = [""] * self.ws

    def finished(self) -> bool:
        return all(self.done)

    def _log(self, rank: int, **event) -> None:
        event["case"] = self.case[rank]
        self.out.events[rank].append(event)

    def _reply(self, rank: int, ident: int, tensor=None) -> None:
        self.socks[rank].sendall(
            wire.encode({"t": "done", "id": ident}, [tensor] if tensor is not None else []))

    def handle(self, rank: int, header: dict, tensors: list) -> None:
        kind = header.get("t")
        if rank >= self.ws:
            raise wire.ProtocolError("message from a rank outside the round")
        op = str(header.get("op")) if kind == "coll" else kind
        if kind in ("send", "recv", "coll") and op not in self.allowed:
            self.out.failure = Failure(
                "error", f"torch.distributed.{op} is not available to graded code in this "
                f"exercise. {self.why}", rank, "AttributeError")
            return
        if kind == "send":
            dst = int(header["dst"])
            if not 0 <= dst < self.ws or dst == rank or len(tensors) != 1:
                raise wire.ProtocolError("bad send")
            t = tensors[0]
            self._log(rank, op="send", peer=dst, nbytes=t.numel() * t.element_size())
            self.mail[(rank, dst, int(header.get("tag", 0)))].append(t)
            self._match(dst)
        elif kind == "recv":
            src = int(header["src"])
            if not 0 <= src < self.ws or src == rank:
                raise wire.ProtocolError("bad recv")
            self._log(rank, op="recv", peer=src)
            self.recvs[rank].append((src, int(header.get("tag", 0)), int(header["id"])))
            self._match(rank)
        elif kind == "coll":
            self._collective(rank, header, tensors)
        elif kind == "wait":
            self._log(rank, op="wait", what=str(header.get("what", "")))
        elif kind == "mark":
            self._log(rank, op="mark", label=str(header.get("label", "")))
        elif kind == "begin":
            self.case[rank] = str(header.get("case", ""))
            self._log(rank, op="begin", label=self.case[rank])
        elif kind == "result":
            self.out.outputs[rank] = wire.unpack(header.get("outputs"), tensors)
            self.done[rank] = True
        elif kind == "error":
            self.out.failure = Failure.reported(rank, header)
        else:
            raise wire.ProtocolError(f"unknown message {kind!r}")

    def _match(self, rank: int) -> None:
        still = []
        for src, tag, ident in self.recvs[rank]:
            box = self.mail[(src, rank, tag)]
            if box:
                t = box.popleft()
                self._log(rank, op="delivered", peer=src, nbytes=t.numel() * t.element_size())
                self._reply(rank, ident, t)
            else:
                still.append((src, tag, ident))
        self.recvs[rank] = still

    def _collective(self, rank: int, header: dict, tensors: list) -> None:
        seq = self.coll_seq[rank]
        self.coll_seq[rank] += 1
        op = str(header["op"])
        t = tensors[0] if tensors else None
        nbytes = t.numel() * t.element_size() if t is not None else 0
        if op == "all_gather_into_tensor":
            nbytes *= self.ws  # as CommTrace records it: the gathered (output) buffer
        self._log(rank, op=op, nbytes=nbytes, seq=seq, async_op=bool(header.get("async")))
        self.colls[seq][rank] = (header, t)
        if len(self.colls[seq]) < self.ws:
            return
        entries = self.colls.pop(seq)
        kinds = {(h["op"], h.get("reduce"), h.get("src"),
                  None if x is None else (str(x.dtype), tuple(x.shape))) for h, x in entries.values()}
        if len(kinds) > 1:
            desc = "; ".join(f"rank {r}: {h['op']}" + (f" of {x.numel() * x.element_size()} "
                                                       f"bytes" if x is not None else "")
                             for r, (h, x) in sorted(entries.items()))
            self.out.failure = Failure(
                "error", f"the ranks disagree on collective number {seq + 1}: {desc}. Every rank "
                "must issue the same collectives, in the same order, with tensors of the same "
                "size (with torch this hangs or corrupts data).", rank, "CollectiveMismatch")
            return
        if op == "all_reduce":
            result = _reduce(header.get("reduce", "sum"), [entries[r][1] for r in range(self.ws)])
        elif op == "broadcast":
            result = entries[int(header.get("src", 0))][1]
        elif op == "all_gather_into_tensor":
            result = torch.cat([entries[r][1].reshape(-1) for r in range(self.ws)])
        elif op == "reduce_scatter_tensor":
            total = _reduce("sum", [entries[r][1].reshape(-1) for r in range(self.ws)])
            if total.numel() % self.ws:
                raise wire.ProtocolError("reduce_scatter_tensor of a size not divisible by "
                                         "the world size")
            chunks = total.chunk(self.ws)
            for r, (h, _) in entries.items():
                self._reply(r, int(h["id"]), chunks[r].clone())
            return
        else:
            result = None
        for r, (h, _) in entries.items():
            self._reply(r, int(h["id"]), result)

    def timeout_failure(self, timeout: float) -> Failure:
        lines = []
        waiting = [r for r in range(self.ws) if not self.done[r]]
        for r in waiting:
            doing = f" in case '{self.case[r]}'" if self.case[r] else ""
            if self.recvs[r]:
                src = self.recvs[r][0][0]
                what = (f"waiting in recv from rank {src}, which never sent the matching "
                        "message")
            elif any(r in e for e in self.colls.values()):
                seq = min(s for s, e in self.colls.items() if r in e)
                op = self.colls[seq][r][0]["op"]
                missing = [x for x in range(self.ws) if x not in self.colls[seq]]
                what = (f"waiting in {op} (its collective number {seq + 1}), which rank(s) "
                        f"{', '.join(map(str, missing))} never issued")
            else:
                frames = [f for f in main_thread_frames(self.stack(r), ("dpcourse/",))
                          if f[0].startswith("<") and "frozen" not in f[0]]
                where = "; ".join(f"{f[0]} line {f[1]} in {f[2]}" for f in frames[:2])
                what = ("running your code, not waiting for any message (a loop that does not "
                        "end, or a sleep)" + (f": {where}" if where else ""))
            lines.append(f"rank {r}{doing}: {what}")
        return Failure("timeout", f"world size {self.ws}: not finished after {timeout:g} s.\n"
                       + "\n".join(lines))


_KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT", "CUDA_VISIBLE_DEVICES")
# The machine's GPU settings (e.g. NVLink multicast switched off) hold for graded GPU ranks too.
_KEEP_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def _env(tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k in _KEEP_ENV or k.startswith(_KEEP_PREFIXES)}
    env.update(PYTHONPATH=package_root(), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TMPDIR=tmp, PYTHONUNBUFFERED="1")
    return env


class World:
    """``size`` rank processes that load the learner's definitions once and run rounds.

    Args:
        size: how many rank processes (the largest world size of the check).
        setup: the message each rank gets first (check name, source cells, names).
        label: used in temp-dir names.
        sandbox: the :class:`~dpcourse.grading.sandbox.Sandbox` each rank starts in (with a
            scratch folder of its own), or ``None`` (the learner's own ``check()``).
        shared_folder: also give every rank one folder in common, ``self.shared``.
        dist_api, dist_why: the torch.distributed functions the exercise allows (the relay
            refuses any other operation), and what to say about another one.
    """

    def __init__(self, size: int, setup: dict, label: str = "check", sandbox=None,
                 shared_folder: bool = False, dist_api=(), dist_why: str = ""):
        self.allowed, self.why = allowed_ops(dist_api), dist_why
        self.tmp = tempfile.mkdtemp(prefix=f"dpcourse-{label}-")
        self.procs, self.socks, self.readers = [], [], []
        self.sandboxed = sandbox is not None
        # The one folder every rank sees, where the check asks for a shared disk.
        self.shared = os.path.join(self.tmp, "shared") if shared_folder else None
        if self.shared:
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

    def _serve(self, ranks, deadline: float, handle, finished, on_timeout) -> Failure | None:
        """Hand each message from ``ranks`` to ``handle(rank, header, tensors)`` until it returns
        a :class:`Failure`, ``finished()`` holds (None), a rank stops or ``deadline`` passes."""
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
                            failure = handle(rank, header, tensors)
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
            if kind == "error":
                return Failure.reported(rank, header)
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
        relay = MessageRelay(self.socks, out, self.stack, self.allowed, self.why)

        def handle(rank, header, tensors):
            relay.handle(rank, header, tensors)
            return out.failure
        out.failure = self._serve(range(world_size), t0 + timeout, handle, relay.finished,
                                  lambda: relay.timeout_failure(timeout))
        out.seconds = time.monotonic() - t0
        return out

    def _died(self, rank: int) -> Failure:
        try:
            code = self.procs[rank].wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        what = ("closed its connection" if code is None else f"exited with status {code}"
                if code >= 0 else f"was killed by signal {signal.Signals(-code).name}")
        with open(os.path.join(self.tmp, f"rank{rank}.log"), "rb") as f:
            tail = "\n".join(f.read()[-4000:].decode("utf-8", "replace").strip().splitlines()[-6:])
        return Failure("died", f"rank {rank} {what} during the check."
                       + (f"\nlast output of rank {rank}:\n{tail}" if tail else ""), rank)

    def stack(self, rank: int) -> str:
        """Ask rank ``rank`` for its Python stack (faulthandler on SIGUSR1) and return the dump."""
        path = os.path.join(self.tmp, f"rank{rank}.log")
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
        """Stop every rank (and anything they started) and remove the temp dir."""
        for sock in self.socks:
            sock.close()
        reaper.kill_tree([p.pid for p in self.procs])
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
