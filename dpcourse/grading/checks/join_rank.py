"""The rank's side of exercise 10: the check's model, and the learner's wrapper trained under Join.

:func:`rank_run` builds the check's model (a frozen middle layer), wraps it in
the learner's ``JoinableDDP`` and trains it under torch's own ``Join`` on this
rank's batches. Join's two collectives travel through the grader like the
learner's: :class:`_JoinDist` is ``torch.distributed`` as Join sees it in a
graded rank, and :class:`_Handle` the handle ``notify_join_context`` returns.
Each ``main_hook`` and ``post_hook`` call is marked so that the grader can
compare what a joined rank issues with the others' steps. Nothing here knows an
expected value.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import begin
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


def rank_run(link, learner, inputs) -> list:
    """Train the learner's wrapper under ``Join`` on each case of ``inputs``; return the outputs."""
    import torch.distributed.algorithms.join as join_module

    dist = DistModule(link, COLLECTIVES, "")
    real, join_module.dist = join_module.dist, _JoinDist(dist)
    try:
        return [run_case(link, learner["main"], inputs["seed"], case)
                for case in inputs["cases"]]
    finally:
        join_module.dist = real


def run_case(link, cls, seed, case) -> dict:
    """Train ``cls`` (the learner's wrapper) under ``Join`` on one case; return what it left."""
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


def dist_world(link):
    """What ``dist.group.WORLD`` is in a graded rank (the shim's default group)."""
    return DistModule(link, COLLECTIVES, "").group.WORLD
