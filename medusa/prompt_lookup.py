"""Prompt lookup (n-gram matching against the prompt and output so far, no model) and the hybrid proposer.

Prompt lookup wins on copy-heavy text (translation, summarisation, RAG): the continuation of an earlier occurrence
of the last few tokens is often what comes next. The hybrid proposer grafts that continuation, as one chain, onto
the Medusa heads' tree, so both kinds of guess are verified in the same target forward.
"""

from __future__ import annotations

import torch

from medusa.ngram import ngram_continuation
from medusa.propose import build_medusa_proposer
from medusa.tree import Candidates, TreeBuffers, TreeSpec, buffers_from_parents, build_buffers, chain

MAX_NGRAM = 3  # longest suffix tried first (prompt-lookup-decoding's default; transformers uses 2)
NUM_TOKENS = 10  # continuation length, as transformers' prompt_lookup_num_tokens=10


def graft_chain(candidates: Candidates, chain_tokens: list[int]) -> Candidates:
    """Add a chain of tokens after the root to a candidate tree, sharing nodes where the tree already holds its prefix.

    Shared prefixes keep sibling tokens distinct (acceptance rules walk siblings as distinct guesses) and cost no
    extra verified tokens. Returns `candidates` itself when the whole chain is already in the tree.
    """
    tree = candidates.tree
    tokens, parent = candidates.tokens.tolist(), tree.parent.tolist()
    child_of = {(parent[i], tokens[i]): i for i in range(1, len(tokens))}
    node, shared = 0, 0
    while shared < len(chain_tokens) and (node, chain_tokens[shared]) in child_of:
        node = child_of[(node, chain_tokens[shared])]
        shared += 1
    new = chain_tokens[shared:]
    if not new:
        return candidates
    n, device = len(tokens), candidates.tokens.device
    merged = buffers_from_parents(parent + [node] + list(range(n, n + len(new) - 1)), device)
    return Candidates(
        tokens=torch.cat([candidates.tokens, torch.tensor(new, dtype=torch.long, device=device)]),
        tree=merged,
        draft_probs=candidates.draft_probs,
    )


class PromptLookupProposer:
    """A chain: the n-gram continuation of the prompt and output so far (`state.tokens`), or the root alone."""

    def __init__(self, device: torch.device, max_ngram: int = MAX_NGRAM, num_tokens: int = NUM_TOKENS):
        if max_ngram < 1 or num_tokens < 1:
            raise ValueError(f"prompt lookup needs max_ngram >= 1 and num_tokens >= 1, got {max_ngram}, {num_tokens}")
        self.device, self.max_ngram, self.num_tokens = device, max_ngram, num_tokens
        self.max_nodes = 1 + num_tokens
        self._chains: dict[int, TreeBuffers] = {}  # chain length -> buffers on the device (keeps their mask cache)

    def continuation(self, state) -> list[int]:
        return ngram_continuation(torch.tensor(state.tokens), self.max_ngram, self.num_tokens)

    def chain_buffers(self, length: int) -> TreeBuffers:
        if length not in self._chains:
            self._chains[length] = build_buffers(TreeSpec(chain(length)), max(length, 1)).to(self.device)
        return self._chains[length]

    def propose(self, state) -> Candidates:
        guess = self.continuation(state)
        tokens = torch.cat([state.root_token.view(1), torch.tensor(guess, dtype=torch.long, device=self.device)])
        return Candidates(tokens=tokens, tree=self.chain_buffers(len(guess)))

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass


class HybridProposer:
    """Another proposer's tree (Medusa heads) with the prompt-lookup chain grafted on: one verify pass for both."""

    def __init__(self, inner, lookup: PromptLookupProposer):
        self.inner, self.lookup = inner, lookup
        self.max_nodes = inner.max_nodes + lookup.num_tokens  # the chain may share no node with the tree

    def propose(self, state) -> Candidates:
        candidates = self.inner.propose(state)
        guess = self.lookup.continuation(state)
        return graft_chain(candidates, guess) if guess else candidates

    def observe(self, state, accepted_tokens: list[int]) -> None:
        self.inner.observe(state, accepted_tokens)

    def skip(self, state) -> None:
        if hasattr(self.inner, "skip"):
            self.inner.skip(state)


def build_prompt_lookup_proposer(model, tree: TreeBuffers) -> PromptLookupProposer:
    """The static tree is not used: the chain's length follows the match."""
    return PromptLookupProposer(model.device)


def build_hybrid_proposer(model, tree: TreeBuffers) -> HybridProposer:
    """The model's Medusa heads on the static `tree`, plus the prompt-lookup chain."""
    return HybridProposer(build_medusa_proposer(model, tree), PromptLookupProposer(model.device))
