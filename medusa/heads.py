"""Medusa heads: hidden [..., H] -> per-head hidden [K, ..., H] -> logits [K, ..., V]. No base model inside."""

from __future__ import annotations

import torch
from torch import nn

from medusa.config import MedusaConfig


def head_target_offset(head: int) -> int:
    """How far ahead head `head` (0-based) predicts from the position whose hidden state it reads.

    The base lm_head at position t predicts token t+1; head 0 predicts t+2, head k predicts t+k+2.
    """
    return head + 2


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised so a fresh block is exactly the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of L residual blocks each, and either K own projections or the base model's shared lm_head."""

    def __init__(self, config: MedusaConfig, base_lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        # Distinct ResBlock instances per head and layer (repeating one instance would tie their weights).
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        if config.projection == "own":
            self.projections = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if base_lm_head is not None:
                for proj in self.projections:
                    proj.weight.data.copy_(base_lm_head.weight.data)
        else:
            self.projections = None

    def head_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> (K, ..., H): each head's transformed hidden state before projection."""
        return torch.stack([block(hidden) for block in self.blocks])

    def project(self, head_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(K, ..., H) -> (K, ..., V). With a shared lm_head all heads go through one matmul."""
        if self.projections is None:
            return lm_head(head_hidden)
        return torch.stack([proj(h) for proj, h in zip(self.projections, head_hidden)])

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V)."""
        return self.project(self.head_hidden(hidden), lm_head)
