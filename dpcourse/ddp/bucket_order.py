"""Which gradients share a bucket: torch's small first bucket and the rebuild in arrival order.

torch's reducer does two things our plain :func:`~dpcourse.ddp.buckets.assign_buckets`
does not:

* **A small first bucket.** The first bucket to be reduced closes at
  ``first_bucket_mb`` (torch: 1 MiB when ``bucket_cap_mb`` is left at its
  default), the others at ``bucket_cap_mb``. The first all-reduce then starts
  after a few gradients instead of after 25 MiB of them, so communication
  begins earlier in backward.
* **A rebuild in arrival order.** Registration order is only a guess of the
  order gradients are produced. During the first synchronised backward the
  reducer records the order in which they really arrive, and before the next
  forward it rebuilds the buckets in that order (once per training run);
  rank 0's order is broadcast so that every rank builds the same buckets.

A wrapper builds its buckets with :func:`buckets_in_order` and, once, with
:func:`rebuild_buckets` (its :class:`~dpcourse.ddp.reducer.Reducer` records the
arrival order and says when).

Reference: ``torch/csrc/distributed/c10d/reducer.cpp``
(``compute_bucket_assignment_by_size``, ``Reducer::rebuild_buckets``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.ddp.buckets import Bucket, MiB, check_bucket_cap, make_buckets

Where = dict[int, tuple[int, int]]  # parameter index -> (bucket, slot in it)


def assign_buckets_in_order(params, order, bucket_cap_mb: float = 25.0,
                            first_bucket_mb: float | None = None) -> list[list[int]]:
    """Fill buckets following ``order``; the first bucket of each dtype closes at ``first_bucket_mb``.

    Args:
        params: tensors, indexed by the entries of ``order`` (one bucket holds one dtype
            and device).
        order: parameter indices in the order their gradients arrive.
        bucket_cap_mb: a bucket closes once it holds at least this many MiB
            (the tensor that crosses the cap stays in it).
        first_bucket_mb: the cap of the first bucket; ``None``: ``bucket_cap_mb``.

    Returns:
        Buckets in the order they become complete, each a list of indices in arrival order.
    """
    cap = check_bucket_cap(bucket_cap_mb) * MiB
    first = cap if first_bucket_mb is None else check_bucket_cap(first_bucket_mb) * MiB
    position = {i: k for k, i in enumerate(order)}
    open_buckets: dict = {}   # (dtype, device) -> (indices, bytes)
    closed_per_key: dict = {}  # how many buckets each kind has closed
    buckets = []
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        indices, total = open_buckets.pop(key, ([], 0))
        indices.append(i)
        total += p.numel() * p.element_size()
        limit = first if closed_per_key.get(key, 0) == 0 else cap
        if total >= limit:
            buckets.append(indices)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
        else:
            open_buckets[key] = (indices, total)
    buckets.extend(indices for indices, _ in open_buckets.values())
    buckets.sort(key=lambda b: position[b[-1]])  # complete when its last gradient arrives
    return buckets


def agree_on_order(order: list[int], num_params: int, device, group=None) -> list[int]:
    """Return rank 0's arrival order on every rank (one broadcast), so all build the same buckets.

    Args:
        order: this rank's observed arrival order (a permutation of ``range(num_params)``,
            or a prefix of one: the missing indices are appended in reverse registration order).
        num_params: number of trainable parameters.
        device: device of the broadcast tensor (a GPU for NCCL).
        group: process group (``None``: the default group).

    Returns:
        The agreed order.
    """
    seen = set(order)
    full = list(order) + [i for i in reversed(range(num_params)) if i not in seen]
    t = torch.tensor(full, dtype=torch.int64, device=device)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(t, src=src, group=group)
    return t.tolist()


def buckets_in_order(named_params, bucket_cap_mb: float, order: list[int] | None = None, *,
                     first_bucket_mb: float | None = None,
                     gradient_as_bucket_view: bool = True) -> tuple[list[Bucket], Where]:
    """Build a wrapper's buckets: in reverse registration order, or in ``order`` (a rebuild).

    Args:
        named_params: the trainable ``(name, parameter)`` pairs, registration order.
        bucket_cap_mb: the cap of every bucket (see :func:`~dpcourse.ddp.buckets.assign_buckets`).
        order: parameter indices in the order their gradients arrived; ``None``:
            reverse registration order, the guess before any backward ran.
        first_bucket_mb: the cap of the first bucket; ``None``: ``bucket_cap_mb``.
        gradient_as_bucket_view: ``param.grad`` is a view into its bucket
            (see :class:`~dpcourse.ddp.buckets.Bucket`).

    Returns:
        ``(buckets, where)``: the buckets in reduction order, and for each parameter
        index ``(bucket index, position inside the bucket)``.
    """
    assignment = None   # lesson 05's assign_buckets: one cap, reverse registration order
    if order is not None or first_bucket_mb is not None:
        order = list(reversed(range(len(named_params)))) if order is None else order
        assignment = assign_buckets_in_order([p for _, p in named_params], order, bucket_cap_mb,
                                             first_bucket_mb)
    return make_buckets(named_params, bucket_cap_mb, assignment, gradient_as_bucket_view)


@torch.no_grad()
def rebuild_buckets(named_params, arrival: list[int], device, group, bucket_cap_mb: float, *,
                    first_bucket_mb: float | None = None,
                    gradient_as_bucket_view: bool = True) -> tuple[list[Bucket], Where]:
    """Build new buckets in rank 0's arrival order (one broadcast), keeping accumulated gradients.

    Args:
        named_params: the trainable ``(name, parameter)`` pairs, registration order.
        arrival: the order this rank saw gradients arrive in its first synchronised backward.
        device: device of the broadcast order (a GPU for NCCL).
        group: process group (``None``: the default group).
        bucket_cap_mb, first_bucket_mb, gradient_as_bucket_view: as :func:`buckets_in_order`.

    Returns:
        ``(buckets, where)``, as :func:`buckets_in_order`.
    """
    order = agree_on_order(arrival, len(named_params), device, group)
    buckets, where = buckets_in_order(named_params, bucket_cap_mb, order,
                                      first_bucket_mb=first_bucket_mb,
                                      gradient_as_bucket_view=gradient_as_bucket_view)
    if gradient_as_bucket_view:  # keep accumulated gradients, now in the new buckets
        for bucket in buckets:
            for k, p in enumerate(bucket.params):
                if p.grad is not None:
                    bucket.attach_grad(k)
    return buckets, where
