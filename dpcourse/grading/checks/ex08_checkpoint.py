"""Exercise 08: a rank-0 checkpoint from which training resumes exactly.

The learner writes ``save_checkpoint(path, model, optimizer, sampler, step)``
and ``load_checkpoint(path, model, optimizer, sampler) -> step``; both run on
every rank. Each rank trains a small MLP with dropout (so every rank's random
number generator matters, and the ranks' states differ) with AdamW, a shuffling
:class:`~dpcourse.data.ShardedSampler`, and gradients averaged over the ranks
after every backward, as DDP does:

1. until the middle of epoch 1, where ``save_checkpoint`` is called;
2. then as a new process would: a model from another seed, a fresh optimizer, a
   sampler at epoch 0, a scrambled generator; ``load_checkpoint``; the rest.

The grader computes the uninterrupted run itself and compares the resumed
losses and final parameters with it
(:mod:`~dpcourse.grading.checks.checkpoint_verdicts`, which ranks cannot import). Right after loading,
each piece of state is compared with what it was at saving time, so a failure
names the piece that was lost.

The rank also watches who calls ``torch.save``, under any name, and what the file holds at
the moment ``save_checkpoint`` returns on each rank. Rank 0's ``torch.save`` stops halfway
through writing until every other rank has either returned or is waiting for a message that
only rank 0 can still send (:mod:`~dpcourse.grading.checks.checkpoint_watch`): a rank that
can return before the file is complete therefore does so, on every run, and sees half a file.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, begin
from dpcourse.grading.checks.checkpoint_watch import SaveWindow, WatchedSaves, file_state
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES, P2P, DistModule

IN, HIDDEN, OUT = 6, 16, 2
N, BATCH, EPOCHS = 40, 4, 3       # 40 examples, 4 per rank and step: 5 steps per epoch on 2 ranks
STOP = (1, 2)                     # save after 2 steps of epoch 1
LR = 0.01
TOL = (1e-6, 1e-7)  # the grader recomputes the run in its own process: float32 rounding only


def make_model(seed: int) -> nn.Module:
    """Return the check's MLP (with dropout) built from ``seed``; the global generator is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(0.3),
                             nn.Linear(HIDDEN, OUT))


