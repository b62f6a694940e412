"""Run the kernels' schedule (:mod:`dpcourse.comm.kernels.schedule`) on a model of the machine.

The model holds what the kernels touch, per rank: the input tensor, the
symmetric buffer and the signal pad. A seeded scheduler picks, at every
step, one block of any rank whose next step can run (a ``send`` into a full
flag slot or a ``wait`` on an empty one spins), the way the GPUs give no
order between ranks. With ``release=False`` flags are set with relaxed
atomics: a block's stores to symmetric buffers stay pending until the
scheduler lets them land, so a peer can see a flag before the data it
announces.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dpcourse.comm.kernels.schedule import Step, one_shot_plan, two_shot_plan


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
        return m.flags[s.peer].get((s.block, s.rank), 0) == 0
    if s.op == "wait":
        return m.flags[s.rank].get((s.block, s.peer), 0) == 1
    return True


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


def execute(m: Machine, s: Step, kind: str, release: bool = True) -> None:
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
        m.flags[s.peer][(s.block, s.rank)] = 1
    elif s.op == "wait":  # acquire: compare-and-swap this rank's flag 1 -> 0
        m.flags[s.rank][(s.block, s.peer)] = 0
    elif s.op == "copy":
        for i in s.index:
            _store(m, s, s.rank, off + i, x[i], weak)
    elif s.op == "reduce" and kind == "one_shot":
        for i in s.index:
            x[i] = sum(_load(m, s, p, off + i) for p in range(world))
    elif s.op == "reduce":  # two-shot: own slice from the input, the peers' from their buffers
        for i in s.index:
            x[i] = sum(x[i] if p == s.rank else _load(m, s, p, i) for p in range(world))
    elif s.op == "push":
        for i in s.index:
            _store(m, s, s.peer, i, x[i], weak)
    elif s.op == "copy_out":
        for i in s.index:
            x[i] = _load(m, s, s.rank, i)
    where = f" [{s.index.start}:{s.index.stop})" if s.index is not None else ""
    m.log.append(f"rank {s.rank} block {s.block}: {s.op}"
                 + (f" peer {s.peer}" if s.peer is not None else "") + where
                 + (f" buffer half {off // len(x)}" if s.op in ("copy", "reduce") and off else ""))


def simulate(inputs: list[list[float]], kind: str = "one_shot", *, calls: int = 1,
             block: int = 4, max_blocks: int = 2, barrier: bool = True, seed: int = 0,
             double_buffer: bool = True, release: bool = True,
             next_inputs=None) -> tuple[Machine, list]:
    """Run ``calls`` back-to-back all-reduces through the simulated kernel; return the results.

    Each rank runs its calls in stream order (call ``c + 1`` starts once all of
    its blocks finished call ``c``), but ranks are not held together: a rank
    may start its next call while a peer is still in the previous one. At
    every step a seeded scheduler picks one ready block of any rank.

    Args:
        inputs: one list of numbers per rank, all the same length.
        kind: ``"one_shot"`` or ``"two_shot"``.
        calls: back-to-back calls; call ``c`` starts from ``next_inputs(c, rank)``
            (default: the original inputs again).
        block, max_blocks: elements per tile and the grid-size cap.
        barrier: include the signal-pad barrier (``False`` shows the race).
        seed: scheduler seed.
        double_buffer: one-shot alternates between two halves of its buffer
            (``False``: one buffer, reused by every call, which races).
        release: set flags with release semantics (``False``: relaxed, so a
            peer may see the flag before the stores it was meant to announce).
        next_inputs: ``fn(call, rank) -> list`` for the inputs of each call.

    Returns:
        ``(machine, results)``: ``results[c][r]`` is rank ``r``'s tensor after call ``c``.

    Raises:
        RuntimeError: no block can move (a deadlock).
    """
    if kind not in ("one_shot", "two_shot"):
        raise ValueError(f"kind must be 'one_shot' or 'two_shot', got {kind!r}.")
    world, n = len(inputs), len(inputs[0])
    if any(len(x) != n for x in inputs):
        raise ValueError("every rank must pass the same number of elements.")
    next_inputs = next_inputs or (lambda c, r: list(inputs[r]))
    halves = 2 if kind == "one_shot" and double_buffer else 1

    def plan_of(c):
        if kind == "one_shot":
            return one_shot_plan(n, world, block, max_blocks, barrier, (c % halves) * n)
        return two_shot_plan(n, world, block, max_blocks, barrier)

    m = Machine([next_inputs(0, r) for r in range(world)],
                [[float("nan")] * (n * halves) for _ in range(world)])
    rng = random.Random(seed)
    call = [0] * world
    results: list[list] = [[None] * world for _ in range(calls)]
    queues = [_queues(plan_of(0), r) for r in range(world)]
    while True:
        ready = []
        for r in range(world):
            if not any(queues[r].values()) and call[r] < calls:
                for pid in queues[r]:  # the kernel has ended: all its stores are visible
                    drain(m, r, pid)
                results[call[r]][r] = list(m.inputs[r])  # the rank's call is complete
                call[r] += 1
                if call[r] < calls:  # stream order: its next call starts now
                    m.inputs[r][:] = next_inputs(call[r], r)
                    queues[r] = _queues(plan_of(call[r]), r)
            ready += [(r, b) for b, q in queues[r].items() if q and is_ready(m, q[0])]
            ready += [(r, -1 - b) for (rr, b), q in m.pending.items() if rr == r and q]
        if not ready:
            if all(c == calls for c in call):
                return m, results
            raise RuntimeError("deadlock: every live block is spinning on a flag.")
        r, b = rng.choice(ready)
        if b < 0:  # one in-flight store of block -1 - b reaches memory
            drain(m, r, -1 - b, 1)
        else:
            execute(m, queues[r][b].pop(0), kind, release)


def _queues(plan: dict, rank: int) -> dict[int, list[Step]]:
    return {pid: list(steps) for (r, pid), steps in plan.items() if r == rank}
