"""Bytes one rank sends per FSDP step, against DDP's all-reduce."""

from __future__ import annotations

from dpcourse.zero.collectives import wire_bytes


def fsdp_wire_bytes(root_bytes: float, unit_bytes: list[float], world_size: int,
                    grad_scale: float = 1.0) -> dict[str, float]:
    """Return what one rank sends per step under FSDP (ring collectives).

    Every unit is all-gathered before its forward; every unit but the root is gathered
    again before its backward (the root stays gathered in between); every gradient is
    reduce-scattered once.

    Args:
        root_bytes: gathered bytes of the root unit's parameters (compute dtype).
        unit_bytes: gathered bytes of each other unit (compute dtype).
        world_size: ranks ``N``.
        grad_scale: bytes of a reduced gradient element over a gathered one
            (1 when both use the same dtype).

    Returns:
        ``{"forward_gather", "backward_gather", "reduce_scatter", "total"}`` in bytes sent.
    """
    full = root_bytes + sum(unit_bytes)
    out = {"forward_gather": wire_bytes("all_gather_into_tensor", full, world_size),
           "backward_gather": wire_bytes("all_gather_into_tensor", sum(unit_bytes), world_size),
           "reduce_scatter": wire_bytes("reduce_scatter_tensor", full * grad_scale, world_size)}
    out["total"] = sum(out.values())
    return out
