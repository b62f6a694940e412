"""CommTrace: record every collective and point-to-point call a rank makes.

Lessons use it to count all-reduces and bytes on the wire; checks use it to
assert structure (the ring uses only sends and receives, one all-reduce per
bucket, nothing inside ``no_sync``, the first all-reduce before backward ends).

It works by temporarily replacing the functions in ``torch.distributed`` with
thin wrappers, so it sees calls made by the learner's code, by ``dpcourse``
and by ``batch_isend_irecv``. It does not see collectives that PyTorch issues
from C++ (torch DDP's reducer).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# op name -> (positional index, keyword) of the tensor whose size is recorded.
# For gathers and scatters that is the full (N x chunk) buffer.
TRACED_OPS = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
    "isend": (0, "tensor"),
    "irecv": (0, "tensor"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_gather": (1, "tensor"),
    "reduce_scatter": (0, "output"),
    "all_to_all_single": (1, "input"),
    "barrier": (None, None),
}
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


@dataclass
class CommEvent:
    """One recorded call.

    Attributes:
        op: the ``torch.distributed`` function name, e.g. ``"all_reduce"`` or ``"isend"``.
        nbytes: bytes of the recorded tensor (0 for barrier).
        start: seconds since the trace began when the call was issued.
        end: seconds since the trace began when it completed: on return for a blocking
            call, at ``wait()`` for an async one (``None`` if never waited). On GPU
            these are host times: the kernels may still run after ``end``.
        async_op: whether the call returned a work handle.
        peer: the destination or source rank for point-to-point calls.
    """

    op: str
    nbytes: int
    start: float
    end: float | None
    async_op: bool = False
    peer: int | None = None


class _TracedWork:
    """A work handle that notes when it was waited on."""

    def __init__(self, work, event: CommEvent, t0: float):
        self._work, self._event, self._t0 = work, event, t0

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if self._event.end is None:
            self._event.end = time.perf_counter() - self._t0
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _tensor_arg(args, kwargs, spec):
    pos, key = spec
    if pos is None:
        return None
    if key in kwargs:
        t = kwargs[key]
    elif len(args) > pos:
        t = args[pos]
    else:
        return None
    if isinstance(t, (list, tuple)):  # all_gather / reduce_scatter take lists
        return sum(x.numel() * x.element_size() for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else None


class CommTrace:
    """Record the collectives issued inside a ``with`` block on this rank.

    Example::

        with CommTrace() as trace:
            ring_all_reduce(t)
        trace.count("isend"), trace.bytes_sent()

    Attributes:
        events: the recorded :class:`CommEvent` list, in issue order.
        marks: ``(label, seconds since start)`` pairs added with :meth:`mark`.
    """

    def __init__(self):
        self.events: list[CommEvent] = []
        self.marks: list[tuple[str, float]] = []
        self._saved: dict[str, object] = {}
        self._t0 = 0.0
        # Per thread (autograd runs GPU hooks on its own threads): how deep we are
        # inside traced calls. torch's blocking ``send`` calls ``isend`` itself, and
        # only the outermost call is the learner's.
        self._depth = threading.local()

    # -- recording -------------------------------------------------------
    def now(self) -> float:
        """Seconds since the trace began (the time base of every event)."""
        return time.perf_counter() - self._t0

    def mark(self, label: str) -> float:
        """Record a named instant (e.g. ``"backward_end"``) on the trace's clock; return it."""
        t = self.now()
        self.marks.append((label, t))
        return t

    def _wrap(self, name, original):
        spec = TRACED_OPS[name]

        def traced(*args, **kwargs):
            if getattr(self._depth, "n", 0):
                return original(*args, **kwargs)
            nbytes = _tensor_arg(args, kwargs, spec) or 0
            peer = None
            if name in POINT_TO_POINT:
                peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
                if peer is None:
                    peer = kwargs.get("group_dst", kwargs.get("group_src"))
            event = CommEvent(name, int(nbytes), self.now(), None, peer=peer)
            self.events.append(event)
            self._depth.n = 1
            try:
                work = original(*args, **kwargs)
            finally:
                self._depth.n = 0
            if work is None:
                event.end = self.now()
                return work
            event.async_op = True
            return _TracedWork(work, event, self._t0)

        traced.__wrapped__ = original
        traced.__name__ = name
        return traced

    def __enter__(self) -> "CommTrace":
        self._t0 = time.perf_counter()
        for name in TRACED_OPS:
            original = getattr(c10d, name)
            self._saved[name] = original
            wrapped = self._wrap(name, original)
            # Both namespaces: P2POp checks ``op in [isend, irecv]`` against c10d's globals.
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._saved.clear()

    # -- queries -----------------------------------------------------------
    def of(self, op: str | None = None) -> list[CommEvent]:
        """Events of one op name (all events if ``op`` is None)."""
        return [e for e in self.events if op is None or e.op == op]

    def count(self, op: str | None = None) -> int:
        """Number of calls of ``op`` (of any op if None)."""
        return len(self.of(op))

    def bytes(self, op: str | None = None) -> int:
        """Total recorded bytes of ``op`` (of every op if None)."""
        return sum(e.nbytes for e in self.of(op))

    def bytes_sent(self) -> int:
        """Bytes this rank sent point to point (``send`` + ``isend``)."""
        return self.bytes("send") + self.bytes("isend")

    def bytes_received(self) -> int:
        """Bytes this rank received point to point (``recv`` + ``irecv``)."""
        return self.bytes("recv") + self.bytes("irecv")

    def collective_ops(self) -> set[str]:
        """Names of the non point-to-point ops that were called."""
        return {e.op for e in self.events if e.op not in POINT_TO_POINT}

    def summary(self) -> dict[str, dict[str, int]]:
        """``{op: {"count": n, "bytes": b}}`` for every op seen, for printing in lessons."""
        out: dict[str, dict[str, int]] = {}
        for e in self.events:
            row = out.setdefault(e.op, {"count": 0, "bytes": 0})
            row["count"] += 1
            row["bytes"] += e.nbytes
        return out

    def to_records(self) -> list[dict]:
        """Events as plain dicts (picklable, for returning from a rank to the notebook)."""
        return [dict(op=e.op, nbytes=e.nbytes, start=e.start, end=e.end,
                     async_op=e.async_op, peer=e.peer) for e in self.events]
