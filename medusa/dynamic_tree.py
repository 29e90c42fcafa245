"""The dynamic tree proposer: a per-step candidate tree (the EAGLE-2 idea on Medusa heads).

A static tree (medusa.tree) fixes which ranks of which heads are tried. A dynamic tree ranks every path by the heads'
own confidence this step, the product of the heads' probabilities along it, and keeps the best N: a confident step
grows deep chains, an uncertain one spreads wide near the root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from medusa.propose import build_medusa_proposer
from medusa.tree import Candidates, TreeBuffers, TreeSpec, buffers_from_parents, build_buffers, chain

DEFAULT_TOPK = 10  # children tried per node: the widest static Medusa trees use up to top-10 of head 0
# How sure a copy guess is, for scoring paths: on 80 of the target's greedy training answers a copy guess (4- to
# 2-gram match) was the emitted token 77-86% of the time where one existed, more at deeper heads (their copies
# continue a copy already right); a little below that, as a prior.
COPY_PROBABILITY = 0.75


def copy_first(tokens: list[int], logp: list[float], guess: int, probability: float = COPY_PROBABILITY):
    """A head's top guesses `tokens` and their log-probabilities `logp` for one path, with its copy guess (-1: none)
    ranked first -> (tokens, logp) scored as the mixture `probability` * copy + (1 - probability) * head; without a
    copy they are returned as they are."""
    if guess < 0:
        return tokens, logp
    own = dict(zip(tokens, logp))
    others = [t for t in tokens if t != guess][: len(tokens) - 1]
    copy_logp = math.log(probability + (1 - probability) * math.exp(own.get(guess, -math.inf)))
    return [guess, *others], [copy_logp] + [own[t] + math.log1p(-probability) for t in others]


def rank_copies_first(
    paths: list[tuple[int, ...]],
    tokens: list[list[int]],
    logp: list[list[float]],
    copies: list[int],
    depth: int,
    every_path: bool = False,
) -> None:
    """In place, at tree depth `depth`: the copy guess `copies[depth]` (ngram.copy_chain) ranked first by `copy_first`
    in the row of each path that follows the copy chain so far (ngram.copy_guesses' rule, on host lists), or of every
    path with `every_path` (heads that read no path guess the same after each)."""
    if depth >= len(copies):
        return
    for i, path in enumerate(paths):
        if every_path or list(path) == copies[:depth]:
            tokens[i], logp[i] = copy_first(tokens[i], logp[i], copies[depth])


@dataclass
class Level:
    """One depth of the search: the best children of the previous level's kept nodes, best first in one stable
    order (score, then parent, then rank)."""

    scores: list[float]  # log-probability of each node's path
    parents: list[int]  # index of its parent among the previous level's nodes
    tokens: list[int]


def keep_best(beam: list[float], top_logp: list[list[float]], top_tokens: list[list[int]], budget: int) -> Level:
    """The kept parents' path scores `beam` (B,), their children's log-probabilities and tokens (B, s) -> the best
    `budget` children. The search runs on the host: its few dozen numbers cost less as Python floats than as tensor
    ops."""
    children = [
        (score + logp, parent, token)
        for parent, (score, row_logp, row_tokens) in enumerate(zip(beam, top_logp, top_tokens))
        for logp, token in zip(row_logp, row_tokens)
    ]
    children.sort(key=lambda child: -child[0])  # stable: ties keep parent, then rank order
    kept = children[:budget]
    return Level([c[0] for c in kept], [c[1] for c in kept], [c[2] for c in kept])


def surviving_parents(beam: list[float], levels: list[Level], budget: int) -> int:
    """How many of the previous level's kept nodes (scores `beam`, sorted descending) can still have a child in the
    final cut. A child scores at most its parent (log-probabilities <= 0) and comes after every shallower node in the
    cut's stable order, so once `budget` nodes score at least t, a parent scoring <= t has no child in the cut. The
    survivors are a prefix of the beam, so their indices, and the proposal, are those of the unpruned search; only
    head calls that could not matter are skipped."""
    scores = sorted((s for level in levels for s in level.scores), reverse=True)
    if len(scores) < budget:
        return len(beam)
    return sum(score > scores[budget - 1] for score in beam)


def cut_tree(root: torch.Tensor, levels: list[Level], budget: int) -> Candidates:
    """The best `budget` nodes across the levels `keep_best` kept, as a tree rooted at `root` (1,). Within a level the
    stable global order equals the level's own, so each level contributes a prefix of its sorted list, and since a
    child never scores above its parent the cut is prefix-closed."""
    ranked = sorted(((score, d) for d, level in enumerate(levels) for score in level.scores), key=lambda x: -x[0])
    counts = [0] * len(levels)
    for _, d in ranked[:budget]:
        counts[d] += 1
    parents, tokens, start = [0], [], 0  # start: node index of the previous level's first node (the root's: 0)
    for level, count in zip(levels, counts):
        if count == 0:
            break
        parents += [start + p for p in level.parents[:count]]
        tokens += level.tokens[:count]
        start = len(parents) - count
    new = torch.tensor(tokens, dtype=root.dtype).to(root.device, non_blocking=True)
    return Candidates(tokens=torch.cat([root, new]), tree=buffers_from_parents(parents, root.device))


class DynamicTreeProposer:
    """Each step: the best `num_nodes - 1` paths by the product of head probabilities, a tree rooted at the root token.

    A node at depth d holds one of the top-`topk` tokens of head d-1 (its copy guess first, scored by
    `copy_first`, for heads with `copy_ngram`). Log-probabilities are <= 0, so a path never
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

    def budget(self, num_nodes: int) -> None:
        """Propose `num_nodes` nodes a step from now on (a batch's rows, as the batch's size changes)."""
        if num_nodes < 1:
            raise ValueError(f"a dynamic tree needs num_nodes >= 1, got {num_nodes}")
        self.num_nodes = self.max_nodes = num_nodes

    @property
    def batch_key(self) -> tuple:
        """Rows whose proposers have equal keys propose together (propose_batch)."""
        return self.num_nodes, self.depth, self.topk, id(self.medusa.heads)

    def propose(self, state) -> Candidates:
        return self.propose_batch([self], [state])[0]

    @staticmethod
    def propose_batch(proposers: list[DynamicTreeProposer], states) -> list[Candidates]:
        """Each of `proposers` (a batch's rows: alike, over the same heads) at its state in `states`, as its `propose`
        gives it, with the rows' context reads in one call and each depth's head in one call over every row's paths
        (a call costs about the same for one row as for a few on a CPU: its weights are read once)."""
        first = proposers[0]
        if any(other.batch_key != first.batch_key for other in proposers[1:]):
            raise ValueError("a batch's rows propose together only with one kind of tree over the same heads")
        roots = [state.root_token.view(1) for state in states]
        budget = first.num_nodes - 1  # non-root nodes
        if budget == 0 or first.depth == 0:
            for proposer, state in zip(proposers, states):  # (a batch's rows budgeted to plain steps for a while)
                proposer.skip(state)  # the heads' context layer reads these positions with the next guessing step's
            return [Candidates(tokens=root, tree=buffers_from_parents([0], root.device)) for root in roots]
        medusa, rows = first.medusa, range(len(states))
        hidden = medusa.read_batch([p.medusa for p in proposers], states)
        copies = [p.medusa.step_copies(state) for p, state in zip(proposers, states)]
        if not medusa.by_path:  # every head reads only the root: all levels' guesses at once, (D, V') a row
            logits = [medusa.head_logits(hidden[b], states[b].root_token, first.depth) for b in rows]

        # Level d keeps its best `budget` candidates, sorted; children of those are level d+1's candidates.
        levels: list[list[Level]] = [[] for _ in rows]
        # the previous level's kept nodes, per row: path scores (the root: log 1), tokens after the root
        beams, paths = [[0.0] for _ in rows], [[()] for _ in rows]
        for d in range(first.depth):
            going = list(rows)
            if d:  # only nodes above the budget-th best score so far can have a child in the final cut
                for b in rows:
                    keep = surviving_parents(beams[b], levels[b], budget)
                    beams[b], paths[b] = beams[b][:keep], paths[b][:keep]
                going = [b for b in rows if paths[b]]  # a row with none: its remaining heads need not run
                if not going:
                    break
            if medusa.by_path:  # (P, V'): each kept node's children depend on its path
                path_ids = [path for b in going for path in paths[b]]
                level_logits = medusa.path_logits(
                    torch.cat([hidden[b].expand(len(paths[b]), -1) for b in going]),
                    torch.cat([roots[b].expand(len(paths[b])) for b in going]),
                    d,
                    torch.tensor(path_ids, dtype=torch.long).view(len(path_ids), d).to(roots[0].device),
                )
            else:  # (G, V'): one row each, shared by all its paths
                level_logits = torch.cat([logits[b][d : d + 1] for b in going])
            width = min(first.topk, budget, level_logits.shape[-1])  # the same at every level
            top_logp, top_index = level_logits.float().log_softmax(-1).clamp(max=0).topk(width, dim=-1)
            top_logp, top_tokens = top_logp.tolist(), medusa.projection.token(top_index).tolist()
            start = 0
            for b in going:
                count = len(paths[b]) if medusa.by_path else 1
                row_logp, row_tokens = top_logp[start : start + count], top_tokens[start : start + count]
                start += count
                if not medusa.by_path:
                    row_logp, row_tokens = row_logp * len(beams[b]), row_tokens * len(beams[b])
                rank_copies_first(paths[b], row_tokens, row_logp, copies[b], d, every_path=not medusa.by_path)
                levels[b].append(keep_best(beams[b], row_logp, row_tokens, budget))
                beams[b] = levels[b][-1].scores
                paths[b] = [paths[b][p] + (t,) for p, t in zip(levels[b][-1].parents, levels[b][-1].tokens)]
        return [cut_tree(roots[b], levels[b], budget) for b in rows]

    def observe(self, state, accepted_tokens: list[int]) -> None:
        pass

    def skip(self, state) -> None:
        self.medusa.skip(state)


def build_dynamic_proposer(model, tree: TreeBuffers, topk: int = DEFAULT_TOPK) -> DynamicTreeProposer:
    """As many nodes per step as the static tree `tree` has, over all of the model's heads."""
    depth = model.config.num_heads
    heads_only = build_medusa_proposer(model, build_buffers(TreeSpec(chain(depth)), depth).to(model.device))
    return DynamicTreeProposer(heads_only, num_nodes=tree.num_nodes, depth=depth, topk=topk)
