"""The mistakes a data-parallel wrapper refuses, each checked at one named moment.

* :func:`check_wrappable` - at construction: what can be wrapped at all, and
  (:func:`check_same_model`) every rank wraps the same parameters;
* :func:`check_forward` - at each forward: the wrapper is still the module's;
* :func:`check_backward_start` - at the first gradient of a synchronised backward:
  a forward through the wrapper preceded it;
* :func:`check_all_gradients` - when gradients are synchronised: every trainable
  parameter got one (otherwise the ranks would wait for each other forever);
* :func:`install_step_guard` - at ``optimizer.step()``: no gradient is still
  this rank's alone (:func:`install` arms it, at construction).

Each error says what went wrong and what to do, because the alternative is a
hang or replicas that silently drift apart.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


class Wrapper(Protocol):
    """What the guards read of a wrapper (``DataParallelNaive``, ``DataParallelBucketed``, ``DataParallelOverlapped``)."""

    reducer: Any              # .named_params: trainable (name, parameter), registration order
    _unsynced: set[int]       # indices of gradients not yet averaged
    _forward_pending: bool    # a forward through the wrapper awaits its backward
    _replaced: bool           # a newer wrapper took the module over
    _step_guard: RemovableHandle


def check_wrappable(module: nn.Module, group: dist.ProcessGroup | None,
                    all_reduce: object) -> list[tuple[str, nn.Parameter]]:
    """Validate a wrapper's arguments here and across ranks; return the trainable parameters.

    Args:
        module: the model to wrap.
        group: process group (``None``: the default group).
        all_reduce: ``None`` or a function ``fn(tensor, group=None)`` summing in place.

    Returns:
        Trainable parameters in registration order, each once (tied weights appear once).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to wrap, got {type(module).__name__}.")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed has no process group yet. Run this code inside "
            "dpcourse.run(fn) (which initialises one per rank), or under torchrun after "
            "torch.distributed.init_process_group(backend)."
        )
    if all_reduce is not None and not callable(all_reduce):
        raise TypeError(
            f"all_reduce must be a function like torch.distributed.all_reduce(tensor, group=None), "
            f"got {type(all_reduce).__name__}."
        )
    # named_parameters() yields a shared Parameter once, so tied weights are reduced once.
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"{type(module).__name__} has no trainable parameters (none with requires_grad=True): "
            "there is nothing to synchronise. Unfreeze some parameters before wrapping."
        )
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise ValueError(
            f"the module's trainable parameters live on several devices "
            f"({sorted(map(str, devices))}); "
            "data parallelism keeps one full replica per rank on one device: move the module "
            "with module.to(device) before wrapping."
        )
    device = devices.pop()
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        raise ValueError(
            f"the process group uses NCCL, which only moves GPU tensors, but the module is on "
            f"{device}. Move it first: module.to(f'cuda:{{rank}}')."
        )
    check_same_model(module, group, device)  # the first collective: every rank is checked
    return params


def _signature(named) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
            for name, p in named]


