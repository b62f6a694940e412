"""The pipelined ring on GPUs: transfers and additions on separate CUDA streams.

Why a separate path: ProcessGroupNCCL makes its communication stream wait for
*everything already queued* on the stream that issues a send or receive. If
the additions of the reduce-scatter sit on that stream, every transfer waits
for every earlier addition, and the pipeline degenerates into
transfer, add, transfer, add. Here transfers are issued from a stream that
carries nothing but the waits each message really needs (its send slice must
be final, its receive buffer free), and additions run on a second stream, so
adding slice ``k`` overlaps moving slice ``k + 1``, and the all-gather of the
first slices starts while the last ones are still being reduced.

Measured on 2 H200s over NVLink (NCCL 2.28), this does *not* beat the plain
ring: 256 MiB took 1.26 ms with 2 slices against 1.15 ms unsliced (NCCL's own
all-reduce: 0.94 ms). Each extra ``batch_isend_irecv`` costs tens of
microseconds on the host, and the additions compete with the transfers for
the GPU's memory bandwidth. It stays here as the experiment a learner can
rerun (``dpcourse bench allreduce --impls ring,ring_pipelined:2``).
"""

from __future__ import annotations

import torch

from dpcourse.comm.p2p import exchange, global_rank, group_rank_and_size


def ring_pipelined_on_streams(flat: torch.Tensor, phases: tuple[str, ...], group,
                              slices: int) -> None:
    """Run the ring's ``phases`` on the CUDA tensor ``flat``, ``slices`` pieces per chunk.

    Same messages, same order and same result as the CPU pipeline
    (:func:`dpcourse.comm.ring.pipeline_tasks`); only the stream placement differs.
    On return the caller's current stream is ordered after all of it.

    Args:
        flat: contiguous 1-D CUDA tensor, updated in place.
        phases: phases to run, in order.
        group: the process group; ``None`` means the default group.
        slices: pieces per chunk (>= 2).
    """
    from dpcourse.comm.ring import chunk_bounds, pipeline_tasks

    rank, world_size = group_rank_and_size(group)
    right = global_rank(group, (rank + 1) % world_size)
    left = global_rank(group, (rank - 1) % world_size)
    tasks = pipeline_tasks(rank, world_size, flat.numel(), phases, slices)
    largest = chunk_bounds(chunk_bounds(flat.numel(), world_size, 0)[1], slices, 0)[1]
    # Allocated on the caller's stream, which waits for both side streams at the
    # end, so the caching allocator never hands these out while still in use.
    buffers = [flat.new_empty(largest), flat.new_empty(largest)]
    caller = torch.cuda.current_stream(flat.device)
    issue, adder = torch.cuda.Stream(flat.device), torch.cuda.Stream(flat.device)
    issue.wait_stream(caller)
    adder.wait_stream(caller)
    done: list[torch.cuda.Event] = []   # done[i]: task i's data is in place
    writer: dict[int, int] = {}         # slice start -> the task that last wrote it
    for i, (s0, s1, r0, r1, reduce) in enumerate(tasks):
        with torch.cuda.stream(issue):
            if s0 in writer:             # we send what an earlier task produced
                issue.wait_event(done[writer[s0]])
            if reduce and i >= 2:        # the buffer we receive into was added from two tasks ago
                issue.wait_event(done[i - 2])
            incoming = buffers[i % 2][: r1 - r0] if reduce else flat[r0:r1]
            works = exchange(flat[s0:s1], right, incoming, left, group, tag=i % 2)
        with torch.cuda.stream(adder):
            for w in works:
                w.wait()                 # the adder stream waits for this message only
            if reduce:
                flat[r0:r1].add_(incoming)
            event = torch.cuda.Event()
            event.record(adder)
        done.append(event)
        writer[r0] = i
    caller.wait_stream(adder)
    caller.wait_stream(issue)
