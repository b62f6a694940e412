"""Triton kernels: one-shot and two-shot all-reduce over symmetric memory, with signal pads.

Imported only on a CUDA machine (``dpcourse.comm.kernels`` imports it lazily). How
they are launched from the host: :mod:`dpcourse.comm.kernels.triton_launch`.

What a kernel sees. Every rank allocated a buffer of the same size with
``torch.distributed._symmetric_memory`` and exchanged handles, so each GPU
has every peer's buffer mapped into its own address space: a plain load or
store at ``my_buffer + delta[p]`` reaches rank ``p``'s memory over NVLink.
``delta[p]`` (in elements) is the distance between the two mappings; it is
0 for this rank. Each buffer comes with a *signal pad*, a small zeroed int32
array, mapped the same way.

Who waits for whom. Block ``b`` of every rank works on the same elements, so
block ``b`` only ever waits for block ``b`` of the other ranks (flag slot
``b * WORLD + sender`` on the receiver's pad). The grid is capped so that
every block of the kernel can be resident at once; a block that spins on a
flag therefore never waits for a block that cannot be scheduled.

The flag protocol (:func:`block_barrier`). A one-slot mailbox per (block,
sender) on each receiver: *send* is a compare-and-swap 0 -> 1 on the
peer's slot with **release** semantics at **system** scope; *wait* is a
compare-and-swap 1 -> 0 on one's own slot with **acquire** semantics at
system scope. A sender whose previous message has not been taken yet spins
until it has, so slots never overflow, and every slot is 0 again after each
barrier: nothing needs resetting between calls. A block raises its flags on
all peers at once, one thread per peer, then takes the flags it receives at
once, instead of one peer after another: a compare-and-swap on a peer's
memory returns its answer over NVLink before the loop can go on (lesson 12
measures the difference on 4 ranks).

Memory-ordering argument (the same in both kernels). Stores made by any
thread of block ``b`` before the barrier are ordered before the releasing
compare-and-swap by ``tl.debug_barrier()`` (bar.sync: all threads of the
block have issued them, and a release is cumulative over what its thread has
observed). A peer's acquiring compare-and-swap that reads the 1 synchronises
with that release, and its own ``bar.sync`` after the wait extends the order
to all of its threads: their loads after the barrier see the stores. The
scope must be ``sys``: the two sides run on different GPUs, and a ``gpu``
scoped release orders memory only for observers on the same device.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def send_signal(flags, todo):
    """Raise the flag at each lane's pointer in ``flags`` whose lane is in ``todo``, all at once.

    A lane spins while its flag is still up (the peer has not taken the last
    one yet); a lane that has raised its flag is left alone (its compare value
    becomes -1, which no flag ever holds), so it never raises a second one.
    """
    # release: every store this thread observed before (the whole block's, after
    # bar.sync) is visible to whoever acquires this flag.
    up = tl.full(todo.shape, 1, tl.int32)
    while tl.max(todo.to(tl.int32), 0) > 0:
        old = tl.atomic_cas(flags, tl.where(todo, 0, -1), up, sem="release", scope="sys")
        todo = todo & (old != 0)


@triton.jit
def wait_signal(flags, todo):
    """Wait until each flag in ``flags`` whose lane is in ``todo`` is up; take it down, all at once.

    A lane that has taken its flag is left alone (compare value -1), so it
    cannot take the flag a peer raises for the next barrier.
    """
    # acquire: no load or store after this may be performed before the flag was seen.
    down = tl.zeros(todo.shape, tl.int32)
    while tl.max(todo.to(tl.int32), 0) > 0:
        old = tl.atomic_cas(flags, tl.where(todo, 1, -1), down, sem="acquire", scope="sys")
        todo = todo & (old != 1)


@triton.jit
def block_barrier(pad, pad_deltas, block, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Block ``block`` of this rank meets block ``block`` of every other rank.

    One lane per rank, each handled by its own thread: the flags to every peer
    go out at once, not one after another, and then the flags from every peer
    are awaited at once. The lane of this rank (and the lanes past ``WORLD``:
    a lane count is a power of two) points at this rank's own slot, which no
    one raises, and does nothing.
    """
    LANES: tl.constexpr = triton.next_power_of_2(WORLD)  # tl.arange's length: a power of two
    p = tl.arange(0, LANES)
    peers = (p != RANK) & (p < WORLD)
    # slot block * WORLD + sender on the receiver's pad; idle lanes: slot (block, RANK) here
    deltas = tl.load(pad_deltas + p, mask=peers, other=0)
    tl.debug_barrier()  # every thread's earlier stores are issued before the releases below
    send_signal(pad + deltas + block * WORLD + RANK, peers)
    wait_signal(pad + block * WORLD + tl.where(peers, p, RANK), peers)
    tl.debug_barrier()  # every thread's later loads come after the acquires above


