"""FlatShard: the parameters of one unit, flattened, cut into N shards, gathered only when needed.

A unit's parameters are concatenated into one flat vector of ``T`` elements,
padded to ``N * c`` (``c = ceil(T / N)``), and rank ``r`` keeps only elements
``[r c, (r + 1) c)``: :attr:`FlatShard.shard`, an fp32 ``nn.Parameter`` that the
optimizer steps. The module's own parameters are removed; while the unit
computes, its attributes (``linear.weight``...) are *views* into
:attr:`FlatShard.full`, a buffer that an all-gather fills just before and that
is freed right after.

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

from dpcourse.zero.collectives import all_gather
from dpcourse.zero.layout import chunk_size


@dataclass
class Site:
    """One place a parameter is registered: ``module.<attr>`` (a tied weight has several)."""

    module: nn.Module
    attr: str


class FlatShard:
    """Shard one group of parameters (all trainable or all frozen) of one unit.

    Args:
        params: the unique parameters, in registration order.
        sites: ``sites[k]``: where ``params[k]`` is registered.
        group: process group.
        compute_dtype: dtype of the gathered weights (``None``: the parameters' dtype).
        shard: this rank's shard, already cut (a model materialised from the meta
            device, :mod:`dpcourse.fsdp.materialize`); ``None``: cut it from ``params``.

    Attributes:
        shard: this rank's ``c`` elements, an ``nn.Parameter`` in the parameters' dtype.
        full: the ``N * c`` gathered buffer in ``compute_dtype``; its storage is
            empty while the unit is not computing.
        sizes, shapes: numel and shape of each parameter.
    """

    def __init__(self, params: list[nn.Parameter], sites: list[list[Site]], group,
                 world_size: int, rank: int, compute_dtype: torch.dtype | None,
                 shard: torch.Tensor | None = None):
        self.sites, self.group, self.world_size = sites, group, world_size
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
        self.free()
        for p_sites in sites:  # the module forgets its parameters; views replace them
            for s in p_sites:
                del s.module._parameters[s.attr]
                setattr(s.module, s.attr, torch.empty(0, dtype=dtype, device=device))

    @property
    def gathered(self) -> bool:
        """Whether ``full`` holds memory (gathered, or a gather is in flight)."""
        return self.full.untyped_storage().nbytes() > 0

    def start_gather(self) -> None:
        """Allocate ``full`` and launch the all-gather of every rank's shard into it (async)."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        # Cast before sending: in mixed precision the all-gather moves half the bytes.
        self._block = self.shard.detach().to(self.compute_dtype)
        self._version = self.full._version
        self._work = all_gather(self.full, self._block, group=self.group, async_op=True)

    def wait_gather(self) -> None:
        """Make ``full`` valid: wait for the in-flight all-gather (start one if none)."""
        self.start_gather()
        if self._work is not None:
            self._work.wait()
            # The collective counts as an in-place write (at launch or on completion,
            # depending on the backend): restore the version autograd saw.
            torch._C._autograd._unsafe_set_version_counter((self.full,), (self._version,))
            self._work, self._block = None, None

    def free(self) -> None:
        """Release ``full``'s memory; views into it stay valid objects with no data.

        A gather still in flight is waited for first: a prefetch whose unit never ran
        (e.g. a frozen first layer has no backward) would otherwise keep writing into
        memory already released, and corrupt the process's heap.
        """
        if self._work is not None:
            self._work.wait()
            self._work, self._block = None, None
        self.full.untyped_storage().resize_(0)

    def set_views(self, full: torch.Tensor) -> None:
        """Point every site at its slice of ``full`` (``full`` may carry autograd history)."""
        parts = full.split(self.sizes + [self.padding])
        for part, shape, p_sites in zip(parts, self.shapes, self.sites):
            view = part.view(shape)
            for s in p_sites:
                setattr(s.module, s.attr, view)

    @torch.no_grad()
    def gather_full(self) -> list[torch.Tensor]:
        """All-gather the master shards (not the compute copies); return each parameter, cloned."""
        out = torch.empty(self.world_size * self.chunk, dtype=self.shard.dtype,
                          device=self.shard.device)
        all_gather(out, self.shard.detach(), group=self.group)
        return [t.view(s).clone() for t, s in zip(out.split(self.sizes + [self.padding]),
                                                 self.shapes)]
