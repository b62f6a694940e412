"""Criteria, tolerances and the recorder a check uses inside each rank.

A check is a list of named :class:`Criterion` objects. Inside a rank, the check
runs cases and records, per criterion, whether each case held
(:class:`RankRecorder`). Records go to a small JSON-lines file per rank as they
happen, so the launching process still knows what passed, and which case was
running, when a rank raises or hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

NOT_IMPLEMENTED = "NotImplementedError"


@dataclass(frozen=True)
class Criterion:
    """One thing a check verifies.

    Attributes:
        name: short identifier shown in reports (and asserted by tests).
        description: what must hold, in one sentence.
        hint: the likely mistake when it fails, and where to look.
        requires: name of an extra object (``check(..., reduce_scatter=f)``) this criterion
            needs; the criterion is left out when that object is not given.
    """

    name: str
    description: str
    hint: str = ""
    requires: str | None = None


NO_DEADLOCK = Criterion(
    "no_deadlock", "every rank finishes within the time limit (no hang, no error)",
    "A hang means ranks disagree: one waits for a message or collective that its peer never "
    "issues (a send without a matching recv, a collective skipped on one rank, or blocking "
    "sends on every rank at once). Look at where each rank was waiting.")
NO_DELEGATION = Criterion(
    "no_delegation", "your code does the work itself (no torch DDP, no dpcourse reference)",
    "This exercise is about writing the mechanism yourself: do not wrap "
    "torch.nn.parallel.DistributedDataParallel or call the dpcourse implementation of what "
    "you are asked to build.")

# (rtol, atol) per dtype and backend. "vs_ddp": same data on each rank, only the
# order of the gradient sum differs, so a few ulps. "vs_single": one process on
# the whole batch sums in a different order inside the matmuls too, so looser.
TOLERANCES = {
    ("gloo", torch.float32): {"vs_ddp": (1e-5, 1e-6), "vs_single": (1e-4, 1e-5),
                              "collective": (1e-5, 1e-5)},
    ("nccl", torch.float32): {"vs_ddp": (1e-4, 1e-5), "vs_single": (1e-3, 1e-4),
                              "collective": (1e-5, 1e-5)},
    ("gloo", torch.float64): {"vs_ddp": (1e-10, 1e-12), "vs_single": (1e-9, 1e-10),
                              "collective": (1e-12, 1e-12)},
    ("nccl", torch.float64): {"vs_ddp": (1e-10, 1e-12), "vs_single": (1e-9, 1e-10),
                              "collective": (1e-12, 1e-12)},
    # Low precision: every hop of a ring rounds its partial sum, the library may not.
    ("gloo", torch.bfloat16): {"collective": (2e-2, 2e-2)},
    ("nccl", torch.bfloat16): {"collective": (2e-2, 2e-2)},
    ("gloo", torch.float16): {"collective": (2e-3, 2e-3)},
    ("nccl", torch.float16): {"collective": (2e-3, 2e-3)},
}


def tolerance(backend: str, dtype: torch.dtype, against: str) -> tuple[float, float]:
    """Return ``(rtol, atol)`` for comparing results of ``dtype`` on ``backend``.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        dtype: the tensors' dtype.
        against: ``"vs_ddp"`` (torch DDP), ``"vs_single"`` (one process) or ``"collective"``.

    Returns:
        ``(rtol, atol)`` for ``torch.allclose``.
    """
    table = TOLERANCES.get((backend, dtype)) or TOLERANCES[("gloo", torch.float32)]
    return table.get(against, TOLERANCES[("gloo", torch.float32)][against])


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> str:
    """Return ``""`` when ``got`` matches ``want``, else a one-line description of the difference.

    Args:
        got: the learner's tensor.
        want: the expected tensor.
        rtol, atol: tolerances as in ``torch.allclose``.

    Returns:
        An empty string, or e.g. ``"max |diff| 0.5 at index 3 (got 1.0, expected 0.5)"``.
    """
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


class RankRecorder:
    """Record criterion outcomes on one rank, to a JSON-lines file the launcher reads.

    Args:
        path: the file to append to (one per rank and launch).
        world_size: the launch's world size, stored with every record.
    """

    def __init__(self, path: str, world_size: int):
        self.path, self.world_size = path, world_size

    def _write(self, record: dict) -> None:
        record["world_size"] = self.world_size
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # the rank may be killed right after (a hang)

    def record(self, criterion: str, passed: bool, detail: str = "", case: str = "") -> bool:
        """Record one case of ``criterion``; return ``passed``.

        Args:
            criterion: the criterion's name.
            passed: whether the case held.
            detail: what was observed when it did not.
            case: a short description of the case (e.g. ``"length 5"``).
        """
        self._write({"criterion": criterion, "passed": bool(passed), "detail": detail,
                     "case": case})
        return passed

    @contextlib.contextmanager
    def case(self, criterion: str, case: str = ""):
        """Run learner code for one case; on an exception record a failure, then re-raise.

        The launcher sees the re-raised error at once and stops the other ranks, so
        the learner gets the traceback instead of a hang on the ranks that did not fail.

        Args:
            criterion: the criterion this case belongs to.
            case: a short description of the case.
        """
        self._write({"begin": criterion, "case": case})
        try:
            yield
        except BaseException as exc:
            name = type(exc).__name__
            if name == "DelegationError":
                self.record(NO_DELEGATION.name, False, str(exc), case)
            detail = (f"not implemented yet ({exc})" if name == NOT_IMPLEMENTED
                      else f"raised {name}: {exc}")
            self.record(criterion, False, detail, case)
            raise
