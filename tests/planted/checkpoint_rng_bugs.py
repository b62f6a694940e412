"""Checkpoints for exercise 08 that lose the generator states in different ways."""

import torch
import torch.distributed as dist


def save_checkpoint(path, model, optimizer, sampler, step, *, only_rank_0=False):
    """Right (every rank's state reaches rank 0), unless ``only_rank_0``."""
    mine, rng = torch.get_rng_state(), []
    for src in range(dist.get_world_size()):
        state = mine.clone() if src == dist.get_rank() else torch.empty_like(mine)
        dist.broadcast(state, src=src)
        rng.append(state)
    if only_rank_0:
        rng = [rng[0]] * len(rng)  # BUG: the ranks' states differ
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": sampler.epoch, "step": step, "rng": rng}, path)
    dist.barrier()


def save_rank_0_state_for_all(path, model, optimizer, sampler, step):
    """Writes rank 0's generator state as every rank's."""
    save_checkpoint(path, model, optimizer, sampler, step, only_rank_0=True)


def save_with_object_gather(path, model, optimizer, sampler, step):
    """Gathers the states with an object collective, which this exercise does not offer."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": sampler.epoch, "step": step, "rng": states}, path)
    dist.barrier()


def _restore(path, model, optimizer, sampler):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.set_epoch(state["epoch"])
    return state


def load_checkpoint(path, model, optimizer, sampler):
    """Right: every rank takes its own entry."""
    state = _restore(path, model, optimizer, sampler)
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["step"]


def load_without_rng(path, model, optimizer, sampler):
    """Restores everything but the generator."""
    return _restore(path, model, optimizer, sampler)["step"]  # BUG: no set_rng_state


def load_mirrored_rng(path, model, optimizer, sampler):
    """Takes the entry of the rank at the other end of the list."""
    state = _restore(path, model, optimizer, sampler)
    torch.set_rng_state(state["rng"][dist.get_world_size() - 1 - dist.get_rank()])  # BUG
    return state["step"]
