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
        # Checked whether sampling or not: a setting that would be refused when sampling is a mistake when greedy too.
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be True or False, got {self.do_sample!r}")
        for name in ("temperature", "posterior_threshold", "posterior_alpha"):
            _check_number(name, getattr(self, name))
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (greedy decoding: do_sample=False)")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k <= 0
        ):
            raise ValueError(f"top_k must be a positive integer or None (no top-k), got {self.top_k!r}")
        if self.top_p is not None:
            _check_number("top_p", self.top_p)
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must lie in (0, 1] (1 or None: no top-p), got {self.top_p!r}")
        if not 0.0 <= self.posterior_threshold <= 1.0:
            raise ValueError(
                "posterior_threshold (typical acceptance's epsilon) must lie in [0, 1], got "
                f"{self.posterior_threshold!r}"
            )
        if not self.posterior_alpha >= 0.0:
            raise ValueError(f"posterior_alpha (typical acceptance's alpha) must be >= 0, got {self.posterior_alpha!r}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


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


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> (...) the most likely token ids. bf16 logits are widened first: the same ids (the widening is
    exact and ties go to the first index either way), and torch's CPU argmax over bf16 takes several times as long."""
    return logits.float().argmax(-1)


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits (..., V) -> the distribution p the target samples from (..., V), fp32."""
    return shape_logits(logits, sampling).softmax(-1)


def select_token(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits (V,) -> one token (0-dim long): argmax when greedy, else a draw from the shaped distribution."""
    if not sampling.do_sample:
        return greedy_tokens(logits)
    return torch.multinomial(target_probs(logits, sampling), 1, generator=generator)[0]
