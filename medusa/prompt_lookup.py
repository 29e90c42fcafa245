"""Prompt lookup (n-gram matching against the prompt and output so far, no model) and the hybrid proposer.

Prompt lookup wins on copy-heavy text (translation, summarisation, RAG): what followed an earlier occurrence of the
last few tokens is often what comes next. It proposes a tree of what followed each earlier occurrence. The hybrid
proposer grafts one such continuation, as a chain, onto the Medusa heads' tree, so both kinds of guess are verified
in the same target forward.
"""

from __future__ import annotations

import torch

from medusa.ngram import ngram_continuation, ngram_matches
from medusa.propose import build_medusa_proposer
from medusa.tree import Candidates, TreeBuffers, buffers_from_parents

MAX_NGRAM = 3  # longest suffix tried first (prompt-lookup-decoding's default; transformers uses 2)
NUM_TOKENS = 10  # most guesses a step, as transformers' prompt_lookup_num_tokens=10
MAX_MATCHES = 64  # the most recent earlier occurrences a step's tree is built from (a common token has hundreds)
# Where a step's verify cost is known per number of guesses, each guess's chance of being right (given those before it
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
    """A tree of what followed the earlier occurrences of the longest suffix seen before (`ngram_matches` over the
    prompt and output so far, `state.tokens`), or the root alone.

    A path is weighted by how many of those occurrences (the most recent MAX_MATCHES) it starts. A node is expected
    right as often as guesses at its depth were so far in the call (given those before it were), that chance shared
    among siblings by their weights; the tree keeps the likeliest nodes, which a child never outranks its parent in.
    It keeps `num_tokens` of them, or with `chain_ms` (the verify's ms for the root and L guesses, L = 0 .. num_tokens,
    on the engine that runs the call) as many as give the most expected tokens per ms. On a CPU, where a verify's
    cost grows with its tokens and most matches fail at their first guess, a long chain loses; where the cost is flat
    (a GPU) the tree keeps all it may (docs/benchmarks/cpu-no-heads-session58, cpu-lookup-trees-session59)."""

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
        self._guessed_after: set[tuple[int, ...]] = set()  # the last step's paths that had guesses after them

    def depth_rates(self) -> list[float]:
        """[1, r_1 .. r_num_tokens]: how often a guess at each depth was right so far, given the guesses before it
        were; a depth's count starts from the estimate at the depth above (the first from PRIOR_RIGHT)."""
        rates, rate = [1.0], PRIOR_RIGHT
        for depth in range(1, self.num_tokens + 1):
            rate = (self._right[depth] + PRIOR_WEIGHT * rate) / (self._tries[depth] + PRIOR_WEIGHT)
            rates.append(rate)
        return rates

    def ranked(self, state) -> list[tuple[tuple[int, ...], float]]:
        """Every continuation path (tokens after the root) of the suffix's earlier occurrences, with the chance it is
        right, likeliest first (ties: the more recent occurrence first)."""
        history = state.tokens
        starts = ngram_matches(torch.tensor(history), self.max_ngram)[-MAX_MATCHES:]
        weight: dict[tuple[int, ...], int] = {(): len(starts)}  # a path is counted after its prefix: parents first
        for start in reversed(starts):
            follow = tuple(history[start : start + self.num_tokens])
            for depth in range(1, len(follow) + 1):
                weight[follow[:depth]] = weight.get(follow[:depth], 0) + 1
        rates, chance = self.depth_rates(), {(): 1.0}
        for path, w in weight.items():
            if path:
                chance[path] = chance[path[:-1]] * rates[len(path)] * w / weight[path[:-1]]
        del chance[()]
        return sorted(chance.items(), key=lambda item: -item[1])  # stable

    def tree_size(self, chances: list[float]) -> int:
        """How many of the ranked nodes (their `chances`, likeliest first) to guess this step."""
        if self.chain_ms is None or not chances:
            return min(self.num_tokens, len(chances))
        best, best_speed, expected = 1, 0.0, 1.0
        for size, chance in enumerate(chances[: self.num_tokens], 1):
            expected += chance
            if expected / self.chain_ms[size] > best_speed:  # tokens per ms
                best, best_speed = size, expected / self.chain_ms[size]
        return best

    def continuation(self, state, length: int | None = None) -> list[int]:
        """The earliest match's continuation, as one chain (what the hybrid grafts onto its heads' tree)."""
        return ngram_continuation(torch.tensor(state.tokens), self.max_ngram, length or self.num_tokens)

    def propose(self, state) -> Candidates:
        ranked = self.ranked(state)
        kept = sorted(ranked[: self.tree_size([chance for _, chance in ranked])], key=lambda item: len(item[0]))
        node, parents = {(): 0}, [0]
        for path, _ in kept:  # parents first: a node's parent is likelier, so kept, and shorter
            node[path] = len(parents)
            parents.append(node[path[:-1]])
        self._guessed_after = {path[:-1] for path, _ in kept}
        guesses = torch.tensor([path[-1] for path, _ in kept], dtype=torch.long, device=self.device)
        tree = buffers_from_parents(parents, self.device)
        return Candidates(tokens=torch.cat([state.root_token.view(1), guesses]), tree=tree)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        taken, path = accepted_tokens[:-1], ()  # the guesses taken; the last token is the target's own
        for depth in range(1, self.num_tokens + 1):  # each depth guessed after the guesses before it were right
            if path not in self._guessed_after:
                break
            self._tries[depth] += 1
            if depth > len(taken):
                break
            self._right[depth] += 1
            path += (int(taken[depth - 1]),)


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
    """The static tree is not used: the lookup tree follows the matches (sized by the verify's cost where the call's
    plan knows it: `chain_ms`, set by MedusaModel._decode_one)."""
    return PromptLookupProposer(model.device)


def build_hybrid_proposer(model, tree: TreeBuffers) -> HybridProposer:
    """The model's Medusa heads on the static `tree`, plus the prompt-lookup chain."""
    return HybridProposer(build_medusa_proposer(model, tree), PromptLookupProposer(model.device))
