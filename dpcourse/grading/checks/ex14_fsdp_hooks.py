"""Exercise 14: the hooks of one FSDP unit (gather, free, gather again, reduce-scatter, free).

The learner writes ``UnitHooks(unit, flats, group=None)``, which registers the
hooks of one unit. The rank builds a three-unit model (``inp``, ``mid``,
``out``; ``mid`` holds a frozen LayerNorm weight, so it has a trainable and a
frozen flat), cuts every unit into :class:`~dpcourse.fsdp.flat_params.FlatParams`
(35, 55 + 7 and 21 elements: none divisible by 2, most not by 3), hands each
unit to ``UnitHooks`` and trains the shards for 3 steps with SGD (momentum)
and with AdamW. Once backward returns, the loop frees what is still gathered
(frozen flats: no gradient says when their backward is over).

The rank's own hooks, registered after the learner's, note at every unit's
forward start and end, and at its backward start, which flats hold memory and
what the module computes with; they stop a step, with a message, before torch
would read freed memory (which would crash the rank). The grader computes one
process training on the whole batch, the averaged gradient's shards and the
collectives FSDP issues, and compares with the outputs and with its own record
of every collective (the facts CommTrace records: op, bytes, order). What runs
in the ranks is :mod:`~dpcourse.grading.checks.fsdp_watch`; the verdicts are
:mod:`~dpcourse.grading.checks.fsdp_verdicts`, which ranks cannot import.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import Exercise
from dpcourse.grading.checks.fsdp_watch import BATCH, IN, OUT, RUNS, STEPS, TOL, train
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES, SHARDED, SHARDED_WHY


class FSDPHooks(Exercise):
    """``UnitHooks(unit, flats, group=None)``: one FSDP unit's gather, free and reduce-scatter."""

    name, exercise, title = "fsdp_hooks", "14", "The hooks of an FSDP unit"
    defines = (("main", "UnitHooks"),)
    world_sizes = (2, 3)
    dist_api, dist_why = SHARDED + COLLECTIVES, SHARDED_WHY
    allowed_imports = {"dpcourse.fsdp.flat_params": {"FlatParams", "gathered"}}
    timeout = 60.0
    criteria = (
        Criterion("gathers_before_forward", "when a unit's forward starts, every parameter of "
                  "it is a view into its flat's gathered buffer and holds the full weight",
                  "When the unit's forward started, its weights were not the full weights, or "
                  "not views into its flats' full buffers. Before a unit computes, each of its "
                  "flats is gathered from every rank's shard into the buffer that alloc_unsharded "
                  "hands out, and the module is pointed at views of it: through gathered for a "
                  "trainable flat (autograd's only path back to the shard), at the full buffer "
                  "itself for a frozen one. A copy instead of a view keeps memory that freeing "
                  "does not release."),
        Criterion("frees_after_forward", "when a unit's forward ends, none of its flats holds "
                  "memory", "A unit still held gathered weights after its forward had ended. "
                  "Its forward no longer needs them and its backward gathers them again: "
                  "keeping them adds up every unit's full weights over the forward.",
                  needs=("gathers_before_forward",)),
        Criterion("gathers_before_backward", "when a unit's backward starts, its flats are "
                  "gathered again, into the same buffers autograd saved views of",
                  "A unit's backward started with its weights freed, or gathered into a buffer "
                  "autograd never saw. The backward needs the weights the forward used, and "
                  "autograd saved views of each flat's full buffer: those same buffers must be "
                  "gathered again by a hook that runs when the unit's output gradient is known, "
                  "one registered on the output while the unit's forward ends.", weight=2),
        Criterion("frees_after_backward", "once a unit's gradient is reduce-scattered its "
                  "trainable flats hold no memory (checked when the next unit's backward "
                  "starts, and when backward returns)",
                  "A unit's trainable weights were still gathered after its gradient had been "
                  "reduce-scattered. Its backward is over at that moment; keeping them means "
                  "holding every unit's full weights by the end of backward.",
                  needs=("gathers_before_backward",)),
        Criterion("reduce_scatters_gradients", "at optimizer.step(), each trainable shard's "
                  ".grad is this rank's chunk of the gradient averaged over the ranks; frozen "
                  "shards have none",
                  "The shard's gradient was not this rank's chunk of the gradient averaged over "
                  "the ranks. The gradient hook receives this rank's own gradient of the whole "
                  "flat, and a reduce-scatter leaves each rank the sum of its chunk over all "
                  "ranks. A ratio equal to the world size means the sum was never divided; no "
                  "gradient at all means nothing was stored on the shard.", weight=2),
        Criterion("collectives_as_fsdp", "each step issues exactly: forward, one all-gather "
                  "per flat, unit by unit; backward, in reverse unit order, the unit's "
                  "all-gathers again, then one reduce-scatter per trainable flat; sizes N x "
                  "chunk", "The collectives differ from FSDP's. An all-reduce of the gradient "
                  "leaves every rank the whole gradient, which sharding exists to avoid, and "
                  "moves twice the bytes of a reduce-scatter; an extra or missing gather shows "
                  "a hook that runs too often, or never.",
                  weight=2, needs=("gathers_before_forward",)),
        Criterion("matches_single_process", "after each of 3 steps (SGD with momentum, and "
                  "AdamW), the parameters assembled from the ranks' shards equal one process "
                  "training on the whole batch (the frozen weight unchanged)",
                  "Check the other criteria first: each names one part of the step.", weight=2),
        no_delegation("matches_single_process"), no_deadlock("matches_single_process"),
    )
    notes = (f"model: units inp (35 elements), mid (55 trainable + 7 frozen), out (21); world "
             f"sizes 2 and 3; parameters compared with one process to atol={TOL[1]:g}, "
             f"gradients to (rtol, atol) {tolerance('gloo', torch.float32, 'vs_single')}; fresh "
             "random seeds and batches on each run",)

    def make_inputs(self, rng, world_size):
        seed = rng.getrandbits(31)
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        return [{"seed": seed, "batches": [(torch.randn(BATCH, IN, generator=gen),
                                            torch.randn(BATCH, OUT, generator=gen))
                                           for _ in range(STEPS)]}
                for _ in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        return [train(link, learner["main"], inputs, run) for run in range(len(RUNS))]

    verdicts = "dpcourse.grading.checks.fsdp_verdicts"

    def explain(self, text):
        if "SIGSEGV" in text or "SIGBUS" in text:
            return ("A rank crashed inside torch: something read or wrote a tensor whose memory "
                    "had been freed. A flat's buffer may be freed only after the last use of its "
                    "weights, and must be allocated and gathered again before anything reads it.")
        if "has no memory" in text:
            return ("A collective touched a buffer that held no memory: it was not allocated "
                    "before the gather, or it was freed before the collective had finished.")
        if "not available to graded code" in text:
            return self.dist_why
        return ""
