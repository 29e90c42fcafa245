"""Heads that also read the next token (the tree root), and the loss over the candidate vocabulary only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medusa import MedusaModel
from medusa.evaluation import head_rank_hits
from medusa.heads import head_target_offset
from medusa.heads_io import export_heads
from medusa.train.losses import medusa_heads_loss
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_heads, make_tiny_model


def test_fresh_conditioned_heads_equal_plain_heads_and_need_the_embedding():
    plain = make_heads(num_heads=3, random=True)
    conditioned = make_heads(num_heads=3, condition_on_next_token=True)
    conditioned.load_state_dict(plain.state_dict(), strict=False)  # same blocks; the next-token maps start at zero
    hidden, embedding = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    torch.testing.assert_close(conditioned.head_hidden(hidden, embedding), plain.head_hidden(hidden))
    with pytest.raises(ValueError, match="pass next_embedding"):
        conditioned.head_hidden(hidden)
    torch.nn.init.normal_(conditioned.next_token_maps[1].weight, std=0.3)  # now head 1 depends on the next token
    moved = conditioned.head_hidden(hidden, embedding) - plain.head_hidden(hidden)
    assert moved[0].abs().max() == 0 and moved[1].abs().max() > 0.1


@pytest.mark.parametrize("path", [False, True], ids=["root", "path"])
@pytest.mark.parametrize("projection", ["shared", "own"])
def test_conditioned_loss_equals_the_naive_computation(projection, path):
    torch.manual_seed(0)
    heads = make_heads(
        num_heads=3, random=True, projection=projection, condition_on_next_token=True, condition_on_path=path
    )
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden, ids = torch.randn(2, 10, HIDDEN), torch.randint(0, VOCAB, (2, 10))
    mask = torch.zeros(2, 10, dtype=torch.long)
    mask[:, 3:] = 1
    out = medusa_heads_loss(heads, hidden, ids, mask, lm_head, embed_tokens=embed, chunk_size=4)
    for k in range(3):
        off = head_target_offset(k)
        rows = [(b, t) for b in range(2) for t in range(10 - off) if mask[b, t + off]]
        ce = []
        for b, t in rows:  # head k reads the root ids[t+1] and, for path heads, the path ids[t+2 .. t+k+1]
            x = heads.run_head(k, hidden[b, t], embed(ids[b, t + 1]), embed(ids[b, t + 2 : t + k + 2]))
            logits = lm_head(x) if projection == "shared" else heads.projections[k](x)
            ce.append(F.cross_entropy(logits, ids[b, t + off]))
        torch.testing.assert_close(out.ce[k], torch.stack(ce).mean().detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="embed_tokens"):
        medusa_heads_loss(heads, hidden, ids, mask, lm_head)


def test_candidate_loss_is_a_softmax_over_the_subset_and_misses_outside_it():
    torch.manual_seed(0)
    heads = make_heads(num_heads=2, random=True)
    subset = torch.tensor([3, 5, 7, 11, 13, 17, 19, 23])
    heads.set_vocab_subset(subset)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(1, 12, HIDDEN)
    ids = subset[torch.randint(0, 8, (1, 12))]
    ids[0, 6] = 4  # one target the heads can never propose
    mask = torch.ones(1, 12, dtype=torch.long)
    out = medusa_heads_loss(heads, hidden, ids, mask, lm_head, candidates_only=True, chunk_size=3)
    full = medusa_heads_loss(heads, hidden, ids, mask, lm_head, chunk_size=3)
    for k in range(2):
        off = head_target_offset(k)
        rows = [t for t in range(12 - off) if int(ids[0, t + off]) in subset.tolist()]
        logits = heads.blocks[k](hidden[0, rows]) @ lm_head.weight[subset].T  # (n, 8): the candidates only
        targets = torch.tensor([subset.tolist().index(int(ids[0, t + off])) for t in rows])
        torch.testing.assert_close(out.ce[k], F.cross_entropy(logits, targets), atol=1e-5, rtol=1e-5)
        hits = int((logits.argmax(-1) == targets).sum())
        assert int(out.correct[k, 0]) == hits  # the out-of-subset target is a miss ...
        assert int(out.count[k]) == 12 - off == int(full.count[k])  # ... but still counts
        assert out.ce[k] < full.ce[k]  # fewer competitors than the whole vocabulary


@pytest.mark.parametrize("family", FAMILIES)
def test_conditioned_heads_keep_greedy_identity_and_round_trip(tmp_path, family):
    base = make_tiny_model(family)
    heads = make_heads(random=True, condition_on_next_token=True)
    model = MedusaModel(base, heads, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    prompt = torch.tensor([[5, 17, 33, 2, 8, 41]])
    expected = base.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    for proposer in ("medusa", "dynamic", "hybrid"):
        out = model.generate(prompt, max_new_tokens=24, proposer=proposer)
        assert torch.equal(out, expected), (family, proposer)
    model.save_pretrained(tmp_path / "heads")
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base=base)
    assert loaded.config.condition_on_next_token
    for name, value in heads.state_dict().items():
        assert torch.equal(loaded.heads.state_dict()[name], value), name


def test_the_proposer_feeds_the_root_token_to_the_heads():
    """Heads whose guesses depend only on the root: the candidates must change with it."""
    model = MedusaModel(make_tiny_model("llama"), make_heads(num_heads=2, condition_on_next_token=True), tree=[[0]])
    proposer_input = []
    proposing = model.proposal_heads  # the heads proposing runs (on CPU a copy of model.heads on int8 weights)
    original = proposing.run_head
    proposing.run_head = lambda k, hidden, embedding=None: (
        proposer_input.append(embedding) or original(k, hidden, embedding)
    )
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4)
    embed = model.base.get_input_embeddings()
    assert proposer_input and all(e is not None and e.shape == (HIDDEN,) for e in proposer_input)
    # The first proposal reads the embedding of the prefill's next token (the first generated token).
    first = model.base.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=1, do_sample=False)[0, -1]
    torch.testing.assert_close(proposer_input[0], embed(first))


def test_rank_accuracy_of_conditioned_heads_reads_the_next_token():
    torch.manual_seed(0)
    base = make_tiny_model("qwen2")
    heads = make_heads(num_heads=2, random=True, condition_on_next_token=True)
    model = MedusaModel(base, heads)
    ids = torch.randint(2, VOCAB, (14,))
    got = head_rank_hits(model, ids, response_start=4, ranks=3)
    with torch.no_grad():
        hidden = base(ids[None], output_hidden_states=True).hidden_states[-1][0]
        embed = base.get_input_embeddings()
        for k in range(2):
            off = head_target_offset(k)
            positions = range(3, 14 - off)
            hits = sum(
                int(
                    ids[t + off]
                    in heads(hidden[t], base.get_output_embeddings(), embed(ids[t + 1]))[k].topk(1).indices.tolist()
                )
                for t in positions
            )
            assert int(got.hits[k, 0]) == hits and int(got.counts[k]) == len(positions)


def test_export_refuses_conditioned_heads(tmp_path):
    heads = make_heads(num_heads=2, condition_on_next_token=True)
    for fmt in ("medusa", "vllm"):
        with pytest.raises(ValueError, match="condition_on_next_token"):
            export_heads(heads, tmp_path / fmt, fmt, lm_head_weight=torch.zeros(VOCAB, HIDDEN))
