"""Exercise 02: an all-gather of pieces of different lengths, built from all-reduce and broadcast.

Every rank holds a 1-D tensor of its own length (lengths differ between ranks,
one may be empty) and dtype shared by all ranks. ``all_gather_uneven(tensor,
group=None)`` must return, on every rank, every rank's tensor concatenated in
rank order: what ``dist.all_gather`` gives for equal lengths, which torch's
all-gather cannot do directly for unequal ones. The graded ``torch.distributed``
offers only the two collectives the lesson showed in use, ``all_reduce`` and
``broadcast`` (and ``barrier``); the grader delivers them and refuses a
collective whose tensors differ between ranks, as torch would hang or corrupt
data. The expected result is the concatenation the grader computes itself.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import Exercise, CaseVerdict, begin, returned
from dpcourse.grading.checks.random_inputs import torch_generator
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES

# (criterion, dtype) of each case; the dtype cases have uneven lengths too.
CASES = (("uneven_lengths", torch.float32), ("equal_lengths", torch.float32),
         ("empty_piece", torch.float32), ("keeps_dtype", torch.float64),
         ("keeps_dtype", torch.int64))


def case_lengths(crit: str, world_size: int, rng) -> list[int]:
    """Each rank's length in a case: equal, one rank empty, else distinct odd lengths."""
    if crit == "equal_lengths":
        return [rng.randrange(1, 6)] * world_size
    lengths = rng.sample(range(1, 12, 2), world_size)
    if crit == "empty_piece":
        lengths[rng.randrange(world_size)] = 0
    return lengths


def _piece(length: int, dtype: torch.dtype, gen) -> torch.Tensor:
    if dtype == torch.int64:
        # beyond float32's 24-bit mantissa: a detour through float32 changes them
        return torch.randint(2**40, 2**41, (length,), generator=gen)
    return torch.randn(length, generator=gen, dtype=torch.float64).to(dtype)


