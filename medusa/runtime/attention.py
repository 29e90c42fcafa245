"""Attention for tree verifies: transformers' sdpa attention, sharing grouped key/value heads under a mask."""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SHARED_GQA_SDPA = "medusa_shared_gqa_sdpa"
ROW_INVARIANT_SDPA = "medusa_row_invariant_sdpa"


def attends_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `shared_gqa_sdpa` computes attention over activations of `dtype` on `device` in fp32 (half precision
    on a CPU): what it widens to, and what kv_dtype keeps a cache in."""
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def shared_gqa_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    is_causal=None,
    sdpa=None,
    **kwargs,
):
    """transformers' sdpa attention, except that
    - a masked forward (a tree) over grouped key/value heads lets sdpa share each key/value head (enable_gqa) instead
      of copying it for every query head (repeat_kv), as transformers already does without a mask: the same numbers
      (compared bit for bit on SmolLM2), a cheaper verify;
    - on a CPU, bf16 and fp16 attend in fp32: torch's CPU flash kernel is slower in bf16 than in fp32 at every query
      length, several times at one token (docs/engines.md), and fp32 loses nothing.
    `sdpa`: what computes it, torch's by default (row_invariant_sdpa passes its own, which also takes what
    transformers' path would).
    Everything else: transformers'."""
    if attends_in_fp32(query.device, query.dtype):
        floating = attention_mask is not None and attention_mask.is_floating_point()
        mask = attention_mask.float() if floating else attention_mask  # a boolean mask stays as it is
        out, weights = shared_gqa_sdpa(
            module, query.float(), key.float(), value.float(), mask, dropout, scaling, is_causal, sdpa, **kwargs
        )
        return out.to(query.dtype), weights
    torch_kernel = sdpa is None  # torch's own, looked up at each call
    sdpa = sdpa or torch.nn.functional.scaled_dot_product_attention
    if (
        (torch_kernel and (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1))
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = sdpa(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)  # (B, heads, q, head_dim)
    return out.transpose(1, 2).contiguous(), None


# How many query rows an uncompiled forward attends row-invariantly (trees, plain steps); a longer one (a prompt) takes
# sdpa: its rows are computed once, for plain and speculative decoding alike, and the products would not fit (a
# larger tree than this, uncompiled, rounds as sdpa does)
ROW_INVARIANT_ROWS = 16


def reduction_sdpa(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
    """torch's sdpa (the arguments `shared_gqa_sdpa` passes) written as multiply-and-sum reductions whose order
    depends neither on how many query rows there are nor on where the keys a row sees sit among hidden ones: each row
    comes out as it would alone over exactly its own keys."""
    if enable_gqa and key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    scores = (query.unsqueeze(-2) * key.unsqueeze(-3)).sum(-1) * scale  # (B, heads, q, k)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    # Every sum over the keys runs key after key: a tree's node does not sit where plain decoding puts the same token
    # (its siblings come between), and a sum grouped by the keys' places would round them otherwise. The values' sum:
    # inductor loops over the keys in order where each key adds a vector (a row of values, read where it lies);
    # uncompiled, aten's cumulative sum, a sequential scan (its sum is a cascade grouped by place). The weights' sum:
    # that scan, compiled too (inductor would vectorise a sum of one number a key over the keys).
    weights = (scores - scores.amax(-1, keepdim=True)).exp()  # (B, heads, q, k)
    products = weights.unsqueeze(-1) * value.unsqueeze(-3)  # (B, heads, q, k, head_dim)
    summed = products.sum(-2) if torch.compiler.is_compiling() else products.cumsum(-2)[..., -1, :]
    return summed / weights.cumsum(-1)[..., -1:]  # (B, heads, q, head_dim)


def row_invariant_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """`shared_gqa_sdpa` with every tree node computed as plain decoding computes its token (`reduction_sdpa`), where
    sdpa's kernels block the rows (the fourth row of a tree on SmolLM2 differs from that row verified alone by a
    rounding). A w8a8 target needs it: rounding activations to int8 turns such a rounding into a level, which moved
    logits by up to 3 between a tree's verify and plain decoding (docs/engines.md). A prompt longer than
    ROW_INVARIANT_ROWS, uncompiled, takes sdpa: its rows are computed once, for plain and speculative decoding alike."""
    prompt = not torch.compiler.is_compiling() and query.shape[-2] > ROW_INVARIANT_ROWS
    if prompt or dropout:
        return shared_gqa_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if attention_mask is None and query.shape[-2] > 1 and is_causal is not False:
        # sdpa's own causal case: aligned to the first key (a static cache's unwritten rows come after the query's)
        rows, keys = query.shape[-2], key.shape[-2]
        attention_mask = torch.ones(rows, keys, dtype=torch.bool, device=query.device).tril()
    return shared_gqa_sdpa(
        module, query, key, value, attention_mask, dropout, scaling, is_causal, sdpa=reduction_sdpa, **kwargs
    )


def on_medusa_attention(model) -> bool:
    """Whether `model` attends with medusa's attention (an engine's copy of the target, or a w8a8 target), for which
    transformers makes no masks: a forward without one attends causally over every row it is shown."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in (
        SHARED_GQA_SDPA,
        ROW_INVARIANT_SDPA,
    )


def kv_dtype(model) -> torch.dtype | None:
    """The dtype a static cache keeps `model`'s key and value rows in: float32 where it attends in fp32 over half-
    precision activations (`shared_gqa_sdpa` on a CPU), so that each row is widened once, as it is written, instead
    of the whole cache at every layer of every step; None elsewhere (rows kept as they come). Eager forwards give the
    same numbers (bf16 and fp16 widen exactly); a compiled one may store the rotary keys unrounded, which moves
    answers by near-ties. Twice the cache's memory (docs/engines.md, session 30)."""
    if on_medusa_attention(model) and attends_in_fp32(model.device, model.dtype):
        return torch.float32
    return None


@functools.cache
def _register() -> None:
    AttentionInterface.register(SHARED_GQA_SDPA, shared_gqa_sdpa)
    AttentionInterface.register(ROW_INVARIANT_SDPA, row_invariant_sdpa)


def use_row_invariant_sdpa(model) -> None:
    """Run `model` on `row_invariant_sdpa` (a w8a8 target: medusa.runtime.quantize), whatever it attended with."""
    _register()
    model.set_attn_implementation(ROW_INVARIANT_SDPA)


def use_shared_gqa_sdpa(model) -> None:
    """Run `model` (an engine's copy of the target) on `shared_gqa_sdpa` if it is on transformers' sdpa attention;
    registered with transformers when an engine first asks, not at import."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        _register()
        model.set_attn_implementation(SHARED_GQA_SDPA)
