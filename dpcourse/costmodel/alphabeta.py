"""An alpha-beta cost model of all-reduce and of a data-parallel training step.

One all-reduce of ``n`` bytes over ``N`` ranks costs

    time(n) = k * alpha + (2 (N - 1) / N) * n * beta

``alpha`` is the fixed cost of one message (software overhead + network latency),
``beta`` the seconds per byte on a rank's link (1 / bandwidth). ``2 (N-1)/N * n`` is
what each rank sends with a ring all-reduce: ``N-1`` chunks of ``n/N`` bytes in
the reduce-scatter, ``N-1`` more in the all-gather. ``k`` counts latency terms:

* ``latency="ring"``: ``k = 2 (N - 1)``, one per ring step, because each of the
  ``2 (N-1)`` steps waits for its message before the next one can start;
* ``latency="call"``: ``k = 1``, one per call, for a library treated as a black
  box (NCCL or gloo may pipeline or pick tree algorithms, so only the per-call
  cost is observable).

The two choices fit the same data equally well for a fixed ``N`` (``alpha``
just rescales); they differ when you extrapolate to another world size.

References: Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (2005) for the alpha-beta model; Li et al.,
"PyTorch Distributed" (VLDB 2020) for bucketing and overlap in DDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LATENCY_MODELS = ("ring", "call")
DTYPE_BYTES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2,
               "fp16": 2, "float16": 2, "half": 2, "fp64": 8, "float64": 8, "fp8": 1}


def dtype_bytes(dtype) -> int:
    """Return the bytes per element of ``dtype``.

    Args:
        dtype: a name such as ``"bf16"``/``"fp32"``, a ``torch.dtype`` or an int (bytes).

    Returns:
        Bytes per element.
    """
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype > 0:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_BYTES:
        return DTYPE_BYTES[dtype.lower()]
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype
    if isinstance(itemsize, int):
        return itemsize
    raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPE_BYTES)}, "
                     "a torch.dtype or a number of bytes.")


def bus_factor(world_size: int) -> float:
    """Return ``2 (N - 1) / N``: bytes each rank sends per byte all-reduced with a ring.

    Multiplying a measured ``nbytes / time`` (the algorithm bandwidth) by it gives the
    bus bandwidth, the rate each rank's link carries, comparable across world sizes.

    Args:
        world_size: number of ranks ``N``.

    Returns:
        ``2 (N - 1) / N`` (0 for a single rank).
    """
    _check_world_size(world_size)
    return 2.0 * (world_size - 1) / world_size


def ring_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Return the bytes each rank sends (and receives) in one ring all-reduce.

    Args:
        nbytes: size of the tensor being all-reduced, in bytes.
        world_size: number of ranks ``N``.

    Returns:
        ``2 (N - 1) / N * nbytes`` (0 for a single rank).
    """
    return bus_factor(world_size) * nbytes


def latency_terms(world_size: int, latency: str = "ring") -> int:
    """Return ``k``, the number of ``alpha`` terms in one all-reduce.

    Args:
        world_size: number of ranks ``N``.
        latency: ``"ring"`` (``2 (N - 1)`` sequential steps) or ``"call"`` (1 per call).

    Returns:
        ``k``.
    """
    _check_world_size(world_size)
    if latency not in LATENCY_MODELS:
        raise ValueError(f"latency must be one of {LATENCY_MODELS}, got {latency!r}.")
    if world_size == 1:
        return 0  # nothing to exchange: an all-reduce on one rank is free
    return 2 * (world_size - 1) if latency == "ring" else 1


def _check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) \
            or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")


