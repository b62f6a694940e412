"""Models that each exercise one corner of gradient synchronisation, for the DDP tests.

A frozen layer and a frozen bias (no gradient to reduce), tied weights (one
parameter used twice, reduced once), buffers (broadcast, not reduced) and an
unused layer (a gradient that never arrives).
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.models import MLP, seeded


def frozen_layer_mlp(seed: int | None = 0, **kwargs) -> MLP:
    """Build an :class:`MLP` whose first Linear layer is frozen (as in fine-tuning)."""
    model = MLP(seed=seed, **kwargs)
    model[0].requires_grad_(False)
    return model


def frozen_bias_mlp(seed: int | None = 0, **kwargs) -> MLP:
    """Build an :class:`MLP` whose last bias is frozen: one frozen tensor among trainable ones."""
    model = MLP(seed=seed, **kwargs)
    model[-1].bias.requires_grad_(False)
    return model


class TiedEmbeddingModel(nn.Module):
    """Predict the next token with an output projection that shares the embedding's weight.

    The same ``Parameter`` is reached twice (``embed.weight`` and ``head.weight``):
    autograd sums both contributions into one gradient, which must be all-reduced once.

    Args:
        vocab_size: number of token ids.
        dim: embedding width.
        seed: initialisation seed.
    """

    def __init__(self, vocab_size: int = 16, dim: int = 8, seed: int | None = 0):
        super().__init__()
        with seeded(seed):
            self.embed = nn.Embedding(vocab_size, dim)
            self.hidden = nn.Linear(dim, dim)
            self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tie

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids (B,) or (B, T) to logits (..., vocab_size)."""
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


class _MiddleLayerMLP(nn.Module):
    """``fc1``, a middle module that subclasses name and build, and ``fc2``, created in that order.

    Args:
        in_features: input width.
        hidden: hidden width.
        out_features: output width.
        seed: initialisation seed.
    """

    middle = ""  # the middle module's attribute name

    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 1,
                 seed: int | None = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(in_features, hidden)
            self.add_module(self.middle, self.make_middle(hidden))
            self.fc2 = nn.Linear(hidden, out_features)

    def make_middle(self, hidden: int) -> nn.Module:
        """Return the module that sits between ``fc1`` and ``fc2``."""
        raise NotImplementedError


class BatchNormMLP(_MiddleLayerMLP):
    """An MLP with BatchNorm1d: its running statistics are buffers, broadcast, never reduced."""

    middle = "norm"

    def make_middle(self, hidden: int) -> nn.Module:
        return nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, in_features) to (B, out_features)."""
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class UnusedLayerMLP(_MiddleLayerMLP):
    """An MLP with a trainable layer that forward never uses: its gradient never arrives."""

    middle = "unused"

    def make_middle(self, hidden: int) -> nn.Module:
        return nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, in_features) to (B, out_features), skipping ``self.unused``."""
        return self.fc2(torch.tanh(self.fc1(x)))
