"""Acceptance rules: (Candidates, VerifyOutput, SamplingConfig, generator) -> Acceptance. One signature, a registry.

Every rule returns the accepted root-to-node path and the new tokens: the accepted tree tokens after the root,
then one token from the target (the next root, "bonus"), so every step commits at least one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa.runtime import StepGraph, VerifyOutput
from medusa.sampling import SamplingConfig, greedy_tokens, select_token, target_probs
from medusa.tree import Candidates


@dataclass(frozen=True)
class Acceptance:
    nodes: torch.Tensor  # (a + 1,) long: accepted node indices, root first (on the model's device)
    tokens: list[int]  # a + 1 new tokens: accepted tree tokens after the root, then the bonus token


def _with_sentinel(x: torch.Tensor) -> torch.Tensor:
    """Append one zero so leaf paths padded with index N gather something harmless."""
    return torch.cat([x, x.new_zeros(1)])


def _accepted_depths(leaf_paths: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """The tree's leaf paths (L, D + 1) and ok (N,) bool per node (root ignored) -> (L,) long: how deep each
    root-to-leaf path is accepted."""
    return _with_sentinel(ok)[leaf_paths[:, 1:]].long().cumprod(1).sum(1)  # sentinel padding is never ok


def _packed(tokens: torch.Tensor, length: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """Accepted depth (0-dim), its leaf path (D + 1,) and the bonus token -> (D + 3,): depth, path tokens, bonus."""
    return torch.cat([length.view(1), _with_sentinel(tokens)[path], bonus.view(1)])


def _unpacked(path: torch.Tensor, packed: torch.Tensor) -> Acceptance:
    """_packed's result -> Acceptance, with the step's one host sync."""
    values = packed.tolist()
    accepted, path_tokens = values[0], values[1:-1]
    return Acceptance(nodes=path[: accepted + 1], tokens=path_tokens[1 : accepted + 1] + [values[-1]])


def _finish(candidates: Candidates, length: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    """Accepted depth (0-dim), its leaf path (D + 1,) and the bonus token (1,) -> Acceptance, with one host sync."""
    return _unpacked(path, _packed(candidates.tokens, length, path, bonus))


def _row(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (N, ...) and a 0-dim device index -> x[index], without turning the index into a Python int (a host sync)."""
    return x.index_select(0, index.view(1))[0]


def greedy(candidates: Candidates, verified: VerifyOutput, sampling: SamplingConfig, generator=None) -> Acceptance:
    """Longest root-to-leaf path whose every token is the argmax of its parent's logits, plus that argmax at its end.
    A CUDA graph on a GPU for a tree (medusa.runtime.StepGraph); the root alone (plain decoding) is its argmax, one
    kernel and the step's host sync."""
    tree = candidates.tree
    if tree.num_nodes == 1:
        return Acceptance(nodes=tree.leaf_paths[0], tokens=greedy_tokens(verified.logits).tolist())
    return _unpacked(*GREEDY_PATH(candidates.tokens, verified.logits, tree.parent, tree.leaf_paths))


