"""Exercise 10: make a bucketed wrapper Join-aware (a shadow all-reduce per bucket).

The learner's ``JoinableDDP(module, bucket_cap_mb=...)`` implements torch's
``Joinable`` interface. The rank trains it under ``Join([model],
divide_by_initial_world_size=...)`` on batch counts that differ between ranks
(by 0 to 3), on a model with a frozen layer, and returns each step's averaged
gradients and the parameters every rank holds after ``Join`` exits. ``Join``
is torch's own class; in the rank its two collectives (the "not joined yet"
all-reduce and the "who is left?" all-reduce) travel through the grader like
the learner's, and the handle ``notify_join_context`` returns behaves as
torch's (``wait``, ``result``, ``get_future``).

The grader computes what torch DDP under ``Join`` leaves
(:func:`~dpcourse.grading.checks.join_verdicts.join_reference`; the tests hold
it against ``DistributedDataParallel`` + ``Join`` on gloo) and compares: the
gradients of every step on the ranks that still had data, and the final
parameters on every rank. What runs in the ranks is
:mod:`~dpcourse.grading.checks.join_rank`; the verdicts are
:mod:`~dpcourse.grading.checks.join_verdicts`, which ranks cannot import.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks import join_rank
from dpcourse.grading.checks.base import Exercise
from dpcourse.grading.checks.join_rank import BATCH, CASES, IN, OUT
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES


class JoinShadow(Exercise):
    """``JoinableDDP(module, bucket_cap_mb=...)``: torch's ``Join`` drives it on uneven inputs."""

    name, exercise, title = "join_shadow", "10", "A Join-aware bucketed wrapper"
    defines = (("main", "JoinableDDP"),)
    world_sizes = (2, 3)
    dist_api = COLLECTIVES
    allowed_imports = {"dpcourse.ddp.join": {"Join", "Joinable", "JoinHook"}}
    timeout = 45.0
    criteria = (
        Criterion("shadows_each_step", "while others still train, each main_hook call on a "
                  "rank without data issues the collectives of the others' gradient "
                  "synchronisation: one all-reduce per bucket, same sizes, same order",
                  "A rank that has run out of data meets the others' collectives only through "
                  "main_hook, which Join calls once per step of the others (after Join's own "
                  "all-reduce, which answers notify_join_context). Issue there what "
                  "finish_gradient_synchronization issues on the others: one all-reduce per "
                  "bucket of the wrapper's own buckets (frozen parameters are in none), with "
                  "as many elements, in the same order, contributing zeros.", weight=2),
        Criterion("join_interface", "Join([model]) works: join_hook(**kwargs) returns a hook "
                  "with main_hook and post_hook, join_device is the parameters' device, "
                  "join_process_group the group the wrapper averages over",
                  "Join asks the wrapper for its hook (join_hook receives Join's keyword "
                  "arguments), and for the device and group of its own one-element "
                  "all-reduces: those of the parameters, and the default process group."),
        Criterion("average_over_world", "with divide_by_initial_world_size=True (Join's "
                  "default) each step's gradients equal torch DDP + Join's: the sum over the "
                  "ranks with data divided by the world size",
                  "A joined rank contributes zeros, and torch still divides by the world size: "
                  "the ranks with data are averaged as if the joined ones had a zero gradient. "
                  "A ratio in the message below 1 or above 1 means another divisor was used, "
                  "or a joined rank added non-zero gradients (its own, from its last step).",
                  weight=2),
        Criterion("average_over_ranks_with_data", "with divide_by_initial_world_size=False "
                  "each step's gradients equal torch DDP + Join's: the sum divided by the number "
                  "of ranks that still have data",
                  "Join passes divide_by_initial_world_size to join_hook. When it is False, the "
                  "divisor is the number of ranks that announced data in this step: that is "
                  "the result of the all-reduce notify_join_context starts in forward (each "
                  "rank with data adds 1, Join adds 0 for a joined rank). Keep its handle and "
                  "read it before dividing.", weight=2),
        Criterion("ranks_agree_at_exit", "after Join exits every rank holds the parameters a "
                  "rank that joined last had when it finished training",
                  "A rank that joined early stopped updating its parameters. In post_hook, "
                  "agree on one rank that joined last (is_last_joiner says whether this rank "
                  "is one; an all-reduce with MAX over the candidates' ranks picks the same "
                  "one everywhere) and broadcast its parameters to all. Rank 0 is not "
                  "necessarily a last joiner.", weight=2),
        Criterion("matches_torch_join", "after Join exits, every rank's parameters (frozen "
                  "layer included) equal those torch DDP + Join leaves on the same data",
                  "Check the other criteria first: each names one cause (a divisor, a "
                  "missing copy at the end).", weight=2),
        no_delegation("shadows_each_step"), no_deadlock("shadows_each_step"),
    )
    notes = (f"compared with torch DDP + Join (recomputed by the grader) to rtol, atol = "
             f"{tolerance('gloo', torch.float32, 'vs_ddp')}: the ranks' gradients are added in "
             "another order than gloo's, which changes float32 sums by a few ulps; any wrong "
             "divisor, missing shadow or stale copy is far larger. Fresh random data on each run",)

    def make_inputs(self, rng, world_size):
        seeds = [rng.getrandbits(31) for _ in range(world_size)]
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        per_rank = [{"seed": seeds[r], "cases": []} for r in range(world_size)]
        for name, counts, divide in CASES[world_size]:
            for r in range(world_size):
                batches = [(torch.randn(BATCH, IN, generator=gen),
                            torch.randn(BATCH, OUT, generator=gen)) for _ in range(counts[r])]
                per_rank[r]["cases"].append({"case": name, "divide": divide,
                                             "batches": batches})
        return per_rank

    rank_run = staticmethod(join_rank.rank_run)
    verdicts = "dpcourse.grading.checks.join_verdicts"

    def explain(self, text):
        if "disagree on collective number" in text and "all_reduce of 4 bytes" in text:
            return ("An all-reduce of 4 bytes against a larger one: a rank without data was "
                    "already in Join's next one-element round ('does anyone still have data?') "
                    "while another rank synchronised a bucket, so main_hook issued fewer "
                    "collectives than a step of the others (or none).")
        if "disagree on collective number" in text and "broadcast" in text:
            return ("A broadcast against another collective: post_hook runs on every rank, "
                    "whether it joined early or last, and all of them must take part in the "
                    "same agreement on the source rank and in the same broadcasts, in order.")
        if "disagree on collective number" in text:
            return ("The ranks issued different collectives at the same point: compare what "
                    "a rank without data issues in main_hook with what the others issue in a "
                    "step (notify_join_context's all-reduce in forward, answered by Join "
                    "itself, then one all-reduce per bucket).")
        if "not finished after" in text:
            return ("The named rank waited in a collective that another rank never issued: "
                    "either a rank left Join while others still trained (main_hook must shadow "
                    "every collective of their step), or forward did not notify the join "
                    "context, so Join never learnt that ranks still had data.")
        if "_join_config" in text or "calls the ``Joinable`` constructor" in text:
            return ("The wrapper's constructor must also run Joinable's constructor: it sets "
                    "the state Join fills in.")
        if "abstract" in text:
            return ("Joinable is an abstract class: the wrapper must define join_hook, and "
                    "join_device and join_process_group as properties.")
        return ""

