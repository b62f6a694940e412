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

The grader computes what torch DDP under ``Join`` leaves (:func:`join_reference`;
the tests hold it against ``DistributedDataParallel`` + ``Join`` on gloo) and
compares: the gradients of every step on the ranks that still had data, and the
final parameters on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, Record, begin, events_of
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES, DistModule

IN, HIDDEN, MID, OUT = 8, 16, 12, 4
BATCH, LR = 4, 0.05
BUCKET_CAP_MB = 200 / 2**20  # two buckets of the trainable parameters: [fc3], [fc1]
# (name, batches per rank, divide_by_initial_world_size), per world size.
CASES = {
    2: (("equal counts", (3, 3), True),
        ("rank 1 has 3 more", (1, 4), True),
        ("rank 0 has 2 more, divide by ranks with data", (3, 1), False)),
    3: (("rank 0 joins first, 3 behind", (1, 4, 2), True),
        ("rank 1 joins first, divide by ranks with data", (3, 2, 3), False)),
}


class FrozenMiddle(nn.Module):
    """Three linear layers; the middle one is frozen (``requires_grad=False``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, MID), \
            nn.Linear(MID, OUT)
        self.fc2.requires_grad_(False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model(seed: int) -> FrozenMiddle:
    torch.manual_seed(seed)
    return FrozenMiddle()


def join_reference(seed0: int, batches: list, divide_by_initial_world_size: bool) -> dict:
    """What torch DDP under ``Join`` computes, in one process.

    Args:
        seed0: rank 0's seed (DDP starts every replica from rank 0's parameters).
        batches: ``batches[rank]`` is that rank's list of ``(x, y)``; the lengths differ.
        divide_by_initial_world_size: as ``Join``'s keyword.

    Returns:
        ``{"grads": [step][trainable parameter], "params": [parameter]}``: at step s, the
        ranks that still have a batch each divide their gradient by the world size (or by
        how many they are) and the sum goes to every one of them; a joined rank adds zeros.
        After ``Join`` every rank holds the parameters of a rank that joined last.
    """
    ws = len(batches)
    model = make_model(seed0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR)
    out = {"grads": []}
    for step in range(max(len(b) for b in batches)):
        active = [r for r in range(ws) if len(batches[r]) > step]
        divisor = ws if divide_by_initial_world_size else len(active)
        total = None
        for r in active:  # divide before summing, as DDP's reducer does
            model.zero_grad(set_to_none=True)
            x, y = batches[r][step]
            nn.functional.mse_loss(model(x), y).backward()
            mine = [p.grad / divisor for p in trainable]
            total = mine if total is None else [a + b for a, b in zip(total, mine)]
        for p, g in zip(trainable, total):
            p.grad = g.clone()
        opt.step()
        out["grads"].append(total)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


class _Handle:
    """The work handle of Join's "not joined yet" all-reduce, as torch's: wait, result, future."""

    def __init__(self, work, tensor):
        self.work, self.tensor = work, tensor

    def wait(self, timeout=None) -> bool:
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def result(self) -> list:
        self.work.wait()
        return [self.tensor]

    def get_future(self):
        handle = self

        class _Future:
            def wait(self):
                return handle.result()

            def value(self):
                return handle.result()

            def done(self):
                return True
        return _Future()


class _JoinDist:
    """``torch.distributed`` as torch's ``Join`` module sees it in a graded rank."""

    def __init__(self, dist):
        self.dist = dist

    def get_rank(self, group=None):
        return self.dist.get_rank(group)

    def get_world_size(self, group=None):
        return self.dist.get_world_size(group)

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        work = self.dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return _Handle(work, tensor) if async_op else work


