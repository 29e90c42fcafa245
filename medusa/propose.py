"""Proposers: state -> Candidates (tokens arranged as a tree). One small interface, several implementations."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from medusa.tree import TreeBuffers


@dataclass(frozen=True)
class Candidates:
    tokens: torch.Tensor  # (N,) long: node 0 is the root (the target's own next token)
    tree: TreeBuffers  # on the model's device
    draft_probs: torch.Tensor | None = None  # (N, V): q that drew node i's token (draft-model sampling only)


class Proposer(Protocol):
    def propose(self, state) -> Candidates:
        """Guess tokens after `state.root_token`, arranged as a tree rooted at it."""

    def observe(self, state, accepted_tokens: list[int]) -> None:
        """Learn what the target committed this step (e.g. to roll back a draft model's cache)."""


@dataclass(frozen=True)
class CandidateProjection:
    """The heads' vocabulary projection as used for proposing: built once per model, maybe cheaper than the base's.

    Candidates only need a ranking, not exact logits, so the projection may use a lower precision and a subset of
    frequent tokens; the target still verifies every candidate, so outputs do not change.
    """

    weight: torch.Tensor  # (V', H) shared or (K, V', H) own
    token_ids: torch.Tensor | None  # (V',) candidate index -> token id; None: the full vocabulary

    @classmethod
    def build(cls, heads, lm_head, dtype: torch.dtype) -> "CandidateProjection":
        return cls(heads.candidate_weight(lm_head).detach().to(dtype).contiguous(), getattr(heads, "vocab_subset", None))

    def logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """(K, H) -> (K, V') logits over the candidate vocabulary."""
        head_hidden = head_hidden.to(self.weight.dtype)
        if self.weight.dim() == 2:
            return head_hidden @ self.weight.T
        return torch.einsum("kh,kvh->kv", head_hidden, self.weight[: head_hidden.shape[0]])

    def token(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.token_ids is None else self.token_ids[index]


class MedusaProposer:
    """Top-s tokens of each head, read from the last committed hidden state, placed by a static tree."""

    def __init__(self, heads, projection: CandidateProjection, tree: TreeBuffers, embed_tokens=None):
        if len(tree.topk_per_head) > heads.config.num_heads:
            raise ValueError(f"tree needs {len(tree.topk_per_head)} heads, the model has {heads.config.num_heads}")
        if heads.config.condition_on_next_token and embed_tokens is None:
            raise ValueError("these heads read the next token's embedding: pass embed_tokens (the base's input embeddings)")
        self.heads, self.projection, self.tree, self.embed_tokens = heads, projection, tree, embed_tokens
        self.used_heads = max((k + 1 for k, s in enumerate(tree.topk_per_head) if s), default=0)

    def head_logits(self, hidden: torch.Tensor, next_token: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden (H,), next_token () its following token (the root) -> (K_used, V') over the candidate vocabulary
        (map with `.projection.token`): the first `num_heads` heads (default: those the tree uses)."""
        embedding = self.embed_tokens(next_token) if self.heads.config.condition_on_next_token else None
        count = self.used_heads if num_heads is None else num_heads
        return self.projection.logits(torch.stack([self.heads.run_head(k, hidden, embedding) for k in range(count)]))

    @torch.inference_mode()
    def propose(self, state) -> Candidates:
        tree = self.tree
        parts = [state.root_token.view(1)]
        if self.used_heads:
            logits = self.head_logits(state.last_hidden, state.root_token)
            width = max(tree.topk_per_head)
            top = self.projection.token(torch.topk(logits, width, dim=-1).indices)  # (K_used, width) token ids
            parts += [top[k, :s] for k, s in enumerate(tree.topk_per_head[: self.used_heads]) if s]
        flat = torch.cat(parts)
        return Candidates(tokens=flat[tree.candidate_index], tree=tree)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass


def build_medusa_proposer(model, tree: TreeBuffers) -> MedusaProposer:
    embed = model.base.get_input_embeddings() if model.heads.config.condition_on_next_token else None
    return MedusaProposer(model.heads, model.candidate_projection, tree, embed)


def _lazy(target: str):
    """'module:builder' -> a builder that imports it on first use (those modules import this one)."""
    module, name = target.split(":")
    return lambda model, tree: getattr(importlib.import_module(module), name)(model, tree)


# name -> builder(model: MedusaModel, tree: TreeBuffers on the model's device) -> Proposer.
# Other modules add their proposers here (dynamic tree, prompt lookup, hybrid).
PROPOSERS = {
    "medusa": build_medusa_proposer,
    "dynamic": _lazy("medusa.dynamic_tree:build_dynamic_proposer"),
    "prompt_lookup": _lazy("medusa.prompt_lookup:build_prompt_lookup_proposer"),
    "hybrid": _lazy("medusa.prompt_lookup:build_hybrid_proposer"),
}


def get_proposer(name: str):
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}: use one of {sorted(PROPOSERS)}")
    return PROPOSERS[name]
