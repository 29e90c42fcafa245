"""One target forward over all tree nodes: the public `forward` with a 4D tree mask, position ids and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.heads import base_features
from medusa.propose import Candidates


@dataclass(frozen=True)
class VerifyOutput:
    logits: torch.Tensor  # (N, V): the target's next-token logits at every node
    hidden: torch.Tensor  # (N, H): the last (post-norm) hidden state at every node (and feature layers: base_features)


def tree_attention_mask(candidates: Candidates, past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, N, past + N) additive mask: the whole past is visible, the tree part follows ancestry."""
    tree = candidates.tree
    bias = tree.attention_bias(dtype, candidates.tokens.device)
    past = torch.zeros((tree.num_nodes, past_length), dtype=dtype, device=bias.device)
    return torch.cat([past, bias], dim=1)[None, None]


@torch.inference_mode()
def verify(model, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
    """Run the target once over the N candidate tokens; the cache grows by N rows (commit keeps the accepted ones)."""
    tokens = candidates.tokens[None]  # (1, N)
    position_ids = (past_length + candidates.tree.depth)[None]  # (1, N)
    out = model(
        input_ids=tokens,
        attention_mask=tree_attention_mask(candidates, past_length, model.dtype),
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    return VerifyOutput(logits=out.logits[0], hidden=base_features(out.hidden_states, feature_layers)[0])
