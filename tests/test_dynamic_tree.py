"""The dynamic tree proposer: its choice of paths per step, greedy identity."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from medusa import MedusaModel
from medusa.dynamic_tree import DynamicTreeProposer
from medusa.proposers import get_proposer
from medusa.tree import TreeSpec, build_buffers, chain
from tests.conftest import FAMILIES, make_heads, make_tiny_model


class FixedHeads:
    """Stands in for a MedusaProposer: fixed head logits (D, V), candidate index = token id."""

    by_path = False  # every head reads only the root

    def __init__(self, logits):
        self.logits = logits
        self.projection = SimpleNamespace(token=lambda index: index)

    def read_batch(self, proposers, states):
        return [state.last_hidden for state in states]

    def step_copies(self, state):
        return []  # no copy guesses (tests/test_copy.py covers them)

    def skip(self, state):
        pass  # no context layer to leave positions for

    def head_logits(self, hidden, next_token, num_heads=None):
        return self.logits[:num_heads]


def _state(root=0):
    return SimpleNamespace(root_token=torch.tensor(root), last_hidden=torch.zeros(4))


def _token_paths(candidates) -> list[tuple[int, ...]]:
    """Each non-root node's tokens from the root's child down to it."""
    tokens, parent = candidates.tokens.tolist(), candidates.tree.parent.tolist()
    paths = []
    for i in range(1, len(tokens)):
        path, node = [], i
        while node:
            path.append(tokens[node])
            node = parent[node]
        paths.append(tuple(reversed(path)))
    return paths


def _check_tree(candidates, root):
    tree = candidates.tree
    parent, depth, tokens = tree.parent.tolist(), tree.depth.tolist(), candidates.tokens.tolist()
    assert tokens[0] == root and parent[0] == 0 and depth[0] == 0
    for i in range(1, tree.num_nodes):
        assert parent[i] < i and depth[i] == depth[parent[i]] + 1
    siblings = {}
    for i in range(1, tree.num_nodes):
        siblings.setdefault(parent[i], []).append(tokens[i])
    assert all(len(s) == len(set(s)) for s in siblings.values()), "siblings must be distinct guesses"


@pytest.mark.parametrize("topk", [7, 3])
def test_dynamic_tree_keeps_the_most_probable_paths(topk):
    torch.manual_seed(0)
    depth, vocab, num_nodes = 3, 7, 13
    logits = torch.randn(depth, vocab) * 2
    proposer = DynamicTreeProposer(FixedHeads(logits), num_nodes=num_nodes, depth=depth, topk=topk)
    candidates = proposer.propose(_state(root=5))
    _check_tree(candidates, root=5)
    assert candidates.tree.num_nodes == num_nodes

    logp = logits.log_softmax(-1)
    allowed = [logp[d].topk(topk).indices.tolist() for d in range(depth)]
    scored = {
        p: sum(logp[d, t].item() for d, t in enumerate(p))
        for n in range(1, depth + 1)
        for p in itertools.product(*allowed[:n])
    }
    best = sorted(scored, key=scored.get, reverse=True)[: num_nodes - 1]
    assert set(_token_paths(candidates)) == set(best)
    # siblings come most probable first (acceptance rules walk them in node order)
    tokens, parent, depths = (
        candidates.tokens.tolist(),
        candidates.tree.parent.tolist(),
        candidates.tree.depth.tolist(),
    )
    for p in set(parent[1:]):
        probs = [logp[depths[i] - 1, tokens[i]].item() for i in range(1, len(tokens)) if parent[i] == p]
        assert probs == sorted(probs, reverse=True)


class PathHeads(FixedHeads):
    """Path-dependent head logits: a fixed pseudo-random function of (head, path), coarse so that scores tie; counts
    the rows each head is run on."""

    by_path = True

    def __init__(self, vocab, coarse):
        super().__init__(None)
        self.vocab, self.coarse, self.rows = vocab, coarse, []

    def path_logits(self, hidden, root, head, paths):
        self.rows.append(paths.shape[0])
        out = []
        for path in paths.tolist():
            generator = torch.Generator().manual_seed(hash((head, *path)) % 2**31)
            logits = torch.randn(self.vocab, generator=generator) * 3
            out.append(logits.round() if self.coarse else logits)
        return torch.stack(out)


@pytest.mark.parametrize("coarse", [False, True])
@pytest.mark.parametrize("num_nodes", [2, 4, 9, 17])
def test_dynamic_tree_pruning_changes_no_proposal(monkeypatch, num_nodes, coarse):
    """Skipping the nodes that cannot reach the final cut gives the very tree the full search gives, on fewer head
    rows (a 2-node tree runs one head, not four)."""
    import medusa.dynamic_tree as dynamic_tree

    proposals, rows = [], []
    for prune in (True, False):
        if not prune:
            monkeypatch.setattr(dynamic_tree, "surviving_parents", lambda beam, levels, budget: len(beam))
        heads = PathHeads(vocab=12, coarse=coarse)
        candidates = DynamicTreeProposer(heads, num_nodes=num_nodes, depth=4, topk=5).propose(_state(root=3))
        _check_tree(candidates, root=3)
        proposals.append((candidates.tokens.tolist(), candidates.tree.parent.tolist()))
        rows.append(sum(heads.rows))
    assert proposals[0] == proposals[1]
    assert rows[0] <= rows[1]
    if num_nodes == 2:
        assert rows == [1, 4]


def test_dynamic_tree_confident_heads_grow_a_deep_chain():
    logits = torch.full((4, 10), -10.0)
    for d in range(4):
        logits[d, d + 1] = 10.0  # head d is sure of token d + 1
    candidates = DynamicTreeProposer(FixedHeads(logits), num_nodes=5, depth=4).propose(_state())
    assert candidates.tokens.tolist() == [0, 1, 2, 3, 4]
    assert candidates.tree.max_depth == 4


def test_dynamic_tree_ties_keep_every_parent():
    """All paths of one depth score the same: cuts through ties must still keep each node's parent."""
    candidates = DynamicTreeProposer(FixedHeads(torch.zeros(3, 5)), num_nodes=10, depth=3, topk=4).propose(_state())
    _check_tree(candidates, root=0)
    assert candidates.tree.num_nodes == 10


