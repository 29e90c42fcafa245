"""Prompt lookup and the hybrid proposer: n-gram matching, lookup trees and their size, grafting a chain onto a tree,
greedy identity."""

from types import SimpleNamespace

import pytest
import torch

from medusa import MedusaModel
from medusa.ngram import ngram_continuation, ngram_matches
from medusa.plan import Plan
from medusa.prompt_lookup import PRIOR_RIGHT, PromptLookupProposer, graft_chain
from medusa.tree import Candidates, TreeSpec, build_buffers
from tests.conftest import FAMILIES, make_heads, make_tiny_model


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([1, 2, 3, 4, 1, 2], [3, 4, 1, 2]),  # bigram [1, 2] seen at the start
        ([1, 2, 3, 4, 5], []),  # nothing repeats
        ([7], []),  # too short to match anything
        ([5, 1, 2, 9, 7, 1, 2, 8, 7, 1, 2], [8, 7, 1, 2]),  # trigram [7, 1, 2] wins over the earlier bigram [1, 2]
        ([4, 4, 4], [4]),  # the continuation may run into the suffix itself
        ([3, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]),  # capped at num_tokens
    ],
)
def test_ngram_continuation(tokens, expected):
    assert ngram_continuation(torch.tensor(tokens), max_ngram=3, num_tokens=10) == expected


def test_ngram_continuation_takes_the_earliest_match():
    assert ngram_continuation(torch.tensor([1, 5, 1, 6, 1]), max_ngram=3, num_tokens=1) == [5]


def _tree_candidates():
    """[[0], [1], [0, 0]] with tokens: root 9, node 1 = 5 (depth 1), node 2 = 6 (depth 1), node 3 = 7 (under 1)."""
    return Candidates(tokens=torch.tensor([9, 5, 6, 7]), tree=build_buffers(TreeSpec([[0], [1], [0, 0]])))


def test_graft_chain_shares_the_prefix_already_in_the_tree():
    merged = graft_chain(_tree_candidates(), [5, 7, 3, 4])
    tree = merged.tree
    assert merged.tokens.tolist() == [9, 5, 6, 7, 3, 4]
    assert tree.parent.tolist() == [0, 0, 0, 1, 3, 4]
    assert tree.depth.tolist() == [0, 1, 1, 2, 3, 4]
    assert tree.visible[5].long().tolist() == [1, 1, 0, 1, 1, 1]
    assert [0, 1, 3, 4, 5] in tree.leaf_paths.tolist()


def test_graft_chain_starts_a_new_branch():
    merged = graft_chain(_tree_candidates(), [8, 5])
    assert merged.tokens.tolist() == [9, 5, 6, 7, 8, 5]
    assert merged.tree.parent.tolist() == [0, 0, 0, 1, 0, 4]
    assert merged.tree.depth.tolist() == [0, 1, 1, 2, 1, 2]
    assert not merged.tree.visible[5, 1], "the chain's 5 must not see the tree's 5 (a cousin)"


def test_graft_chain_already_in_the_tree_changes_nothing():
    candidates = _tree_candidates()
    assert graft_chain(candidates, [5, 7]) is candidates


def test_ngram_matches_lists_every_earlier_occurrence_of_the_longest_suffix_seen():
    tokens = torch.tensor([7, 1, 2, 3, 7, 1, 2, 5, 9, 1, 2, 7, 1, 2])
    assert ngram_matches(tokens, max_ngram=3) == [3, 7]  # [7, 1, 2] twice; the bigram [1, 2]'s third is not counted
    assert ngram_matches(tokens, max_ngram=2) == [3, 7, 11]
    assert ngram_matches(torch.tensor([1, 2, 3]), max_ngram=3) == []


def test_prompt_lookup_proposer_builds_a_chain_from_one_match():
    state = SimpleNamespace(tokens=[1, 2, 3, 4, 1, 2], root_token=torch.tensor(2))
    candidates = PromptLookupProposer(torch.device("cpu"), num_tokens=3).propose(state)
    assert candidates.tokens.tolist() == [2, 3, 4, 1]
    assert candidates.tree.parent.tolist() == [0, 0, 1, 2] and candidates.tree.max_depth == 3
    alone = PromptLookupProposer(torch.device("cpu")).propose(
        SimpleNamespace(tokens=[1, 2, 3], root_token=torch.tensor(3))
    )
    assert alone.tokens.tolist() == [3] and alone.tree.num_nodes == 1


TWO_BRANCHES = [1, 2, 3, 4, 9, 1, 2, 5, 6, 8, 1, 2, 3, 4, 7, 1, 2]  # [7, 1, 2] is new; [1, 2] came 3 times


def test_prompt_lookup_proposes_a_tree_over_every_earlier_match():
    """[1, 2] was followed by 3 4 twice and by 5 6 once: both branches are guessed, the more frequent first; at equal
    counts the more recent match ranks first."""
    state = SimpleNamespace(tokens=TWO_BRANCHES, root_token=torch.tensor(2))
    lookup = PromptLookupProposer(torch.device("cpu"), num_tokens=4)
    candidates = lookup.propose(state)
    assert candidates.tokens.tolist() == [2, 3, 5, 4, 6]
    assert candidates.tree.parent.tolist() == [0, 0, 0, 1, 2]
    chances = dict(lookup.ranked(state))
    assert chances[(3,)] == pytest.approx(PRIOR_RIGHT * 2 / 3) and chances[(5,)] == pytest.approx(PRIOR_RIGHT / 3)
    assert chances[(3, 4)] < chances[(3,)]  # a child never outranks its parent
    tied = SimpleNamespace(tokens=[1, 2, 3, 8, 1, 2, 5, 9, 1, 2], root_token=torch.tensor(2))
    assert PromptLookupProposer(torch.device("cpu"), num_tokens=2).propose(tied).tokens.tolist()[:3] == [2, 5, 3]


