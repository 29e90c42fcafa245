"""Attention for tree verifies: transformers' sdpa attention, sharing grouped key/value heads under a mask."""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SHARED_GQA_SDPA = "medusa_shared_gqa_sdpa"


def attends_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `shared_gqa_sdpa` computes attention over activations of `dtype` on `device` in fp32 (half precision
    on a CPU): what it widens to, and what kv_dtype keeps a cache in."""
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def shared_gqa_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' sdpa attention, except that
    - a masked forward (a tree) over grouped key/value heads lets sdpa share each key/value head (enable_gqa) instead
      of copying it for every query head (repeat_kv), as transformers already does without a mask: the same numbers
      (compared bit for bit on SmolLM2), a cheaper verify;
    - on a CPU, bf16 and fp16 attend in fp32: torch's CPU flash kernel is slower in bf16 than in fp32 at every query
      length, several times at one token (docs/engines.md), and fp32 loses nothing.
    Everything else: transformers'."""
    if attends_in_fp32(query.device, query.dtype):
        floating = attention_mask is not None and attention_mask.is_floating_point()
        mask = attention_mask.float() if floating else attention_mask  # a boolean mask stays as it is
        out, weights = shared_gqa_sdpa(
            module, query.float(), key.float(), value.float(), mask, dropout, scaling, is_causal, **kwargs
        )
        return out.to(query.dtype), weights
    if (
        attention_mask is None
        or getattr(module, "num_key_value_groups", 1) == 1
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )  # (B, heads, q, head_dim)
    return out.transpose(1, 2).contiguous(), None


def kv_dtype(model) -> torch.dtype | None:
    """The dtype a static cache keeps `model`'s key and value rows in: float32 where it attends in fp32 over half-
    precision activations (`shared_gqa_sdpa` on a CPU), so that each row is widened once, as it is written, instead
    of the whole cache at every layer of every step; None elsewhere (rows kept as they come). Eager forwards give the
    same numbers (bf16 and fp16 widen exactly); a compiled one may store the rotary keys unrounded, which moves
    answers by near-ties. Twice the cache's memory (docs/engines.md, session 30)."""
    uses_ours = getattr(getattr(model, "config", None), "_attn_implementation", None) == SHARED_GQA_SDPA
    if uses_ours and attends_in_fp32(model.device, model.dtype):
        return torch.float32
    return None


@functools.cache
def _register() -> None:
    AttentionInterface.register(SHARED_GQA_SDPA, shared_gqa_sdpa)


def use_shared_gqa_sdpa(model) -> None:
    """Run `model` (an engine's copy of the target) on `shared_gqa_sdpa` if it is on transformers' sdpa attention;
    registered with transformers when an engine first asks, not at import."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        _register()
        model.set_attn_implementation(SHARED_GQA_SDPA)