def test_dynamic_tree_degenerate_sizes():
    heads = FixedHeads(torch.randn(2, 6))
    only_root = DynamicTreeProposer(heads, num_nodes=1, depth=2).propose(_state(3))
    assert only_root.tokens.tolist() == [3] and only_root.tree.num_nodes == 1
    with pytest.raises(ValueError, match="num_nodes >= 1"):
        DynamicTreeProposer(heads, num_nodes=0, depth=2)


def test_dynamic_proposer_takes_the_static_tree_size():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True), tree=[[0], [1], [0, 0]])
    tree = build_buffers(TreeSpec(model.tree), model.config.num_heads)
    proposer = get_proposer("dynamic")(model, tree)
    assert proposer.num_nodes == 4 and proposer.depth == model.config.num_heads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("random_heads", [False, True], ids=["untrained", "random"])
def test_dynamic_greedy_identity(family, random_heads):
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=random_heads))
    for seed, tree in zip(range(3), [None, chain(2), [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0]]]):
        torch.manual_seed(seed)
        prompt = torch.randint(1, 90, (1, 5 + 4 * seed))
        out = model.generate(prompt, max_new_tokens=40, proposer="dynamic", tree=tree, return_dict_in_generate=True)
        reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
        assert torch.equal(out.sequences, reference), (family, seed)
        assert 1 + sum(out.stats.accepted_lengths) >= 40  # prefill's token + every step's; the last may overshoot


def test_dynamic_sampling_runs():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True))
    out = model.generate(
        torch.tensor([[5, 6, 7]]),
        max_new_tokens=20,
        proposer="dynamic",
        do_sample=True,
        temperature=0.8,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (1, 23)
