"""A pure-Python simulation of ring all-reduce, step by step, for pictures and widgets.

It follows exactly the schedule of :func:`dpcourse.comm.ring_all_reduce` (it asks
:func:`dpcourse.comm.ring.ring_step_chunks` and :func:`~dpcourse.comm.shard_range`
which chunk moves where), but runs in one process on plain numbers, so every
intermediate state can be shown: which chunk each rank sends, receives and holds,
and which ranks' inputs each held chunk already contains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpcourse.comm.ring import PHASES, ring_step_chunks
from dpcourse.comm.sharding import shard_range


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a ring step."""

    src: int
    dst: int
    chunk: int
    nbytes: int


@dataclass(frozen=True)
class RingFrame:
    """The state of every rank after one ring step.

    Attributes:
        phase: ``"start"``, ``"reduce_scatter"`` or ``"all_gather"``.
        step: step index inside the phase (0 for ``"start"``).
        messages: what was sent during this step (empty for ``"start"``).
        data: ``data[r]`` is rank ``r``'s flat array after the step.
        contributors: ``contributors[r][c]`` is the set of ranks whose inputs chunk
            ``c`` of rank ``r`` contains (all ranks: the chunk is fully reduced).
    """

    phase: str
    step: int
    messages: tuple[Message, ...]
    data: tuple[np.ndarray, ...]
    contributors: tuple[tuple[frozenset, ...], ...]

    def chunk(self, rank: int, index: int) -> np.ndarray:
        """Return chunk ``index`` of rank ``rank``'s data."""
        start, end = shard_range(len(self.data[rank]), len(self.data), index)
        return self.data[rank][start:end]

    def is_reduced(self, rank: int, index: int) -> bool:
        """Whether chunk ``index`` on ``rank`` already holds the sum over every rank."""
        return len(self.contributors[rank][index]) == len(self.data)


def simulate_ring(inputs) -> list[RingFrame]:
    """Run ring all-reduce on ``inputs`` in one process; return the state after every step.

    Args:
        inputs: one equal-length 1-D sequence (or numpy array) per rank.

    Returns:
        ``2 (N - 1) + 1`` frames: the start, then each reduce-scatter step, then each
        all-gather step. The last frame's data is the elementwise sum on every rank.
    """
    data = [np.array(x, copy=True).reshape(-1) for x in inputs]
    n = len(data)
    if n < 1:
        raise ValueError("simulate_ring needs the inputs of at least one rank.")
    if len({d.shape[0] for d in data}) != 1:
        raise ValueError("every rank must hold the same number of elements, "
                         "as with dist.all_reduce.")
    numel, itemsize = data[0].shape[0], data[0].itemsize
    owners = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    frames = [_frame("start", 0, (), data, owners)]
    for phase in PHASES:
        for step in range(n - 1):
            # Every rank sends before anyone adds: read all outgoing chunks first,
            # as the real ring's simultaneous send/receive does.
            outgoing = []
            for r in range(n):
                send_chunk, _ = ring_step_chunks(r, n, phase, step)
                s0, s1 = shard_range(numel, n, send_chunk)
                outgoing.append((send_chunk, data[r][s0:s1].copy(), owners[r][send_chunk]))
            messages = []
            for r in range(n):
                src = (r - 1) % n
                chunk, payload, who = outgoing[src]
                assert chunk == ring_step_chunks(r, n, phase, step)[1]
                r0, r1 = shard_range(numel, n, chunk)
                if phase == "reduce_scatter":
                    data[r][r0:r1] += payload
                    owners[r][chunk] = owners[r][chunk] | who
                else:
                    data[r][r0:r1] = payload
                    owners[r][chunk] = who
                messages.append(Message(src, r, chunk, (r1 - r0) * itemsize))
            frames.append(_frame(phase, step, tuple(messages), data, owners))
    return frames


def _frame(phase, step, messages, data, owners) -> RingFrame:
    return RingFrame(phase, step, messages, tuple(d.copy() for d in data),
                     tuple(tuple(o) for o in owners))


def messages_of(frames: list[RingFrame], rank: int) -> dict[str, list[tuple[int, int]]]:
    """Return the ``(peer, nbytes)`` lists rank ``rank`` sends and receives, in order.

    Empty chunks are left out, as the real ring does not post empty messages.

    Args:
        frames: the output of :func:`simulate_ring`.
        rank: which rank.

    Returns:
        ``{"send": [(dst, nbytes), ...], "recv": [(src, nbytes), ...]}``.
    """
    out = {"send": [], "recv": []}
    for frame in frames:
        for m in frame.messages:
            if m.nbytes == 0:
                continue
            if m.src == rank:
                out["send"].append((m.dst, m.nbytes))
            if m.dst == rank:
                out["recv"].append((m.src, m.nbytes))
    return out
