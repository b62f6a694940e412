"""Parameters a forward did not use: torch's ``find_unused_parameters`` and ``static_graph``.

A wrapper reduces a bucket once every gradient in it has arrived. A parameter
that the forward never touched gets no gradient, so its bucket would wait
forever and the ranks would hang. torch's answers, reproduced here:

* ``find_unused_parameters=True``: after each forward, walk the autograd graph
  from the outputs; parameters not reached are marked ready at the start of
  backward (their slot holds zeros). One extra all-reduce of a "used" flag per
  parameter then tells every rank which parameters nobody used, whose
  gradients are left untouched (``None`` stays ``None``, so the optimizer skips them).
* ``static_graph=True``: promise that every step uses the same parameters.
  The first step finds the unused ones at its end (no graph walk) and
  all-reduces the used flags once; later steps reuse that answer, with
  neither the walk nor the extra all-reduce.

Reference: ``torch/csrc/distributed/c10d/reducer.cpp``
(``search_unused_parameters``, ``all_reduce_local_used_map``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


def reachable_parameters(outputs, params) -> set[int]:
    """Indices of ``params`` that the autograd graph of ``outputs`` reaches.

    Args:
        outputs: the forward's result (a tensor, or lists, tuples, dicts of them).
        params: the trainable parameters, indexed as the returned set.

    Returns:
        Indices of the parameters whose gradient backward from ``outputs`` would accumulate.
    """
    index_of = {id(p): i for i, p in enumerate(params)}
    found, seen = set(), set()
    stack = []
    for t in _tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif id(t) in index_of:  # the output is a parameter itself
            found.add(index_of[id(t)])
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and id(variable) in index_of:
            found.add(index_of[id(variable)])
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


def globally_unused(used: set[int], num_params: int, device, group=None) -> set[int]:
    """All-reduce the per-parameter "used" flags; return the parameters no rank used.

    Args:
        used: indices this rank used (got a gradient for) since the last synchronisation.
        num_params: number of trainable parameters.
        device: device of the flag tensor (a GPU for NCCL).
        group: process group (``None``: the default group).

    Returns:
        Indices used on no rank.
    """
    flags = torch.zeros(num_params, device=device)
    if used:
        flags[sorted(used)] = 1.0
    dist.all_reduce(flags, group=group)
    return {i for i in range(num_params) if flags[i].item() == 0}


class UnusedParameters:
    """One rank's record of which parameters got a gradient, and what torch's options make of it.

    Args:
        params: the wrapper's trainable parameters (indices below are into this list).
        find_unused_parameters: search every forward's graph for the parameters it did not use.
        static_graph: the same parameters are used every step: find them in the first only.

    Attributes:
        at_forward: parameters the last forward did not use; backward marks them ready at once.
        used: parameters that got a gradient since the last synchronisation.
        grad_was_none: parameters without ``.grad`` before this step's forwards.
    """

    def __init__(self, params: list[nn.Parameter], find_unused_parameters: bool,
                 static_graph: bool):
        self.params = params
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.at_forward: set[int] = set()
        self.used: set[int] = set()
        self.grad_was_none: set[int] = set()
        self._static: tuple[set[int], set[int]] | None = None  # first step's (locally, globally)

    @property
    def searched(self) -> bool:
        """Whether either option is on: unused parameters' zero gradients are reduced too."""
        return self.find_unused_parameters or self.static_graph

    def before_forward(self) -> None:
        """Note the parameters with no gradient yet (a forward with grad enabled follows)."""
        if self.searched:
            self.grad_was_none.update(i for i, p in enumerate(self.params) if p.grad is None)

    def after_forward(self, output: Any, syncs: bool) -> None:
        """Find the parameters this forward did not use (only when asked to, as in torch).

        Args:
            output: the forward's result.
            syncs: whether the backward of this forward synchronises (outside ``no_sync``).
        """
        if syncs and self.static_graph and self._static is not None:
            self.at_forward = self._static[0]  # found in the first step; no graph walk
        elif syncs and self.find_unused_parameters and not self.static_graph:
            reached = reachable_parameters(output, self.params)
            self.at_forward = set(range(len(self.params))) - reached
        else:
            self.at_forward = set()

    def forget_globally_unused(self, device: torch.device,
                               group: dist.ProcessGroup | None) -> None:
        """Give back ``None`` gradients to parameters no rank used, so optimizers skip them."""
        if self.static_graph and self._static is not None:
            unused = self._static[1]  # a static graph: the first step's answer holds
        else:
            unused = globally_unused(self.used, len(self.params), device, group)
            if self.static_graph:
                local = set(range(len(self.params))) - self.used
                self._static = (local, unused)
        for i in unused & self.grad_was_none:
            self.params[i].grad = None

    def clear(self) -> None:
        """Start a new synchronisation: nothing used yet."""
        self.used.clear()
        self.grad_was_none.clear()
