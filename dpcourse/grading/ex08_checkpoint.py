"""Check for exercise 08: a rank-0 checkpoint from which training resumes exactly.

The learner writes ``save_checkpoint(path, model, optimizer, sampler, step)``
and ``load_checkpoint(path, model, optimizer, sampler) -> step``; both are
called on every rank. The check trains a small MLP with dropout (so every
rank's random number generator matters, and each rank's differs) under torch
DDP with AdamW and a shuffling :class:`~dpcourse.data.ShardedSampler`:

1. uninterrupted, 3 epochs of 5 steps;
2. interrupted in the middle of epoch 1, where ``save_checkpoint`` is called;
3. a fresh start: new model from another seed, new optimizer, new sampler at
   epoch 0, a scrambled generator, then ``load_checkpoint``, then the rest.

The resumed run must end bitwise equal to the uninterrupted one. On the way the
check looks at each piece of state right after loading, so a failure names the
piece that was lost, and it watches who calls ``torch.save``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.grading.criteria import Criterion
from dpcourse.grading.inprocess import CheckSpec

IN, HIDDEN, OUT = 6, 16, 2
N, BATCH, EPOCHS = 40, 4, 3       # 40 examples, 4 per rank and step: 5 steps per epoch on 2 ranks
STOP = (1, 2)                     # save after 2 steps of epoch 1


def make_model(seed: int, device) -> nn.Module:
    """Return the check's MLP (with dropout) built from ``seed``; the global generator is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(0.3),
                             nn.Linear(HIDDEN, OUT)).to(device)


def dataset(device):
    """Return the check's fixed regression data ``(x, y)``."""
    g = torch.Generator().manual_seed(8)
    return torch.randn(N, IN, generator=g).to(device), torch.randn(N, OUT, generator=g).to(device)


