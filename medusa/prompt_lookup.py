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
NUM_TOKENS = 10  # longest continuation, as transformers' prompt_lookup_num_tokens=10
# Where a step's verify cost is known per chain length, each guess's chance of being right (given those before it
# were) is counted per depth as decoding goes. A depth's count starts from the estimate at the depth above, worth
# PRIOR_WEIGHT guesses (the first from PRIOR_RIGHT): a copy runs on at the rate it started with, so chains that
# are taken whole grow (an even prior per depth never grew them: docs/benchmarks/cpu-no-heads-session58)
PRIOR_RIGHT, PRIOR_WEIGHT = 0.5, 2.0


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
    """A chain: the n-gram continuation of the prompt and output so far (`state.tokens`), or the root alone.

    `chain_ms` (the verify's ms for the root and L guesses, L = 0 .. num_tokens, on the engine that runs the call):
    each step guesses the length with the most expected tokens per ms, each guess expected right as often as guesses
    at its depth were so far in the call. Without it, every match is guessed num_tokens long. On a CPU, where a
    verify's cost grows with its tokens and most matches fail at their first guess, the long chain loses; where the
    cost is flat (a GPU) it stays (docs/benchmarks/cpu-no-heads-session58)."""

    def __init__(
        self,
        device: torch.device,
        max_ngram: int = MAX_NGRAM,
        num_tokens: int = NUM_TOKENS,
        chain_ms: list[float] | None = None,
    ):
        if max_ngram < 1 or num_tokens < 1:
            raise ValueError(f"prompt lookup needs max_ngram >= 1 and num_tokens >= 1, got {max_ngram}, {num_tokens}")
        if chain_ms is not None and len(chain_ms) != num_tokens + 1:
            raise ValueError(f"chain_ms needs {num_tokens + 1} verify times (0 .. {num_tokens} guesses)")
        self.device, self.max_ngram, self.num_tokens = device, max_ngram, num_tokens
        self.max_nodes = 1 + num_tokens
        self.chain_ms = chain_ms
        self._right, self._tries = [0] * (num_tokens + 1), [0] * (num_tokens + 1)  # per depth, 1 .. num_tokens
        self._guessed = 0  # the last step's guesses
        self._chains: dict[int, TreeBuffers] = {}  # chain length -> buffers on the device (keeps their mask cache)

    def chain_length(self) -> int:
        """How many guesses a match may take this step (num_tokens without `chain_ms`)."""
        if self.chain_ms is None:
            return self.num_tokens
        best, best_speed, reach, expected, rate = 1, 0.0, 1.0, 1.0, PRIOR_RIGHT
        for length in range(1, self.num_tokens + 1):
            rate = (self._right[length] + PRIOR_WEIGHT * rate) / (self._tries[length] + PRIOR_WEIGHT)
            reach *= rate
            expected += reach
            if expected / self.chain_ms[length] > best_speed:  # tokens per ms
                best, best_speed = length, expected / self.chain_ms[length]
        return best

    def continuation(self, state, length: int | None = None) -> list[int]:
        return ngram_continuation(torch.tensor(state.tokens), self.max_ngram, length or self.num_tokens)

    def chain_buffers(self, length: int) -> TreeBuffers:
        if length not in self._chains:
            self._chains[length] = build_buffers(TreeSpec(chain(length)), max(length, 1)).to(self.device)
        return self._chains[length]

    def propose(self, state) -> Candidates:
        guess = self.continuation(state, self.chain_length())
        self._guessed = len(guess)
        tokens = torch.cat([state.root_token.view(1), torch.tensor(guess, dtype=torch.long, device=self.device)])
        return Candidates(tokens=tokens, tree=self.chain_buffers(len(guess)))

    def observe(self, state, accepted_tokens: list[int]) -> None:
        right = len(accepted_tokens) - 1  # the guesses taken; the last token is the target's own
        for depth in range(1, min(self._guessed, right + 1) + 1):  # the guesses verified with all before them right
            self._tries[depth] += 1
            self._right[depth] += depth <= right


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
    """The static tree is not used: the chain's length follows the match (and the verify's cost where
    MedusaModel.make_proposer knows it: `chain_ms`)."""
    return PromptLookupProposer(model.device)


def build_hybrid_proposer(model, tree: TreeBuffers) -> HybridProposer:
    """The model's Medusa heads on the static `tree`, plus the prompt-lookup chain."""
    return HybridProposer(build_medusa_proposer(model, tree), PromptLookupProposer(model.device))
