"""Sampling settings and how they shape a distribution, as transformers' generation does (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # Typical acceptance (lossy): accept x if p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))).
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature} (use do_sample=False for greedy)")
            if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k <= 0):
                raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
            if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.posterior_threshold <= 1.0:
            raise ValueError(f"posterior_threshold (typical acceptance's epsilon) must lie in [0, 1], got {self.posterior_threshold!r}")
        if not self.posterior_alpha >= 0.0:
            raise ValueError(f"posterior_alpha (typical acceptance's alpha) must be >= 0, got {self.posterior_alpha!r}")


def shape_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits (..., V) -> processed logits (..., V): temperature, then top-k, then top-p (transformers' order).

    Filtered entries are -inf. Ties at the top-k boundary are kept, as in transformers.
    """
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - sampling.top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits (..., V) -> the distribution p the target samples from (..., V), fp32."""
    return shape_logits(logits, sampling).softmax(-1)


def select_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (V,) -> one token (0-dim long): argmax when greedy, else a draw from the shaped distribution."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, sampling), 1, generator=generator)[0]
