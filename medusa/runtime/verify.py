"""The target's forwards: prefill over the prompt, and one forward over all tree nodes (the public `forward` with a 4D
tree mask, position ids and the KV cache); what heads read from either (`base_features`)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from medusa.runtime.attention import on_medusa_attention
from medusa.runtime.kv_cache import reading_rows
from medusa.tree import Candidates


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def with_cache(model, cache) -> dict:
    """{keyword: cache} for `model`'s forward: transformers 5.23 takes the KV cache as `cache` (`past_key_values`
    warns there, and goes in 5.40), earlier 5.x releases as `past_key_values`. A wrapper whose forward names neither
    (torch.compile's) gets the old name, which those releases still take."""
    return {_cache_keyword(type(model)): cache}


def sliding_window(config) -> int | None:
    """The window of a model with sliding-window attention, in transformers' two ways: layers of types, some
    "sliding_attention" (Gemma 2 and 3, Qwen2 with `use_sliding_window`, gpt-oss, ...), or no layer types and a
    `sliding_window` that every layer keeps (Mistral, Mixtral, Phi-3, Starcoder2). A query attends to the keys less
    than this many positions before it. None: no such layer."""
    text = config.get_text_config()
    window, layer_types = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    return window


# Where a sliding layer's read of the cache starts is rounded down to a multiple of this many rows, and where a prompt's
# chunk's read ends rounded up to one: torch's CPU flash kernel sums the keys in blocks of 512 from the first it is
# given, so a read of whole blocks sums every visible key in the blocks, hence the roundings, that a read of the whole
# cache under the same mask does (the rows outside weigh exactly 0 there); checked bit for bit by
# tests/test_sliding_window.py
WINDOW_BLOCK = 512
# A sliding-window model's prompt runs on a CPU in forwards of this many query rows (prefill_in_chunks): one forward
# over the whole prompt computes every query against every key, where a chunk reads only the keys up to its end, its
# sliding layers only their window's. Bit for bit the one forward's rows (each row's sums run over the same key blocks;
# CPU GEMMs of 2 or more rows give each row as alone), so chunking stays where that was checked: CPU kernels. A multiple
# of WINDOW_BLOCK: every chunk but the last ends on a block boundary, so its read is the rows written (a cache that
# shows attention only those) or whole blocks.
PREFILL_CHUNK = 512


def sliding_layers(config) -> list[bool]:
    """Per layer, whether it attends over a sliding window (sliding_window's two ways)."""
    text = config.get_text_config()
    if sliding_window(config) is None:
        return [False] * text.num_hidden_layers
    layer_types = getattr(text, "layer_types", None)
    return [kind == "sliding_attention" for kind in layer_types] if layer_types else [True] * text.num_hidden_layers


def window_mask(config, mask: torch.Tensor, positions: torch.Tensor, past_length: int) -> torch.Tensor | None:
    """For a sliding-window model, the mask of its sliding layers over only the rows they read in a step of queries
    at `positions` (1, N) after `past_length` cached rows under `mask` (1, 1, N, K): from the first row the earliest
    query's window reaches, rounded down to WINDOW_BLOCK, to K. None for other models. A step then reads a window's
    rows, not the whole context, where llama.cpp's sliding-window cache keeps a window's rows only."""
    window = sliding_window(config)
    if window is None:
        return None
    first = max(0, past_length - window + 1) // WINDOW_BLOCK * WINDOW_BLOCK
    return _windowed(mask, positions, window)[..., first:]


def needs_window_masks(model) -> bool:
    """Whether a forward of `model` needs masks from medusa even where transformers would make them (a prompt, one
    token): a sliding-window model on medusa's attention, for which transformers makes none."""
    return sliding_window(model.config) is not None and on_medusa_attention(model)


def layer_masks(config, mask, positions: torch.Tensor, offsets: list[int] | None = None):
    """A (B, 1, N, K) additive mask over cache rows -> what the model's forward takes: the mask itself, or for a
    sliding-window model (`sliding_window`) the mask also hiding the rows a window leaves out, for its sliding layers:
    a dict by layer type where the model has types (transformers reads a 4D mask as every layer's; a dict skips its
    own masks), else the windowed mask (every layer slides). Every layer keeps every row (medusa's caches), so a tree
    of any length past the window verifies exactly as plain decoding. `positions` (B, N): the queries'; `offsets`
    (one per row): how far row b's cache index is ahead of its position (a batch's left padding; None: the index is
    the position). A tree's own rows lie within its depth of each other, never a window apart."""
    window = sliding_window(config)
    if window is None or mask is None or isinstance(mask, dict):
        return mask
    return by_layer_type(config, mask, _windowed(mask, positions, window, offsets))


def _windowed(mask, positions: torch.Tensor, window: int, offsets: list[int] | None = None) -> torch.Tensor:
    """`mask` (B, 1, N, K) also hiding the rows at or beyond `window` positions before each query (layer_masks)."""
    keys = torch.arange(mask.shape[-1], device=mask.device)[None]  # (1, K) each row's position, or (B, K)
    if offsets is not None:
        keys = keys - torch.tensor(offsets, device=mask.device)[:, None]
    far = positions[:, None, :, None] - keys[:, None, None, :] >= window  # (B, 1, N, K)
    return mask.masked_fill(far, torch.finfo(mask.dtype).min)


def by_layer_type(config, full, sliding):
    """A sliding-window model's masks as its forward takes them: a dict by layer type where the model has types
    (transformers reads a 4D mask as every layer's; a dict skips its own masks), else the sliding one alone (every
    layer slides)."""
    if getattr(config.get_text_config(), "layer_types", None):
        return {"full_attention": full, "sliding_attention": sliding}
    return sliding


def base_features(hidden_states: tuple[torch.Tensor, ...] | torch.Tensor, feature_layers=()) -> torch.Tensor:
    """A base forward's `hidden_states` (embeddings, then each layer's output; the last one post-norm; or those
    stacked on a first axis, as a package returns them) -> what heads read per position: the last hidden state, then
    the residual stream after each of `feature_layers`, concatenated on the last axis ((..., H) without feature
    layers)."""
    if not feature_layers:
        return hidden_states[-1]
    layers = len(hidden_states) - 1
    for layer in feature_layers:
        if layer >= layers:
            raise ValueError(
                f"the heads read the base's layer {layer} (feature_layers) but the base has {layers} "
                f"layers (0 = embeddings .. {layers - 1}): use heads trained for this base"
            )
    return torch.cat([hidden_states[-1], *(hidden_states[layer] for layer in feature_layers)], dim=-1)


@dataclass(frozen=True)
class PrefillOutput:
    logits: torch.Tensor  # (V,): the target's next-token logits after the prompt
    hidden: torch.Tensor  # (T, F): what heads read at every prompt position (base_features)


@torch.inference_mode()
def run_prefill(model, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
    """One ordinary forward over the prompt (1, T) into `cache` (empty), logits kept for its last position only."""
    out = model(
        input_ids=input_ids,
        attention_mask=prefill_masks(model, cache, input_ids.shape[1]),
        **with_cache(model, cache),
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    return PrefillOutput(out.logits[0, -1], base_features(out.hidden_states, feature_layers)[0])


def prefill_masks(model, cache, length: int):
    """None (transformers masks a prompt itself) or, for a sliding-window model on medusa's attention (an engine's copy
    of the target), for which transformers makes no masks at all and whose sliding layers would see past their
    window, a prompt's causal masks (layer_masks) over the rows `cache` shows attention."""
    if not needs_window_masks(model):
        return None
    mask = bias_over_rows(causal_bias(length, model.dtype, model.device), 0, cache.get_mask_sizes(length, 0)[0])
    return layer_masks(model.config, mask, torch.arange(length, device=model.device)[None])


def causal_bias(length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(length, length) additive mask: each row sees itself and the rows before it."""
    causal = torch.ones((length, length), dtype=torch.bool, device=device).tril()
    return torch.zeros((length, length), dtype=dtype, device=device).masked_fill(~causal, torch.finfo(dtype).min)


def prefills_in_chunks(model, length: int) -> bool:
    """Whether a prompt of `length` tokens runs on `model` (an engine's copy of the target, over a static cache) in
    chunks (prefill_in_chunks): a sliding-window model on medusa's attention on a CPU, a prompt longer than a chunk."""
    return model.device.type == "cpu" and needs_window_masks(model) and length > PREFILL_CHUNK


def prefill_chunks(length: int) -> list[tuple[int, int]]:
    """Where a prompt of `length` tokens is cut: (start, end) every PREFILL_CHUNK rows, a last chunk of fewer than
    PREFILL_CHUNK // 8 rows joined to the one before it (a forward of a few rows takes kernels of its own: one row a
    GEMV, a w8a8 target's up to attention.ROW_INVARIANT_ROWS its row-invariant attention, which round otherwise)."""
    ends = list(range(PREFILL_CHUNK, length, PREFILL_CHUNK)) + [length]
    if len(ends) > 1 and length - ends[-2] < PREFILL_CHUNK // 8:
        del ends[-2]
    return list(zip([0, *ends[:-1]], ends))


@torch.inference_mode()
def prefill_in_chunks(model, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
    """run_prefill's result over the prompt (1, T) in forwards of a chunk each (prefill_chunks), written into `cache`
    (a static one, empty) as that one forward writes it. A chunk's queries attend over the keys up to its end, read up
    to a multiple of WINDOW_BLOCK rows (never past what the one forward read) and its sliding layers from where their
    window starts (window_mask), so every sum runs over the key blocks the one forward's did, bit for bit."""
    length, config, device = input_ids.shape[1], model.config, model.device
    whole = cache.get_mask_sizes(length, 0)[0]  # the rows one forward over the prompt would read
    sliding = sliding_layers(config)
    features = []
    for start, end in prefill_chunks(length):
        visible = min(whole, -(-end // WINDOW_BLOCK) * WINDOW_BLOCK)
        mask = bias_over_rows(causal_bias(end - start, model.dtype, device), start, visible)
        positions = torch.arange(start, end, device=device)[None]
        window = window_mask(config, mask, positions, start)
        first = visible - window.shape[-1]  # where the sliding layers' read starts
        out = model(
            input_ids=input_ids[:, start:end],
            position_ids=positions,
            attention_mask=by_layer_type(config, mask, window),
            **with_cache(model, reading_rows(cache, [first if each else 0 for each in sliding], visible)),
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        features.append(base_features(out.hidden_states, feature_layers)[0])
    return PrefillOutput(out.logits[0, -1], torch.cat(features))


@dataclass(frozen=True)
class VerifyOutput:
    logits: torch.Tensor  # (N, V): the target's next-token logits at every node
    hidden: torch.Tensor  # (N, H): the last (post-norm) hidden state at every node (and feature layers: base_features)


def tree_attention_mask(
    candidates: Candidates, past_length: int, dtype: torch.dtype, rows: int | None = None
) -> torch.Tensor:
    """(1, 1, N, rows) additive mask, rows = past + N by default: the whole past is visible, the tree part follows
    ancestry, and rows beyond past + N (a static cache's unwritten allocation) are hidden."""
    bias = candidates.tree.attention_bias(dtype, candidates.tokens.device)
    return bias_over_rows(bias, past_length, rows or past_length + candidates.tree.num_nodes)


def bias_over_rows(bias: torch.Tensor, past_length: int | torch.Tensor, rows: int) -> torch.Tensor:
    """The tree's (N, N) bias placed after `past_length` visible rows in a (1, 1, N, rows) mask, hidden beyond.
    `past_length` may be a 0-d tensor: then no host value enters, and a CUDA graph that builds the mask reads the
    length from that tensor's address at every replay."""
    n = bias.shape[0]
    if isinstance(past_length, int) and rows == past_length + n:  # nothing hidden: the past, then the tree's bias
        # two operations where the general case takes eight (a one-token step's mask on a CPU: docs/engines.md)
        return torch.cat([bias.new_zeros((n, past_length)), bias], dim=1)[None, None]
    place = torch.arange(rows, device=bias.device) - past_length  # each row's place in the tree part
    mask = torch.where(place < n, bias.index_select(1, place.clamp(0, n - 1)), torch.finfo(bias.dtype).min)
    return torch.where(place < 0, 0.0, mask)[None, None]


def verify_inputs(
    candidates: Candidates, past_length: int, dtype: torch.dtype, mask_rows: int | None = None, windowed: bool = False
):
    """-> input_ids (1, N), position_ids (1, N) and the tree's mask (None for one token without `mask_rows`, unless
    `windowed`: needs_window_masks)."""
    tokens = candidates.tokens[None]
    position_ids = (past_length + candidates.tree.depth)[None]
    one_token = tokens.shape[1] == 1 and mask_rows is None and not windowed
    mask = None if one_token else tree_attention_mask(candidates, past_length, dtype, mask_rows)
    return tokens, position_ids, mask


@torch.inference_mode()
def verify(
    model, cache, candidates: Candidates, past_length: int, feature_layers=(), mask_rows: int | None = None
) -> VerifyOutput:
    """Run the target once over the N candidate tokens; the cache grows by N rows (commit keeps the accepted ones).

    One token sees the whole past: it goes without a mask (transformers' one-token path, as in its `generate`),
    unless `mask_rows` asks for a mask of that fixed width (a compiled graph's static shapes) or the model's sliding
    layers need one from medusa (needs_window_masks)."""
    tokens, position_ids, mask = verify_inputs(
        candidates, past_length, model.dtype, mask_rows, needs_window_masks(model)
    )
    return forward_nodes(model, cache, tokens, position_ids, mask, feature_layers, fixed_width=mask_rows is not None)


def forward_nodes(model, cache, tokens, position_ids, mask, feature_layers=(), fixed_width=False) -> VerifyOutput:
    """The verify's forward over (1, N) tokens at their positions under `mask`. A mask of a fixed width (a compiled
    graph's static shapes) marks N dynamic for torch.compile: one graph serves every tree size (N = 1 gets its own,
    as dynamo specialises 1)."""
    if fixed_width:
        torch._dynamo.mark_static(mask, 3)  # the cache's size: a graph each
        if tokens.shape[1] > 1:
            for tensor, dim in ((tokens, 1), (position_ids, 1), (mask, 2)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
    mask = layer_masks(model.config, mask, position_ids)
    logits, hidden = _forward(model, cache, tokens, mask, position_ids, feature_layers)
    return VerifyOutput(logits=logits[0], hidden=hidden[0])


def rows_forward(model, cache, ids, mask, positions, feature_layers=(), logits_to_keep=None):
    """A batch's forward (medusa.batch): the target over (B, n) tokens at their positions under `mask`, into a
    RowsCache -> (logits (B, n or logits_to_keep, V), what heads read (B, n, F))."""
    options = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    return _forward(model, cache.cache, ids, mask, positions, feature_layers, **options)


def _forward(model, cache, ids, mask, positions, feature_layers, **options):
    """The target over (B, n) tokens at their positions under `mask`, into a transformers Cache -> (logits, what
    heads read)."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **with_cache(model, cache),
        use_cache=True,
        output_hidden_states=True,
        **options,
    )
    return out.logits, base_features(out.hidden_states, feature_layers)
