"""Run the kernels' schedule (:mod:`dpcourse.comm.kernels.schedule`) on a model of the machine.

The model holds what the kernels touch, per rank: the input tensor, the
symmetric buffer and the signal pad. A seeded scheduler picks, at every
step, one step that can run, of any block of any rank (a ``send`` into a
full flag slot or a ``wait`` on an empty one spins), the way the GPUs give
no order between ranks. A block's steps run in order, except a barrier's
sends (and then its waits), which run in any order: the kernel gives each
peer's flag its own thread (:func:`runnable`). With ``release=False`` flags
are set with relaxed atomics: a block's stores to symmetric buffers stay
pending until the scheduler lets them land, so a peer can see a flag before
the data it announces.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from dpcourse.comm.kernels.schedule import Step, half_offset, one_shot_plan, two_shot_plan


@dataclass
class Machine:
    """What the kernels touch: per-rank input, symmetric buffer and signal pad, and a log."""

    inputs: list[list[float]]
    buffers: list[list[float]]
    # flags[rank][(block, peer)]: the flag that block ``block`` of ``rank`` waits on for ``peer``
    flags: list[dict] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    # Stores to symmetric buffers that a block has issued but peers cannot see yet:
    # pending[(rank, block)] = [(target rank, index, value), ...] (only with release=False)
    pending: dict = field(default_factory=dict)

    def __post_init__(self):
        self.flags = self.flags or [{} for _ in self.inputs]

    def pad_is_clear(self) -> bool:
        """Return whether every flag is 0 again (the pad can serve the next call)."""
        return all(v == 0 for f in self.flags for v in f.values())


def is_ready(m: Machine, s: Step) -> bool:
    """Return whether ``s`` can run now: a send into a full slot or a wait on an empty one spins."""
    if s.op == "send":
        return m.flags[s.target].get((s.block, s.rank), 0) == 0
    if s.op == "wait":
        return m.flags[s.rank].get((s.block, s.peer), 0) == 1
    return True


def runnable(m: Machine, queue: list[Step]) -> list[int]:
    """Return the positions in a block's ``queue`` of the steps that can run now.

    The first step, if it is ready; but when the queue starts with a barrier's
    sends (or its waits), any of them that is ready: each peer's flag has a
    thread of its own, so they go in any order and a thread that spins holds
    up no other. The waits begin only once every send is done.
    """
    if not queue:
        return []
    head = queue[0].op
    if head not in ("send", "wait"):
        return [0] if is_ready(m, queue[0]) else []
    lanes = list(itertools.takewhile(lambda s: s.op == head, queue))
    return [i for i, s in enumerate(lanes) if is_ready(m, s)]


def drain(m: Machine, rank: int, block: int, count: int | None = None) -> None:
    """Make ``count`` (default: all) of a block's pending stores visible, in issue order."""
    queue = m.pending.get((rank, block), [])
    for target, i, value in queue[:count]:
        m.buffers[target][i] = value
    del queue[:count]


def _store(m: Machine, s: Step, target: int, i: int, value: float, weak: bool) -> None:
    if weak:  # a relaxed store: it reaches memory whenever the scheduler drains it
        m.pending.setdefault((s.rank, s.block), []).append((target, i, value))
    else:
        m.buffers[target][i] = value


def _load(m: Machine, s: Step, source: int, i: int) -> float:
    # A block sees its own stores in program order, even those still pending.
    for target, j, value in reversed(m.pending.get((s.rank, s.block), [])):
        if (target, j) == (source, i):
            return value
    return m.buffers[source][i]


def apply_step(m: Machine, s: Step, kind: str, release: bool = True) -> None:
    """Apply one step to the machine and log it.

    With ``release=False`` the flag is set with a relaxed atomic: the block's
    earlier stores to symmetric buffers may still be in flight when a peer
    sees the flag (they stay pending until the scheduler drains them).
    """
    world, off, weak = len(m.inputs), s.offset, not release
    x = m.inputs[s.rank]
    if s.op == "send":  # compare-and-swap the peer's flag 0 -> 1
        if release:  # release: every store this block issued before is visible first
            drain(m, s.rank, s.block)
        m.flags[s.target][(s.block, s.rank)] = 1
    elif s.op == "wait":  # acquire: compare-and-swap this rank's flag 1 -> 0
        m.flags[s.rank][(s.block, s.peer)] = 0
    elif s.op == "copy":
        for i in s.elements:
            _store(m, s, s.rank, off + i, x[i], weak)
    elif s.op == "reduce" and kind == "one_shot":
        for i in s.elements:
            x[i] = sum(_load(m, s, p, off + i) for p in range(world))
    elif s.op == "reduce":  # two-shot: own slice from the input, the peers' from their buffers
        for i in s.elements:
            x[i] = sum(x[i] if p == s.rank else _load(m, s, p, off + i) for p in range(world))
    elif s.op == "push":
        for i in s.elements:
            _store(m, s, s.target, off + i, x[i], weak)
    elif s.op == "copy_out":
        for i in s.elements:
            x[i] = _load(m, s, s.rank, off + i)
    where = f" [{s.index.start}:{s.index.stop})" if s.index is not None else ""
    m.log.append(f"rank {s.rank} block {s.block}: {s.op}"
                 + (f" peer {s.peer}" if s.peer is not None else "") + where
                 + (" (second half of the buffer)" if off else ""))


