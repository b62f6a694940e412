"""FlatParams: one unit's parameters flattened, sharded across ranks, unsharded only when needed.

A unit's parameters of one kind (all trainable or all frozen) are concatenated
into one flat vector of ``numel`` elements, padded to ``N * chunk``
(``chunk = ceil(numel / N)``, :func:`dpcourse.comm.sharding.chunk_size`), and rank
``r`` keeps only elements ``[r * chunk, (r + 1) * chunk)``: :attr:`FlatParams.shard`,
an ``nn.Parameter`` that the optimizer steps. That is the layout of
``dist.reduce_scatter_tensor`` and ``dist.all_gather_into_tensor``. The module's
own parameters are removed; while the unit computes, its attributes
(``linear.weight``...) are views into :attr:`FlatParams.full`, the unsharded
vector, which an all-gather fills just before and which is freed right after.

The vocabulary is torch FSDP2's (``FSDPParam``): :meth:`~FlatParams.unshard`
allocates ``full`` and all-gathers into it, :meth:`~FlatParams.reshard` frees it,
:meth:`~FlatParams.to_unsharded` points the module at views of it.
:class:`~dpcourse.fsdp.FullyShardedDataParallel` calls those; exercise 14's hooks
issue the collectives themselves, into the buffer :meth:`~FlatParams.alloc_unsharded`
returns.

Freeing keeps the tensor objects and releases their memory:
``full.untyped_storage().resize_(0)``. Autograd's saved tensors (e.g. the
weight a ``Linear`` needs for its backward) are views of that storage, so a
second all-gather into the same storage before the unit's backward brings
them back to life. Writing into a tensor that autograd saved normally bumps
its version counter and makes backward refuse it; the data written is the
very same weights, so the counter is preserved around the write (torch's
FSDP does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dpcourse.comm.sharding import chunk_size
from dpcourse.zero.collectives import all_gather


@dataclass
class Site:
    """One place a parameter is registered: ``module.<attr>`` (a tied weight has several)."""

    module: nn.Module
    attr: str


def sites_by_param(module: nn.Module) -> dict[int, list[Site]]:
    """Return every place each parameter of ``module`` is registered, by ``id(parameter)``."""
    sites: dict[int, list[Site]] = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                sites.setdefault(id(p), []).append(Site(m, attr))
    return sites


class FlatParams:
    """Shard one group of parameters (all trainable or all frozen) of one unit.

    Args:
        params: the unique parameters, in registration order.
        sites: ``sites[k]``: where ``params[k]`` is registered.
        world_size: ranks ``N``.
        rank: this rank.
        group: process group of :meth:`unshard` (``None``: the default group).
        compute_dtype: dtype of the unsharded weights (``None``: the parameters' dtype).
        shard: this rank's shard, already cut (a model materialised from the meta
            device, :mod:`dpcourse.fsdp.materialize`); ``None``: cut it from ``params``.
        names: the parameters' names, for whoever needs them (``None``: empty).

    Attributes:
        shard: this rank's ``chunk`` elements, an ``nn.Parameter`` in the parameters' dtype.
        full: the ``N * chunk`` unsharded vector in ``compute_dtype``; it holds no
            memory while the unit is not computing (:attr:`is_unsharded`).
        numel, chunk, padding: elements before padding, per rank, and of padding.
        sizes, shapes, names: numel, shape and name of each parameter.
    """

    def __init__(self, params: list[nn.Parameter], sites: list[list[Site]], world_size: int,
                 rank: int, *, group=None, compute_dtype: torch.dtype | None = None,
                 shard: torch.Tensor | None = None, names: list[str] | None = None):
        self.sites, self.group, self.world_size = sites, group, world_size
        self.names = names or []
        self.sizes = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.numel = sum(self.sizes)
        self.chunk = chunk_size(self.numel, world_size)
        self.padding = world_size * self.chunk - self.numel
        dtype = params[0].dtype
        device = params[0].device if shard is None else shard.device
        self.compute_dtype = compute_dtype or dtype
        if shard is None:
            with torch.no_grad():
                flat = torch.zeros(world_size * self.chunk, dtype=dtype, device=device)
                torch.cat([p.detach().reshape(-1) for p in params], out=flat[:self.numel])
                shard = flat[rank * self.chunk:(rank + 1) * self.chunk].clone()
                del flat
        self.shard = nn.Parameter(shard, requires_grad=params[0].requires_grad)
        self.full = torch.empty(world_size * self.chunk, dtype=self.compute_dtype, device=device)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self._work = None
        self._version = 0
        self._block: torch.Tensor | None = None
        self.reshard()
        for p_sites in sites:  # the module forgets its parameters; views replace them
            for s in p_sites:
                del s.module._parameters[s.attr]
                setattr(s.module, s.attr, torch.empty(0, dtype=dtype, device=device))

    @classmethod
    def of_unit(cls, module: nn.Module, world_size: int, rank: int,
                group=None) -> list[FlatParams]:
        """Return a unit's flats: its trainable parameters first, then its frozen ones.

        Names are relative to ``module``; a weight tied inside it is one parameter.
        """
        sites = sites_by_param(module)
        named = dict((id(p), (n, p)) for n, p in reversed(list(module.named_parameters())))
        order = [named[pid] for pid in sites]  # registration order, first name of each
        flats = []
        for trainable in (True, False):
            kind = [(n, p) for n, p in order if p.requires_grad == trainable]
            if kind:
                flats.append(cls([p for _, p in kind], [sites[id(p)] for _, p in kind],
                                 world_size, rank, group=group, names=[n for n, _ in kind]))
        return flats

    @property
    def requires_grad(self) -> bool:
        """Whether these parameters are trained."""
        return self.shard.requires_grad

    @property
    def is_unsharded(self) -> bool:
        """Whether :attr:`full` holds memory (unsharded, or an all-gather into it is in flight)."""
        return self.full.untyped_storage().nbytes() > 0

    def alloc_unsharded(self) -> torch.Tensor:
        """Give :attr:`full` its memory back and return the tensor an all-gather fills.

        The returned tensor is :attr:`full`'s memory without its autograd bookkeeping:
        before a unit's backward, the weights autograd saved in forward (views of
        ``full``) are refilled with the very same values, which autograd must not
        count as a change. The contents are undefined until a collective fills them.
        """
        self.full.untyped_storage().resize_(self._full_bytes)
        return self.full.data

    def unshard(self) -> None:
        """Allocate :attr:`full` and launch the all-gather of every rank's shard into it (async)."""
        if self.is_unsharded:
            return
        self.alloc_unsharded()
        # Cast before sending: in mixed precision the all-gather moves half the bytes.
        self._block = self.shard.detach().to(self.compute_dtype)
        self._version = self.full._version
        self._work = all_gather(self.full, self._block, group=self.group, async_op=True)

    def wait_for_unshard(self) -> None:
        """Make :attr:`full` valid: wait for the in-flight all-gather (start one if none)."""
        self.unshard()
        if self._work is not None:
            self._work.wait()
            # The collective counts as an in-place write (at launch or on completion,
            # depending on the backend): restore the version autograd saw.
            torch._C._autograd._unsafe_set_version_counter((self.full,), (self._version,))
            self._work, self._block = None, None

    def reshard(self) -> None:
        """Release :attr:`full`'s memory; views into it stay valid objects with no data.

        An all-gather still in flight is waited for first: a prefetch whose unit never
        ran (e.g. a frozen first layer has no backward) would otherwise keep writing
        into memory already released, and corrupt the process's heap.
        """
        if self._work is not None:
            self._work.wait()
            self._work, self._block = None, None
        self.full.untyped_storage().resize_(0)

    def to_unsharded(self, full: torch.Tensor) -> None:
        """Point every site at its view of ``full``.

        Args:
            full: :attr:`full` itself, or the tensor :func:`gathered` returns (which
                carries the link to :attr:`shard` that autograd follows).
        """
        parts = full.split(self.sizes + [self.padding])
        for part, shape, p_sites in zip(parts, self.shapes, self.sites):
            view = part.view(shape)
            for s in p_sites:
                setattr(s.module, s.attr, view)

    @torch.no_grad()
    def full_tensors(self) -> list[torch.Tensor]:
        """All-gather the master shards (not the compute copies); return each parameter, cloned."""
        out = torch.empty(self.world_size * self.chunk, dtype=self.shard.dtype,
                          device=self.shard.device)
        all_gather(out, self.shard.detach(), group=self.group)
        return [t.view(s).clone() for t, s in zip(out.split(self.sizes + [self.padding]),
                                                 self.shapes)]


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


def gathered(flat: FlatParams, on_gradient) -> torch.Tensor:
    """Return ``flat.full`` as autograd's function of ``flat.shard``.

    Point the module at it (:meth:`FlatParams.to_unsharded`) and, once backward
    has the gradient of every view of it, autograd calls
    ``on_gradient(flat, grad_full)`` with the gradient of the whole ``N * chunk``
    vector on this rank (zeros in the padding).

    Args:
        flat: a trainable flat whose ``full`` holds the gathered weights.
        on_gradient: ``on_gradient(flat, grad_full)``, called once per backward.
    """
    return _Gathered.apply(flat.shard, flat, on_gradient)
