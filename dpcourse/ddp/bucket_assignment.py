"""Which gradients share a bucket: the cap, a small first bucket, the rebuild in arrival order.

**The plain rule** (:func:`assign_buckets` with its defaults). Buckets are filled in
REVERSE parameter order: backward produces the last layer's gradients first,
so the first bucket is the first one complete. A bucket closes as soon as it
holds at least ``bucket_cap_mb`` (the tensor that crosses the cap stays in it,
so a bucket may exceed the cap by one tensor, exactly as in torch DDP's
``_compute_bucket_assignment_by_size``). Tensors are never split, so this rule
needs no special case: a tensor larger than the cap simply forms a bucket of
its own, and ``bucket_cap_mb=0`` gives one bucket per parameter. Every bucket
has the same cap.

torch's reducer does two things more, which :func:`assign_buckets` does when asked:

* **A small first bucket** (``assign_buckets(..., first_bucket_mb=)``, the wrappers'
  ``first_bucket_mb=``). The first bucket to be reduced closes at
  ``first_bucket_mb`` (torch: 1 MiB when ``bucket_cap_mb`` is left at its
  default), the others at ``bucket_cap_mb``. The first all-reduce then starts
  after a few gradients instead of after 25 MiB of them, so communication
  begins earlier in backward.
* **A rebuild in arrival order** (``assign_buckets(..., order=)`` with the
  ``order`` of :func:`agree_on_order`). Registration order is only a guess of the
  order gradients are produced. During the first synchronised backward the
  reducer records the order in which they really arrive, and before the next
  forward it rebuilds the buckets in that order (once per training run);
  rank 0's order is broadcast so that every rank builds the same buckets.

A wrapper builds its buckets with :func:`~dpcourse.ddp.buckets.buckets_in_order`
and, once, with :func:`~dpcourse.ddp.buckets.rebuild_buckets` (its
:class:`~dpcourse.ddp.reducer.Reducer` records the arrival order and says when).

Reference: ``torch/csrc/distributed/c10d/reducer.cpp``
(``compute_bucket_assignment_by_size``, ``Reducer::rebuild_buckets``).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from dpcourse.formatting import MiB


def check_bucket_cap(bucket_cap_mb) -> float:
    """Validate a bucket cap; return it as a float (``math.inf``: one bucket per dtype/device).

    Args:
        bucket_cap_mb: the cap in MiB, a non-negative number.

    Returns:
        The cap as a float.
    """
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real):
        raise TypeError(
            f"bucket_cap_mb must be a number of MiB (e.g. 25.0), got {bucket_cap_mb!r}.")
    cap = float(bucket_cap_mb)
    if math.isnan(cap) or cap < 0:
        raise ValueError(
            f"bucket_cap_mb must be >= 0 (0: one bucket per parameter; math.inf: a single "
            f"bucket), got {bucket_cap_mb!r}."
        )
    return cap


def _size_and_key(item):
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size(), (item.dtype, item.device)
    if isinstance(item, numbers.Integral) and not isinstance(item, bool) and item >= 0:
        return int(item), None
    raise TypeError(f"assign_buckets takes tensors or sizes in bytes (ints >= 0), got {item!r}.")


def assign_buckets(params, bucket_cap_mb: float = 25.0, *, order=None,
                   first_bucket_mb: float | None = None) -> list[list[int]]:
    """Split parameters into buckets, filled in reverse order and closed once they reach the cap.

    Args:
        params: tensors (grouped by dtype and device: one bucket holds one kind)
            or sizes in bytes, in the order the model registers its parameters.
        bucket_cap_mb: a bucket closes once it holds at least this many MiB;
            0 gives one bucket per parameter.
        order: parameter indices in the order their gradients arrive (a rebuild, lesson 11);
            ``None``: reverse registration order, the guess before any backward ran.
        first_bucket_mb: the cap of the first bucket of each kind (torch's small first
            bucket, lesson 11); ``None``: ``bucket_cap_mb``.

    Returns:
        Buckets in the order they become complete during backward, each a list of
        indices into ``params`` in the order their gradients arrive.
        Example: sizes ``[4, 4, 4]`` bytes with a cap of 8 bytes give ``[[2, 1], [0]]``.
    """
    cap = check_bucket_cap(bucket_cap_mb) * MiB
    first = cap if first_bucket_mb is None else check_bucket_cap(first_bucket_mb) * MiB
    items = [_size_and_key(p) for p in params]
    order = list(reversed(range(len(items)))) if order is None else list(order)
    open_buckets: dict = {}  # (dtype, device) -> (indices, bytes)
    closed: set = set()      # the kinds whose first bucket has closed
    buckets: list[list[int]] = []
    for i in order:
        size, key = items[i]
        indices, total = open_buckets.pop(key, ([], 0))
        indices.append(i)
        total += size
        if total >= (cap if key in closed else first):  # the crossing tensor stays, as in torch
            buckets.append(indices)
            closed.add(key)
        else:
            open_buckets[key] = (indices, total)
    buckets.extend(indices for indices, _ in open_buckets.values())
    # A bucket is complete when its last gradient arrives.
    position = {i: k for k, i in enumerate(order)}
    buckets.sort(key=lambda b: position[b[-1]])
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