def _clone(ts) -> list:
    return [None if t is None else t.detach().clone() for t in ts]


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

    @staticmethod
    def rank_run(link, learner, inputs):
        import torch.distributed.algorithms.join as join_module

        dist = DistModule(link, COLLECTIVES, "")
        real, join_module.dist = join_module.dist, _JoinDist(dist)
        try:
            return [JoinShadow._run_case(link, learner["main"], inputs["seed"], case)
                    for case in inputs["cases"]]
        finally:
            join_module.dist = real

    @staticmethod
    def _run_case(link, cls, seed, case) -> dict:
        from torch.distributed.algorithms.join import Join

        model = make_model(seed)
        begin(link, f"{case['case']}: construction")
        wrapped = cls(model, bucket_cap_mb=BUCKET_CAP_MB)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=LR)
        out = {"grads": [], "hook_ok": None}
        original = wrapped.join_hook

        def join_hook(**kwargs):  # Join calls it once; mark each main_hook and post_hook call
            hook = original(**kwargs)
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

        object.__setattr__(wrapped, "join_hook", join_hook)
        begin(link, f"{case['case']}: training")
        with Join([wrapped], divide_by_initial_world_size=case["divide"]):
            out["device"] = str(wrapped.join_device)
            out["group_ok"] = wrapped.join_process_group is dist_world(link)
            for x, y in case["batches"]:
                optimizer.zero_grad(set_to_none=True)
                nn.functional.mse_loss(wrapped(x), y).backward()
                link.mark("finish")
                wrapped.finish_gradient_synchronization()
                link.mark("finish_end")
                out["grads"].append(_clone(p.grad for p in trainable))
                optimizer.step()
            out["last_own"] = _clone(model.parameters())
        out["params"] = _clone(model.parameters())
        return out

    def judge(self, ws, inputs, outputs, events):
        recs = []
        names = [n for n, _ in make_model(0).named_parameters()]
        trainable = [n for n, p in make_model(0).named_parameters() if p.requires_grad]
        tol = tolerance("gloo", torch.float32, "vs_ddp")
        for k, (case, counts, divide) in enumerate(CASES[ws]):
            label = f"world size {ws}, {case} (batches per rank {list(counts)})"
            batches = [inputs[r]["cases"][k]["batches"] for r in range(ws)]
            ref = join_reference(inputs[0]["seed"], batches, divide)
            other = join_reference(inputs[0]["seed"], batches, not divide)
            for r in range(ws):
                got = outputs[r][k]
                recs.append(self._interface(got, r, label))
                recs.append(self._shadow(events[r], counts, r, case, label, events))
                crit = "average_over_world" if divide else "average_over_ranks_with_data"
                recs.append(self._grads(crit, got, ref, other, trainable, counts, r, ws, divide,
                                        tol, label))
                recs.append(self._agree(got, outputs, k, counts, r, label))
                bad = [(n, m) for n, a, b in zip(names, got["params"], ref["params"])
                       if (m := mismatch(a, b, *tol))]
                recs.append(Record("matches_torch_join", not bad, f"rank {r}, {bad[0][0]}: "
                                   f"{bad[0][1]}" if bad else "", label))
        return recs

    @staticmethod
    def _interface(got, r, label) -> Record:
        detail = ("join_hook returned an object without main_hook and post_hook"
                  if not got["hook_ok"] else
                  f"join_device is {got['device']}, the parameters are on cpu"
                  if got["device"] != "cpu" else
                  "join_process_group is not dist.group.WORLD" if not got["group_ok"] else "")
        return Record("join_interface", not detail, f"rank {r}: {detail}" if detail else "",
                      label)

    @staticmethod
    def _shadow(mine, counts, r, case, label, events) -> Record:
        """Compare the all-reduces of each main_hook call with a rank-with-data's same step."""
        def sizes_between(evs, start, end):
            out, inside = [], []
            for e in evs:
                if e["op"] == "mark" and e["label"] == start:
                    inside = []
                elif e["op"] == "mark" and e["label"] == end:
                    out.append(inside)
                    inside = None
                elif inside is not None and e["op"] in ("all_reduce", "broadcast", "barrier"):
                    inside.append((e["op"], e.get("nbytes", 0)))
            return out

        training = events_of(mine, f"{case}: training")
        shadows = sizes_between(training, "main_hook", "main_hook_end")
        last = max(counts)
        if len(shadows) != last - counts[r]:
            return Record("shadows_each_step", False, f"rank {r} ran out of data after "
                          f"{counts[r]} step(s) of {last}; Join called main_hook "
                          f"{len(shadows)} time(s)", label)
        longest = counts.index(last)
        theirs = sizes_between(events_of(events[longest], f"{case}: training"), "finish",
                               "finish_end")
        for i, got in enumerate(shadows):
            want = theirs[counts[r] + i]
            if got != want:
                return Record("shadows_each_step", False, f"rank {r}, step {counts[r] + i}: "
                              f"main_hook issued {_describe(got)}; rank {longest}, which had "
                              f"data, issued {_describe(want)} to synchronise its gradients",
                              label)
        return Record("shadows_each_step", True, "", label)

    @staticmethod
    def _grads(crit, got, ref, other, trainable, counts, r, ws, divide, tol, label) -> Record:
        if len(got["grads"]) != counts[r]:
            return Record(crit, False, f"rank {r} trained {len(got['grads'])} step(s), "
                          f"expected {counts[r]}", label)
        for step, (mine, want, alt) in enumerate(zip(got["grads"], ref["grads"],
                                                    other["grads"])):
            bad = [(n, "no gradient" if a is None else mismatch(a, b, *tol))
                   for n, a, b in zip(trainable, mine, want)]
            bad = [x for x in bad if x[1]]
            if not bad:
                continue
            active = sum(c > step for c in counts)
            detail = f"rank {r}, step {step} ({active} of {ws} ranks with data), " \
                     f"{bad[0][0]}.grad: {bad[0][1]}"
            if all(a is not None and not mismatch(a, b, *tol) for a, b in zip(mine, alt)):
                detail += (f" — this is the sum divided by {active if divide else ws}; with "
                           f"divide_by_initial_world_size={divide} torch divides by "
                           f"{ws if divide else active}")
            return Record(crit, False, detail, label)
        return Record(crit, True, "", label)

    @staticmethod
    def _agree(got, outputs, k, counts, r, label) -> Record:
        """Every rank ends with the parameters a last joiner had before the post-hooks ran."""
        last = [q for q, c in enumerate(counts) if c == max(counts)]
        sources = [outputs[q][k]["last_own"] for q in last]
        if any(all(torch.equal(a, b) for a, b in zip(got["params"], src)) for src in sources):
            return Record("ranks_agree_at_exit", True, "", label)
        if r not in last and all(torch.equal(a, b) for a, b in zip(got["params"],
                                                                    got["last_own"])):
            detail = (f"rank {r} ran out of data after {counts[r]} of {max(counts)} steps and "
                      "still holds its own parameters: post_hook copied nothing onto it")
        elif r in last:
            detail = (f"rank {r} trained to the end, and post_hook replaced its parameters "
                      "with those of a rank that joined earlier")
        else:
            detail = (f"rank {r} holds parameters that no rank that joined last (rank(s) "
                      f"{', '.join(map(str, last))}) had at the end of training")
        return Record("ranks_agree_at_exit", False, detail, label)

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


def dist_world(link):
    """What ``dist.group.WORLD`` is in a graded rank (the shim's default group)."""
    return DistModule(link, COLLECTIVES, "").group.WORLD


def _describe(ops: list) -> str:
    if not ops:
        return "no collective"
    return ", ".join(f"{op} of {n} bytes" for op, n in ops)
