"""Keep the accepted path's KV rows after a tree verification; drop the rest."""

from __future__ import annotations

import torch


@torch.inference_mode()
def commit(cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
    """Cache rows past_length + accepted_nodes (src) move to past_length .. past_length + a (dst); the rest go.

    accepted_nodes: (a + 1,) long node indices, root first. In place on every layer of a transformers Cache.
    """
    src = past_length + accepted_nodes
    keep = past_length + accepted_nodes.numel()
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and getattr(layer, "cumulative_length", 0) >= layer.sliding_window - 1:
            raise NotImplementedError(
                "the sequence outgrew a sliding-window layer's cache; tree verification supports sliding-window "
                "models only while prompt + new tokens stay inside the window"
            )
        for name in ("keys", "values"):
            rows = getattr(layer, name)  # (B, heads, T, head_dim)
            rows[:, :, past_length:keep] = rows[:, :, src]  # the right side is gathered (copied) first
            setattr(layer, name, rows[:, :, :keep])
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = keep
