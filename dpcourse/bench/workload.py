"""The GPT training step the data-parallel benchmarks time: model size, optimizer, one step.

Every benchmark of a step (``dpcourse bench ddp``, the sharded variants, the
lessons' recordings, the profiler) builds it from here, so they all measure the
same work: GPT-2 small on a GPU (a tiny GPT on CPU), AdamW (fused on CUDA),
bf16 autocast on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

CONFIGS = ("gpt2_small", "tiny")


def gpt_config(name: str, device: torch.device) -> tuple[str, Any]:
    """Resolve a model size; return ``(name, GPTConfig)``.

    Args:
        name: ``"gpt2_small"`` (~124M parameters), ``"tiny"``, or ``"auto"`` (GPT-2 small
            on a GPU, tiny on CPU).
        device: the rank's device.
    """
    from dpcourse import models

    if name == "auto":
        name = "gpt2_small" if device.type == "cuda" else "tiny"
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}: choose 'auto' or one of {CONFIGS}.")
    return name, getattr(models, name)()


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The benchmarks' mixed precision: bf16 autocast on CUDA, none on CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


def adamw_options(device: torch.device) -> dict[str, Any]:
    """AdamW's arguments: lr 1e-4, fused into one kernel per step on CUDA (none on CPU)."""
    return {"lr": 1e-4, "fused": True} if device.type == "cuda" else {"lr": 1e-4}


def adamw(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.optim.AdamW:
    """The benchmarks' optimizer: ``torch.optim.AdamW`` with :func:`adamw_options`."""
    return torch.optim.AdamW(params, **adamw_options(device))


def make_step(model, opt, idx: torch.Tensor, targets: torch.Tensor,
              amp: torch.dtype | None) -> Callable[[], None]:
    """Return a function running one forward, backward and optimizer step.

    Args:
        model: a GPT (wrapped or not) returning ``(logits, loss)``.
        opt: its optimizer.
        idx, targets: the batch, on the model's device.
        amp: autocast dtype, or ``None`` for none.
    """
    def step():
        with torch.autocast(idx.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step
