"""Proposers: state -> Candidates (tokens arranged as a tree). One small interface, several implementations."""

from __future__ import annotations

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


class MedusaProposer:
    """Top-s tokens of each head, read from the last committed hidden state, placed by a static tree."""

    def __init__(self, heads, lm_head, tree: TreeBuffers):
        if len(tree.topk_per_head) > heads.config.num_heads:
            raise ValueError(f"tree needs {len(tree.topk_per_head)} heads, the model has {heads.config.num_heads}")
        self.heads, self.lm_head, self.tree = heads, lm_head, tree
        self.used_heads = max((k + 1 for k, s in enumerate(tree.topk_per_head) if s), default=0)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (H,) -> (K_used, V): only the heads the tree uses, all through one projection."""
        head_hidden = self.heads.head_hidden(hidden)[: self.used_heads]
        return self.heads.project(head_hidden, self.lm_head)

    def propose(self, state) -> Candidates:
        tree = self.tree
        parts = [state.root_token.view(1)]
        if self.used_heads:
            logits = self.head_logits(state.last_hidden)
            width = max(tree.topk_per_head)
            top = torch.topk(logits, width, dim=-1).indices  # (K_used, width)
            parts += [top[k, :s] for k, s in enumerate(tree.topk_per_head[: self.used_heads]) if s]
        flat = torch.cat(parts)
        return Candidates(tokens=flat[tree.candidate_index], tree=tree)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass


def build_medusa_proposer(model, tree: TreeBuffers) -> MedusaProposer:
    return MedusaProposer(model.heads, model.base.get_output_embeddings(), tree)


# name -> builder(model: MedusaModel, tree: TreeBuffers on the model's device) -> Proposer.
# Other modules add their proposers here (dynamic tree, prompt lookup, hybrid).
PROPOSERS = {"medusa": build_medusa_proposer}


def get_proposer(name: str):
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}: use one of {sorted(PROPOSERS)}")
    return PROPOSERS[name]
