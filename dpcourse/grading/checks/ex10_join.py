"""Exercise 10: make a bucketed wrapper Join-aware (a shadow all-reduce per bucket).

The rank trains the learner's ``JoinableDDP`` under torch's own ``Join`` on batch
counts that differ between ranks, on a model with a frozen layer, and returns each
step's gradients and the parameters every rank holds after ``Join`` exits. Join's
own all-reduces travel through the grader like the learner's; each ``main_hook``
and ``post_hook`` call is marked so that the grader can compare what a joined rank
issues with the others' steps. The verdicts, and the reference torch DDP + ``Join``
is held to in the tests, are :mod:`~dpcourse.grading.checks.join_verdicts`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, begin, clone_all
from dpcourse.grading.checks.random_inputs import regression_batches, torch_generator
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES, DistModule

IN, HIDDEN, MID, OUT = 8, 16, 12, 4
BATCH, LR = 4, 0.05
BUCKET_CAP_MB = 200 / 2**20  # two buckets of the trainable parameters: [fc3], [fc1]
JOINABLE_INIT_HINT = ("The wrapper's constructor must also run Joinable's constructor: it sets "
                      "the state Join fills in.")
# (name, batches per rank, divide_by_initial_world_size), per world size.
CASES = {
    2: (("equal counts", (3, 3), True),
        ("rank 1 has 3 more", (1, 4), True),
        ("rank 0 has 2 more, divide by ranks with data", (3, 1), False)),
    3: (("rank 0 joins first, 3 behind", (1, 4, 2), True),
        ("rank 1 joins first, divide by ranks with data", (3, 2, 3), False)),
}


def make_model(seed: int) -> nn.Sequential:
    """Three linear layers built from ``seed``; the middle one is frozen."""
    torch.manual_seed(seed)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(IN, HIDDEN), relu1=nn.ReLU(),
                                      fc2=nn.Linear(HIDDEN, MID), relu2=nn.ReLU(),
                                      fc3=nn.Linear(MID, OUT)))
    model.fc2.requires_grad_(False)
    return model


class _JoinDist(DistModule):
    """``torch.distributed`` as ``Join`` sees it in a graded rank: handles have ``result()``."""

    def all_reduce(self, tensor, *args, **kwargs):
        work = super().all_reduce(tensor, *args, **kwargs)
        if work is not None:
            work.result = lambda: (work.wait(), [tensor])[1]
        return work


def train_under_join(link, learner, inputs) -> list:
    """Train the learner's wrapper under ``Join`` on each case; return what each case left."""
    import torch.distributed.algorithms.join as join_module

    real, join_module.dist = join_module.dist, _JoinDist(link, COLLECTIVES, "")
    try:
        return [_run_case(link, learner["main"], inputs["seed"], case)
                for case in inputs["cases"]]
    finally:
        join_module.dist = real


def _marked(link, hook, out):
    """``hook`` with every ``main_hook`` and ``post_hook`` call marked on the grader's record."""
    main, post = getattr(hook, "main_hook", None), getattr(hook, "post_hook", None)
    out["hook_ok"] = callable(main) and callable(post)
    if out["hook_ok"]:
        def marked_main():
            link.mark("main_hook")
            main()
            link.mark("main_hook_end")

        def marked_post(is_last_joiner):
            link.mark("post_hook")
            post(is_last_joiner)
        object.__setattr__(hook, "main_hook", marked_main)
        object.__setattr__(hook, "post_hook", marked_post)
    return hook


def _run_case(link, cls, seed, case) -> dict:
    from torch.distributed.algorithms.join import Join

    model = make_model(seed)
    begin(link, f"{case['case']}: construction")
    wrapped = cls(model, bucket_cap_mb=BUCKET_CAP_MB)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR)
    out = {"grads": [], "hook_ok": None}
    original = wrapped.join_hook
    object.__setattr__(wrapped, "join_hook", lambda **kw: _marked(link, original(**kw), out))
    begin(link, f"{case['case']}: training")
    with Join([wrapped], divide_by_initial_world_size=case["divide"]):
        out["device"] = str(wrapped.join_device)
        out["group_ok"] = wrapped.join_process_group is None  # dist.group.WORLD in a rank
        for x, y in case["batches"]:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(wrapped(x), y).backward()
            link.mark("finish")
            wrapped.finish_gradient_synchronization()
            link.mark("finish_end")
            out["grads"].append(clone_all(p.grad for p in trainable))
            optimizer.step()
        out["last_own"] = clone_all(model.parameters())
    out["params"] = clone_all(model.parameters())
    return out


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
        Criterion("average_over_world", "with divide_by_initial_world_size=True (the "
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
             f"{tolerance('gloo', torch.float32, 'vs_ddp')}: the grader may add the ranks' "
             "gradients in another order than gloo, which changes float32 sums by a few ulps; any "
             "wrong divisor, missing shadow or stale copy is far larger. Fresh random data on "
             "each run",)
    error_hints = (
        (("disagree on collective number", "all_reduce of 4 bytes"),
         "An all-reduce of 4 bytes against a larger one: a rank without data was already in "
         "Join's next one-element round ('does anyone still have data?') while another rank "
         "synchronised a bucket, so main_hook issued fewer collectives than a step of the "
         "others (or none)."),
        (("disagree on collective number", "broadcast"),
         "A broadcast against another collective: post_hook runs on every rank, whether it "
         "joined early or last, and all of them must take part in the same agreement on the "
         "source rank and in the same broadcasts, in order."),
        (("disagree on collective number",),
         "The ranks issued different collectives at the same point: compare what a rank "
         "without data issues in main_hook with what the others issue in a step "
         "(notify_join_context's all-reduce in forward, answered by Join itself, then one "
         "all-reduce per bucket)."),
        (("not finished after",),
         "The named rank waited in a collective that another rank never issued: either a rank "
         "left Join while others still trained (main_hook must shadow every collective of "
         "their step), or forward did not notify the join context, so Join never learnt that "
         "ranks still had data."),
        (("_join_config",), JOINABLE_INIT_HINT),
        (("calls the ``Joinable`` constructor",), JOINABLE_INIT_HINT),
        (("abstract",),
         "Joinable is an abstract class: the wrapper must define join_hook, and join_device "
         "and join_process_group as properties."),
    )

    def make_inputs(self, rng, world_size):
        seeds = [rng.getrandbits(31) for _ in range(world_size)]
        gen = torch_generator(rng)
        per_rank = [{"seed": seeds[r], "cases": []} for r in range(world_size)]
        for name, counts, divide in CASES[world_size]:
            for r in range(world_size):
                per_rank[r]["cases"].append({"case": name, "divide": divide, "batches":
                                             regression_batches(gen, counts[r], BATCH, IN, OUT)})
        return per_rank

    rank_run = staticmethod(train_under_join)
    verdicts = "dpcourse.grading.checks.join_verdicts"