def check_same_model(module, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Refuse to wrap when the ranks' models differ in parameters, shapes, dtypes or requires_grad.

    Different models would make the ranks' collectives disagree: a hang (different
    parameter counts), a crash inside the backend (different sizes), or silently
    wrong training (a transposed weight of the same size). One all-gather of
    a 16-byte signature per rank finds out; only if they differ are the full
    parameter lists gathered, to name the first difference (torch DDP makes the
    same check at construction).

    Args:
        module: the model this rank is about to wrap (an ``nn.Module``), or the
            ``(name, parameter)`` pairs it is about to shard (a sharded optimizer's).
        group: process group (``None``: the default group).
        device: where the backend's tensors live (the module's device).
    """
    mine = _signature(module.named_parameters() if isinstance(module, nn.Module) else module)
    digest = hashlib.sha256(repr(mine).encode()).digest()[:8]
    summary = torch.tensor([len(mine), int.from_bytes(digest, "little", signed=True)],
                           dtype=torch.int64, device=device)
    gathered = [torch.empty_like(summary) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, summary, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    signatures: list = [None] * len(gathered)
    dist.all_gather_object(signatures, mine, group=group)
    raise RuntimeError(
        f"the ranks wrap different models: {_first_difference(signatures)}. Every rank must "
        "build the same model (same code, same arguments, same dtype and frozen parameters) "
        "before wrapping it; data parallelism averages gradients parameter by parameter."
    )


def _first_difference(signatures: list) -> str:
    """Name the first parameter where some rank's signature differs from rank 0's."""
    ref = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        for i, ((n0, s0, d0, g0), (n1, s1, d1, g1)) in enumerate(zip(ref, sig)):
            if n0 != n1:
                return f"parameter {i} is {n0!r} on rank 0 but {n1!r} on rank {rank}"
            for what, a, b in (("shape", s0, s1), ("dtype", d0, d1), ("requires_grad", g0, g1)):
                if a != b:
                    return f"{n0} has {what} {a} on rank 0 but {b} on rank {rank}"
        if len(sig) != len(ref):
            extra = (ref[len(sig):] or sig[len(ref):])[0][0]
            return (f"rank 0 has {len(ref)} parameters but rank {rank} has {len(sig)} "
                    f"(the first without a match: {extra!r})")
    return "their parameter lists differ"


def check_forward(wrapper: Wrapper) -> None:
    """Refuse a forward through a wrapper whose module a newer wrapper took over."""
    if wrapper._replaced:
        raise RuntimeError(
            f"this {type(wrapper).__name__} no longer synchronises gradients: its module was "
            "wrapped again by a newer wrapper, which took over. Use the newer wrapper."
        )


def check_backward_start(wrapper: Any) -> None:
    """Refuse a synchronised backward that no forward through the wrapper preceded; consume that forward."""
    if not wrapper._forward_pending:
        raise RuntimeError(
            f"{type(wrapper).__name__}: a backward pass reached the wrapped parameters but "
            "no forward through the wrapper preceded it since the last synchronisation. "
            "Call the wrapper (model(x), not model.module(x)) before each backward; to "
            "backpropagate several losses of one forward, add them and call backward "
            "once, or run the earlier backwards inside no_sync()."
        )
    wrapper._forward_pending = False


def check_all_gradients(wrapper: Wrapper) -> None:
    """Refuse to synchronise when some trainable parameter received no gradient."""
    missing = [n for i, (n, _) in enumerate(wrapper.reducer.named_params) if i not in wrapper._unsynced]
    if missing:
        raise RuntimeError(
            f"{type(wrapper).__name__}: these parameters received no gradient in this step: "
            f"{', '.join(missing)}. Every rank must all-reduce every gradient, or the ranks "
            "would wait for each other forever. Make each trainable parameter contribute to "
            "the loss, or freeze the unused ones (param.requires_grad_(False)) before "
            "wrapping (torch DDP offers find_unused_parameters=True for this case)."
        )


def install(wrapper: Wrapper) -> None:
    """Arm the guards of a new wrapper: no forward awaits its backward yet, and the step guard."""
    wrapper._forward_pending = False
    install_step_guard(wrapper)


def install_step_guard(wrapper: Wrapper) -> None:
    """Make any optimizer step on ``wrapper``'s parameters raise while their gradients are unsynchronised.

    With ``no_sync()`` or a hand-driven loop, a learner can call ``optimizer.step()``
    while some gradients are still this rank's alone. Every rank would then step
    with a different gradient and the replicas would silently drift apart (torch
    DDP does not catch this). A global optimizer pre-step hook catches it at the
    step, while the mistake is still one line away.

    The hook holds the wrapper weakly and is removed when the wrapper is
    garbage-collected or its hooks are removed.

    Args:
        wrapper: reads its ``reducer.named_params`` and ``_unsynced`` (indices of gradients
            not yet averaged); sets ``_step_guard`` to the hook's handle.
    """
    me = weakref.ref(wrapper)
    index_of = {id(p): i for i, (_, p) in enumerate(wrapper.reducer.named_params)}

    def before_step(optimizer, args, kwargs):
        w = me()
        if w is None or not w._unsynced:
            return
        stepped = {index_of[id(p)] for g in optimizer.param_groups for p in g["params"]
                   if id(p) in index_of}
        pending = sorted(stepped & w._unsynced)
        if pending:
            names = ", ".join(w.reducer.named_params[i][0] for i in pending[:5])
            more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
            raise RuntimeError(
                f"optimizer.step() was called before the gradients of {names}{more} were "
                f"averaged across ranks: each rank would step with its own gradient and the "
                f"replicas would drift apart. Run the last micro-step's backward outside "
                f"no_sync(), or call model.finish_gradient_synchronization() before "
                f"optimizer.step()."
            )

    handle = register_optimizer_step_pre_hook(before_step)
    wrapper._step_guard = handle
    weakref.finalize(wrapper, handle.remove)
