"""Checks for lesson 02 (what collectives produce) and lesson 04 (ring all-reduce from send/recv).

Every expectation comes from torch itself: ``dist.all_reduce``,
``dist.reduce_scatter_tensor``, ``dist.all_gather_into_tensor`` and
``dist.broadcast`` run on the same inputs before the learner's code does.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from dpcourse.comm.trace import POINT_TO_POINT, CommTrace
from dpcourse.grading.criteria import Criterion, mismatch, tolerance
from dpcourse.grading.runner import CheckSpec

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def _device():
    from dpcourse.device import rank_device

    return rank_device()


def _bounds(numel: int, world_size: int, index: int) -> tuple[int, int]:
    base, extra = divmod(numel, world_size)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _rank_input(case: int, rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype in (torch.bfloat16, torch.float16):  # small integers: sums exact in low precision
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


class CollectiveSemantics(CheckSpec):
    """``simulate_collective(op, inputs) -> outputs``: predict what each rank holds afterwards."""

    name, exercise, title = "collective_semantics", "02", "What collectives produce"
    world_sizes = (4,)  # one launch; groups of 2, 3 and 4 ranks inside it
    criteria = tuple(Criterion(
        f"{op}_matches_torch", f"simulate_collective('{op}', ...) gives what dist.{op} gives "
        "every rank (groups of 2, 3, 4 ranks)", hint) for op, hint in zip(OPS, (
            "After all_reduce (SUM) every rank holds the elementwise sum of ALL ranks' inputs: "
            "the same tensor on every rank, not the mean and not only on rank 0.",
            "reduce_scatter: sum elementwise over ranks, then cut the sum into N equal blocks; "
            "rank r keeps block r (its length is len/N).",
            "all_gather: every rank receives every rank's input, concatenated in rank order "
            "(length N * len).",
            "broadcast from rank 0: every rank ends with a copy of rank 0's input.")))
    notes = ("compared exactly (integer-valued inputs) with torch.distributed on groups of 2, 3, "
             "4 ranks",)

    @staticmethod
    def _inputs(op: str, n: int) -> list[torch.Tensor]:
        k = 3
        numel = n * k if op == "reduce_scatter" else (k if op == "all_gather" else 5)
        return [_rank_input(OPS.index(op) * 10 + n, r, numel).round() for r in range(n)]

    def prepare(self, rec):
        rank, device, truth = dist.get_rank(), _device(), {}
        # Newer torch renames the *_tensor collectives; the old names are what lessons use.
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        for n in (2, 3, 4):
            group = dist.new_group(list(range(n)))  # every rank must call new_group
            outputs = {}
            if rank < n:
                for op in OPS:
                    x = self._inputs(op, n)[rank].to(device)
                    if op == "all_reduce":
                        dist.all_reduce(x, group=group)
                        out = x
                    elif op == "reduce_scatter":
                        out = x.new_empty(x.numel() // n)
                        dist.reduce_scatter_tensor(out, x, group=group)
                    elif op == "all_gather":
                        out = x.new_empty(x.numel() * n)
                        dist.all_gather_into_tensor(out, x, group=group)
                    else:
                        dist.broadcast(x, src=0, group=group)
                        out = x
                    outputs[op] = out.cpu()
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, outputs)
            truth[n] = gathered[:n]
        return truth

    def run(self, rec, simulate, extras, reference):
        truth = reference.get()  # every rank takes part in the torch collectives
        if dist.get_rank() != 0:
            return  # the simulation is pure: rank 0 runs it against everyone's results
        for op in OPS:
            crit = f"{op}_matches_torch"
            for n in (2, 3, 4):
                inputs = [t.clone() for t in self._inputs(op, n)]
                with rec.case(crit, f"{n} ranks"):
                    got = simulate(op, inputs)
                want = [truth[n][r][op] for r in range(n)]
                if not isinstance(got, (list, tuple)) or len(got) != n:
                    rec.record(crit, False, f"expected a list of {n} tensors (one per rank), got "
                               f"{type(got).__name__}" + (f" of length {len(got)}"
                                                          if hasattr(got, '__len__') else ""),
                               f"{n} ranks")
                    continue
                bad = [(r, m) for r in range(n)
                       if (m := mismatch(torch.as_tensor(got[r]).flatten(), want[r], 0, 1e-6))]
                rec.record(crit, not bad, f"rank {bad[0][0]}: {bad[0][1]}" if bad else "",
                           f"{n} ranks")


def _cases(ws: int) -> list[tuple[str, int, tuple, torch.dtype]]:
    """(criterion, case id, shape, dtype) for one world size: regular sizes, then awkward ones."""
    regular = [(ws,), (8 * ws,), (2 * ws, 3), (1024 * ws,)]
    awkward = [(0,), (1,), (max(ws - 1, 1),), (2 * ws + 1,), (1001,)]
    cases = [("matches_all_reduce", i, s, torch.float32) for i, s in enumerate(regular)]
    cases.append(("matches_all_reduce", 10, (4 * ws,), torch.float64))
    cases.append(("matches_all_reduce", 11, (6 * ws,), torch.bfloat16))
    cases += [("awkward_lengths", 20 + i, s, torch.float32) for i, s in enumerate(awkward)]
    return cases


def _case_name(shape, dtype) -> str:
    return f"shape {tuple(shape)}, {str(dtype).replace('torch.', '')}"


class RingAllReduce(CheckSpec):
    """``ring_all_reduce(tensor, group=None)``: an in-place sum from point-to-point messages."""

    name, exercise, title = "ring_all_reduce", "04", "Ring all-reduce from send/recv"
    world_sizes = (2, 3, 4)
    forbidden = tuple(f"dpcourse.comm.{m}" for m in (
        "ring.ring_all_reduce", "ring.ring_reduce_scatter", "ring.ring_all_gather",
        "ring.chunk_bounds", "ring.ring_step_chunks", "naive.naive_all_reduce",
        "naive.all_reduce_per_tensor", "p2p.exchange"))
    criteria = (
        Criterion("matches_all_reduce", "leaves the same sum as dist.all_reduce on every rank "
                  "(world sizes 2, 3, 4; float32, float64, bfloat16; 1-D and 2-D)",
                  "If some chunks are right and others wrong, look at the chunk indices: in "
                  "reduce-scatter step s rank r sends chunk (r - s - 1) % N and receives chunk "
                  "(r - s - 2) % N, adding it to its own copy; in all-gather step s it sends "
                  "(r - s) % N and receives (r - s - 1) % N, overwriting. If every value is N "
                  "times too small or large, you averaged or summed twice."),
        Criterion("awkward_lengths", "also works for lengths 0, 1, fewer than the world size "
                  "and not divisible by it",
                  "Cut the flat tensor into N chunks whose sizes differ by at most one (the first "
                  "numel % N chunks get one extra element); some chunks may be empty. Skip "
                  "sending/receiving empty chunks on both sides, and return early for numel 0."),
        Criterion("in_place", "updates the tensor it is given (like dist.all_reduce), any shape",
                  "Work on tensor.view(-1) (a view shares memory) and write results into it; "
                  "don't build a new tensor and return it."),
        Criterion("uses_only_point_to_point", "uses only send/recv/isend/irecv (no collective)",
                  "The ring is built from messages between neighbours: use dist.P2POp(dist.isend, "
                  "...) / dist.P2POp(dist.irecv, ...) with dist.batch_isend_irecv, or "
                  "dist.send/dist.recv. Calling dist.all_reduce (or any other collective) inside "
                  "the ring hands the work back to the library."),
        Criterion("ring_neighbours_only", "rank r only sends to r + 1 and receives from r - 1",
                  "In a ring each rank talks to two neighbours: dst = (rank + 1) % N, "
                  "src = (rank - 1) % N."),
        Criterion("bandwidth_optimal", "each rank sends 2 (N - 1) / N of the tensor's bytes",
                  "Send one chunk (numel / N elements) per step, N - 1 steps per phase. Sending "
                  "the whole tensor, or gathering everything on one rank, sends more."),
        Criterion("chunk_bounds_correct", "chunk_bounds(numel, world_size, index) cuts like the "
                  "lesson: sizes differ by at most one, the first numel % N chunks are longer",
                  "base, extra = divmod(numel, world_size); chunk i starts at "
                  "i * base + min(i, extra) and has base + (1 if i < extra else 0) elements.",
                  requires="chunk_bounds"),
        Criterion("reduce_scatter_owns_chunk_r", "after ring_reduce_scatter, chunk r on rank r "
                  "holds the sum over all ranks", "After N - 1 steps the chunk rank r received "
                  "last must be chunk r: receive chunk (r - s - 2) % N at step s.",
                  requires="reduce_scatter"),
        Criterion("all_gather_copies_chunks", "ring_all_gather copies each rank's chunk r to every "
                  "rank", "Start by sending your own chunk r (step 0 sends (r - s) % N) and "
                  "overwrite (copy_) the received chunk, don't add.", requires="all_gather"),
    )
    notes = (f"tolerances (rtol, atol): float32 {tolerance('gloo', torch.float32, 'collective')}, "
             f"bfloat16 {tolerance('gloo', torch.bfloat16, 'collective')} (gloo; see "
             "dpcourse.grading.criteria.TOLERANCES)",)

    def prepare(self, rec):
        ws, rank, device = dist.get_world_size(), dist.get_rank(), _device()
        expected = {}
        for crit, case, shape, dtype in _cases(ws):
            numel = int(torch.Size(shape).numel())
            x = _rank_input(case, rank, numel, dtype).to(device)
            dist.all_reduce(x)
            expected[case] = x.reshape(shape).cpu()
        return expected

    def run(self, rec, ring, extras, reference):
        expected = reference.get()
        ws, rank, device = dist.get_world_size(), dist.get_rank(), _device()
        backend = dist.get_backend()
        for crit, case, shape, dtype in _cases(ws):
            numel = int(torch.Size(shape).numel())
            x = _rank_input(case, rank, numel, dtype).reshape(shape).to(device)
            before = x.data_ptr()
            name = _case_name(shape, dtype)
            with rec.case(crit, name), CommTrace() as trace:
                ring(x)
            got = x.cpu()
            if dtype == torch.float32 and numel > 1:
                rec.record("in_place", x.data_ptr() == before and x.shape == torch.Size(shape),
                           "the tensor was replaced instead of updated in place", name)
            rtol, atol = tolerance(backend, dtype, "collective")
            diff = mismatch(got, expected[case], rtol, atol)
            if diff and numel >= ws:
                chunks = [slice(*_bounds(numel, ws, i)) for i in range(ws)]
                wrong = [i for i, c in enumerate(chunks)
                         if mismatch(got.flatten()[c], expected[case].flatten()[c], rtol, atol)]
                diff += f"; wrong chunks on rank {rank}: {wrong} of {list(range(ws))}"
            rec.record(crit, not diff, f"rank {rank}: {diff}", name)
            self._structure(rec, trace, ws, rank, numel, got.element_size(), name)
        if "chunk_bounds" in extras and rank == 0:
            self._check_bounds(rec, extras["chunk_bounds"])
        for key in ("reduce_scatter", "all_gather"):
            if key in extras:
                self._check_half(rec, key, extras[key], ws, rank, device, expected)

    @staticmethod
    def _structure(rec, trace, ws, rank, numel, elsize, name) -> None:
        collectives = sorted(trace.collective_ops())
        p2p = [e for e in trace.events if e.op in POINT_TO_POINT]
        if collectives:
            detail = f"rank {rank} called {', '.join(collectives)} inside the ring"
        elif not p2p and ws > 1 and numel >= ws:
            detail = f"rank {rank} sent no point-to-point message at all"
        else:
            detail = ""
        rec.record("uses_only_point_to_point", not detail, detail, name)
        right, left = (rank + 1) % ws, (rank - 1) % ws
        stray = [f"{e.op} peer {e.peer}" for e in p2p
                 if e.peer is not None and e.peer != (right if "send" in e.op else left)]
        rec.record("ring_neighbours_only", not stray,
                   f"rank {rank}: {', '.join(sorted(set(stray)))} (neighbours are {right} and "
                   f"{left})", name)
        if numel % ws == 0 and numel > 0 and not collectives:
            want = 2 * (ws - 1) * (numel // ws) * elsize
            sent = sum(e.nbytes for e in p2p if "send" in e.op)
            rec.record("bandwidth_optimal", sent == want,
                       f"rank {rank} sent {sent} bytes, a ring sends {want}", name)

    @staticmethod
    def _check_bounds(rec, chunk_bounds) -> None:
        for numel in (0, 1, 2, 5, 12, 1001):
            for n in (1, 2, 3, 4):
                for i in range(n):
                    case = f"chunk_bounds({numel}, {n}, {i})"
                    with rec.case("chunk_bounds_correct", case):
                        got = chunk_bounds(numel, n, i)
                    want = _bounds(numel, n, i)
                    if tuple(got) != want:
                        rec.record("chunk_bounds_correct", False, f"got {tuple(got)}, expected "
                                   f"{want}", case)
                        return
        rec.record("chunk_bounds_correct", True)

    @staticmethod
    def _check_half(rec, key, fn, ws, rank, device, expected) -> None:
        crit = ("reduce_scatter_owns_chunk_r" if key == "reduce_scatter"
                else "all_gather_copies_chunks")
        for _, case, shape, dtype in _cases(ws):
            if dtype != torch.float32:
                continue
            numel = int(torch.Size(shape).numel())
            lo, hi = _bounds(numel, ws, rank)
            name = _case_name(shape, dtype)
            if key == "reduce_scatter":
                x = _rank_input(case, rank, numel).to(device)
                want = expected[case].flatten()[lo:hi]
            else:  # own chunk valid, the rest NaN: copying fixes it, adding does not
                full = expected[case].flatten()
                x = torch.full((numel,), float("nan"))
                x[lo:hi] = full[lo:hi]
                x, want = x.to(device), full
            with rec.case(crit, name):
                fn(x)
            got = x.cpu()[lo:hi] if key == "reduce_scatter" else x.cpu()
            diff = mismatch(got, want, *tolerance(dist.get_backend(), dtype, "collective"))
            rec.record(crit, not diff, f"rank {rank}: {diff}", name)
