"""Copy guesses (heads with copy_ngram): the n-gram match, the ranking, the proposers, scoring, exactness."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from medusa import MedusaModel
from medusa.config import MedusaConfig
from medusa.dynamic_tree import DynamicTreeProposer, copy_first
from medusa.evaluation import head_rank_hits
from medusa.heads import head_target_offset
from medusa.ngram import copy_chain, copy_guesses, ngram_continuation, put_first
from medusa.propose import build_medusa_proposer
from medusa.tree import TreeSpec, build_buffers, chain
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_heads, make_tiny_model


def copying(heads, ngram=4):
    heads.config = dataclasses.replace(heads.config, copy_ngram=ngram)
    return heads


class State:
    def __init__(self, hidden, tokens):
        self.last_hidden, self.tokens, self.root_token = hidden, tokens, torch.tensor(tokens[-1])


def slow_copy_chain(tokens: list[int], max_ngram: int, length: int) -> list[int]:
    """Most recent earlier occurrence of the last n tokens, n = max_ngram .. 2, searched one position at a time."""
    for n in range(max_ngram, 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + length]
    return []


def test_ngram_continuation_latest_and_min_ngram():
    tokens = torch.tensor([1, 2, 5, 1, 2, 6, 3, 1, 2])
    assert ngram_continuation(tokens, 3, 1) == [5]  # earliest occurrence of [1, 2]
    assert ngram_continuation(tokens, 3, 1, latest=True) == [6]
    assert ngram_continuation(torch.tensor([4, 9, 8, 4]), 3, 2) == [9, 8]  # a single-token match
    assert ngram_continuation(torch.tensor([4, 9, 8, 4]), 3, 2, min_ngram=2) == []


def test_copy_chain_matches_a_slow_search():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator)
        assert copy_chain(tokens, 4, 3) == slow_copy_chain(tokens.tolist(), 4, 3), tokens.tolist()
    assert copy_chain(torch.tensor([7, 1, 2, 3, 9, 8, 0, 1, 2, 3]), 4, 3) == [9, 8, 0]  # the 3-gram [1, 2, 3]


def test_copy_guesses_follow_the_chain_for_path_heads_only():
    chain_tokens = [8, 5, 1]
    paths = torch.tensor([[8, 5], [8, 6], [2, 5]])
    assert copy_guesses(chain_tokens, 2, paths).tolist() == [1, -1, -1]  # only the path that follows the chain
    assert copy_guesses(chain_tokens, 2, None).tolist() == [1]  # heads that read no path: the same after every path
    assert copy_guesses(chain_tokens, 3, None).tolist() == [-1]  # the chain is too short for head 3
    assert copy_guesses([], 0, torch.zeros(2, 0, dtype=torch.long)).tolist() == [-1, -1]


def test_put_first_matches_a_list_reference():
    generator = torch.Generator().manual_seed(1)
    for _ in range(100):
        rows, width = 5, int(torch.randint(1, 6, (1,), generator=generator))
        tokens = torch.stack([torch.randperm(9, generator=generator)[:width] for _ in range(rows)])
        first = torch.randint(-1, 9, (rows,), generator=generator)
        want = [
            row if f < 0 else ([f] + [t for t in row if t != f])[:width]
            for row, f in zip(tokens.tolist(), first.tolist())
        ]
        assert put_first(tokens, first).tolist() == want


def test_copy_first_is_the_mixture():
    tokens, logp = [4, 7, 9], [math.log(p) for p in (0.5, 0.3, 0.1)]
    rows = [copy_first(tokens, logp, guess, probability=0.6) for guess in (9, 2, -1)]
    assert [merged for merged, _ in rows] == [[9, 4, 7], [2, 4, 7], [4, 7, 9]]
    want = [[0.6 + 0.4 * 0.1, 0.4 * 0.5, 0.4 * 0.3], [0.6, 0.4 * 0.5, 0.4 * 0.3], [0.5, 0.3, 0.1]]
    for (_, mixed), probabilities in zip(rows, want):
        assert [math.exp(x) for x in mixed] == pytest.approx(probabilities)


def test_config_rejects_bad_copy_ngram():
    for bad in (1, -1, True, 2.0):
        with pytest.raises(ValueError, match="copy_ngram"):
            MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, copy_ngram=bad)
    assert MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, copy_ngram=2).copy_ngram == 2


REPEATING = [5, 11, 23, 40, 6, 12, 5, 11, 23, 41, 3, 5, 11]  # [5, 11] last followed by 23, then 41 ([5, 11, 23])


def test_static_proposer_ranks_the_copy_first():
    model = MedusaModel(make_tiny_model("llama"), copying(make_heads(3, random=True)), tree=[[0], [1], [0, 0], [1, 0]])
    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(model.tree), 3))
    hidden = torch.randn(HIDDEN)
    plain = (
        build_medusa_proposer(
            MedusaModel(model.base, make_heads(3, random=True)), build_buffers(TreeSpec(model.tree), 3)
        )
        .propose(State(hidden, REPEATING))
        .tokens
    )
    tokens = proposer.propose(State(hidden, REPEATING)).tokens.tolist()
    # node order: root, [0], [1], [0, 0], [1, 0]: head 0 rank 0 = 23, head 1 rank 0 = 41 (shared by both parents)
    assert tokens[1] == 23 and tokens[3] == tokens[4] == 41
    assert tokens[2] == (plain[1] if int(plain[1]) != 23 else plain[2])  # head 0's own best comes next
    plain_no_match = build_medusa_proposer(
        MedusaModel(model.base, make_heads(3, random=True)), build_buffers(TreeSpec(model.tree), 3)
    ).propose(State(hidden, [1, 2, 3, 4]))
    assert torch.equal(proposer.propose(State(hidden, [1, 2, 3, 4])).tokens, plain_no_match.tokens)  # nothing to copy


def test_path_proposer_copies_along_the_chain_only():
    heads = copying(make_heads(3, random=True, condition_on_path=True))
    model = MedusaModel(make_tiny_model("qwen2"), heads, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(model.tree), 3))
    chain_tokens = copy_chain(torch.tensor(REPEATING), 4, 3)
    assert chain_tokens == [23, 41, 3]
    tokens = proposer.propose(State(torch.randn(HIDDEN), REPEATING)).tokens.tolist()
    assert tokens[1] == 23 and tokens[3] == 41 and tokens[5] == 3  # the chain [0], [0, 0], [0, 0, 0]
    assert tokens[4] != 41 or tokens[2] == 23  # under the other parent, head 1's copy is not forced


def test_dynamic_proposer_scores_copies_as_the_mixture():
    heads = copying(make_heads(3, random=True, condition_on_path=True))
    model = MedusaModel(make_tiny_model("gemma"), heads)
    dynamic = DynamicTreeProposer(
        build_medusa_proposer(model, build_buffers(TreeSpec(chain(3)), 3)), num_nodes=4, depth=3, topk=3
    )
    got = dynamic.propose(State(torch.randn(HIDDEN), REPEATING))
    # random heads are unsure (each token ~1/96): the copy chain (0.75 each) beats every other path
    assert got.tokens.tolist() == [REPEATING[-1], 23, 41, 3] and got.tree.parent.tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path_heads", [False, True], ids=["root-heads", "path-heads"])
def test_copying_heads_keep_greedy_identity(family, path_heads):
    base = make_tiny_model(family)
    heads = copying(make_heads(3, random=True, condition_on_path=path_heads), ngram=3)
    model = MedusaModel(base, heads, tree=[[0], [1], [0, 0], [0, 0, 0]])
    prompt = torch.tensor([REPEATING * 2])
    expected = base.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False, min_new_tokens=30
    )
    for proposer in ("medusa", "dynamic", "hybrid"):
        out = model.generate(prompt, max_new_tokens=30, proposer=proposer)
        assert torch.equal(out, expected), (family, proposer)


@pytest.mark.parametrize("path_heads", [False, True], ids=["root-heads", "path-heads"])
def test_rank_accuracy_scores_the_copy_as_the_proposer_ranks_it(path_heads):
    """head_rank_hits with copy_ngram equals a slow loop: each head's top-R list with its copy guess put first."""
    heads = copying(make_heads(3, random=True, condition_on_path=path_heads), ngram=3)
    model = MedusaModel(make_tiny_model("llama"), heads, tokenizer=object(), projection_dtype=torch.float32)
    ids = torch.tensor(list(itertools.islice(itertools.cycle([3, 9, 4, 9, 4, 7, 2, 3, 9, 1]), 45)))
    start, ranks = 6, 4
    got = head_rank_hits(model, ids, start, ranks=ranks)
    embed = model.base.get_input_embeddings()
    hits = torch.zeros(3, ranks, dtype=torch.long)
    copy_counts = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        hidden = model.base(ids[None], output_hidden_states=True).hidden_states[-1][0]
        for t in range(start - 1, len(ids) - 2):
            chain_tokens = slow_copy_chain(ids[: t + 2].tolist(), 3, 3)
            for k in range(3):
                j = t + head_target_offset(k)
                if j >= len(ids):
                    continue
                following = ids[t + 1 : t + 2 + k]
                x = heads.run_head(k, hidden[t], embed(following[0]), embed(following[1:]) if path_heads else None)
                top = model.candidate_projection.head_logits(k, x[None])[0].topk(ranks).indices.tolist()
                follows = not path_heads or ids[t + 2 : t + 2 + k].tolist() == chain_tokens[:k]
                if len(chain_tokens) > k and follows:
                    copy_counts[k] += 1
                    top = ([chain_tokens[k]] + [x for x in top if x != chain_tokens[k]])[:ranks]
                if int(ids[j]) in top:
                    hits[k, top.index(int(ids[j]))] += 1
    assert torch.equal(got.hits, hits) and torch.equal(got.copy_counts, copy_counts)
    assert got.copy_hits.sum() > 0 and got.copy_precision.max() <= 1
    plain = head_rank_hits(
        MedusaModel(model.base, copying(heads, 0), tokenizer=object(), projection_dtype=torch.float32),
        ids,
        start,
        ranks=ranks,
    )
    assert got.hits[:, 0].sum() > plain.hits[:, 0].sum()  # the text repeats: copying must help
    assert plain.copy_counts.sum() == 0
