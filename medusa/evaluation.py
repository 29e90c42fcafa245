"""Head accuracy by rank on the target's own responses: acc[k][r], the input the tree builder grows trees from.

acc[k][r] = the share of scored positions where the r-th most likely token (0-based) of head k is the token the
target actually emitted there. Head k reads the hidden state at position t and is scored against token
t + head_target_offset(k). Only positions the decoder really consults are scored: t runs from the last prompt
token (the heads' first use, right after prefill) to the last position whose target is still in the sequence.
Ranks come from the model's candidate projection, as the proposer ranks them (its dtype, its vocabulary subset:
a token outside the subset is never a hit), with the copy guess first for heads with `copy_ngram` (medusa.ngram).

acc_given_prefix[k][r] is the same share over the positions where heads 0..k-1 all had the emitted token at rank 0.
A tree step reaches depth k only through such positions, and they are easier than average (the errors of
neighbouring heads are correlated), so a product of the marginals acc undervalues deep paths; the tree builder
multiplies these conditional shares instead. Row 0 equals acc[0].

by_confidence[k][b] is head k's top-1 accuracy split by how sure the target itself was of the emitted token (its
probability where it emitted it; for greedy answers the target's top probability), in the bins CONFIDENCE_EDGES
cut: it tells misses the target could not have avoided either from misses on tokens the target found obvious.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.heads import following_tokens, head_target_offset, tokens_read
from medusa.ngram import copy_chain, copy_guesses, put_first
from medusa.propose import CandidateProjection
from medusa.runtime import base_features

CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9)  # bins of the target's probability of the emitted token: [0, .3), ... [.9, 1]


@dataclass(frozen=True)
class RankAccuracy:
    hits: torch.Tensor  # (K, R) long: scored positions where rank r of head k was the emitted token
    counts: torch.Tensor  # (K,) long: positions scored for head k (fewer for far heads: their targets run out)
    prefix_hits: torch.Tensor  # (K, R) long: hits among the positions where heads 0..k-1 were right at rank 0
    prefix_counts: torch.Tensor  # (K,) long: those positions
    confidence_hits: torch.Tensor  # (K, B) long: rank-0 hits by the bin of the target's probability of the token
    confidence_counts: torch.Tensor  # (K, B) long: scored positions by that bin
    copy_counts: torch.Tensor  # (K,) long: scored positions where head k had a copy guess (heads with copy_ngram)
    copy_hits: torch.Tensor  # (K,) long: those where the copy guess was the emitted token

    @property
    def acc(self) -> torch.Tensor:
        """(K, R) float: hits / counts (0 where a head scored no position)."""
        return self.hits.double() / self.counts.clamp(min=1)[:, None]

    @property
    def acc_given_prefix(self) -> torch.Tensor:
        """(K, R) float: prefix_hits / prefix_counts, the chance given that heads 0..k-1 were right (rank 0)."""
        return self.prefix_hits.double() / self.prefix_counts.clamp(min=1)[:, None]

    @property
    def chain(self) -> torch.Tensor:
        """(K,) share of positions where heads 0..k all were right at rank 0: how often a top-1 chain reaches k+1."""
        return self.acc_given_prefix[:, 0].cumprod(0)

    @property
    def confidence_share(self) -> torch.Tensor:
        """(K, B) float: share of head k's scored positions whose emitted token's target probability is in bin b."""
        return self.confidence_counts.double() / self.counts.clamp(min=1)[:, None]

    @property
    def by_confidence(self) -> torch.Tensor:
        """(K, B) float: top-1 accuracy of head k where the target's probability of the emitted token lay in bin b."""
        return self.confidence_hits.double() / self.confidence_counts.clamp(min=1)

    @property
    def copy_share(self) -> torch.Tensor:
        """(K,) share of head k's scored positions where it had a copy guess."""
        return self.copy_counts.double() / self.counts.clamp(min=1)

    @property
    def copy_precision(self) -> torch.Tensor:
        """(K,) how often head k's copy guess was the emitted token, where it had one."""
        return self.copy_hits.double() / self.copy_counts.clamp(min=1)

    def top(self, n: int) -> torch.Tensor:
        """(K,) cumulative top-n accuracy: the emitted token is among head k's n best."""
        return self.acc[:, :n].sum(1)

    def __add__(self, other: RankAccuracy) -> RankAccuracy:
        return RankAccuracy(*(mine + theirs for mine, theirs in zip(self._tensors(), other._tensors())))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.hits,
            self.counts,
            self.prefix_hits,
            self.prefix_counts,
            self.confidence_hits,
            self.confidence_counts,
            self.copy_counts,
            self.copy_hits,
        )


