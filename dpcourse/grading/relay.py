"""The grader's side of one round: deliver the ranks' messages, compute their collectives,
and record per rank, in order, what it did and how many bytes it sent.

Graded ranks reach each other only through this relay (see :mod:`dpcourse.grading.shim`),
so it refuses every operation the exercise does not allow, whatever name the rank called it
by, and the checks judge structure from its record.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

import torch

from dpcourse.grading import wire
from dpcourse.grading.shim import COLLECTIVES, SHARDED
from dpcourse.launch.stacks import main_thread_frames


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


_REDUCE = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def allowed_ops(dist_api) -> set[str]:
    """Return the operations the relay carries for graded code that may call ``dist_api``."""
    api = set(dist_api)
    ops = api & {*COLLECTIVES, *SHARDED}
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

    def _log(self, rank: int, **event) -> None:
        self.out.events[rank].append(dict(event, case=self.case[rank]))

    def _reply(self, rank: int, ident: int, tensor=None) -> None:
        self.socks[rank].sendall(
            wire.encode({"t": "done", "id": ident}, [tensor] if tensor is not None else []))

    def handle(self, rank: int, header: dict, tensors: list) -> Failure | None:
        """Act on one message of ``rank``; return ``out.failure`` (set by a refused operation)."""
        kind = header.get("t")
        # Judged by the operation as it arrives: `type(dist).all_reduce` is refused all the same.
        op = str(header.get("op")) if kind == "coll" else kind
        if kind in ("send", "recv", "coll") and op not in self.allowed:
            self.out.failure = Failure(
                "error", f"torch.distributed.{op} is not available to graded code in this "
                f"exercise. {self.why}", rank, "AttributeError")
        elif kind == "send":
            dst = int(header["dst"])
            if not 0 <= dst < self.ws or dst == rank or len(tensors) != 1:
                raise wire.ProtocolError("bad send")
            self._log(rank, op="send", peer=dst, nbytes=_nbytes(tensors[0]))
            self.mail[(rank, dst, int(header.get("tag", 0)))].append(tensors[0])
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
        else:
            raise wire.ProtocolError(f"unknown message {kind!r}")
        return self.out.failure

    def _match(self, rank: int) -> None:
        still = []
        for src, tag, ident in self.recvs[rank]:
            box = self.mail[(src, rank, tag)]
            if box:
                t = box.popleft()
                self._log(rank, op="delivered", peer=src, nbytes=_nbytes(t))
                self._reply(rank, ident, t)
            else:
                still.append((src, tag, ident))
        self.recvs[rank] = still

    def _collective(self, rank: int, header: dict, tensors: list) -> None:
        seq = self.coll_seq[rank]
        self.coll_seq[rank] += 1
        op = str(header["op"])
        t = tensors[0] if tensors else None
        nbytes = _nbytes(t) if t is not None else 0
        if op == "all_gather_into_tensor":
            nbytes *= self.ws  # as CommTrace records it: the gathered (output) buffer
        self._log(rank, op=op, nbytes=nbytes, seq=seq, async_op=bool(header.get("async")))
        self.colls[seq][rank] = (header, t)
        if len(self.colls[seq]) < self.ws:
            return
        entries = self.colls.pop(seq)
        kinds = {(h["op"], h.get("reduce"), h.get("src"),
                  None if x is None else (str(x.dtype), tuple(x.shape)))
                 for h, x in entries.values()}
        if len(kinds) > 1:
            desc = "; ".join(f"rank {r}: {h['op']}" + (f" of {_nbytes(x)} bytes" if x is not None
                                                       else "")
                             for r, (h, x) in sorted(entries.items()))
            self.out.failure = Failure(
                "error", f"the ranks disagree on collective number {seq + 1}: {desc}. Every rank "
                "must issue the same collectives, in the same order, with tensors of the same "
                "size (with torch this hangs or corrupts data).", rank, "CollectiveMismatch")
            return
        inputs = [entries[r][1] for r in range(self.ws)]
        results = [None] * self.ws  # a barrier's reply carries no tensor
        if op == "all_reduce":
            results = [functools.reduce(_REDUCE[header.get("reduce", "sum")], inputs)] * self.ws
        elif op == "broadcast":
            results = [inputs[int(header.get("src", 0))]] * self.ws
        elif op == "all_gather_into_tensor":
            results = [torch.cat([x.reshape(-1) for x in inputs])] * self.ws
        elif op == "reduce_scatter_tensor":
            total = functools.reduce(torch.add, [x.reshape(-1) for x in inputs])
            if total.numel() % self.ws:
                raise wire.ProtocolError("reduce_scatter_tensor of a size not divisible by "
                                         "the world size")
            results = [chunk.clone() for chunk in total.chunk(self.ws)]
        for r, (h, _) in entries.items():
            self._reply(r, int(h["id"]), results[r])

    def timeout_failure(self, timeout: float) -> Failure:
        """Say, per unfinished rank, what it is waiting for."""
        lines = []
        for r in (r for r in range(self.ws) if not self.done[r]):
            doing = f" in case '{self.case[r]}'" if self.case[r] else ""
            pending = [s for s, e in self.colls.items() if r in e]
            if self.recvs[r]:
                what = (f"waiting in recv from rank {self.recvs[r][0][0]}, which never sent the "
                        "matching message")
            elif pending:
                seq = min(pending)
                missing = [x for x in range(self.ws) if x not in self.colls[seq]]
                what = (f"waiting in {self.colls[seq][r][0]['op']} (its collective number "
                        f"{seq + 1}), which rank(s) {', '.join(map(str, missing))} never issued")
            else:
                frames = [f for f in main_thread_frames(self.stack(r), ("dpcourse/",))
                          if f[0].startswith("<") and "frozen" not in f[0]]
                where = "; ".join(f"{f[0]} line {f[1]} in {f[2]}" for f in frames[:2])
                what = ("running your code, not waiting for any message (a loop that does not "
                        "end, or a sleep)" + (f": {where}" if where else ""))
            lines.append(f"rank {r}{doing}: {what}")
        return Failure("timeout", f"world size {self.ws}: not finished after {timeout:g} s.\n"
                       + "\n".join(lines))
