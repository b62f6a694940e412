"""The grader's side of exercise 04: the ring's sums, halves, bounds and messages judged.

Imported only by the grader (ranks cannot import it).
"""

from __future__ import annotations

import math
import re

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict, events_of, failed
from dpcourse.grading.checks.ex04_ring import MATCH
from dpcourse.grading.criteria import mismatch, tolerance

_SCALED = "every value {} times too small or too large"
_ALL = "all of them"
_EVEN = "an even split (chunk lengths differing by at most one) everywhere"
_PAST = "past the tensor's end"
_PADDED = "what chunks padded to ceil(numel / N) elements carry"


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Judge every rank's sums, halves, bounds and messages against the oracles."""
    recs = []
    if outputs[0]["bounds"]:  # first: the halves' hints depend on whether it failed
        recs.append(_judge_bounds(inputs[0]["bounds"], outputs[0]["bounds"]))
    for k, case in enumerate(inputs[0]["cases"]):
        name, crit = case["case"], case["crit"]
        xs = [inputs[r]["cases"][k]["x"] for r in range(ws)]
        want = oracles.all_reduce_sum(xs)
        rtol, atol = tolerance("gloo", want.dtype, "collective")
        numel, elsize = want.numel(), want.element_size()
        for r in range(ws):
            got = outputs[r]["cases"][k]
            diff = mismatch(got["x"], want, rtol, atol)
            ret = got["ret"]
            if diff and ret is not None and not mismatch(ret.reshape(want.shape), want, rtol,
                                                         atol):
                diff = ("the tensor you were given still differs from the sum, but your "
                        "function returned the sum in a new tensor: write the result into "
                        "the given tensor (in place), as dist.all_reduce does")
            elif diff and numel >= ws:
                chunks = [oracles.chunk_bounds(numel, ws, i) for i in range(ws)]
                wrong = [i for i, (a, b) in enumerate(chunks) if mismatch(
                    got["x"].flatten()[a:b], want.flatten()[a:b], rtol, atol)]
                diff += f"; wrong chunks on rank {r}: {wrong} of {list(range(ws))}"
                if not mismatch(got["x"] * ws, want, rtol, atol) or \
                        not mismatch(got["x"], want * ws, rtol, atol):
                    diff += f" ({_SCALED.format(ws)})"
                elif len(wrong) == ws:
                    diff += f" ({_ALL})"
            mine = events_of(events[r], name)
            received = sum(e["nbytes"] for e in mine if e["op"] == "delivered")
            if not diff and ws > 1 and numel and received < numel * elsize:
                diff = (f"rank {r} holds the sum but received only {received} bytes through "
                        f"torch.distributed; the other ranks' data takes at least "
                        f"{numel * elsize}: it came some other way")
                recs.append(CaseVerdict("no_delegation", False, diff, name))
            recs.append(CaseVerdict(crit, not diff, f"rank {r}: {diff}" if diff else "", name))
            if numel > 1 and want.dtype == torch.float32:
                recs.append(CaseVerdict("in_place", got["same"],
                                   "the tensor was replaced or reshaped instead of updated "
                                   "in place", name))
            recs.append(_neighbours(r, ws, mine, name))
            if diff or not recs[-1].passed:
                continue  # the leftward ring's bytes: counted where it turns left to the sum
            sent = sum(e["nbytes"] for e in mine if e["op"] == "send")
            need = oracles.ring_sent_bytes(numel, ws, r, elsize)
            detail = f"rank {r} sent {sent} bytes, the ring sends {need}"
            if numel % ws and sent == 2 * (ws - 1) * -(-numel // ws) * elsize:
                detail += f" ({_PADDED})"
            recs.append(CaseVerdict("bandwidth_optimal", sent == need, detail, name))
    _judge_halves(ws, inputs, outputs, recs)
    for key, role in (("rs", "reduce_scatter"), ("ag", "all_gather")):
        for i in range(len(outputs[0][key])):
            recs += [_neighbours(r, ws, events_of(events[r], f"{role} {i}"), f"{role} {i}")
                     for r in range(ws)]
    return recs

def _judge_halves(ws, inputs, outputs, recs) -> None:
    for i in range(len(outputs[0]["rs"])):
        xs = [inputs[r]["rs"][i] for r in range(ws)]
        total = oracles.all_reduce_sum(xs)
        for r in range(ws):
            lo, hi = oracles.chunk_bounds(total.numel(), ws, r)
            diff = mismatch(outputs[r]["rs"][i][lo:hi], total[lo:hi], 1e-5, 1e-5)
            recs.append(CaseVerdict("reduce_scatter_owns_chunk_r", not diff,
                               f"rank {r}, chunk {r} of length {total.numel()}: {diff}",
                               f"length {total.numel()}"))
    for i in range(len(outputs[0]["ag"])):
        numel = inputs[0]["ag"][i].numel()
        final = torch.zeros(numel)
        for r in range(ws):
            lo, hi = oracles.chunk_bounds(numel, ws, r)
            final[lo:hi] = inputs[r]["ag"][i][lo:hi]
        for r in range(ws):
            diff = mismatch(outputs[r]["ag"][i], final, 0, 0)
            recs.append(CaseVerdict("all_gather_copies_chunks", not diff, f"rank {r}: {diff}",
                               f"length {numel}"))

def _even_split(numel: int, world_size: int, index: int) -> list[int]:
    """Chunk ``index`` of an even split (the first ``numel % N`` chunks one longer): a mistake."""
    base, extra = divmod(numel, world_size)
    start = index * base + min(index, extra)
    return [start, start + base + (1 if index < extra else 0)]


def _judge_bounds(queries, answers) -> CaseVerdict:
    for (numel, w, i), got in zip(queries, answers):
        want = list(oracles.chunk_bounds(numel, w, i))
        # An empty chunk slices nothing wherever it starts inside the tensor.
        empty = want[0] == want[1] and isinstance(got, list) and len(got) == 2 and \
            0 <= got[0] == got[1] <= numel
        if got != want and not empty:
            detail = f"chunk_bounds({numel}, {w}, {i}) gave {got}, expected {want}"
            if all(a == _even_split(*q) for q, a in zip(queries, answers)):
                detail += f"; your chunks are {_EVEN}"
            elif isinstance(got, list) and got and max(got) > numel:
                detail += f": {_PAST} (numel = {numel})"
            return CaseVerdict("chunk_bounds_correct", False, detail,
                               f"chunk_bounds({numel}, {w}, {i})")
    return CaseVerdict("chunk_bounds_correct", True)


def _neighbours(r: int, ws: int, mine: list, case: str) -> CaseVerdict:
    """Rank ``r`` sent only to its left neighbour and received only from its right one."""
    left, right = (r - 1) % ws, (r + 1) % ws
    stray = sorted({f"{e['op']} {'to' if e['op'] == 'send' else 'from'} rank {e['peer']}"
                    for e in mine if (e["op"] == "send" and e["peer"] != left)
                    or (e["op"] == "recv" and e["peer"] != right)})
    rightward = all(e["peer"] == (right if e["op"] == "send" else left) for e in mine
                    if e["op"] in ("send", "recv"))
    detail = f"rank {r}: {', '.join(stray)} (it sends to {left} and receives from {right})"
    if stray and rightward:
        detail += "; every message went the way lesson 04's ring turns"
    return CaseVerdict("ring_neighbours_only", not stray, detail, case)


def cause(spec, ws: int, rec: CaseVerdict) -> str:
    """The hint for the cause of a failing record of the ring check (see ``follow_causes``)."""
    text = rec.detail
    if rec.criterion == "chunk_bounds_correct":
        if _EVEN in text:
            return ("Your chunks differ in length by at most one, longer ones first. Lesson "
                    "04's ring cuts as dist.reduce_scatter_tensor cuts a tensor padded to a "
                    "multiple of N: every chunk as long as the first, only the last ones short "
                    "or empty. Write out 10 elements on 4 ranks both ways.")
        if _PAST in text:
            return ("A chunk reaches past the tensor's end: when N chunks of the lesson's "
                    "length are more than the tensor holds, the last chunks stop at its end, "
                    "and one that would start beyond it is empty there.")
        return ""
    if rec.criterion in ("reduce_scatter_owns_chunk_r", "all_gather_copies_chunks") and \
            failed(spec, "chunk_bounds_correct"):
        return ("chunk_bounds fails too (see chunk_bounds_correct), and your halves cut the "
                "tensor with it: fix it first.")
    if rec.criterion == "bandwidth_optimal" and _PADDED in text:
        return ("Only lengths that N does not divide send too much: every message carried a "
                "chunk padded to the first chunk's length. Send each chunk's real elements "
                "(cut by chunk_bounds), and nothing for an empty one.")
    if rec.criterion == "ring_neighbours_only" and "the way lesson 04's ring turns" in text:
        return ("Your ring turns right, like lesson 04's: rank r sent to r + 1. This ring turns "
                "left (send to r - 1, receive from r + 1), and rank r must still end the "
                "reduce-scatter with chunk r: work out anew which chunk each rank sends at "
                "each step.")
    if rec.criterion == MATCH:
        if "times too small or too large" in text:
            return ("Every value is N times off: the sum was divided by the world size "
                    "(all_reduce sums, it does not average), or every contribution was added "
                    "N times.")
        if "returned the sum in a new tensor" in text:
            return ("The sum is right but lives in a tensor the caller never sees: write it "
                    "into the given tensor (a slice of a view of it shares its memory).")
        if _ALL in text:
            return ("Every chunk is wrong: the additions went to the wrong chunks from the "
                    "first step on, or the all-gather passed on partial chunks. Write out for "
                    "three ranks which chunk each rank holds complete after the reduce-scatter "
                    "(rank r: chunk r) and count back from the last step.")
        if "wrong chunks on rank" in text:
            return ("Some chunks are right and others wrong: a rank added or copied a chunk "
                    "into the wrong place. The chunk it sends at a step is not the one its "
                    "left neighbour expects to receive then: on the leftward ring rank r "
                    "receives from r + 1, so the chunk indices run the other way than in "
                    "lesson 04.")
        return ""
    if rec.criterion == "awkward_lengths":
        if failed(spec, MATCH):
            return ("The regular lengths fail too (see matches_all_reduce): this length fails "
                    "for the same reason; fix that first.")
        numel = math.prod(int(v) for v in re.findall(r"\d+", rec.case.split(")")[0]))
        if numel == 0:
            return ("An empty tensor failed while every regular length passed: with 0 elements "
                    "there is nothing to send, and no rank may wait for a message.")
        if numel < ws:
            return ("Only a length smaller than the world size fails: some chunks are empty, "
                    "and an empty chunk must be skipped on both sides of a message (the given "
                    "ring_exchange skips it) or on neither.")
        return ("Only lengths that N does not divide fail: the two sides of a message cut the "
                "tensor differently, or an empty chunk (the last of 9 elements on 4 ranks) was "
                "sent or awaited on one side only; cut every chunk with chunk_bounds on both "
                "sides.")
    return ""
