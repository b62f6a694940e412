"""Exercise 02: predict what each collective leaves on every rank (a pure function)."""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import Exercise, Record, begin
from dpcourse.grading.criteria import Criterion, mismatch, no_delegation

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
HINTS = (
    "After all_reduce (SUM) every rank holds the elementwise sum of ALL ranks' inputs: the same "
    "tensor on every rank, not the mean and not only on rank 0.",
    "reduce_scatter: sum elementwise over ranks, then cut the sum into N equal blocks; rank r "
    "keeps block r (its length is len/N).",
    "all_gather: every rank receives every rank's input, concatenated in rank order: one 1-D "
    "tensor of length N * len (torch.cat, not torch.stack).",
    "broadcast from rank 0: every rank ends with a copy of rank 0's input.")


class CollectiveSemantics(Exercise):
    """``simulate_collective(op, inputs) -> outputs``: predict what each rank holds afterwards."""

    name, exercise, title = "collective_semantics", "02", "What collectives produce"
    defines = (("main", "simulate_collective"),)
    criteria = tuple(Criterion(f"{op}_matches_torch", f"simulate_collective('{op}', ...) gives "
                               f"what dist.{op} gives every rank (groups of 2, 3, 4 ranks)", hint,
                               weight=2)
                     for op, hint in zip(OPS, HINTS)) + (
        Criterion("inputs_unchanged", "the inputs are left as they were (a prediction does not "
                  "modify the ranks' tensors)", "Build new tensors (torch.stack(inputs).sum(0), "
                  "t.clone()); adding into inputs[0] in place changes rank 0's input.",
                  needs=("all_reduce_matches_torch",)),
        no_delegation("all_reduce_matches_torch"))
    notes = ("compared exactly, with fresh integer-valued inputs on each run",)

    def make_inputs(self, rng, world_size):
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        cases = []
        for op in OPS:
            for n in (2, 3, 4):
                k = rng.randrange(1, 5)
                numel = n * k if op == "reduce_scatter" else rng.randrange(1, 7)
                cases.append({"op": op, "n": n, "inputs": [
                    torch.randint(-9, 10, (numel,), generator=gen).float() for _ in range(n)]})
        return [{"cases": cases}]

    @staticmethod
    def rank_run(link, learner, inputs):
        simulate, out = learner["main"], []
        for case in inputs["cases"]:
            xs = [t.clone() for t in case["inputs"]]
            begin(link, f"{case['op']}, {case['n']} ranks")
            got = simulate(case["op"], xs)
            if isinstance(got, (list, tuple)):
                got = [t if isinstance(t, torch.Tensor) else {"type": type(t).__name__}
                       for t in got]
            else:
                got = {"type": type(got).__name__}
            out.append({"got": got, "after": xs})
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = []
        for case, out in zip(inputs[0]["cases"], outputs[0]):
            op, n, xs = case["op"], case["n"], case["inputs"]
            crit, name = f"{op}_matches_torch", f"{n} ranks"
            want = oracles.collective(op, xs)
            got = out["got"]
            if not isinstance(got, list) or len(got) != n:
                what = got["type"] if isinstance(got, dict) else f"a list of {len(got)}"
                recs.append(Record(crit, False, f"expected a list of {n} tensors (one per rank), "
                                   f"got {what}", name))
                continue
            bad = []
            for r in range(n):
                if not isinstance(got[r], torch.Tensor):
                    bad.append(f"rank {r}: expected a tensor, got {got[r]['type']}")
                elif m := mismatch(got[r], want[r], 0, 0):
                    bad.append(f"rank {r}: {m}")
            recs.append(Record(crit, not bad, bad[0] if bad else "", name))
            changed = [r for r in range(n) if mismatch(out["after"][r], xs[r], 0, 0)]
            recs.append(Record("inputs_unchanged", not changed,
                               f"simulate_collective('{op}', ...) changed the input of rank(s) "
                               f"{changed}", name))
        return recs
