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

The grader computes the uninterrupted run itself (:func:`uninterrupted`) and
compares the resumed losses and final parameters with it. Right after loading,
each piece of state is compared with what it was at saving time, so a failure
names the piece that was lost; the rank also watches who calls ``torch.save``.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, CaseVerdict, begin
from dpcourse.grading.checks.hints import follow_causes
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


def _orders(world_size: int, rank: int, epoch: int) -> list[int]:
    from dpcourse.data import ShardedSampler

    sampler = ShardedSampler(range(N), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def _average(grads_per_rank: list) -> list:
    """Sum in rank order, as the grader's all-reduce does, then divide: what every rank holds."""
    out = []
    for i in range(len(grads_per_rank[0])):
        total = grads_per_rank[0][i].clone()
        for g in grads_per_rank[1:]:
            total += g[i]
        out.append(total / len(grads_per_rank))
    return out


def uninterrupted(inputs: list) -> dict:
    """Train all ranks in one process, each with its own generator state; return losses, params."""
    ws, x, y = len(inputs), inputs[0]["x"], inputs[0]["y"]
    model = make_model(inputs[0]["model_seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    states = []
    with torch.random.fork_rng(devices=[]):
        for r in range(ws):
            torch.manual_seed(inputs[r]["rng_seed"])
            states.append(torch.get_rng_state())
        losses = {}
        for epoch in range(EPOCHS):
            orders = [_orders(ws, r, epoch) for r in range(ws)]
            for step in range(len(orders[0]) // BATCH):
                grads = []
                for r in range(ws):
                    torch.set_rng_state(states[r])
                    rows = orders[r][step * BATCH:(step + 1) * BATCH]
                    model.zero_grad(set_to_none=True)
                    loss = nn.functional.mse_loss(model(x[rows]), y[rows])
                    loss.backward()
                    states[r] = torch.get_rng_state()
                    grads.append([p.grad.clone() for p in model.parameters()])
                    losses[(r, epoch, step)] = loss.item()
                for p, g in zip(model.parameters(), _average(grads)):
                    p.grad = g
                opt.step()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


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
        calls, original = [], torch.save

        def watched_save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)):
                calls.append(str(f))
                if rank == 0:
                    time.sleep(0.3)  # a slow disk: a rank that does not wait would see no file
            return original(obj, f, *args, **kwargs)

        torch.save = watched_save
        try:
            begin(link, "save_checkpoint")
            learner["main"](path, replica, opt, sampler, STOP[1])
        finally:
            torch.save = original
        out = {"saved_calls": len(calls), "exists": os.path.exists(path), "losses": losses}
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

    def judge(self, ws, inputs, outputs, events):
        shutil.rmtree(inputs[0]["folder"], ignore_errors=True)
        recs = []
        for r, out in enumerate(outputs):
            detail = ""
            if r != 0 and out["saved_calls"]:
                detail = f"rank {r} called torch.save"
            elif r == 0 and not out["saved_calls"]:
                detail = "rank 0 never called torch.save"
            elif not out["exists"]:
                detail = f"rank {r}: save_checkpoint returned before the file existed"
            recs.append(CaseVerdict("rank_0_writes", not detail, detail))
        if "loaded" not in outputs[0]:
            return recs
        want = uninterrupted(inputs)
        for r, out in enumerate(outputs):
            got = out["loaded"]
            recs.append(CaseVerdict("restores_model_and_optimizer", got["params"] and got["opt"],
                               f"rank {r}: " + ("parameters" if not got["params"] else
                                                "the optimizer's state") +
                               " differ from those at saving time"))
            epoch, saved_epoch = got["epoch"]
            detail = (f"rank {r}: sampler at epoch {epoch}, saved at {saved_epoch}"
                      if epoch != saved_epoch else
                      f"rank {r}: load_checkpoint returned {got['step']!r}, saved at step "
                      f"{STOP[1]}" if got["step"] != STOP[1] else "")
            recs.append(CaseVerdict("restores_sampler_position", not detail, detail))
            recs.append(CaseVerdict("restores_each_ranks_rng", got["rng"],
                               _rng_detail(r, outputs)))
            bad = [k for k, v in want["losses"].items() if k[0] == r and not math.isclose(
                out["losses"].get(f"{k[1]},{k[2]}", math.nan), v, rel_tol=TOL[0], abs_tol=TOL[1])]
            params_ok = all(torch.allclose(a, b, rtol=TOL[0], atol=TOL[1])
                            for a, b in zip(out["params"], want["params"]))
            recs.append(CaseVerdict("exact_resume", not bad and params_ok,
                               f"rank {r}: loss at (epoch, step) {bad[0][1:]} is "
                               f"{out['losses'].get(f'{bad[0][1]},{bad[0][2]}')}, uninterrupted "
                               f"{want['losses'][bad[0]]}" if bad else
                               f"rank {r}: final parameters differ" if not params_ok else ""))
        follow_causes(self, recs, _cause)
        return recs

    def explain(self, text: str) -> str:
        if "is not available to graded code" in text:
            return self.dist_why
        return ""


_NOT_RESTORED = "no state was restored"
_NO_RANKS = "a state no rank had at saving time"


def _rng_detail(r: int, outputs: list) -> str:
    """What rank ``r``'s generator holds after loading, when it is not its own saved state."""
    states = outputs[r]["loaded"].get("rng_states")
    if outputs[r]["loaded"]["rng"] or states is None:
        return ""
    head = f"rank {r}: the generator's state is not the one this rank had at saving time: "
    if torch.equal(states["loaded"], states["fresh"]):
        return head + f"{_NOT_RESTORED} (it is the state the new process started with)"
    for q, out in enumerate(outputs):
        theirs = out.get("loaded", {}).get("rng_states")
        if q != r and theirs is not None and torch.equal(states["loaded"], theirs["saved"]):
            return head + f"it holds the state rank {q} had at saving time"
    return head + f"it holds {_NO_RANKS}"


def _cause(rec: CaseVerdict) -> str:
    """The hint for the cause of a failing record (see ``hints``)."""
    if rec.criterion != "restores_each_ranks_rng":
        return ""
    rank = rec.detail.split(":", 1)[0].capitalize()
    if _NOT_RESTORED in rec.detail:
        return (f"{rank} resumed with the generator state a new process starts with: "
                "load_checkpoint set no generator state on it. Dropout draws from each rank's "
                "own generator: set each rank's own saved state back on that rank.")
    if "holds the state rank " in rec.detail:
        other = rec.detail.rsplit("holds the state rank ", 1)[1].split(" ", 1)[0]
        return (f"{rank} resumed with rank {other}'s generator state, not its own: the ranks' "
                "states differ, and rank 0 can only write what has reached it, so each rank's "
                "state must travel to rank 0 before the save (a collective on a tensor), and "
                "each rank must load its own entry back.")
    if _NO_RANKS in rec.detail:
        return (f"{rank} resumed with a generator state that no rank had at saving time: it "
                "was read before or after other random draws than those at saving time (take "
                "it when save_checkpoint is called, and set it last when loading), or it was "
                "changed on the way.")
    return ""
