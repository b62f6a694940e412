"""The NVLink all-reduce kernels' schedule in plain Python: which block does what, in which order.

The GPU kernels in :mod:`dpcourse.comm.kernels.triton_allreduce` run one grid per
rank; block ``b`` of every rank handles the same elements, so block ``b`` only
ever waits for block ``b`` of the other ranks. The plans here list each
block's steps (copy, send, wait, reduce, push, copy out) for one call, with
the element ranges they touch; :mod:`dpcourse.comm.kernels.simulation` runs
them on a model of the machine in random interleavings. No GPU and no Triton
needed, so the lesson and the CPU tests can show:

* which elements each block loads from which peer and stores where
  (:func:`one_shot_plan`, :func:`two_shot_plan`, :func:`peer_traffic`);
* the flag protocol of the signal-pad barrier: ``send`` turns a peer's flag
  from 0 to 1 (*release*: everything this block wrote before is visible to
  whoever sees the 1), ``wait`` turns this block's flag from 1 back to 0
  (*acquire*: nothing after it may run before the 1 was seen). Each flag is
  a one-slot mailbox that empties itself, so the pad is all zeros again
  after every call and the next call can reuse it;
* with ``barrier=False`` (no send/wait steps), what goes wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpcourse.comm.sharding import chunk_size, shard_range


def block_tiles(length: int, block: int, num_blocks: int, pid: int) -> list[range]:
    """Return the tiles of ``range(length)`` that block ``pid`` owns (a grid-stride loop).

    Args:
        length: elements to cover.
        block: elements per tile (``BLOCK`` in the kernel).
        num_blocks: blocks in the grid.
        pid: this block's index.

    Returns:
        ``[range(start, min(start + block, length)), ...]`` for
        ``start = pid * block, pid * block + num_blocks * block, ...``.
    """
    return [range(s, min(s + block, length))
            for s in range(pid * block, length, num_blocks * block)]


def grid_size(length: int, block: int, max_blocks: int) -> int:
    """Return how many blocks a kernel launches for ``length`` elements (at least 1)."""
    return max(1, min(-(-length // block), max_blocks))


@dataclass
class Step:
    """One thing a block does.

    ``op`` is ``"copy"`` (input -> own symmetric buffer), ``"send"`` / ``"wait"``
    (the two halves of the barrier, towards/from ``peer``), ``"reduce"`` (load
    from every rank's buffer, sum, write the input), ``"push"`` (store the sum
    into ``peer``'s buffer) or ``"copy_out"`` (own buffer -> input).
    ``index`` is the range of elements; ``offset`` shifts it inside the buffer
    (calls alternate between two halves of the workspace).
    """

    op: str
    rank: int
    block: int
    peer: int | None = None
    index: range | None = None
    offset: int = 0

    @property
    def elements(self) -> range:
        """``index``; no elements for the barrier's ``send`` and ``wait``."""
        return self.index if self.index is not None else range(0)

    @property
    def target(self) -> int:
        """The rank a ``send`` or ``push`` writes to (those steps always name a peer)."""
        if self.peer is None:
            raise ValueError(f"a {self.op!r} step of rank {self.rank} names no peer.")
        return self.peer


def one_shot_plan(numel: int, world_size: int, block: int = 4, max_blocks: int = 2,
                  barrier: bool = True, offset: int = 0) -> dict[tuple[int, int], list[Step]]:
    """Return every block's steps in one call of the one-shot kernel.

    Per block: copy its tiles of the input into this rank's symmetric buffer
    (at ``offset``), then the barrier (send to every peer, wait for every
    peer), then for each tile load it from every rank's buffer, sum in rank
    order, and write the input.

    Returns:
        ``{(rank, block): [Step, ...]}``.
    """
    blocks = grid_size(numel, block, max_blocks)
    plan = {}
    for rank in range(world_size):
        for pid in range(blocks):
            tiles = block_tiles(numel, block, blocks, pid)
            steps = [Step("copy", rank, pid, None, t, offset) for t in tiles]
            steps += _barrier(rank, pid, world_size) if barrier else []
            steps += [Step("reduce", rank, pid, None, t, offset) for t in tiles]
            plan[(rank, pid)] = steps
    return plan


def two_shot_plan(numel: int, world_size: int, block: int = 4, max_blocks: int = 2,
                  barrier: bool = True, offset: int = 0) -> dict[tuple[int, int], list[Step]]:
    """Return every block's steps in one call of the two-shot kernel.

    Per block: copy its tiles of the *other* ranks' slices into the symmetric
    buffer; barrier; reduce its tiles of this rank's own slice by loading them
    from every peer, write the sum to the input and push it into every peer's
    buffer; barrier; copy the other slices' sums from the buffer to the input.
    Buffer positions are shifted by ``offset``.

    Returns:
        ``{(rank, block): [Step, ...]}``.
    """
    length = chunk_size(numel, world_size)
    blocks = grid_size(length, block, max_blocks)
    plan = {}
    for rank in range(world_size):
        others = [s for s in range(world_size) if s != rank]
        for pid in range(blocks):
            tiles = block_tiles(length, block, blocks, pid)
            own = [_within(t, rank, numel, world_size) for t in tiles]
            steps = [Step("copy", rank, pid, s, _within(t, s, numel, world_size), offset)
                     for t in tiles for s in others]
            steps += _barrier(rank, pid, world_size) if barrier else []
            steps += [Step("reduce", rank, pid, None, t, offset) for t in own]
            steps += [Step("push", rank, pid, p, t, offset) for t in own for p in others]
            steps += _barrier(rank, pid, world_size) if barrier else []
            steps += [Step("copy_out", rank, pid, s, _within(t, s, numel, world_size), offset)
                      for t in tiles for s in others]
            plan[(rank, pid)] = steps
    return plan


def _within(tile: range, which: int, numel: int, world_size: int) -> range:
    """Return ``tile`` (offsets inside a slice) as elements of slice ``which``, clipped to it."""
    start, end = shard_range(numel, world_size, which)
    return range(min(start + tile.start, end), min(start + tile.stop, end))


def _barrier(rank: int, pid: int, world_size: int) -> list[Step]:
    peers = [p for p in range(world_size) if p != rank]
    return ([Step("send", rank, pid, p) for p in peers]
            + [Step("wait", rank, pid, p) for p in peers])


def peer_traffic(plan: dict, rank: int) -> dict[str, int]:
    """Count the elements rank ``rank`` moves over NVLink in one call of ``plan``.

    Returns:
        ``{"loaded": elements loaded from other ranks' buffers, "stored": elements
        stored into other ranks' buffers}``, summed over the rank's blocks.
    """
    world = 1 + max(r for r, _ in plan)
    loaded = stored = 0
    for (r, _), steps in plan.items():
        if r != rank:
            continue
        for s in steps:
            if s.op == "reduce":
                loaded += len(s.index) * (world - 1)
            elif s.op == "push":
                stored += len(s.index)
    return {"loaded": loaded, "stored": stored}


def half_offset(call: int, half_len: int) -> int:
    """Return where call number ``call`` works in the workspace: half ``call % 2``.

    The halves are fixed (``half_len`` elements each, whatever size a call
    reduces), and every call uses the half its number's parity names. A half is
    written again only two calls later, after the barrier of the call in
    between, which no peer passes before its kernel of this call (and so every
    load of this half) has finished.
    """
    return (call % 2) * half_len
