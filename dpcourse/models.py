"""Tiny deterministic models for lessons and tests, and a small GPT.

Each small model takes a ``seed``: the same seed gives the same weights on
every rank and in every run, which is what lets a test compare a data-parallel
run with single-process training value by value. Pass different seeds on
different ranks to see the start-up broadcast at work.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def seeded(seed: int | None):
    """Seed the CPU generator inside the block, leaving the caller's random state untouched."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLP(nn.Sequential):
    """Build a stack of Linear + Tanh layers ending in a Linear layer.

    Args:
        in_features: input width.
        hidden: width of every hidden layer.
        out_features: output width.
        depth: number of Linear layers (at least 1).
        seed: weight initialisation seed (``None``: use the global generator).
    """

    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 1,
                 depth: int = 3, seed: int | None = 0):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}.")
        widths = [in_features] + [hidden] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        with seeded(seed):
            for i in range(depth):
                layers.append(nn.Linear(widths[i], widths[i + 1]))
                if i < depth - 1:
                    layers.append(nn.Tanh())
        super().__init__(*layers)


# -- a small GPT ------------------------------------------------------------------


@dataclass
class GPTConfig:
    """Shape of a GPT-2-style decoder.

    Attributes:
        vocab_size: number of token ids.
        block_size: longest sequence (number of learned positions).
        n_layer: number of transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: model width.
        dropout: dropout probability (0 keeps runs deterministic).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}).")


def gpt2_small() -> GPTConfig:
    """Return GPT-2 small's shape: 12 layers, 12 heads, width 768, about 124M parameters."""
    return GPTConfig()


def tiny() -> GPTConfig:
    """Return a GPT small enough to train on a laptop CPU in seconds (~29k parameters)."""
    return GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only earlier ones."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, T, C) to (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    """One pre-norm transformer block: attention then a 4x-wide MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, T, C) to (B, T, C)."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style language model; the output projection shares the token embedding's weight.

    Args:
        cfg: the shape (see :func:`gpt2_small` and :func:`tiny`).
        seed: initialisation seed (``None``: use the global generator).
    """

    def __init__(self, cfg: GPTConfig | None = None, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg = cfg or tiny()
        with seeded(seed):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
            self.apply(self._init_weights)
            # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so that the
            # residual stream's variance does not grow with depth.
            for name, p in self.named_parameters():
                if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                    nn.init.normal_(p, 0.0, self._residual_std())

    def _residual_std(self) -> float:
        return 0.02 / math.sqrt(2 * self.cfg.n_layer)

    def init_fn(self):
        """Return ``init(module)``: this GPT's initialisation of one module's own parameters.

        For a GPT built under ``torch.device("meta")`` and materialised one module at a
        time (e.g. ``FullyShardedDataParallel(gpt, param_init_fn=gpt.init_fn())``): the
        same distributions as the constructor (normal(0, 0.02), residual projections
        scaled by 1/sqrt(2 * n_layer), zero biases, LayerNorm ones and zeros), not the
        same numbers, since the random draws come in another order.
        """
        residual = {id(m) for name, m in self.named_modules()
                    if name.endswith(("attn.proj", "mlp.2"))}
        std = self._residual_std()

        def init(m: nn.Module) -> None:
            if not isinstance(m, (nn.Linear, nn.Embedding)):
                m.reset_parameters()  # type: ignore[operator]  # LayerNorm: ones and zeros
                return
            self._init_weights(m)
            if id(m) in residual:
                nn.init.normal_(m.weight, 0.0, std)

        return init

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Compute logits, and the mean cross-entropy when ``targets`` is given.

        Args:
            idx: token ids, int64 (B, T) with T <= block_size.
            targets: next-token ids (B, T), or None.

        Returns:
            ``(logits, loss)``: logits (B, T, vocab_size); loss a scalar or None.
        """
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}.")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        """Count parameters, a tied weight once."""
        return sum(p.numel() for p in self.parameters())


def random_tokens(batch: int, cfg: GPTConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Make a deterministic batch of random token ids and their next-token targets.

    Args:
        batch: number of sequences.
        cfg: model shape (vocab and sequence length taken from it).
        seed: generator seed.

    Returns:
        ``(idx, targets)``, both int64 (batch, block_size).
    """
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]
