"""Fresh random inputs for a check's cases, drawn from the round's ``random.Random``.

A check draws new cases on every run (:meth:`~dpcourse.grading.checks.base.Exercise.make_inputs`
receives the round's ``rng``); its tensors come from a ``torch.Generator`` seeded
from that ``rng``, so a run's cases are drawn again from the same seed.
"""

from __future__ import annotations

import torch


def torch_generator(rng) -> torch.Generator:
    """A ``torch.Generator`` seeded from ``rng`` (a ``random.Random``)."""
    return torch.Generator().manual_seed(rng.getrandbits(62))


def regression_batches(gen: torch.Generator, count: int, rows: int, features_in: int,
                       features_out: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches ``(x, y)`` of ``rows`` standard normal samples drawn from ``gen``.

    Each batch's ``x`` is drawn before its ``y``, batch after batch: a check that draws
    its cases in one order gets the same tensors from the same seed.
    """
    return [(torch.randn(rows, features_in, generator=gen),
             torch.randn(rows, features_out, generator=gen)) for _ in range(count)]
