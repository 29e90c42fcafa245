"""Keep the accepted path's KV rows after a tree verification; drop the rest."""

from __future__ import annotations

import torch


def keep_rows(rows: torch.Tensor, past_length: int, accepted_nodes: torch.Tensor) -> None:
    """The one KV gather: rows past_length + accepted_nodes (src) -> past_length .. past_length + a (dst), in place
    on `rows` (B, heads, T, head_dim). Rows beyond stay as they are (stale)."""
    keep = past_length + accepted_nodes.numel()
    rows[:, :, past_length:keep] = rows[:, :, past_length + accepted_nodes]  # the right side is gathered (copied) first


@torch.inference_mode()
def commit(cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
    """Cache rows past_length + accepted_nodes (src) move to past_length .. past_length + a (dst); the rest go.

    accepted_nodes: (a + 1,) long node indices, root first. In place on every layer of a transformers Cache.
    """
    keep = past_length + accepted_nodes.numel()
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and getattr(layer, "cumulative_length", 0) >= layer.sliding_window - 1:
            raise NotImplementedError(
                "the sequence outgrew a sliding-window layer's cache; tree verification supports sliding-window "
                "models only while prompt + new tokens stay inside the window"
            )
        for name in ("keys", "values"):
            rows = getattr(layer, name)
            keep_rows(rows, past_length, accepted_nodes)
            setattr(layer, name, rows[:, :, :keep])
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = keep
