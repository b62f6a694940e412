"""How many ranks a launch gets, on which backend, and why: one rule for every machine.

A lesson about data parallelism needs at least two ranks wherever it runs, so the
rule never turns "no world size given" into a one-rank world:

* with N GPUs visible and N ranks wanted (or none named and N >= 2), every rank
  owns one GPU and the ranks talk over NCCL;
* otherwise the ranks run on the CPU over gloo: a laptop, a machine with one GPU
  (two ranks on one GPU would not be data parallelism across devices, and NCCL
  refuses two ranks on one device), or fewer GPUs than ranks. These CPU ranks see
  no GPU at all, exactly as on a machine without one.

``plan_ranks`` returns the choice with its reason, printable as one line
("4 ranks over gloo on CPU: this machine has 1 GPU, fewer than 4").
"""

from __future__ import annotations

from typing import NamedTuple

DEVICES = ("auto", "cpu")
BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_CPU_RANKS = 2


class RankPlan(NamedTuple):
    """What :func:`dpcourse.run` will start: ``backend``, ``world_size`` and why.

    ``hide_gpus`` is true when the ranks run on the CPU although this process sees
    GPUs (they are started with ``CUDA_VISIBLE_DEVICES`` empty).
    """

    backend: str
    world_size: int
    gpus: int
    hide_gpus: bool
    reason: str

    def __str__(self) -> str:
        ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
        where = "over nccl, one GPU per rank" if self.backend == "nccl" else "over gloo on CPU"
        return f"{ranks} {where}: {self.reason}"


def check_device(device) -> str:
    """Return ``device`` if it is one of :data:`DEVICES`, else raise a ValueError that lists them.

    Args:
        device: ``"auto"`` or ``"cpu"``.
    """
    if not isinstance(device, str) or device not in DEVICES:
        raise ValueError(
            f"unknown device {device!r}: use device='auto' (the ranks see this machine's GPUs, "
            "and run on NCCL when each can have one) or device='cpu' (the ranks see no GPU and "
            "run on gloo, as on a machine without GPUs). For GPUs pass backend='nccl'.")
    return device


def _check_arguments(backend, world_size, device) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'gloo' (CPU) or 'nccl' (GPU).")
    check_device(device)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}.")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if device == "cpu" and backend == "nccl":
        raise ValueError(
            "backend 'nccl' runs on GPUs, but device='cpu' hides every GPU from the ranks: use "
            "backend='gloo' (or 'auto') with device='cpu', or device='auto' to run on GPUs.")


def _has(gpus: int) -> str:
    return "no GPU" if gpus == 0 else ("1 GPU" if gpus == 1 else f"{gpus} GPUs")


def plan_ranks(world_size: int | None = None, backend: str = "auto",
               device: str = "auto", *, gpus: int | None = None) -> RankPlan:
    """Decide the ranks a launch gets, the way :func:`dpcourse.run` does; say why.

    Args:
        world_size: ranks wanted. ``None``: one per GPU over NCCL when this machine has
            2 or more GPUs, else 2 CPU ranks over gloo (also on a machine with 1 GPU).
        backend: ``"auto"`` (NCCL when every rank can own a GPU, else CPU ranks over
            gloo), ``"gloo"`` or ``"nccl"``.
        device: ``"auto"`` (the ranks may see this process's GPUs) or ``"cpu"`` (they
            see none, so ``"auto"`` means gloo and ``"nccl"`` is refused).
        gpus: plan for a machine with this many GPUs instead of this one (``None``:
            the GPUs this process sees), e.g. to show what another machine would get.

    Returns:
        A :class:`RankPlan`; ``str(plan)`` is the one line a lesson prints.

    Raises:
        ValueError, TypeError: a bad argument; the message says which values work.
    """
    from dpcourse.device import visible_gpus  # imports torch

    _check_arguments(backend, world_size, device)
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        raise ValueError(f"gpus must be a whole number >= 0 or None (this machine), got {gpus!r}.")
    gpus = 0 if device == "cpu" else (visible_gpus() if gpus is None else gpus)
    if backend == "nccl":
        wanted = gpus if world_size is None else world_size
        if gpus == 0:
            raise ValueError(
                "backend 'nccl' needs one GPU per rank, but this machine has 0 visible GPUs "
                "(torch.cuda.device_count() is 0): use backend='gloo' (or 'auto') to run the ranks "
                "on CPU.")
        if wanted > gpus:
            raise ValueError(
                f"backend 'nccl' needs one GPU per rank: world_size={wanted} but {gpus} GPU(s) "
                f"are visible. Use world_size<={gpus}, or backend='gloo' (or 'auto') to run the "
                "ranks on CPU.")
        return RankPlan("nccl", wanted, gpus, False, f"backend='nccl' was asked for, this machine has {_has(gpus)}")
    if backend == "gloo":
        n = DEFAULT_CPU_RANKS if world_size is None else world_size
        why = "device='cpu' was asked for" if device == "cpu" else "backend='gloo' was asked for"
        return RankPlan("gloo", n, gpus, device == "cpu", why)
    # auto
    if device == "cpu":
        n = DEFAULT_CPU_RANKS if world_size is None else world_size
        return RankPlan("gloo", n, gpus, True, "device='cpu' was asked for")
    if world_size is None:
        if gpus >= 2:
            return RankPlan("nccl", gpus, gpus, False, f"this machine has {_has(gpus)}")
        return RankPlan("gloo", DEFAULT_CPU_RANKS, gpus, gpus > 0,
                        f"this machine has {_has(gpus)}" + (", and data parallelism needs 2 or more"
                                                            if gpus == 1 else ""))
    if 1 <= world_size <= gpus:
        return RankPlan("nccl", world_size, gpus, False, f"this machine has {_has(gpus)}")
    return RankPlan("gloo", world_size, gpus, gpus > 0,
                    f"this machine has {_has(gpus)}" + (f", fewer than {world_size}" if gpus else ""))


def resolve_backend(backend: str = "auto", world_size: int | None = None,
                    device: str = "auto") -> tuple[str, int]:
    """Pick the backend and world size the way :func:`dpcourse.run` does.

    The rule, and its reason, is :func:`plan_ranks`; this returns only its first two fields.

    Args:
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"`` (see :func:`plan_ranks`).
        world_size: number of ranks, or ``None`` (see :func:`plan_ranks`).
        device: ``"auto"`` or ``"cpu"``.

    Returns:
        ``(backend, world_size)``.
    """
    plan = plan_ranks(world_size, backend, device)
    return plan.backend, plan.world_size