def simulate(inputs: list[list[float]], kind="one_shot", *, calls: int = 1,
             block: int = 4, max_blocks: int = 2, barrier: bool = True, seed: int = 0,
             double_buffer: bool = True, fixed_halves: bool = True, release: bool = True,
             next_inputs=None) -> tuple[Machine, list]:
    """Run ``calls`` back-to-back all-reduces through the simulated kernels; return the results.

    Each rank runs its calls in stream order (call ``c + 1`` starts once all of
    its blocks finished call ``c``), but ranks are not held together: a rank
    may start its next call while a peer is still in the previous one. At
    every step a seeded scheduler picks one ready block of any rank.

    Args:
        inputs: one list of numbers per rank, all the same length (call 0's inputs).
        kind: ``"one_shot"`` or ``"two_shot"``, or a list with one of them per call.
        calls: back-to-back calls; call ``c`` starts from ``next_inputs(c, rank)``
            (default: the original inputs again), whose length may change from call
            to call (as gradient buckets do).
        block, max_blocks: elements per tile and the grid-size cap.
        barrier: include the signal-pad barrier (``False`` shows the race).
        seed: scheduler seed.
        double_buffer: calls alternate between two halves of the workspace
            (``False``: one region, reused by every call, which races for one-shot).
        fixed_halves: the halves have a fixed size (``False``: half ``c % 2`` starts
            at ``n`` elements, the size of the call, so calls of different sizes overlap).
        release: set flags with release semantics (``False``: relaxed, so a
            peer may see the flag before the stores it was meant to announce).
        next_inputs: ``fn(call, rank) -> list`` for the inputs of each call.

    Returns:
        ``(machine, results)``: ``results[c][r]`` is rank ``r``'s tensor after call ``c``.

    Raises:
        RuntimeError: no block can move (a deadlock).
    """
    kinds = [kind] * calls if isinstance(kind, str) else list(kind)
    if len(kinds) != calls or any(k not in ("one_shot", "two_shot") for k in kinds):
        raise ValueError(f"kind must be 'one_shot', 'two_shot' or a list of them per call, "
                         f"got {kind!r}.")
    world = len(inputs)
    next_inputs = next_inputs or (lambda c, r: list(inputs[r]))
    sizes = [len(next_inputs(c, 0)) for c in range(calls)]
    if any(len(next_inputs(c, r)) != sizes[c] for c in range(calls) for r in range(world)):
        raise ValueError("every rank must pass the same number of elements.")
    half_len = max(sizes)

    def plan_of(c):
        n = sizes[c]
        off = (half_offset(c, half_len) if fixed_halves else (c % 2) * n) if double_buffer else 0
        make = one_shot_plan if kinds[c] == "one_shot" else two_shot_plan
        return make(n, world, block, max_blocks, barrier, off)

    m = Machine([next_inputs(0, r) for r in range(world)],
                [[float("nan")] * (2 * half_len) for _ in range(world)])
    rng = random.Random(seed)
    call = [0] * world
    results: list[list] = [[None] * world for _ in range(calls)]
    queues = [_queues(plan_of(0), r) for r in range(world)]
    while True:
        ready: list[tuple[int, int, int | None]] = []
        for r in range(world):
            if not any(queues[r].values()) and call[r] < calls:
                for pid in queues[r]:  # the kernel has ended: all its stores are visible
                    drain(m, r, pid)
                results[call[r]][r] = list(m.inputs[r])  # the rank's call is complete
                call[r] += 1
                if call[r] < calls:  # stream order: its next call starts now
                    m.inputs[r][:] = next_inputs(call[r], r)
                    queues[r] = _queues(plan_of(call[r]), r)
            ready += [(r, b, i) for b, q in queues[r].items() for i in runnable(m, q)]
            ready += [(r, b, None) for (rr, b), q in m.pending.items() if rr == r and q]
        if not ready:
            if all(c == calls for c in call):
                return m, results
            raise RuntimeError("deadlock: every live block is spinning on a flag.")
        r, b, i = rng.choice(ready)
        if i is None:  # one in-flight store of block b reaches memory
            drain(m, r, b, 1)
        else:
            apply_step(m, queues[r][b].pop(i), kinds[call[r]], release)


def _queues(plan: dict, rank: int) -> dict[int, list[Step]]:
    return {pid: list(steps) for (r, pid), steps in plan.items() if r == rank}
