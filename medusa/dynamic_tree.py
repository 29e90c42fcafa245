"""The dynamic tree proposer: a per-step candidate tree (the EAGLE-2 idea on Medusa heads).

A static tree (medusa.tree) fixes which ranks of which heads are tried. A dynamic tree ranks every path by the heads'
own confidence this step, the product of the heads' probabilities along it, and keeps the best N: a confident step
grows deep chains, an uncertain one spreads wide near the root.
"""

from __future__ import annotations

import torch

from medusa.ngram import copy_guesses, put_first
from medusa.propose import build_medusa_proposer
from medusa.tree import Candidates, TreeBuffers, TreeSpec, buffers_from_parents, build_buffers, chain

DEFAULT_TOPK = 10  # children tried per node: the widest static Medusa trees use up to top-10 of head 0
# How sure a copy guess is, for scoring paths: on 80 of the target's greedy training answers a copy guess (4- to
# 2-gram match) was the emitted token 77-86% of the time where one existed, more at deeper heads (their copies
# continue a copy already right); a little below that, as a prior.
COPY_PROBABILITY = 0.75


def copy_first_logp(
    tokens: torch.Tensor, logp: torch.Tensor, guesses: torch.Tensor, probability: float = COPY_PROBABILITY
) -> tuple[torch.Tensor, torch.Tensor]:
    """A head's top guesses tokens, logp (P, W) with its copy guesses (P,) (-1: none) ranked first -> (tokens, logp)
    (P, W) scored as the mixture `probability` * copy + (1 - probability) * head; rows without a copy are unchanged."""
    merged = put_first(tokens, guesses)
    same = merged[:, :, None] == tokens[:, None, :]  # (P, W, W): where each kept token sat among the head's guesses
    own = torch.where(same.any(-1), logp.gather(1, same.int().argmax(-1)), torch.full_like(logp, -float("inf")))
    is_copy = merged == guesses[:, None]
    mixed = torch.where(
        is_copy, torch.log(probability + (1 - probability) * own.exp()), own + torch.log1p(torch.tensor(-probability))
    )
    return merged, torch.where((guesses >= 0)[:, None], mixed, own)


def prune_beam(beam: torch.Tensor, paths: torch.Tensor, scores_so_far: torch.Tensor, budget: int):
    """The previous level's kept nodes (scores `beam` (B,), sorted descending, and their `paths`) whose children can
    still make the final cut. A child scores at most its parent (log-probabilities <= 0) and comes after every
    shallower node in the cut's stable order, so once `budget` nodes score at least t, a parent scoring <= t has no
    child in the cut. The survivors are a prefix of the beam (it is sorted), so their indices, and the proposal, are
    those of the unpruned search; only head calls that could not matter are skipped."""
    if scores_so_far.numel() < budget:
        return beam, paths
    threshold = scores_so_far.topk(budget).values[-1]
    keep = int((beam > threshold).sum())  # host sync: how many rows the next head runs on
    return beam[:keep], paths[:keep]


def keep_best(beam: torch.Tensor, top_logp: torch.Tensor, top_tokens: torch.Tensor, budget: int):
    """One level of the search: the kept parents' scores `beam` (B,), their children's log-probabilities and tokens
    (B, s) -> the best `budget` children (scores, index of the parent in the beam, tokens), sorted descending in one
    stable order (score, then parent, then rank)."""
    scores = (beam[:, None] + top_logp).flatten()  # (B * s,) ordered by parent, then rank
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    return scores[order], order // top_logp.shape[1], top_tokens.flatten()[order]


def cut_tree(root: torch.Tensor, level_scores, level_parents, level_tokens, budget: int) -> Candidates:
    """The best `budget` nodes across the levels `keep_best` kept, as a tree rooted at `root` (1,). Within a level the
    stable global order equals the level's own, so each level contributes a prefix of its sorted list, and since a
    child never scores above its parent the cut is prefix-closed."""
    all_scores = torch.cat(level_scores)
    level_of = torch.cat([torch.full_like(s, d, dtype=torch.long) for d, s in enumerate(level_scores)])
    chosen = torch.sort(all_scores, descending=True, stable=True).indices[:budget]
    counts = torch.bincount(level_of[chosen], minlength=len(level_scores)).tolist()  # host sync: sizes are data

    starts = [1 + sum(counts[:d]) for d in range(len(counts))]  # node index of each level's first node
    tokens, parents, depths = [root], [root.new_zeros(1)], [root.new_zeros(1)]
    for d, count in enumerate(counts):
        if count == 0:
            break
        tokens.append(level_tokens[d][:count])
        parents.append(starts[d - 1] + level_parents[d][:count] if d else root.new_zeros(count))
        depths.append(root.new_full((count,), d + 1))
    tree = buffers_from_parents(torch.cat(parents), torch.cat(depths))
    return Candidates(tokens=torch.cat(tokens), tree=tree)


