"""Check for exercise 04's transfer task: an all-reduce in about log2(N) rounds, for any N.

The learner's ``all_reduce(tensor, group=None)`` runs on 3, 4 and 5 ranks (one
power of two, two not) and must leave what ``dist.all_reduce`` leaves. Every
message is traced, so the check also sees how many rounds each rank needed and
how many bytes it sent: a ring needs 2 (N - 1) rounds, swapping whole tensors
sends too many bytes, and both are reported as what they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.comm.trace import POINT_TO_POINT, CommTrace
from dpcourse.grading.criteria import Criterion, mismatch, tolerance
from dpcourse.grading.inprocess import CheckSpec


def _rank_input(case: int, rank: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 100 * case + rank)
    if dtype == torch.bfloat16:  # small integers: every partial sum is exact in bfloat16
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _cases(ws: int) -> list[tuple[str, int, tuple, torch.dtype]]:
    """(criterion, case id, shape, dtype): lengths the halves divide evenly, then awkward ones."""
    even = 8 * ws * 4  # divisible by N and by every power of two up to 8
    cases = [("matches_all_reduce", 0, (even,), torch.float32),
             ("matches_all_reduce", 1, (4 * ws, 8), torch.float32),
             ("matches_all_reduce", 2, (even,), torch.float64),
             ("matches_all_reduce", 3, (even,), torch.bfloat16)]
    awkward = [(0,), (1,), (max(ws - 1, 1),), (2 * ws + 1,), (1001,)]
    return cases + [("awkward_lengths", 10 + i, s, torch.float32) for i, s in enumerate(awkward)]


def largest_power_of_two(n: int) -> int:
    """Return the largest power of two that is <= ``n`` (``n`` >= 1)."""
    return 1 << (n.bit_length() - 1)


def round_limit(n: int) -> int:
    """Most sends any rank may issue: 2 log2 N for a power of two, one fold more otherwise."""
    p = largest_power_of_two(n)
    return 2 * (p.bit_length() - 1) + (0 if p == n else 1)


def byte_limit(n: int, nbytes: int) -> float:
    """Most bytes any rank may send: 2 (p - 1) / p of the tensor, plus one copy when p < N."""
    p = largest_power_of_two(n)
    return 2 * (p - 1) / p * nbytes + (0 if p == n else nbytes)


class HalvingDoublingAllReduce(CheckSpec):
    """``all_reduce(tensor, group=None)`` in O(log N) rounds, for any world size."""

    name, exercise, title = "halving_doubling", "04", "All-reduce in log2(N) rounds"
    world_sizes = (3, 4, 5)
    timeout = 40.0
    forbidden = tuple(f"dpcourse.comm.{m}" for m in (
        "ring.ring_all_reduce", "ring.ring_reduce_scatter", "ring.ring_all_gather",
        "naive.naive_all_reduce", "naive.all_reduce_per_tensor", "ring_all_reduce"))
    criteria = (
        Criterion("matches_all_reduce", "leaves the same sum as dist.all_reduce on every rank "
                  "(3, 4 and 5 ranks; float32, float64, bfloat16; 1-D and 2-D)",
                  "Partners must agree on which part each of them keeps: both cut the same "
                  "region at the same point, and the one with the lower rank in the pair keeps "
                  "the same half on every step. If the values are N times off, something is "
                  "added twice or averaged."),
        Criterion("awkward_lengths", "also works for lengths 0, 1, fewer than N and odd lengths",
                  "A half of an odd-length region is one element longer than the other, and a "
                  "half may be empty: compute the cut from the region's bounds on both sides "
                  "and skip empty messages on both sides."),
        Criterion("in_place", "updates the tensor it is given, any shape",
                  "Work on tensor.view(-1) and write the sums into it; don't return a new "
                  "tensor."),
        Criterion("uses_only_point_to_point", "uses only send/recv/isend/irecv (no collective)",
                  "Build it from messages between pairs of ranks; a collective inside hands the "
                  "work back to the library."),
        Criterion("log_rounds", "no rank sends more than 2 log2 N messages (one more when N is "
                  "not a power of two): 4 on 4 ranks where a ring sends 6",
                  "Each round must halve the work left: pair rank r with a rank a power of two "
                  "away, so that log2 N rounds reach everyone. A ring passes through N - 1 "
                  "neighbours per phase."),
        Criterion("bandwidth_power_of_two", "on 4 ranks each rank sends 2 (N - 1) / N of the "
                  "tensor's bytes, no more than a ring",
                  "Swapping the whole tensor every round costs log2 N full copies. Send only "
                  "the half your partner keeps, so the messages shrink 1/2, 1/4, ...; then "
                  "send the finished parts back the same way, growing."),
        Criterion("bounded_bytes_other_sizes", "on 3 and 5 ranks no rank sends more than the "
                  "largest power of two below N would need, plus one copy of the tensor",
                  "The ranks beyond a power of two can hand their whole tensor to a partner "
                  "once at the start and get the result once at the end; don't make every rank "
                  "pay for them."),
    )
    notes = (f"tolerances (rtol, atol): float32 {tolerance('gloo', torch.float32, 'collective')}, "
             f"bfloat16 {tolerance('gloo', torch.bfloat16, 'collective')} (gloo)",)

    def prepare(self, rec):
        from dpcourse.device import rank_device

        ws, rank, device = dist.get_world_size(), dist.get_rank(), rank_device()
        expected = {}
        for _, case, shape, dtype in _cases(ws):
            x = _rank_input(case, rank, int(torch.Size(shape).numel()), dtype).to(device)
            dist.all_reduce(x)
            expected[case] = x.reshape(shape).cpu()
        return expected

    def run(self, rec, all_reduce, extras, reference):
        from dpcourse.device import rank_device

        expected = reference.get()
        ws, rank, device = dist.get_world_size(), dist.get_rank(), rank_device()
        for crit, case, shape, dtype in _cases(ws):
            numel = int(torch.Size(shape).numel())
            x = _rank_input(case, rank, numel, dtype).reshape(shape).to(device)
            before = x.data_ptr()
            name = f"shape {tuple(shape)}, {str(dtype).replace('torch.', '')}"
            with rec.case(crit, name), CommTrace() as trace:
                all_reduce(x)
            if numel > 1:
                rec.record("in_place", x.data_ptr() == before and x.shape == torch.Size(shape),
                           "the tensor was replaced instead of updated in place", name)
            diff = mismatch(x.cpu(), expected[case], *tolerance(dist.get_backend(), dtype,
                                                                "collective"))
            rec.record(crit, not diff, f"rank {rank}: {diff}", name)
            self._structure(rec, trace, ws, rank, numel * x.element_size(), name, crit)

    @staticmethod
    def _structure(rec, trace, ws, rank, nbytes, name, crit) -> None:
        collectives = sorted(trace.collective_ops())
        rec.record("uses_only_point_to_point", not collectives,
                   f"rank {rank} called {', '.join(collectives)}", name)
        if collectives or crit != "matches_all_reduce":
            return  # rounds and bytes are measured where every message is non-empty
        sends = [e for e in trace.events if e.op in POINT_TO_POINT and "send" in e.op]
        rec.record("log_rounds", len(sends) <= round_limit(ws),
                   f"rank {rank} sent {len(sends)} messages, at most {round_limit(ws)} allowed "
                   f"on {ws} ranks", name)
        sent = sum(e.nbytes for e in sends)
        if largest_power_of_two(ws) == ws:
            want = 2 * (ws - 1) * nbytes // ws
            rec.record("bandwidth_power_of_two", sent == want,
                       f"rank {rank} sent {sent} bytes of a {nbytes}-byte tensor, expected {want}",
                       name)
        else:
            limit = byte_limit(ws, nbytes)
            rec.record("bounded_bytes_other_sizes", sent <= limit,
                       f"rank {rank} sent {sent} bytes of a {nbytes}-byte tensor, at most "
                       f"{limit:g} allowed", name)