def test_observe_counts_each_depth_along_the_branch_the_target_took():
    state = SimpleNamespace(tokens=TWO_BRANCHES, root_token=torch.tensor(2))
    lookup = PromptLookupProposer(torch.device("cpu"), num_tokens=4)
    lookup.propose(state)  # 3 -> 4 and 5 -> 6
    lookup.observe(state, [5, 6, 8])  # the second branch, whole: depths 1 and 2 right, nothing guessed at 3
    assert (lookup._tries[1:4], lookup._right[1:4]) == ([1, 1, 0], [1, 1, 0])
    lookup.propose(state)
    lookup.observe(state, [3, 7])  # right at depth 1, wrong at 2
    assert (lookup._tries[1:4], lookup._right[1:4]) == ([2, 2, 0], [2, 1, 0])
    lookup.propose(state)
    lookup.observe(state, [8])  # wrong at the first guess
    assert (lookup._tries[1:4], lookup._right[1:4]) == ([3, 2, 0], [2, 1, 0])


def _step(lookup, state, right: int) -> int:
    """One step of `lookup` on `state` (one match: a chain) whose first `right` guesses the target takes -> how many
    it guessed."""
    guesses = lookup.propose(state).tokens[1:].tolist()
    lookup.observe(state, guesses[:right] + [0])
    return len(guesses)


def test_lookups_are_as_large_as_their_expected_tokens_pay_for():
    """With the verify's cost per number of guesses, a match is guessed as far as the expected tokens per ms grow:
    short on a steep curve while guesses fail at their first token, long once whole chains are taken, and as long
    as allowed where verifying more costs nothing more."""
    state = SimpleNamespace(tokens=list(range(20)) * 2, root_token=torch.tensor(19))  # one match, 10 tokens after it
    steep = [20.0, 20.2, 21.2, 23.0, 24.5, 26.0, 27.8, 29.7, 30.9, 35.0, 37.9]  # SmolLM2 fp32 on a 2-core CPU
    assert _step(PromptLookupProposer(torch.device("cpu")), state, right=0) == 10  # no costs known: transformers' 10
    missing = PromptLookupProposer(torch.device("cpu"), chain_ms=steep)
    first = _step(missing, state, right=0)
    for _ in range(8):
        _step(missing, state, right=0)
    assert _step(missing, state, right=0) == 1 < first
    copying = PromptLookupProposer(torch.device("cpu"), chain_ms=steep)
    for _ in range(8):
        _step(copying, state, right=10)
    # as long as pays here: the 9th and 10th guesses cost more than their expected tokens on this curve
    assert _step(copying, state, right=10) == 8
    flat = PromptLookupProposer(torch.device("cpu"), chain_ms=[20.0] * 11)
    for _ in range(8):
        _step(flat, state, right=0)
    assert _step(flat, state, right=0) == 10  # a larger tree never costs more: every guess is free
    with pytest.raises(ValueError, match="chain_ms needs 11"):
        PromptLookupProposer(torch.device("cpu"), chain_ms=steep[:5])


def test_a_plan_gives_lookup_the_verify_cost_of_each_chain_length():
    plan = Plan(
        "inductor",
        "prompt_lookup",
        [],
        1.0,
        20.0,
        "test",
        latency_ms={"inductor": {"1": 20.0, "2": 19.0, "4": 23.0, "12": 39.0}},
    )
    costs = plan.chain_ms("inductor", 10)
    assert costs[:4] == [20.0, 20.0, 21.5, 23.0] and costs[10] == pytest.approx(37.0)  # never falling; linear between
    assert plan.chain_ms("eager", 10) is None  # not timed there: chains of 10


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("proposer", ["prompt_lookup", "hybrid"])
def test_greedy_identity(family, proposer):
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=True))
    taus = []
    for seed in range(3):
        torch.manual_seed(seed)
        half = torch.randint(1, 90, (1, 4 + 3 * seed))
        prompt = torch.cat([half, half, half[:, :2]], dim=1)  # a repeated prompt: lookups find matches
        out = model.generate(prompt, max_new_tokens=60, proposer=proposer, return_dict_in_generate=True)
        reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=60, do_sample=False)
        assert torch.equal(out.sequences, reference), (family, seed)
        taus.append(out.stats.mean_accepted_tokens)
    # tiny random models fall into loops, which lookups catch: the chain is verified and accepted, not just proposed
    assert max(taus) > 1.3, taus


@pytest.mark.parametrize("proposer", ["prompt_lookup", "hybrid"])
def test_sampling_runs(proposer):
    model = MedusaModel(make_tiny_model("qwen2"), make_heads(random=True))
    out = model.generate(
        torch.tensor([[5, 6, 7, 5, 6]]),
        max_new_tokens=20,
        proposer=proposer,
        do_sample=True,
        temperature=0.8,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (1, 25)