class UnevenAllGather(Exercise):
    """``all_gather_uneven(tensor, group=None)``: every rank's tensor, in rank order."""

    name, exercise, title = "uneven_all_gather", "02", "All-gather of pieces of different lengths"
    defines = (("main", "all_gather_uneven"),)
    world_sizes = (2, 3)
    dist_api = COLLECTIVES
    dist_why = ("This exercise builds a gather from the collectives of the lesson: the grader's "
                "process group offers all_reduce, broadcast and barrier.")
    criteria = (
        Criterion("uneven_lengths", "with lengths that differ between ranks, every rank ends "
                  "with every rank's elements and nothing else (world sizes 2 and 3)",
                  "A rank's own tensor tells it nothing about the length of another rank's: "
                  "what each rank receives, and the result's length, must come from the other "
                  "ranks before any element moves.", weight=3),
        Criterion("equal_lengths", "with equal lengths, every rank ends with every rank's "
                  "elements and nothing else (what dist.all_gather gives)",
                  "This fails even where every length is the same, so sizes are not the cause: "
                  "look at which values are missing or repeated on which rank.", weight=2),
        Criterion("empty_piece", "a rank holding no elements still takes part, and every rank "
                  "ends with the other ranks' elements",
                  "A rank holding nothing has no elements to add, but it must still issue every "
                  "collective the others issue, with the same sizes, or their results go "
                  "wrong.", weight=2),
        Criterion("rank_order", "on every rank the pieces sit in rank order (rank 0's first), as "
                  "dist.all_gather orders them",
                  "Every element arrived, but on some rank the pieces are arranged differently: "
                  "a piece's position must follow its sender's rank, whichever rank assembles "
                  "the result.", weight=2, needs=("uneven_lengths",)),
        Criterion("keeps_dtype", "float64 and int64 pieces come back in their dtype with every "
                  "value exact",
                  "The values were rounded on their way: part of the result passed through "
                  "torch's default dtype (float32), which keeps 24 bits of mantissa.",
                  needs=("uneven_lengths",)),
        Criterion("inputs_unchanged", "the tensor each rank passed in holds its values afterwards",
                  "A rank's own tensor was overwritten: it served as the buffer of a collective "
                  "that wrote other ranks' data into it.", needs=("uneven_lengths",)),
        no_delegation("uneven_lengths"), no_deadlock("uneven_lengths"),
    )
    notes = ("compared exactly with the grader's concatenation of every rank's tensor; fresh "
             "random lengths and values on each run",)
    error_hints = ((("disagree on collective",),
                    "The ranks passed tensors of different sizes to one collective: in a "
                    "broadcast every rank, sender and receivers alike, must pass a tensor of the "
                    "sender's number of elements and dtype, and in an all-reduce all ranks the "
                    "same."),
                   (("longest length times",),
                    "The result still carries the room reserved for the longest piece."))

    def make_inputs(self, rng, world_size):
        gen = torch_generator(rng)
        per_rank = [{"cases": []} for _ in range(world_size)]
        for crit, dtype in CASES:
            lengths = case_lengths(crit, world_size, rng)
            label = f"{str(dtype).replace('torch.', '')}, lengths {lengths}"
            for r, n in enumerate(lengths):
                per_rank[r]["cases"].append({"crit": crit, "label": label,
                                             "tensor": _piece(n, dtype, gen)})
        return per_rank

    @staticmethod
    def rank_run(link, learner, inputs):
        gather, out = learner["main"], []
        for case in inputs["cases"]:
            mine = case["tensor"].clone()
            begin(link, case["label"])
            got = gather(mine)
            out.append({"got": returned(got), "after": mine})
        return out

    def judge(self, ws, inputs, outputs, events):
        recs = []
        for k, case in enumerate(inputs[0]["cases"]):
            pieces = [inputs[r]["cases"][k]["tensor"] for r in range(ws)]
            label = case["label"]
            for r in range(ws):
                got = outputs[r][k]["got"]
                recs += self._compare(got, pieces, r, case["crit"], label)
                changed = mismatch(outputs[r][k]["after"], pieces[r], 0, 0)
                recs.append(CaseVerdict("inputs_unchanged", not changed,
                                        f"rank {r}'s tensor afterwards: {changed}", label))
        return recs

    @staticmethod
    def _compare(got, pieces, rank, crit, label) -> list[CaseVerdict]:
        """Judge one rank's result, each failure under the criterion of its cause."""
        want, lengths = torch.cat(pieces), [len(p) for p in pieces]
        # a dtype case with the wrong elements fails for that reason, like any other case
        elements = "uneven_lengths" if crit == "keeps_dtype" else crit

        def fail(name, detail):
            return [CaseVerdict(name, False, f"rank {rank} {detail}", label)]

        if not isinstance(got, torch.Tensor):
            return fail(elements, f"returned {got}, expected a tensor")
        if got.dim() != 1:
            return fail(elements, f"returned shape {tuple(got.shape)}, expected a 1-D tensor")
        if len(got) != len(want):
            padded = " (the longest length times the world size)" \
                if len(got) == max(lengths) * len(pieces) else ""
            return fail(elements, f"returned {len(got)} elements{padded}, expected {len(want)}, "
                                  f"the sum of the ranks' lengths {lengths}")
        dtype = CaseVerdict("keeps_dtype", got.dtype == want.dtype, f"rank {rank} returned "
                            f"{str(got.dtype)[6:]} for {str(want.dtype)[6:]} pieces", label)
        g, w = got.double(), want.double()
        if torch.equal(g, w):
            return [CaseVerdict(elements, True, "", label),
                    CaseVerdict("rank_order", True, "", label), dtype]
        if sorted(g.tolist()) == sorted(w.tolist()):
            return [CaseVerdict(elements, True, "", label), dtype,
                    CaseVerdict("rank_order", False, f"rank {rank} holds every rank's elements, "
                                "but not in rank order", label)]
        if want.dtype != torch.float32 and torch.equal(g, want.float().double()):
            return [CaseVerdict(elements, True, "", label), dtype,
                    CaseVerdict("keeps_dtype", False, f"rank {rank}'s values are the float32 "
                                f"roundings of the {str(want.dtype)[6:]} pieces", label)]
        return fail(elements, f"holds other values: {mismatch(g, w, 0, 0)}")