class Replica(nn.Module):
    """What the learner's functions receive as ``model``: the module is ``.module``, as in DDP."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _train(dist, replica, opt, sampler, x, y, start_step=0, stop=None, losses=None):
    losses = {} if losses is None else losses
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for step in range(start_step, len(order) // BATCH):
            if (epoch, step) == stop:
                return losses
            rows = order[step * BATCH:(step + 1) * BATCH]
            loss = nn.functional.mse_loss(replica(x[rows]), y[rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in replica.module.parameters():  # the mean over ranks, as DDP averages
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
            opt.step()
            losses[f"{epoch},{step}"] = loss.item()
        start_step = 0
    return losses


def _opt_state(opt) -> list:
    state = opt.state_dict()["state"]
    return [[state[k][n].clone() for n in sorted(state[k])] for k in sorted(state)]


class CheckpointResume(Exercise):
    """``save_checkpoint`` / ``load_checkpoint``: written by rank 0, resumed exactly."""

    name, exercise, title = "checkpoint_resume", "08", "Rank-0 checkpoint and exact resume"
    defines = (("main", "save_checkpoint"), ("load_checkpoint", "load_checkpoint"))
    world_sizes = (2,)
    dist_api = P2P + COLLECTIVES
    dist_why = ("Graded code here may call all_reduce, broadcast and barrier on tensors, and "
                "send and receive tensors (send, recv, isend, irecv, P2POp, batch_isend_irecv); "
                "the object collectives (broadcast_object_list, all_gather_object, "
                "gather_object) and the other tensor collectives are not offered: put what a "
                "rank must share into a tensor.")
    timeout = 60.0
    criteria = (
        Criterion("rank_0_writes", "only rank 0 calls torch.save, and when save_checkpoint "
                  "returns on any rank the file is complete",
                  "Another rank wrote too, or a rank returned before the file was complete: "
                  "every rank holds the same weights, and a rank that goes on early can read "
                  "half a file."),
        Criterion("restores_model_and_optimizer", "right after loading, the parameters and the "
                  "optimizer state (AdamW's moments and step) equal those at saving time",
                  "The parameters or the optimizer's moments differ right after loading: the "
                  "wrapper's state carries a 'module.' prefix the bare module lacks, and "
                  "AdamW's moments live in the optimizer, not in the model.",
                  requires="load_checkpoint"),
        Criterion("restores_sampler_position", "right after loading, the sampler is at the saved "
                  "epoch and load_checkpoint returns the saved step",
                  "The resumed run sees other batches, or starts at another step: the "
                  "sampler's shuffle depends on its epoch, and that position did not come "
                  "back.",
                  requires="load_checkpoint"),
        Criterion("restores_each_ranks_rng", "right after loading, every rank's random number "
                  "generator is in the state it had at saving time",
                  "Dropout draws from each rank's own generator, and the ranks' states differ: "
                  "every rank must resume with the state it had itself at saving time, and "
                  "rank 0 can only write what has reached it.", requires="load_checkpoint",
                  weight=2),
        Criterion("exact_resume", "the resumed run's losses and final parameters equal the "
                  "uninterrupted run's", "Check the other criteria first: each names a piece of "
                  "state that did not come back.", requires="load_checkpoint", weight=2),
        no_delegation("rank_0_writes"), no_deadlock("rank_0_writes"),
    )
    notes = (f"the grader recomputes the uninterrupted run; compared to rtol={TOL[0]:g}, "
             f"atol={TOL[1]:g} (a lost generator or optimizer state is far larger)",)

    shared_folder = True  # rank 0 writes the checkpoint, every rank reads it
    verdicts = "dpcourse.grading.checks.checkpoint_verdicts"

    def make_inputs(self, rng, world_size):
        g = torch.Generator().manual_seed(rng.getrandbits(62))
        x, y = torch.randn(N, IN, generator=g), torch.randn(N, OUT, generator=g)
        folder = tempfile.mkdtemp(prefix="dpcourse-ckpt-")
        model_seed = rng.getrandbits(31)
        return [{"x": x, "y": y, "folder": folder, "model_seed": model_seed,
                 "rng_seed": rng.getrandbits(31), "fresh_seed": rng.getrandbits(31), "rank": r}
                for r in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        from dpcourse.data import ShardedSampler

        dist, rank = DistModule(link, COLLECTIVES, ""), inputs["rank"]
        x, y = inputs["x"], inputs["y"]
        path = os.path.join(inputs["folder"], "checkpoint.pt")

        def setup(seed):
            replica = Replica(make_model(seed))
            return replica, torch.optim.AdamW(replica.module.parameters(), lr=LR), \
                ShardedSampler(range(N), num_replicas=link.world_size, rank=rank, shuffle=True,
                               seed=0)

        replica, opt, sampler = setup(inputs["model_seed"])
        torch.manual_seed(inputs["rng_seed"])
        losses = _train(dist, replica, opt, sampler, x, y, stop=STOP)
        saved = {"params": [p.detach().clone() for p in replica.module.parameters()],
                 "opt": _opt_state(opt), "rng": torch.get_rng_state(), "epoch": sampler.epoch}
        begin(link, "save_checkpoint")
        window = SaveWindow(link, inputs["folder"])
        # rank 0's files: half now, the rest once the others are held up
        with window, WatchedSaves(window.hold if rank == 0 else None) as saves:
            learner["main"](path, replica, opt, sampler, STOP[1])
            at_return = file_state(path)
        window.returned()
        out = {"saved_calls": len(saves.calls), "writes": saves.writes, "at_return": at_return,
               "path": path, "losses": losses}
        load = learner.get("load_checkpoint")
        if load is None:
            return out
        dist.barrier()  # the check's own wait: a missing one in save_checkpoint is judged above
        replica, opt, sampler = setup(inputs["fresh_seed"])
        torch.manual_seed(inputs["fresh_seed"])  # a new process: nothing survives but the file
        fresh_rng = torch.get_rng_state()
        begin(link, "load_checkpoint")
        step = load(path, replica, opt, sampler)
        out["loaded"] = {
            "params": all(torch.equal(a, b) for a, b in zip(replica.module.parameters(),
                                                             saved["params"])),
            "opt": _opt_state(opt) == [] and saved["opt"] == [] or (
                len(_opt_state(opt)) == len(saved["opt"]) and all(
                    len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
                    for a, b in zip(_opt_state(opt), saved["opt"]))),
            "rng": torch.equal(torch.get_rng_state(), saved["rng"]),
            "rng_states": {"loaded": torch.get_rng_state(), "saved": saved["rng"],
                           "fresh": fresh_rng},
            "epoch": [sampler.epoch, saved["epoch"]], "step": step if isinstance(step, int)
            else repr(step)}
        begin(link, "training after the resume")
        _train(dist, replica, opt, sampler, x, y, start_step=int(step), losses=losses)
        out["params"] = [p.detach().clone() for p in replica.module.parameters()]
        return out

    def explain(self, text: str) -> str:
        if "is not available to graded code" in text:
            return self.dist_why
        return ""