@torch.inference_mode()
def head_rank_hits(model, input_ids, response_start: int, ranks: int = 10, chunk: int = 64) -> RankAccuracy:
    """Rank hits of every head on one sequence (prompt + the target's response).

    model: a MedusaModel (`.base`, a causal LM; `.heads`; `.candidate_projection`, else the full vocabulary in
    the lm_head's dtype). input_ids: (T,) ids; response_start: index of the first response token.
    `chunk` bounds the (K, chunk, V') logits held at once.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    heads, total, lm_head = model.heads, ids.shape[0], model.base.get_output_embeddings()
    embed = model.base.get_input_embeddings() if heads.config.condition_on_next_token else None
    num_heads = heads.config.num_heads
    # the heads' own accuracy: the candidate projection in the model's proposing dtype, never the int8 weights a CPU
    # proposes with (medusa.runtime.int8_copy; measured to accept as many tokens)
    projection = CandidateProjection.build(heads, lm_head, getattr(model, "projection_dtype", lm_head.weight.dtype))
    candidates = projection.weight.shape[-2]
    if not 1 <= ranks <= candidates:
        raise ValueError(f"ranks must lie in [1, {candidates}] (the candidate vocabulary size), got {ranks}")
    if not 0 <= response_start <= total:
        raise ValueError(f"response_start {response_start} lies outside the sequence of {total} tokens")
    hits, prefix_hits = torch.zeros(num_heads, ranks, dtype=torch.long), torch.zeros(num_heads, ranks, dtype=torch.long)
    counts, prefix_counts = torch.zeros(num_heads, dtype=torch.long), torch.zeros(num_heads, dtype=torch.long)
    edges = torch.tensor(CONFIDENCE_EDGES, dtype=torch.float64)
    confidence_hits = torch.zeros(num_heads, len(edges) + 1, dtype=torch.long)
    confidence_counts = torch.zeros_like(confidence_hits)
    copy_counts, copy_hits = torch.zeros(num_heads, dtype=torch.long), torch.zeros(num_heads, dtype=torch.long)
    first = max(response_start - 1, 0)  # the heads' first read: the last prompt position, after prefill
    last = total - 1 - head_target_offset(0)  # the nearest head's last source position with a target
    if last < first:
        return RankAccuracy(
            hits, counts, prefix_hits, prefix_counts, confidence_hits, confidence_counts, copy_counts, copy_hits
        )
    device = model.base.device
    out = model.base(input_ids=ids[None].to(device), output_hidden_states=True)
    hidden = base_features(out.hidden_states, heads.config.feature_layers)[0]  # (T, H), or (T, H * (1 + layers))
    # bin of the target's probability of each token where it emitted it (position j's token comes from j - 1's logits)
    emitted_p = out.logits[0, :-1].float().log_softmax(-1).gather(-1, ids[1:, None].to(device))[:, 0].exp()
    confidence_bin = torch.bucketize(torch.cat([emitted_p.new_ones(1), emitted_p]).double().cpu(), edges, right=True)
    if (
        heads.context is not None
    ):  # what the heads read: the context layer over every position, each with its next token
        hidden = heads.contextualise(hidden[None], embed(following_tokens(ids, 1)[:, 0].to(device))[None])[0][0]
    offsets = torch.tensor([head_target_offset(k) for k in range(num_heads)])  # (K,)
    reads = torch.arange(1, tokens_read(heads.config, num_heads - 1) + 1)  # offsets of the tokens heads read
    for start in range(first, last + 1, chunk):
        src = torch.arange(start, min(start + chunk, last + 1))  # (n,) positions whose hidden state the heads read
        # the tokens each position's heads read: its root, then (path heads) the target's tokens after it
        following = None if embed is None else ids[(src[:, None] + reads).clamp(max=total - 1)].to(device)  # (n, R)
        head_hidden = torch.stack(
            [heads.run_head_on_tokens(k, hidden[src.to(device)], following, embed) for k in range(num_heads)]
        )
        logits = candidate_logits(projection, head_hidden)  # (K, n, V')
        top = projection.token(logits.topk(ranks, dim=-1).indices).cpu()  # (K, n, R) token ids
        dst = src[None, :] + offsets[:, None]  # (K, n) positions of the tokens each head predicts
        valid = dst < total  # (K, n) far heads run out of targets before near ones
        target = ids[dst.clamp(max=total - 1)]  # (K, n)
        if heads.config.copy_ngram:  # rank each head's copy guess first, as the proposer does
            copies = copy_guesses_along(ids, src, heads.config)  # (K, n)
            top = torch.stack([put_first(top[k], copies[k]) for k in range(num_heads)])
            copy_counts += ((copies >= 0) & valid).sum(1)
            copy_hits += ((copies == target) & valid).sum(1)
        right = (top == target[..., None]) & valid[..., None]  # (K, n, R)
        hits += right.sum(1)
        counts += valid.sum(1)
        # heads 0..k-1 right at rank 0 (an exclusive running product; row 0: every position)
        prefix = torch.cat([torch.ones_like(valid[:1]), right[:-1, :, 0].int().cumprod(0).bool()])  # (K, n)
        prefix_hits += (right & prefix[..., None]).sum(1)
        prefix_counts += (valid & prefix).sum(1)
        bins = confidence_bin[dst.clamp(max=total - 1)]  # (K, n)
        confidence_counts.scatter_add_(1, bins, valid.long())
        confidence_hits.scatter_add_(1, bins, right[..., 0].long())
    return RankAccuracy(
        hits, counts, prefix_hits, prefix_counts, confidence_hits, confidence_counts, copy_counts, copy_hits
    )


def copy_guesses_along(ids: torch.Tensor, sources: torch.Tensor, config) -> torch.Tensor:
    """(T,) ids, (n,) source positions -> (K, n) each head's copy guess there (-1: none), as the proposer makes it in a
    step whose root is ids[t + 1] (path heads: with the target's own tokens as the path)."""
    guesses = torch.full((config.num_heads, sources.numel()), -1, dtype=torch.long)
    for i, t in enumerate(sources.tolist()):
        chain = copy_chain(ids[: t + 2], config.copy_ngram, config.num_heads)
        for k in range(len(chain)):
            path = ids[t + 2 : t + 2 + k][None] if config.condition_on_path else None
            if path is None or path.shape[1] == k:  # the target's path may run out before the chain does
                guesses[k, i] = copy_guesses(chain, k, path)[0]
    return guesses


def candidate_logits(projection: CandidateProjection, head_hidden: torch.Tensor) -> torch.Tensor:
    """(K, n, H) -> (K, n, V'): `CandidateProjection.logits` for n positions at once."""
    head_hidden = head_hidden.to(projection.weight.dtype)
    if projection.weight.dim() == 2:  # shared: one (V', H) matrix
        return head_hidden @ projection.weight.T
    return torch.bmm(head_hidden, projection.weight[: head_hidden.shape[0]].transpose(1, 2))  # own: (K, V', H)


def head_rank_accuracy(model, sequences, response_starts, ranks: int = 10) -> RankAccuracy:
    """Pooled rank hits over sequences: `sequences[i]` (T_i,) ids, `response_starts[i]` where its response begins."""
    return head_rank_accuracy_by_group(model, sequences, response_starts, [None] * len(sequences), ranks)[0]


def head_rank_accuracy_by_group(model, sequences, response_starts, groups, ranks: int = 10):
    """`head_rank_accuracy` pooled over everything and over each group of sequences (e.g. question categories):
    -> (total RankAccuracy, {group: RankAccuracy}), each sequence scored once."""
    if len(sequences) != len(response_starts):
        raise ValueError(f"{len(sequences)} sequences but {len(response_starts)} response starts")
    if len(groups) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(groups)} group labels")
    if not sequences:
        raise ValueError("no sequences to score")
    by_group: dict = {}
    for ids, start, group in zip(sequences, response_starts, groups):
        one = head_rank_hits(model, ids, start, ranks)
        by_group[group] = one if group not in by_group else by_group[group] + one
    total = None
    for part in by_group.values():
        total = part if total is None else total + part
    return total, by_group


def bench_data_dir() -> Path:
    """`$MEDUSA_BENCH_DATA`, else `../shared/bench_data` beside the repository (of a source checkout)."""
    env = os.environ.get("MEDUSA_BENCH_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "bench_data"
