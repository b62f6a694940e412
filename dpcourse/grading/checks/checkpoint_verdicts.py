"""The grader's side of exercise 08: the uninterrupted run, and the verdicts on a resumed one.

Imported only by the grader (ranks cannot import it): it holds the expected
losses and parameters, computed in the grader's process from the same inputs.
"""

from __future__ import annotations

import math
import shutil

import torch
from torch import nn

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict
from dpcourse.grading.checks.ex08_checkpoint import BATCH, EPOCHS, LR, N, STOP, TOL, make_model


def _orders(world_size: int, rank: int, epoch: int) -> list[int]:
    from dpcourse.data import ShardedSampler

    sampler = ShardedSampler(range(N), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


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
                for i, p in enumerate(model.parameters()):  # summed in rank order, as relayed
                    p.grad = oracles.all_reduce_sum([g[i] for g in grads]) / ws
                opt.step()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Judge every rank's save, load and resumed run against the uninterrupted run."""
    shutil.rmtree(inputs[0]["folder"], ignore_errors=True)
    recs = [CaseVerdict("rank_0_writes", not detail, detail)
            for detail in (_write_detail(r, outputs) for r in range(len(outputs)))]
    if "loaded" not in outputs[0]:
        return recs
    want = uninterrupted(inputs)
    for r, out in enumerate(outputs):
        got = out["loaded"]
        what = "parameters" if not got["params"] else "the optimizer's state"
        recs.append(CaseVerdict("restores_model_and_optimizer", got["params"] and got["opt"],
                                f"rank {r}: {what} differ from those at saving time"))
        epoch, saved_epoch = got["epoch"]
        detail = (f"rank {r}: sampler at epoch {epoch}, saved at {saved_epoch}"
                  if epoch != saved_epoch else
                  f"rank {r}: load_checkpoint returned {got['step']!r}, saved at step "
                  f"{STOP[1]}" if got["step"] != STOP[1] else "")
        recs.append(CaseVerdict("restores_sampler_position", not detail, detail))
        recs.append(CaseVerdict("restores_each_ranks_rng", got["rng"], _rng_detail(r, outputs)))
        bad = [k for k, v in want["losses"].items() if k[0] == r and not math.isclose(
            out["losses"].get(f"{k[1]},{k[2]}", math.nan), v, rel_tol=TOL[0], abs_tol=TOL[1])]
        params_ok = all(torch.allclose(a, b, rtol=TOL[0], atol=TOL[1])
                        for a, b in zip(out["params"], want["params"]))
        recs.append(CaseVerdict("exact_resume", not bad and params_ok,
                                f"rank {r}: loss at (epoch, step) {bad[0][1:]} is "
                                f"{out['losses'].get(f'{bad[0][1]},{bad[0][2]}')}, uninterrupted "
                                f"{want['losses'][bad[0]]}" if bad else
                                f"rank {r}: final parameters differ" if not params_ok else ""))
    return recs


_OTHER_WROTE = "called torch.save"
_NOT_WRITTEN = "never called torch.save"
_EARLY = "save_checkpoint returned while"


def _write_detail(r: int, outputs: list) -> str:
    """Why rank ``r`` fails rank_0_writes: it wrote, or the file at ``path`` was not rank 0's
    complete checkpoint when its save_checkpoint returned; ``""`` if neither."""
    out, writes = outputs[r], outputs[0]["writes"]
    if r != 0 and out["saved_calls"]:
        return f"rank {r} {_OTHER_WROTE}"
    if r == 0 and not out["saved_calls"]:
        return f"rank 0 {_NOT_WRITTEN}"
    mine = [w for w in writes if w["file"] == out["path"]]
    if not mine:
        files = ", ".join(sorted({w["file"].rsplit("/", 1)[-1] for w in writes})) or "nothing"
        return (f"rank {r}: rank 0's torch.save wrote {files}, not the path save_checkpoint "
                "was given")
    seen, final = out["at_return"], mine[-1]
    if seen["digest"] == final["digest"]:
        return ""
    if not seen["exists"]:
        held = "there was no file at the path yet"
    elif any(seen["digest"] == w["digest"] for w in mine[:-1]):
        held = (f"the path held an earlier checkpoint ({seen['size']} bytes) that rank 0 then "
                "wrote over")
    else:
        held = (f"the path held {seen['size']} of the {final['size']} bytes of rank 0's "
                "checkpoint: rank 0 had not finished writing it")
    return f"rank {r}: {_EARLY} {held}"


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


def cause(spec, ws: int, rec: CaseVerdict) -> str:
    """The hint for the cause of a failing record (see :func:`~.base.follow_causes`)."""
    if rec.criterion == "rank_0_writes":
        return _write_cause(rec.detail)
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


def _write_cause(detail: str) -> str:
    if _OTHER_WROTE in detail:
        return ("A rank other than 0 wrote a file: every rank holds the same weights, so one "
                "writer is enough, and several writing one path can leave it mixed.")
    if _EARLY in detail:
        rank = detail.split(":", 1)[0].capitalize()
        return (f"{rank} returned from save_checkpoint while rank 0 was still writing: nothing "
                "it waited for came after the end of rank 0's last torch.save, so it could go "
                "on, and read the file, before the file was complete.")
    return ""