def rng_state(device) -> list[torch.Tensor]:
    """Return this rank's generator states that dropout draws from (CPU, and CUDA if used)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _setup(seed: int, device):
    from dpcourse.data import ShardedSampler

    model = make_model(seed, device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, ddp, torch.optim.AdamW(model.parameters(), lr=0.01), \
        ShardedSampler(range(N), shuffle=True, seed=0)


def train(ddp, optimizer, sampler, device, start_step=0, stop=None, losses=None):
    """Train from ``(sampler.epoch, start_step)`` to the end, or until ``stop``; return the stop."""
    x, y = dataset(device)
    losses = {} if losses is None else losses
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for step in range(start_step, len(order) // BATCH):
            if (epoch, step) == stop:
                return losses
            rows = order[step * BATCH:(step + 1) * BATCH]
            loss = nn.functional.mse_loss(ddp(x[rows]), y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses[(epoch, step)] = loss.item()
        start_step = 0
    return losses


def _clone_state(optimizer) -> dict:
    state = optimizer.state_dict()
    return {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()}
            for k, s in state["state"].items()}


def _diff_state(got: dict, want: dict) -> str:
    if got.keys() != want.keys():
        return f"optimizer state for parameters {sorted(got)}, expected {sorted(want)}"
    for k in want:
        for n, v in want[k].items():
            g = got[k].get(n)
            same = torch.equal(g.cpu(), v.cpu()) if isinstance(v, torch.Tensor) else g == v
            if not same:
                return f"optimizer state {n!r} of parameter {k} differs"
    return ""


class CheckpointResume(CheckSpec):
    """``save_checkpoint`` / ``load_checkpoint``: written by rank 0, resumed exactly."""

    name, exercise, title = "checkpoint_resume", "08", "Rank-0 checkpoint and exact resume"
    world_sizes = (2,)
    timeout = 60.0
    forbid_torch_ddp = False  # the wrapper is torch DDP; the exercise is the checkpoint
    criteria = (
        Criterion("rank_0_writes", "only rank 0 calls torch.save, and when save_checkpoint "
                  "returns on any rank the file is complete",
                  "Every rank holds the same weights: let rank 0 write, and make the others wait "
                  "(dist.barrier()) until the file is complete, so nobody reads half a file."),
        Criterion("restores_model_and_optimizer", "right after loading, the parameters and the "
                  "optimizer state (AdamW's moments and step) equal those at saving time",
                  "Save model.module.state_dict() (the unwrapped module: its keys have no "
                  "'module.' prefix) and optimizer.state_dict(), and load both back.",
                  requires="load_checkpoint"),
        Criterion("restores_sampler_position", "right after loading, the sampler is at the saved "
                  "epoch and load_checkpoint returns the saved step",
                  "The sampler's shuffle depends on its epoch: store sampler.epoch, call "
                  "sampler.set_epoch() with it on load, and return the step within the epoch.",
                  requires="load_checkpoint"),
        Criterion("restores_each_ranks_rng", "right after loading, every rank's random number "
                  "generator is in the state it had at saving time",
                  "Dropout draws from each rank's own generator, and the ranks' states differ. "
                  "Rank 0 can only write what it has: collect every rank's "
                  "torch.get_rng_state() first (dist.all_gather_object), and on load let each "
                  "rank restore its own entry (torch.set_rng_state).", requires="load_checkpoint"),
        Criterion("exact_resume", "the resumed run's losses and final parameters are bitwise "
                  "equal to the uninterrupted run's",
                  "Check the other criteria first: each names a piece of state that did not come "
                  "back.", requires="load_checkpoint"),
    )
    notes = ("compared bitwise: same data order, same dropout masks, same arithmetic",)

    def prepare(self, rec):
        from dpcourse.device import rank_device

        device, rank = rank_device(), dist.get_rank()
        model, ddp, opt, sampler = _setup(0, device)
        torch.manual_seed(1000 + rank)  # each rank's own dropout masks
        losses = train(ddp, opt, sampler, device)
        return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}

    def run(self, rec, save_checkpoint, extras, reference):
        from dpcourse.device import rank_device

        load_checkpoint = extras.get("load_checkpoint")
        device, rank = rank_device(), dist.get_rank()
        want = reference.get()
        folder = [tempfile.mkdtemp(prefix="dpcourse-ckpt-") if rank == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        path = os.path.join(folder[0], "checkpoint.pt")
        try:
            model, ddp, opt, sampler = _setup(0, device)
            torch.manual_seed(1000 + rank)
            losses = train(ddp, opt, sampler, device, stop=STOP)
            saved = {"params": [p.detach().clone() for p in model.parameters()],
                     "opt": _clone_state(opt), "rng": rng_state(device), "epoch": sampler.epoch}
            self._save(rec, save_checkpoint, path, ddp, opt, sampler)
            if load_checkpoint is None:
                return
            model, ddp, opt, sampler = _setup(7 + rank, device)
            torch.manual_seed(4242 + rank)  # a new process: nothing survives but the file
            with rec.case("restores_model_and_optimizer", "load_checkpoint"):
                step = load_checkpoint(path, ddp, opt, sampler)
            self._restored(rec, saved, step, model, opt, sampler, device)
            with rec.case("exact_resume", "training after the resume"):
                train(ddp, opt, sampler, device, start_step=int(step), losses=losses)
            bad = [k for k in want["losses"] if losses.get(k) != want["losses"][k]]
            same = all(torch.equal(a, b) for a, b in zip(model.parameters(), want["params"]))
            rec.record("exact_resume", not bad and same,
                       f"rank {rank}: loss at (epoch, step) {bad[0]} is {losses.get(bad[0])}, "
                       f"uninterrupted {want['losses'][bad[0]]}" if bad else
                       f"rank {rank}: final parameters differ" if not same else "")
        finally:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder[0], ignore_errors=True)

    @staticmethod
    def _save(rec, save_checkpoint, path, ddp, opt, sampler) -> None:
        rank, calls, original = dist.get_rank(), [], torch.save

        def watched_save(obj, f, *args, **kwargs):
            if not isinstance(f, (str, os.PathLike)):  # an in-memory buffer (collectives pickle)
                return original(obj, f, *args, **kwargs)
            calls.append(f)
            if rank == 0:
                time.sleep(0.3)  # a slow disk: a rank that does not wait would see no file
            return original(obj, f, *args, **kwargs)

        torch.save = watched_save
        try:
            with rec.case("rank_0_writes", "save_checkpoint"):
                save_checkpoint(path, ddp, opt, sampler, STOP[1])
        finally:
            torch.save = original
        detail = ""
        if rank != 0 and calls:
            detail = f"rank {rank} called torch.save"
        elif rank == 0 and not calls:
            detail = "rank 0 never called torch.save"
        elif not os.path.exists(path):
            detail = f"rank {rank}: save_checkpoint returned before the file existed"
        rec.record("rank_0_writes", not detail, detail)

    @staticmethod
    def _restored(rec, saved, step, model, opt, sampler, device) -> None:
        rank = dist.get_rank()
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), saved["params"]))
        detail = "" if same else f"rank {rank}: parameters differ from those at saving time"
        detail = detail or _diff_state(_clone_state(opt), saved["opt"])
        rec.record("restores_model_and_optimizer", not detail, detail)
        detail = ""
        if sampler.epoch != saved["epoch"]:
            detail = f"rank {rank}: sampler at epoch {sampler.epoch}, saved at {saved['epoch']}"
        elif step != STOP[1]:
            detail = f"rank {rank}: load_checkpoint returned {step!r}, saved at step {STOP[1]}"
        rec.record("restores_sampler_position", not detail, detail)
        got = rng_state(device)
        same = all(torch.equal(a, b) for a, b in zip(got, saved["rng"]))
        rec.record("restores_each_ranks_rng", same, f"rank {rank}: the generator's state is not "
                   "the one this rank had at saving time")
