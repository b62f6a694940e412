"""Exercise 04: a ring all-reduce from send/recv that turns the other way round.

Lesson 04's ring passes chunks to the right (rank r sends to r + 1). The
exercise's ring passes them to the left (rank r sends to r - 1 and receives
from r + 1), while rank r still ends the reduce-scatter owning chunk r, as
torch's reduce-scatter leaves chunk r on rank r: the schedule has to be worked
out anew. Its chunks are lesson 04's (``dist.reduce_scatter_tensor``'s layout),
also for lengths the lesson did not show: fewer elements than ranks, or several
chunks short or empty (5 elements on 4 ranks). The ranks run on the grader's process
group, which offers only point-to-point messages: no collective exists to call.
The grader delivers every message, so it knows each rank's peers and bytes, and
it checks the sums against its own oracle on fresh random tensors
(:mod:`~dpcourse.grading.checks.ring_verdicts`, which ranks cannot import).
"""

from __future__ import annotations

import re

import torch

from dpcourse.grading.checks.base import Exercise, begin
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import P2P

MATCH = "matches_all_reduce"
NOTES = (f"tolerances (rtol, atol): float32 {tolerance('gloo', torch.float32, 'collective')}, "
         f"bfloat16 {tolerance('gloo', torch.bfloat16, 'collective')}; cases are fresh random "
         "tensors on each run",)
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _shapes(ws: int, rng) -> list[tuple[str, tuple, str]]:
    odd = rng.randrange(1, 200) * ws + rng.randrange(1, ws) if ws > 1 else 7
    regular = [(MATCH, (ws,), "float32"), (MATCH, (8 * ws,), "float32"),
               (MATCH, (2 * ws, 3), "float32"), (MATCH, (rng.randrange(256, 1024) * ws,), "float32"),
               (MATCH, (4 * ws,), "float64"), (MATCH, (6 * ws,), "bfloat16")]
    return regular + awkward_cases(ws, odd)


def awkward_cases(ws: int, odd: int) -> list[tuple[str, tuple, str]]:
    """Lengths 0, 1, N - 1, 2 N + 1 and ``odd``, each once: a case's name finds its messages."""
    lengths = dict.fromkeys((0, 1, max(ws - 1, 1), 2 * ws + 1, odd))
    return [("awkward_lengths", (n,), "float32") for n in lengths]


def case_inputs(shapes, rng, world_size: int) -> list[dict]:
    """Per rank, ``{"cases": [{"crit", "case", "x"}]}`` with fresh random tensors of ``shapes``.

    Args:
        shapes: ``(criterion, shape, dtype name)`` triples.
        rng: the grader's ``random.Random``.
        world_size: ranks.
    """
    gens = [torch.Generator().manual_seed(rng.getrandbits(62)) for _ in range(world_size)]
    per_rank = [{"cases": []} for _ in range(world_size)]
    for crit, shape, dtype in shapes:
        for r in range(world_size):
            if dtype == "bfloat16":  # small integers: every partial sum is exact in bfloat16
                x = torch.randint(-8, 9, shape, generator=gens[r]).to(torch.bfloat16)
            else:
                x = torch.randn(shape, generator=gens[r], dtype=torch.float64).to(_DTYPES[dtype])
            per_rank[r]["cases"].append({"crit": crit, "case": f"shape {tuple(shape)}, {dtype}",
                                         "x": x})
    return per_rank


def run_cases(link, fn, cases: list) -> list[dict]:
    """Call ``fn`` on a copy of each case's tensor; return it, whether it stayed the same
    tensor (storage and shape), and what ``fn`` returned when that is a tensor."""
    out = []
    for c in cases:
        x = c["x"].clone()
        ptr, shape = x.data_ptr(), tuple(x.shape)
        begin(link, c["case"])
        ret = fn(x)
        out.append({"x": x, "same": x.data_ptr() == ptr and tuple(x.shape) == shape,
                    "ret": ret if isinstance(ret, torch.Tensor) else None})
    return out