@triton.jit
def peer_delta(buf_deltas, p):
    """Return rank ``p``'s buffer as an element offset from ours, provably a multiple of 16.

    The mappings are far apart and aligned; saying so lets Triton emit 16-byte loads.
    """
    return (tl.load(buf_deltas + p) // 16) * 16


@triton.jit
def one_shot_kernel(x, buf, buf_deltas, pad, pad_deltas, numel,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Sum ``x`` over all ranks into ``x``: copy in, barrier, load every rank's copy and add.

    Ordering: after the barrier, every rank's copy of this block's tiles is in
    its buffer (release/acquire above). The buffer is not reused by the next
    call: calls alternate between two fixed halves of the workspace (``buf``
    points at this call's half, whatever the call's size), and a rank writes
    a half again only two calls later, after the barrier of the call in
    between, which no peer can pass before its kernel of this call (and so
    every load here) has finished. Two-shot calls take part in the same
    alternation, since they stage data before their first barrier.
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(buf + offs, tl.load(x + offs, mask=mask), mask=mask)
    block_barrier(pad, pad_deltas, pid, RANK, WORLD)
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):  # rank order: every rank adds in the same order
            acc += tl.load(buf + peer_delta(buf_deltas, p) + offs, mask=mask).to(tl.float32)
        tl.store(x + offs, acc.to(x.dtype.element_ty), mask=mask)


@triton.jit
def copy_other_slices(src, dst, numel, slice_len, pid, step,
                      RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Copy block ``pid``'s tiles of every slice but this rank's from ``src`` to ``dst``.

    Two-shot's staging (``x`` -> buffer) and copy-out (buffer -> ``x``): rank
    ``s`` owns slice ``s`` (``slice_len`` elements, the last one cut at ``numel``).
    """
    for start in range(pid * BLOCK, slice_len, step):
        inner = start + tl.arange(0, BLOCK)
        for s in tl.static_range(WORLD):
            if s != RANK:
                offs = s * slice_len + inner
                mask = (inner < slice_len) & (offs < numel)
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def two_shot_kernel(x, buf, buf_deltas, pad, pad_deltas, numel, slice_len,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                    COPY: tl.constexpr):
    """Sum ``x`` over all ranks into ``x``: reduce-scatter by peer loads, all-gather by peer stores.

    Rank ``r`` owns slice ``r`` (``slice_len`` elements). (1) Stage the other
    slices in the symmetric buffer (skipped when ``COPY`` is false: ``x`` is
    the symmetric buffer). (2) Barrier. (3) Load this rank's slice from every
    peer, add in rank order, store the sum into ``x`` and into every peer's
    buffer. (4) Barrier. (5) Copy the other slices' sums from the buffer.

    Ordering: (2) makes every peer's staged slice visible before (3) loads
    it; (4) makes every peer's pushed sums visible before (5) reads them. A
    location ``buffer[p], slice s`` is touched in a call only by rank ``p``
    (staging, copy-out) and rank ``s`` (one load in (3), then one store of the
    same element by the same thread); after barrier (4) no peer touches rank
    ``p``'s buffer again in this call. With ``COPY`` the host still alternates
    between the workspace's two halves, as for one-shot, whose last call may
    still be reading the half this call would stage into.
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    if COPY:  # (1) stage
        copy_other_slices(x, buf, numel, slice_len, pid, step, RANK, WORLD, BLOCK)
    block_barrier(pad, pad_deltas, pid, RANK, WORLD)
    for start in range(pid * BLOCK, slice_len, step):
        inner = start + tl.arange(0, BLOCK)
        offs = RANK * slice_len + inner
        mask = (inner < slice_len) & (offs < numel)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                acc += tl.load(x + offs, mask=mask).to(tl.float32)
            else:
                acc += tl.load(buf + peer_delta(buf_deltas, p) + offs, mask=mask).to(tl.float32)
        total = acc.to(x.dtype.element_ty)
        tl.store(x + offs, total, mask=mask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                tl.store(buf + peer_delta(buf_deltas, p) + offs, total, mask=mask)
    block_barrier(pad, pad_deltas, pid, RANK, WORLD)
    if COPY:  # (5) copy out
        copy_other_slices(buf, x, numel, slice_len, pid, step, RANK, WORLD, BLOCK)


@triton.jit
def empty_kernel(x, buf, buf_deltas, pad, pad_deltas, numel, slice_len,
                 RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                 COPY: tl.constexpr):
    """Do nothing, with two-shot's parameters: what launching a kernel costs (measurements only)."""
    pass