class DynamicTreeProposer:
    """Each step: the best `num_nodes - 1` paths by the product of head probabilities, a tree rooted at the root token.

    A node at depth d holds one of the top-`topk` tokens of head d-1 (its copy guess first, scored by
    `copy_first_logp`, for heads with `copy_ngram`). Log-probabilities are <= 0, so a path never
    scores above its prefix and the best set is prefix-closed; one stable order (score, then level, then parent and
    rank) is used for every cut so that ties cannot break that closure.
    """

    def __init__(self, medusa, num_nodes: int, depth: int, topk: int = DEFAULT_TOPK):
        if num_nodes < 1 or depth < 0 or topk < 1:
            raise ValueError(
                f"dynamic tree needs num_nodes >= 1, depth >= 0, topk >= 1; got {num_nodes}, {depth}, {topk}"
            )
        self.medusa = medusa  # a MedusaProposer over a chain of `depth` heads: only its head logits are used
        self.num_nodes, self.depth, self.topk = num_nodes, depth, topk
        self.max_nodes = num_nodes

    def propose(self, state) -> Candidates:
        root = state.root_token.view(1)
        budget = self.num_nodes - 1  # non-root nodes
        if budget == 0 or self.depth == 0:
            return Candidates(tokens=root, tree=buffers_from_parents(root.new_zeros(1), root.new_zeros(1)))
        by_path = self.medusa.by_path
        hidden, copies = self.medusa.read(state), self.medusa.step_copies(state)
        if not by_path:  # every head reads only the root: all levels' guesses at once
            logits = self.medusa.head_logits(hidden, state.root_token, self.depth)  # (D, V')

        # Level d keeps its best `budget` candidates, sorted; children of those are level d+1's candidates.
        level_scores, level_parents, level_tokens = [], [], []
        beam = root.new_zeros(
            1, dtype=torch.float32
        )  # (B,) scores of the previous level's kept nodes (the root: log 1)
        paths = root.new_zeros(1, 0)  # (B, d) tokens of the kept nodes' paths after the root
        for d in range(self.depth):
            if d:  # only nodes above the budget-th best score so far can have a child in the final cut: see prune_beam
                beam, paths = prune_beam(beam, paths, torch.cat(level_scores), budget)
                if beam.numel() == 0:  # nothing deeper can be chosen: the remaining heads need not run
                    break
            # (B, V') when each kept node's children depend on its path, else (1, V') shared by all
            level_logits = self.medusa.path_logits(hidden, state.root_token, d, paths) if by_path else logits[d : d + 1]
            width = min(self.topk, budget, level_logits.shape[-1])  # the same at every level
            top_logp, top_index = level_logits.float().log_softmax(-1).clamp(max=0).topk(width, dim=-1)
            top_tokens = self.medusa.projection.token(top_index).expand(beam.shape[0], width)  # (B, s)
            if copies:
                guesses = copy_guesses(copies, d, paths if by_path else None).to(top_tokens.device)
                top_tokens, top_logp = copy_first_logp(
                    top_tokens, top_logp.expand(beam.shape[0], width), guesses.expand(beam.shape[0])
                )
            kept = keep_best(beam, top_logp, top_tokens, budget)
            for level, part in zip((level_scores, level_parents, level_tokens), kept):
                level.append(part)
            beam = level_scores[-1]
            paths = torch.cat([paths[level_parents[-1]], level_tokens[-1][:, None]], dim=1)
        return cut_tree(root, level_scores, level_parents, level_tokens, budget)

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass

    def skip(self, state) -> None:
        self.medusa.skip(state)


def build_dynamic_proposer(model, tree: TreeBuffers, topk: int = DEFAULT_TOPK) -> DynamicTreeProposer:
    """As many nodes per step as the static tree `tree` has, over all of the model's heads."""
    depth = model.config.num_heads
    heads_only = build_medusa_proposer(model, build_buffers(TreeSpec(chain(depth)), depth).to(model.device))
    return DynamicTreeProposer(heads_only, num_nodes=tree.num_nodes, depth=depth, topk=topk)
