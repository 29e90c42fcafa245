"""The eager engine: transformers' DynamicCache and the model as it is, the reference every other engine is tested
against (greedy output token-identical to transformers' `generate`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from medusa.runtime import kv_cache
from medusa.runtime.kv_cache import RowsCache
from medusa.runtime.verify import PrefillOutput, VerifyOutput, rows_forward, run_prefill, verify
from medusa.tree import Candidates


class EagerEngine:
    name = "eager"
    compile_seconds = 0.0

    def __init__(self, model):
        self.model = model

    def new_rows_cache(self, max_rows: int) -> RowsCache:
        return RowsCache(self.model.config, max_rows)

    def batch_forward(self, cache: RowsCache, ids, mask, positions, feature_layers=(), logits_to_keep=None):
        return rows_forward(self.model, cache, ids, mask, positions, feature_layers, logits_to_keep)

    def new_cache(self, max_length: int):
        """transformers' DynamicCache, its sliding-window layers keeping every row as the others do: a tree verified
        past the window needs the rows its nodes' window reaches back to (runtime.verify.layer_masks hides the rest)."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [
            DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers
        ]
        return cache

    def warm_up(self, progress: bool = True, max_length: int | None = None, batches: bool = False) -> float:
        return 0.0  # nothing to compile

    def prefill(self, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
        return run_prefill(self.model, cache, input_ids, feature_layers)

    def prefill_row(self, cache: RowsCache, row: int, at: int, input_ids, feature_layers=()) -> PrefillOutput:
        own = self.new_cache(input_ids.shape[1])
        out = self.prefill(own, input_ids, feature_layers)
        cache.place([row], own.layers, input_ids.shape[1], at)
        return out

    def verify(self, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
        return verify(self.model, cache, candidates, past_length, feature_layers)

    def commit(self, cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
        kv_cache.commit(cache, past_length, accepted_nodes)

    @torch.inference_mode()
    def truncate(self, cache, length: int) -> None:
        """Drop every row past `length` (after a verify that is not committed, e.g. when timing)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)