@dataclass(frozen=True)
class AlphaBeta:
    """Alpha-beta all-reduce model: ``time(n) = k * alpha + 2 (N-1)/N * n * beta``.

    Attributes:
        alpha: seconds per latency term (per ring step, or per call).
        beta: seconds per byte sent by one rank (1 / bandwidth).
        latency: ``"ring"`` or ``"call"``: how ``k`` depends on the world size.
    """

    alpha: float
    beta: float
    latency: str = "ring"

    @classmethod
    def from_bandwidth(cls, bandwidth: float, alpha: float = 0.0,
                       latency: str = "ring") -> "AlphaBeta":
        """Build a model from a link bandwidth in bytes/s (e.g. ``50e9`` for 50 GB/s)."""
        if bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive bytes/s, got {bandwidth!r}.")
        return cls(alpha=alpha, beta=1.0 / bandwidth, latency=latency)

    @property
    def bandwidth(self) -> float:
        """Bytes per second on one rank's link (``1 / beta``; ``inf`` when ``beta`` is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def allreduce_time(self, nbytes, world_size: int):
        """Predict the seconds of one all-reduce.

        Args:
            nbytes: tensor size in bytes (a number or a numpy array of sizes).
            world_size: number of ranks ``N``.

        Returns:
            Seconds, same shape as ``nbytes``.
        """
        k = latency_terms(world_size, self.latency)
        sent = ring_bytes_per_rank(np.asarray(nbytes, dtype=float), world_size)
        out = k * self.alpha + sent * self.beta
        return float(out) if np.ndim(out) == 0 else out


def _field(row, *names):
    """Read the first present field of a sweep row (a dict or an object with attributes)."""
    for name in names:
        if isinstance(row, dict) and name in row:
            return row[name]
        if not isinstance(row, dict) and hasattr(row, name):
            return getattr(row, name)
    raise KeyError(f"sweep row {row!r} has none of the fields {names}: pass rows like "
                   "dpcourse.bench.allreduce_sweep returns (impl, nbytes, median_s, world_size).")


TIME_FIELDS = ("median_s", "median", "seconds", "time_s")


def sweep_arrays(rows, impl: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Extract ``(nbytes, seconds, world_size)`` arrays from sweep rows, keeping one ``impl``.

    Args:
        rows: iterable of dicts/objects with ``impl``, ``nbytes``, ``median_s``, ``world_size``.
        impl: keep only rows of this implementation (``None`` keeps all).

    Returns:
        Three float arrays of equal length.
    """
    keep = [r for r in rows if impl is None or _field(r, "impl") == impl]
    if not keep:
        raise ValueError(f"no sweep rows{'' if impl is None else f' for impl={impl!r}'}: "
                         "run dpcourse.bench.allreduce_sweep first, or check the impl name.")
    n = np.array([float(_field(r, "nbytes")) for r in keep])
    t = np.array([float(_field(r, *TIME_FIELDS)) for r in keep])
    w = np.array([float(_field(r, "world_size")) for r in keep])
    return n, t, w


def fit_alpha_beta(rows, impl: str | None = None, latency: str = "ring",
                   relative: bool = True) -> AlphaBeta:
    """Fit ``alpha`` and ``beta`` to a measured all-reduce sweep by least squares.

    Args:
        rows: sweep rows (``impl``, ``nbytes``, ``median_s``, ``world_size``), e.g. from
            ``dpcourse.bench.allreduce_sweep``; several world sizes may be mixed.
        impl: fit only this implementation's rows (``None``: all rows).
        latency: ``"ring"`` (``k = 2 (N-1)``) or ``"call"`` (``k = 1``).
        relative: minimise relative rather than absolute errors. Sizes span many
            decades, so absolute least squares would let the largest sizes decide
            everything and leave ``alpha`` to chance.

    Returns:
        The fitted :class:`AlphaBeta` (both parameters constrained to be >= 0).
    """
    n, t, w = sweep_arrays(rows, impl)
    if len(n) < 2:
        raise ValueError("fitting alpha and beta needs at least 2 sweep rows (2 unknowns).")
    k = np.array([latency_terms(int(x), latency) for x in w], dtype=float)
    x = np.array([ring_bytes_per_rank(nb, int(ws)) for nb, ws in zip(n, w)])
    A = np.column_stack([k, x])
    weight = 1.0 / t if relative else np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(A * weight[:, None], t * weight, rcond=None)
    # Physical parameters are non-negative: if noise drives one below zero, the
    # constrained optimum has it at 0, so refit the other alone (2-variable NNLS).
    if alpha < 0 or beta < 0:
        fits = []
        for col in (0, 1):
            a = A[:, col] * weight
            p = max(float(a @ (t * weight)) / float(a @ a), 0.0) if a @ a > 0 else 0.0
            resid = np.sum((a * p - t * weight) ** 2)
            fits.append((resid, col, p))
        _, col, p = min(fits)
        alpha, beta = (p, 0.0) if col == 0 else (0.0, p)
    return AlphaBeta(alpha=float(alpha), beta=float(beta), latency=latency)


def prediction_errors(model: AlphaBeta, rows, impl: str | None = None) -> np.ndarray:
    """Return the relative errors ``(predicted - measured) / measured`` of ``model`` on ``rows``."""
    n, t, w = sweep_arrays(rows, impl)
    pred = np.array([model.allreduce_time(nb, int(ws)) for nb, ws in zip(n, w)])
    return (pred - t) / t
