"""FlatParams: one unit's parameters flattened and sharded, with no communication of its own.

The layout of :class:`~dpcourse.fsdp.flat.FlatShard` without its collectives:
exercise 14 hands these to the learner's hooks, which decide when to all-gather,
free and reduce-scatter. Parameters of one kind (all trainable or all frozen)
are concatenated into ``numel`` elements, padded to ``N * chunk``
(``chunk = ceil(numel / N)``); rank ``r`` keeps elements
``[r * chunk, (r + 1) * chunk)`` as :attr:`FlatParams.shard`. While the unit
computes, the module's attributes are views into :attr:`FlatParams.full`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dpcourse.zero.layout import chunk_size


class FlatParams:
    """The parameters of one kind (trainable or frozen) of one unit, flattened and sharded.

    Args:
        module: the unit; every parameter of it with ``requires_grad == trainable`` moves
            here and leaves ``module``'s parameters (shared parameters are not supported).
        trainable: which kind to take.
        world_size: ranks ``N``.
        rank: this rank.

    Attributes:
        shard: this rank's ``chunk`` elements, an ``nn.Parameter`` (what the optimizer steps).
        full: the ``N * chunk`` gathered vector; it holds no memory until :meth:`allocate`.
        numel, chunk: elements before padding, and per rank.
        requires_grad: whether these parameters are trained.
        names: the parameters' names within ``module``, in registration order.
    """

    def __init__(self, module: nn.Module, trainable: bool, world_size: int, rank: int):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad == trainable]
        if not named:
            raise ValueError(f"the module has no {'trainable' if trainable else 'frozen'} "
                             "parameter.")
        self.names = [n for n, _ in named]
        self.sizes = [p.numel() for _, p in named]
        self.shapes = [p.shape for _, p in named]
        self.numel, self.requires_grad = sum(self.sizes), trainable
        self.chunk = chunk_size(self.numel, world_size)
        dtype = named[0][1].dtype
        with torch.no_grad():
            flat = torch.zeros(world_size * self.chunk, dtype=dtype)
            flat[:self.numel] = torch.cat([p.detach().reshape(-1) for _, p in named])
        self.shard = nn.Parameter(flat[rank * self.chunk:(rank + 1) * self.chunk].clone(),
                                  requires_grad=trainable)
        self.full = torch.empty(world_size * self.chunk, dtype=dtype)
        self._nbytes = self.full.untyped_storage().nbytes()
        self.free()
        self._sites = []
        for name in self.names:  # the module forgets its parameters; views will replace them
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            del sub._parameters[attr]
            setattr(sub, attr, torch.empty(0, dtype=dtype))
            self._sites.append((sub, attr))

    @classmethod
    def of_unit(cls, module: nn.Module, world_size: int, rank: int) -> list["FlatParams"]:
        """Return the unit's flats: its trainable parameters first, then its frozen ones."""
        kinds = [k for k in (True, False) if any(p.requires_grad == k for p in module.parameters())]
        return [cls(module, k, world_size, rank) for k in kinds]

    @property
    def allocated(self) -> bool:
        """Whether :attr:`full` holds memory."""
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self) -> torch.Tensor:
        """Give :attr:`full` its memory back and return the tensor a collective fills.

        The returned tensor is :attr:`full`'s memory without its autograd bookkeeping:
        before a unit's backward, the weights autograd saved in forward (views of
        ``full``) are refilled with the very same values, which autograd must not
        count as a change. The contents are undefined until a collective fills them.
        """
        self.full.untyped_storage().resize_(self._nbytes)
        return self.full.data

    def free(self) -> None:
        """Release :attr:`full`'s memory (views of it stay valid objects with no data).

        Only once every collective writing into it has finished: a collective still in
        flight would write into memory the process has given back.
        """
        self.full.untyped_storage().resize_(0)

    def point_module_at(self, full: torch.Tensor) -> None:
        """Set every parameter's attribute of the module to its view of ``full``.

        Args:
            full: :attr:`full` itself, or the tensor :func:`gathered` returns (which
                carries the link to :attr:`shard` that autograd follows).
        """
        parts = full.split(self.sizes + [full.numel() - self.numel])
        for (sub, attr), part, shape in zip(self._sites, parts, self.shapes):
            setattr(sub, attr, part.view(shape))


class _Gathered(torch.autograd.Function):
    """Identity from a flat's shard to its full vector; backward hands the gradient on."""

    @staticmethod
    def forward(ctx, shard, flat, on_gradient):  # type: ignore[override]
        ctx.flat, ctx.on_gradient = flat, on_gradient
        return flat.full.view(-1)

    @staticmethod
    def backward(ctx, grad_full):  # type: ignore[override]
        ctx.on_gradient(ctx.flat, grad_full)
        return None, None, None  # the shard's .grad is set by on_gradient, not by autograd


class _HasShardAndFull(Protocol):
    """What :func:`gathered` needs of a flat: :class:`FlatParams`, or the FSDP wrapper's FlatShard."""

    @property
    def shard(self) -> torch.Tensor: ...

    @property
    def full(self) -> torch.Tensor: ...


def gathered(flat: _HasShardAndFull, on_gradient) -> torch.Tensor:
    """Return ``flat.full`` as autograd's function of ``flat.shard``.

    Point the module at it (:meth:`FlatParams.point_module_at`) and, once backward
    has the gradient of every view of it, autograd calls
    ``on_gradient(flat, grad_full)`` with the gradient of the whole ``N * chunk``
    vector on this rank (zeros in the padding).

    Args:
        flat: a trainable flat whose ``full`` holds the gathered weights (a
            :class:`FlatParams`, or the wrapper's :class:`~dpcourse.fsdp.flat.FlatShard`).
        on_gradient: ``on_gradient(flat, grad_full)``, called once per backward.
    """
    return _Gathered.apply(flat.shard, flat, on_gradient)
