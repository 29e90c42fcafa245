"""Path heads (Hydra's sequential heads): head k also reads the k tokens of its path after the root."""

from __future__ import annotations

import pytest
import torch

from medusa import MedusaModel
from medusa.config import MedusaConfig
from medusa.dynamic_tree import DynamicTreeProposer
from medusa.evaluation import head_rank_hits
from medusa.heads import following_tokens, head_target_offset
from medusa.heads_io import export_heads
from medusa.propose import build_medusa_proposer
from medusa.tree import TreeSpec, build_buffers, chain
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_heads, make_tiny_model


class State:
    def __init__(self, hidden, root):
        self.last_hidden, self.root_token = hidden, torch.tensor(root)


def test_fresh_path_heads_equal_root_heads_and_need_the_path():
    root_only = make_heads(num_heads=3, random=True, condition_on_next_token=True)
    path = make_heads(num_heads=3, condition_on_path=True)
    path.load_state_dict(root_only.state_dict(), strict=False)  # the path maps start at zero
    hidden, root, rest = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN), torch.randn(5, 2, HIDDEN)
    torch.testing.assert_close(path.head_hidden(hidden, root, rest), root_only.head_hidden(hidden, root))
    torch.testing.assert_close(path.run_head(0, hidden, root), root_only.run_head(0, hidden, root))  # head 0: no path
    with pytest.raises(ValueError, match="path_embeddings"):
        path.run_head(2, hidden, root, rest[:, :1])
    torch.nn.init.normal_(path.path_token_maps[2][1].weight, std=0.3)  # head 2 now reads the 2nd path token
    moved = path.head_hidden(hidden, root, rest) - root_only.head_hidden(hidden, root)
    assert moved[:2].abs().max() == 0 and moved[2].abs().max() > 0.1
    with pytest.raises(ValueError, match="needs condition_on_next_token"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, condition_on_path=True)


def test_following_tokens():
    ids = torch.tensor([[1, 2, 3, 4]])
    assert following_tokens(ids, 2).tolist() == [[[2, 3], [3, 4], [4, 0], [0, 0]]]


def path_model(family="llama", tree=None, seed=1):
    heads = make_heads(num_heads=3, random=True, condition_on_path=True, seed=seed)
    return MedusaModel(make_tiny_model(family), heads, tree=tree or [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def test_static_tree_children_come_from_their_own_path():
    model = path_model()
    with torch.no_grad():  # make the path matter, so that siblings' children differ
        for maps in model.heads.path_token_maps:
            for linear in maps:
                linear.weight.mul_(10)
    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(model.tree), 3))
    embed, heads = model.base.get_input_embeddings(), model.heads
    hidden, root = torch.randn(HIDDEN), 7
    tokens = proposer.propose(State(hidden, root)).tokens.tolist()
    paths = [list(p) for p in TreeSpec([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]).paths]  # node order
    with torch.no_grad():
        for i, path in enumerate(paths, start=1):  # node i: rank path[-1] of head len(path)-1 after its parent's path
            parent_tokens = [tokens[1 + paths.index(path[:j])] for j in range(1, len(path))]
            k = len(path) - 1
            x = heads.run_head(
                k, hidden, embed(torch.tensor(root)), embed(torch.tensor(parent_tokens, dtype=torch.long))
            )
            ranked = model.candidate_projection.head_logits(k, x[None])[0].topk(path[-1] + 1).indices.tolist()
            assert tokens[i] == ranked[path[-1]], (i, path)
    # Siblings' children differ: [0, 0] and [1, 0] are both rank 0 of head 1, after different parents.
    assert tokens[0] == root and tokens[3] != tokens[5]


def test_dynamic_tree_keeps_the_best_paths_of_the_conditional_heads():
    model = path_model()
    heads_only = build_medusa_proposer(model, build_buffers(TreeSpec(chain(3)), 3))
    topk, budget = 3, 7
    dynamic = DynamicTreeProposer(heads_only, num_nodes=budget + 1, depth=3, topk=topk)
    hidden, root = torch.randn(HIDDEN), 11
    got = dynamic.propose(State(hidden, root))
    parent, tokens = got.tree.parent.tolist(), got.tokens.tolist()

    def path_of(i):
        return () if i == 0 else path_of(parent[i]) + (tokens[i],)

    # Naive: score every path of top-`topk` children of each conditional head; keep the best `budget`.
    scored = {}
    with torch.no_grad():
        frontier = [((), 0.0)]
        for k in range(3):
            grown = []
            for path, score in frontier:
                logp = heads_only.path_logits(hidden, torch.tensor(root), k, torch.tensor([path], dtype=torch.long))
                logp = logp[0].float().log_softmax(-1)
                for token in logp.topk(topk).indices.tolist():
                    grown.append((path + (token,), score + float(logp[token])))
            scored.update(grown)
            frontier = grown
    best = sorted(scored, key=scored.get, reverse=True)[:budget]
    assert {path_of(i) for i in range(1, len(tokens))} == set(best)


@pytest.mark.parametrize("family", FAMILIES)
def test_path_heads_keep_greedy_identity_and_round_trip(tmp_path, family):
    model = path_model(family)
    prompt = torch.tensor([[5, 17, 33, 2, 8, 41]])
    expected = model.base.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    for proposer in ("medusa", "dynamic", "hybrid"):
        out = model.generate(prompt, max_new_tokens=24, proposer=proposer)
        assert torch.equal(out, expected), (family, proposer)
    model.save_pretrained(tmp_path / "heads")
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base=model.base)
    assert loaded.config.condition_on_path
    for name, value in model.heads.state_dict().items():
        assert torch.equal(loaded.heads.state_dict()[name], value), name
    with pytest.raises(ValueError, match="condition_on_next_token"):
        export_heads(model.heads, tmp_path / "vllm", "vllm", lm_head_weight=torch.zeros(VOCAB, HIDDEN))


def test_rank_accuracy_of_path_heads_reads_the_targets_path():
    torch.manual_seed(0)
    model = path_model("qwen2")
    base, heads = model.base, model.heads
    ids = torch.randint(2, VOCAB, (14,))
    got = head_rank_hits(model, ids, response_start=4, ranks=2)
    with torch.no_grad():
        hidden = base(ids[None], output_hidden_states=True).hidden_states[-1][0]
        embed, lm_head = base.get_input_embeddings(), base.get_output_embeddings()
        for k in range(3):
            off = head_target_offset(k)
            positions = range(3, 14 - off)
            hits = 0
            for t in positions:
                x = heads.run_head(k, hidden[t], embed(ids[t + 1]), embed(ids[t + 2 : t + k + 2]))
                hits += int(ids[t + off]) in lm_head(x).topk(2).indices.tolist()
            assert int(got.hits[k, :2].sum()) == hits and int(got.counts[k]) == len(positions)