class RingAllReduce(Exercise):
    """``ring_all_reduce(tensor, group=None)``: an in-place sum from point-to-point messages."""

    name, exercise, title = "ring_all_reduce", "04", "Ring all-reduce from send/recv"
    defines = (("main", "ring_all_reduce"), ("chunk_bounds", "chunk_bounds"),
               ("reduce_scatter", "ring_reduce_scatter"), ("all_gather", "ring_all_gather"))
    world_sizes = (2, 3, 4)
    dist_api = P2P
    dist_why = ("The ring is built from messages between neighbours: the grader's process group "
                "offers only send, recv, isend, irecv, P2POp and batch_isend_irecv.")
    criteria = (
        Criterion(MATCH, "leaves the same sum as dist.all_reduce on every rank (world sizes 2, 3, "
                  "4; float32, float64, bfloat16; 1-D and 2-D)",
                  "Write out, for three ranks on paper, the chunk each rank sends at each step "
                  "and the chunk its left neighbour expects to receive then.", weight=4),
        Criterion("awkward_lengths", "also works for lengths 0, 1, fewer than the world size "
                  "and not divisible by it",
                  "A length the regular cases do not have fails: see the why-line for which.",
                  weight=2),
        Criterion("in_place", "updates the tensor it is given (like dist.all_reduce), any shape",
                  "The tensor you were given still holds its old values: the sum was written "
                  "into a new tensor (a copy, not a view of the given one), which the caller "
                  "never sees.", needs=(MATCH,)),
        Criterion("ring_neighbours_only", "the ring turns left: rank r only sends to r - 1 and "
                  "receives from r + 1 (in the all-reduce and in each half)",
                  "A rank exchanged messages with a rank that is not its neighbour on the "
                  "leftward ring (the wrap-around from rank 0 to the last rank included).",
                  weight=3, needs=(MATCH,)),
        Criterion("bandwidth_optimal", "for every length, each rank sends exactly the bytes of "
                  "the chunks the ring's steps carry: every chunk but its own in the "
                  "reduce-scatter, every chunk but its left neighbour's in the all-gather",
                  "A rank sent another number of bytes than the ring's chunks hold: a message "
                  "carried more than one chunk, chunks were padded to one length, or the data "
                  "went through one rank that collected everything.",
                  weight=2, needs=(MATCH, "ring_neighbours_only")),
        Criterion("chunk_bounds_correct", "chunk_bounds(numel, world_size, index) cuts like "
                  "lesson 04's ring (as dist.reduce_scatter_tensor cuts a padded tensor), also "
                  "when several chunks are short or empty",
                  "Your bounds leave a gap or an overlap, or cut other lengths than lesson 04's "
                  "ring: write out on paper the chunks of 9 elements on 4 ranks and of 5 "
                  "elements on 4 ranks.", requires="chunk_bounds"),
        Criterion("reduce_scatter_owns_chunk_r", "after ring_reduce_scatter, chunk r on rank r "
                  "holds the sum over all ranks", "The fully summed chunk ends on the wrong "
                  "rank: the chunk a rank receives at the last step, from its right neighbour, "
                  "is not its own chunk r, so the order in which it sends chunks starts at the "
                  "wrong index.",
                  requires="reduce_scatter"),
        Criterion("all_gather_copies_chunks", "ring_all_gather copies each rank's chunk r to every "
                  "rank", "Chunks that were already complete changed: a received chunk was "
                  "added to the local copy instead of replacing it, or a rank passed on a chunk "
                  "it did not yet hold complete.", requires="all_gather"),
        no_delegation(MATCH),
        no_deadlock(MATCH),
    )
    verdicts = "dpcourse.grading.checks.ring_verdicts"
    notes = NOTES

    # -- grader: fresh cases ---------------------------------------------------------------
    def make_inputs(self, rng, world_size):
        from dpcourse.grading import oracles

        per_rank = case_inputs(_shapes(world_size, rng), rng, world_size)
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        for numel in (world_size, 5 * world_size + 1, rng.randrange(20, 300)):
            final = torch.randn(numel, generator=gen)
            for r in range(world_size):
                per_rank[r].setdefault("rs", []).append(torch.randn(numel, generator=gen))
                lo, hi = oracles.chunk_bounds(numel, world_size, r)
                x = torch.full((numel,), float("nan"))
                x[lo:hi] = final[lo:hi]
                per_rank[r].setdefault("ag", []).append(x)
        # 5 and 9 elements on 4 ranks: tensor_split and torch.chunk cut them otherwise
        queries = [(n, w, i) for n in (0, 1, 2, 5, 9, 12, rng.randrange(100, 5000))
                   for w in (1, 2, 3, 4, rng.randrange(5, 9)) for i in range(w)]
        for r in range(world_size):
            per_rank[r]["bounds"] = queries if r == 0 else []
        return per_rank

    # -- rank: call the learner's code --------------------------------------------------------
    @staticmethod
    def rank_run(link, learner, inputs):
        out = {"rs": [], "ag": [], "bounds": []}
        bounds = learner.get("chunk_bounds")
        if bounds is not None:
            begin(link, "chunk_bounds")
            for numel, w, i in inputs["bounds"]:
                try:
                    got = bounds(numel, w, i)
                    out["bounds"].append([int(v) for v in got])
                except Exception as exc:  # noqa: BLE001 - reported as this query's failure
                    out["bounds"].append(f"raised {type(exc).__name__}: {exc}")
        out["cases"] = run_cases(link, learner["main"], inputs["cases"])
        for key, role in (("rs", "reduce_scatter"), ("ag", "all_gather")):
            fn = learner.get(role)
            for i, x in enumerate(inputs[key] if fn is not None else []):
                x = x.clone()
                begin(link, f"{role} {i}")
                fn(x)
                out[key].append(x)
        return out

    def explain(self, text: str) -> str:
        found = re.search(r"received (\d+) (\w+) elements .* into a buffer of (\d+) (\w+) "
                          r"elements", text)
        if found and found[2] != found[4]:
            return ("The receive buffer has another dtype than what the peer sends: a buffer "
                    "made in torch's default dtype (float32) cannot take another dtype's chunk.")
        if found:
            return ("A rank received a chunk of another length than its buffer: at that step "
                    "the sender and the receiver picked different chunks (on the leftward ring "
                    "a rank receives the chunk its right neighbour sends).")
        if "is not available to graded code" in text:
            return self.dist_why
        return ""