def greedy_path(
    tokens: torch.Tensor, logits: torch.Tensor, parent: torch.Tensor, leaf_paths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy's tensor work: tokens (N,), logits (N, V), the tree's parent (N,) and leaf paths (L, D + 1) -> the
    accepted leaf path (D + 1,) and `_packed` (D + 3,). Fixed shapes, no host sync."""
    predicted = greedy_tokens(logits)  # (N,)
    ok = tokens == predicted[parent]
    lengths = _accepted_depths(leaf_paths, ok)  # (L,)
    best = lengths.argmax()
    path, length = _row(leaf_paths, best), _row(lengths, best)  # (D + 1,), ()
    return path, _packed(tokens, length, path, _row(_with_sentinel(predicted)[path], length))


GREEDY_PATH = StepGraph(greedy_path, "the greedy acceptance")


def rejection(candidates: Candidates, verified: VerifyOutput, sampling: SamplingConfig, generator=None) -> Acceptance:
    """Exact sampling on a tree of deterministic candidates: the committed tokens are distributed as the target's p.

    Per depth, walk the children of the accepted node in order; accept child x with probability p(x), where p is the
    target's shaped distribution at the parent; on rejection set p(x) = 0, renormalise and try the next child (so a
    duplicate of a rejected sibling is never accepted); if every child is rejected, draw the bonus token from what is
    left of p; after an accepted leaf, from p at the leaf. This is Leviathan et al.'s rule with a point-mass draft:
    exact for any candidates chosen without looking at the target's random draws. Greedy when not sampling (T -> 0).

    The walk is vectorised: whether a child would be accepted once reached depends only on its earlier siblings
    (all rejected by then), so one uniform per node decides every node at once; the accepted path is the longest
    chain of nodes that are the first accepted child of their parent. One host sync per step.
    """
    if not sampling.do_sample:
        return greedy(candidates, verified, sampling, generator)
    tree, tokens = candidates.tree, candidates.tokens
    probs = target_probs(verified.logits, sampling)  # (N, V): p at every node
    node = torch.arange(tree.num_nodes, device=tokens.device)
    is_child = node > 0  # the root's parent is itself: exclude it
    earlier = (
        (tree.parent[:, None] == tree.parent[None, :])
        & (node[None, :] < node[:, None])
        & is_child[:, None]
        & is_child[None, :]
    )  # (N, N): node k is an earlier sibling of node i
    mass = probs[tree.parent, tokens] * is_child  # (N,) p_parent(x_i)
    mass = mass.masked_fill((earlier & (tokens[:, None] == tokens[None, :])).any(1), 0.0)  # duplicate: already p = 0
    removed = (earlier.float() @ mass[:, None])[:, 0]  # (N,) mass zeroed by the earlier (rejected) siblings
    accept_prob = mass / (1.0 - removed).clamp_min(torch.finfo(mass.dtype).tiny)
    accepted = torch.rand(tree.num_nodes, device=tokens.device, generator=generator) < accept_prob  # (N,)
    first = accepted & ~(earlier & accepted[None, :]).any(1)  # the child the ordered walk would take
    lengths = _accepted_depths(tree.leaf_paths, first)  # at most one child per node is `first`: one accepted path
    best = lengths.argmax()
    path = tree.leaf_paths[best]
    last = _row(_with_sentinel(node)[path], lengths[best])  # 0-dim: the last accepted node
    p_last = _row(probs, last)  # (V,)
    rejected = torch.zeros_like(p_last).index_add_(0, tokens, ((tree.parent == last) & is_child).float())  # (V,)
    residual = p_last.masked_fill(rejected > 0, 0.0)  # all children of `last` were rejected (none for a leaf)
    residual = torch.where(residual.sum() > 0, residual, p_last)  # float round-off only: p was all on rejected tokens
    return _finish(candidates, lengths[best], path, torch.multinomial(residual, 1, generator=generator))


def speculative(candidates: Candidates, verified: VerifyOutput, sampling: SamplingConfig, generator=None) -> Acceptance:
    """Leviathan et al., Algorithm 1, on a chain drawn from a draft model q: exact sampling from the target's p.

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the bonus from
    norm(max(0, p_i - q_i)); if all gamma are accepted, from p_{gamma+1}. p and q are both shaped by `sampling`
    (the draft samples from its own shaped q). Needs `candidates.draft_probs` (N, V): row i is the q that drew node i.
    Greedy when not sampling (T -> 0), so greedy draft-model decoding equals plain greedy decoding.
    """
    if not sampling.do_sample:
        return greedy(candidates, verified, sampling, generator)
    if candidates.tree.num_nodes == 1:  # a step without guesses (medusa.guard's plain steps): a draw from p
        return rejection(candidates, verified, sampling, generator)
    tree, tokens, q = candidates.tree, candidates.tokens, candidates.draft_probs
    if q is None:
        raise ValueError(
            "acceptance='speculative' needs the draft model's probabilities (Candidates.draft_probs): "
            "use it with MedusaModel.from_draft_model, or use acceptance='rejection' for other proposers"
        )
    if tree.num_nodes != tree.max_depth + 1:
        raise ValueError(
            f"acceptance='speculative' takes a chain (a tree of width 1), got a tree of {tree.num_nodes} "
            f"nodes and depth {tree.max_depth}: use acceptance='rejection' for trees"
        )
    p = target_probs(verified.logits, sampling)  # (N, V): row i = target's p after node i
    q = q.float()
    drafts = tokens[1:, None]  # (gamma, 1)
    p_x, q_x = p[:-1].gather(1, drafts)[:, 0], q[1:].gather(1, drafts)[:, 0]  # (gamma,)
    u = torch.rand(p_x.shape, device=p.device, generator=generator)
    ok = torch.cat([torch.ones_like(p_x[:1], dtype=torch.bool), u * q_x < p_x])  # u < p/q without dividing by q
    lengths = _accepted_depths(tree.leaf_paths, ok)  # (1,)
    residuals = torch.cat(
        [(p[:-1] - q[1:]).clamp_min(0.0), p[-1:]]
    )  # (N, V): what the bonus is drawn from after a accepted
    residual, p_next = _row(residuals, lengths[0]), _row(p, lengths[0])
    residual = torch.where(residual.sum() > 0, residual, p_next)  # float round-off only: p <= q everywhere means p == q
    return _finish(candidates, lengths[0], tree.leaf_paths[0], torch.multinomial(residual, 1, generator=generator))


def typical(candidates: Candidates, verified: VerifyOutput, sampling: SamplingConfig, generator=None) -> Acceptance:
    """Typical acceptance (Medusa, Cai et al. 2024): fast and LOSSY, the output is NOT distributed as the target's p.

    Accept node x if p(x) > min(epsilon, alpha * exp(-H(p))), p being the target's distribution at x's parent
    (shaped by `sampling` when sampling, the plain softmax otherwise), epsilon = `sampling.posterior_threshold`
    (default 0.09), alpha = `sampling.posterior_alpha` (default 0.3). Take the longest accepted path (ties: the most
    likely one, as official Medusa does); the bonus token is drawn from p at its last node (argmax when not sampling).
    Official Medusa's `medusa_generate` uses these defaults, but its helpers `generate_candidates` and
    `evaluate_posterior` declare them swapped (posterior_threshold=0.3, posterior_alpha=0.09).
    """
    tree, tokens = candidates.tree, candidates.tokens
    probs = target_probs(verified.logits, sampling) if sampling.do_sample else verified.logits.float().softmax(-1)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # (N,)
    threshold = (sampling.posterior_alpha * torch.exp(-entropy)).clamp_max(sampling.posterior_threshold)  # (N,)
    mass = probs[tree.parent, tokens]  # (N,) p_parent(x_i)
    lengths = _accepted_depths(tree.leaf_paths, mass > threshold[tree.parent])  # (L,)
    log_mass = _with_sentinel(mass.clamp_min(torch.finfo(mass.dtype).tiny).log())[tree.leaf_paths[:, 1:]]  # (L, D)
    depth = torch.arange(tree.max_depth, device=tokens.device)
    likelihood = (log_mass * (depth[None, :] < lengths[:, None])).sum(1)  # (L,) log p of each accepted prefix
    best = torch.where(lengths == lengths.max(), likelihood, float("-inf")).argmax()
    path = tree.leaf_paths[best]
    last = _row(_with_sentinel(torch.arange(tree.num_nodes, device=tokens.device))[path], lengths[best])
    bonus = select_token(_row(verified.logits, last), sampling, generator)
    return _finish(candidates, lengths[best], path, bonus)


AcceptanceRule = Callable[[Candidates, VerifyOutput, SamplingConfig, "torch.Generator | None"], Acceptance]

# greedy: T = 0, exact. rejection: exact sampling on any tree (the default for do_sample=True). speculative: exact
# sampling on a draft model's chain (uses q). typical: lossy, faster.
ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {
    "greedy": greedy,
    "rejection": rejection,
    "speculative": speculative,
    "typical": typical,
}


def get_rule(name: str) -> AcceptanceRule:
    if name not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {name!r}: use one of {sorted(ACCEPTANCE_RULES)}")
    return ACCEPTANCE_RULES[name]
