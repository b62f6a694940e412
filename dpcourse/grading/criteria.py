"""Criteria and tolerances: what a check verifies, how much each part weighs, how close is equal.

A check is a list of named :class:`Criterion` objects with weights. A criterion
with ``needs`` counts only once the criteria it names pass (an unchanged tensor
is trivially "in place"), and a ``gate`` criterion that fails scores the whole
check zero (code that hands the work to something else earns nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

NOT_IMPLEMENTED = "NotImplementedError"


@dataclass(frozen=True)
class Criterion:
    """One thing a check verifies.

    ``requires``: the role of a further learner definition it grades (e.g. ``"chunk_bounds"``);
    it fails with "not defined" when the notebook lacks it. ``needs``: criteria that must
    pass for this one to count. ``gate``: when it fails, the whole check scores zero.
    """

    name: str
    description: str
    hint: str = ""
    requires: str | None = None
    weight: float = 1.0
    needs: tuple[str, ...] = ()
    gate: bool = False


def no_deadlock(needs: str) -> Criterion:
    """The standard "every rank finishes" criterion, credited once ``needs`` passes."""
    return replace(NO_DEADLOCK, needs=(needs,))


def no_delegation(needs: str) -> Criterion:
    """The standard "does the work itself" gate, credited once ``needs`` passes."""
    return replace(NO_DELEGATION, needs=(needs,))


NO_DEADLOCK = Criterion(
    "no_deadlock", "every rank finishes within the time limit (no hang, no error)",
    "A hang means ranks disagree: one waits for a message or collective that its peer never "
    "issues (a send without a matching recv, a collective skipped on one rank, or blocking "
    "sends on every rank at once). Look at where each rank was waiting.")
NO_DELEGATION = Criterion(
    "no_delegation", "your code does the work itself (no torch DDP, no dpcourse reference, "
    "no reaching into Python's or the grader's internals)",
    "Write the mechanism with torch and torch.distributed's public functions. Graded code may "
    "not wrap torch.nn.parallel.DistributedDataParallel, import the dpcourse implementation of "
    "what you are asked to build, or use exec/eval, gc, inspect, sys, os, frames or private "
    "attributes of modules.", gate=True)

# (rtol, atol) per dtype and backend. "vs_ddp": same data on each rank, only the
# order of the gradient sum differs, so a few ulps. "vs_single": one process on
# the whole batch sums in a different order inside the matmuls too, so looser.
TOLERANCES = {
    ("gloo", torch.float32): {"vs_ddp": (1e-5, 1e-6), "vs_single": (1e-4, 1e-5),
                              "collective": (1e-5, 1e-5)},
    ("nccl", torch.float32): {"vs_ddp": (1e-4, 1e-5), "vs_single": (1e-3, 1e-4),
                              "collective": (1e-5, 1e-5)},
    **{(backend, dtype): table for backend in ("gloo", "nccl") for dtype, table in (
        (torch.float64, {"vs_ddp": (1e-10, 1e-12), "vs_single": (1e-9, 1e-10),
                         "collective": (1e-12, 1e-12)}),
        # Low precision: every hop of a ring rounds its partial sum, the library may not.
        (torch.bfloat16, {"collective": (2e-2, 2e-2)}),
        (torch.float16, {"collective": (2e-3, 2e-3)}))},
}


def tolerance(backend: str, dtype: torch.dtype, against: str) -> tuple[float, float]:
    """Return ``(rtol, atol)`` for comparing results of ``dtype`` on ``backend`` (``"gloo"``,
    ``"nccl"``) ``against`` ``"vs_ddp"`` (torch DDP), ``"vs_single"`` (one process) or
    ``"collective"``."""
    table = TOLERANCES.get((backend, dtype)) or TOLERANCES[("gloo", torch.float32)]
    return table.get(against, TOLERANCES[("gloo", torch.float32)][against])


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> str:
    """Return ``""`` when ``got`` matches ``want`` (``torch.allclose`` with ``rtol``, ``atol``),
    else one line, e.g. ``"max |diff| 0.5 at flat index 3 (got 1.0, expected 0.5; ...)"``."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.numel() == 0:
        return ""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    if torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=False):
        return ""
    diff = (g - w).abs().nan_to_num(float("inf")).flatten()
    i = int(diff.argmax())
    ratio = ""
    if w.flatten()[i] != 0:
        ratio = f", ratio {float(g.flatten()[i] / w.flatten()[i]):.4g}"
    return (f"max |diff| {float(diff[i]):.3g} at flat index {i} (got {float(g.flatten()[i]):.6g}, "
            f"expected {float(w.flatten()[i]):.6g}{ratio}; rtol={rtol:g}, atol={atol:g})")


def first_mismatch(names, got, want, tol, what: str = "") -> str:
    """``"name<what>: how it differs"`` for the first tensor of ``got`` unlike ``want``, or ``""``.

    Args:
        names: the tensors' names (parameters, buffers), in the order of ``got`` and ``want``.
        got, want: tensors (``None`` in ``got``: no gradient).
        tol: ``(rtol, atol)`` for :func:`mismatch`.
        what: appended to the name, e.g. ``".grad"``.
    """
    for name, a, b in zip(names, got, want):
        diff = "no gradient" if a is None else mismatch(a, b, *tol)
        if diff:
            return f"{name}{what}: {diff}"
    return ""
