"""Run graded code on ranks the grader starts, and carry every message between them.

The grader process holds one end of a socket pair per rank; ranks have no
other way to reach each other through torch.distributed (see
:mod:`dpcourse.grading.shim`). This module delivers point-to-point messages,
computes collectives, counts each rank's bytes and keeps the order of
everything a rank did, so structure is judged from the grader's own record.
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from dpcourse.grading import procs, wire

_KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT")


@dataclass
class Failure:
    """Why a round did not finish: ``kind`` is ``"error"``, ``"timeout"`` or ``"died"``."""

    kind: str
    text: str
    rank: int | None = None
    exc_type: str = ""
    traceback: str = ""


@dataclass
class Round:
    """What one round produced: per-rank outputs and the grader's record of their messages."""

    world_size: int
    outputs: list = field(default_factory=list)
    events: list = field(default_factory=list)   # per rank: list of dicts, in order
    failure: Failure | None = None
    seconds: float = 0.0


def _env(tmp: str) -> dict:
    env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.update(PYTHONPATH=package_root, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TMPDIR=tmp, PYTHONUNBUFFERED="1")
    return env


def _reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op == "sum":
            out += t
        elif op == "product":
            out *= t
        elif op == "min":
            out = torch.minimum(out, t)
        else:
            out = torch.maximum(out, t)
    return out


class World:
    """``size`` rank processes that load the learner's definitions once and run rounds.

    Args:
        size: how many rank processes (the largest world size of the check).
        setup: the message each rank gets first (check name, source cells, names).
        label: used in temp-dir names.
    """

    def __init__(self, size: int, setup: dict, label: str = "check"):
        self.tmp = tempfile.mkdtemp(prefix=f"dpcourse-{label}-")
        self.procs, self.socks, self.readers, self.logs = [], [], [], []
        env = _env(self.tmp)
        for rank in range(size):
            mine, theirs = socket.socketpair()
            log = open(os.path.join(self.tmp, f"rank{rank}.log"), "wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "dpcourse.grading.rank", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, cwd=self.tmp, start_new_session=True)
            theirs.close()
            log.close()
            mine.settimeout(10.0)
            mine.sendall(wire.encode(dict(setup, t="setup", rank=rank)))
            self.procs.append(proc)
            self.socks.append(mine)
            self.readers.append(wire.Reader())
        self.loaded = [False] * size

    def wait_ready(self, timeout: float) -> Failure | None:
        """Wait until every rank has loaded the definitions; return why not, or None."""
        deadline = time.monotonic() + timeout
        ready = [False] * len(self.procs)
        sel = selectors.DefaultSelector()
        for rank, sock in enumerate(self.socks):
            sel.register(sock, selectors.EVENT_READ, rank)
        try:
            while not all(ready):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [r for r in range(len(ready)) if not ready[r]]
                    return Failure("timeout", f"rank(s) {', '.join(map(str, late))} did not load "
                                   f"your definitions within {timeout:g} s (top-level code that "
                                   "does not finish?).")
                for key, _ in sel.select(min(left, 0.5)):
                    rank = key.data
                    try:
                        data = self.socks[rank].recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        return self._died(rank)
                    try:
                        messages = self.readers[rank].feed(data)
                    except wire.ProtocolError as exc:
                        return Failure("error", f"rank {rank}: {exc}", rank, "ProtocolError")
                    for header, _ in messages:
                        if header.get("t") == "ready":
                            ready[rank] = True
                        elif header.get("t") == "error":
                            return Failure("error", str(header.get("text", "")), rank,
                                           str(header.get("exc_type", "")),
                                           str(header.get("traceback", "")))
                        else:
                            return Failure("error", f"rank {rank} sent "
                                           f"{str(header.get('t'))!r} before loading",
                                           rank, "ProtocolError")
        finally:
            sel.close()
        return None

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
        state = _Relay(self, out)
        deadline = t0 + timeout
        sel = selectors.DefaultSelector()
        for rank in range(world_size):
            sel.register(self.socks[rank], selectors.EVENT_READ, rank)
        try:
            while out.failure is None and not state.finished():
                left = deadline - time.monotonic()
                if left <= 0:
                    out.failure = state.timeout_failure(timeout)
                    break
                for key, _ in sel.select(min(left, 0.5)):
                    rank = key.data
                    try:
                        data = self.socks[rank].recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        out.failure = self._died(rank)
                        break
                    try:
                        for header, tensors in self.readers[rank].feed(data):
                            state.handle(rank, header, tensors)
                            if out.failure is not None:
                                break
                    except (wire.ProtocolError, KeyError, TypeError, ValueError) as exc:
                        out.failure = Failure("error", f"rank {rank} sent a message the grader "
                                              f"does not accept ({exc}).", rank,
                                              "ProtocolError")
                    if out.failure is not None:
                        break
        finally:
            sel.close()
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
        try:
            size = os.path.getsize(path)
            os.kill(self.procs[rank].pid, signal.SIGUSR1)
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


class _Relay:
    """Deliver one round's messages and record, per rank, what it did, in order."""

    def __init__(self, world: World, out: Round):
        self.world, self.out, self.ws = world, out, out.world_size
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
        self.world.socks[rank].sendall(
            wire.encode({"t": "done", "id": ident}, [tensor] if tensor is not None else []))

    def handle(self, rank: int, header: dict, tensors: list) -> None:
        kind = header.get("t")
        if rank >= self.ws:
            raise wire.ProtocolError("message from a rank outside the round")
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
            self.out.failure = Failure(
                "error", str(header.get("text", "")), rank, str(header.get("exc_type", "")),
                str(header.get("traceback", "")))
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
        from dpcourse.launch.stacks import main_thread_frames

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
                frames = [f for f in main_thread_frames(self.world.stack(r), ("dpcourse/",))
                          if f[0].startswith("<") and "frozen" not in f[0]]
                where = "; ".join(f"{f[0]} line {f[1]} in {f[2]}" for f in frames[:2])
                what = ("running your code, not waiting for any message (a loop that does not "
                        "end, or a sleep)" + (f": {where}" if where else ""))
            lines.append(f"rank {r}{doing}: {what}")
        return Failure("timeout", f"world size {self.ws}: not finished after {timeout:g} s.\n"
                       + "\n".join(lines))
