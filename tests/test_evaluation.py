"""Head rank accuracy: exact on heads that are right by construction, equal to a slow reference loop otherwise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from medusa import MedusaConfig, MedusaHeads, MedusaModel, evaluation, head_target_offset
from medusa.evaluation import head_rank_accuracy, head_rank_accuracy_by_group, head_rank_hits
from medusa.propose import CandidateProjection
from medusa.questions import load_questions, spread
from tests.conftest import make_heads, make_tiny_model

V = 16  # one-hot world: hidden size == vocabulary size


class OneHotBase(nn.Module):
    """A 'causal LM' whose last hidden state at t is one_hot(token t), with an identity lm_head."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(V, V, bias=False)
        self.lm_head.weight.data = torch.eye(V)

    @property
    def device(self):
        return torch.device("cpu")

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, output_hidden_states=True):
        hidden = nn.functional.one_hot(input_ids, V).float()
        return SimpleNamespace(hidden_states=(hidden,), logits=self.lm_head(hidden))


def counting_heads(num_heads: int) -> MedusaHeads:
    """Heads that know the sequence counts up mod V: head k maps token x to x + head_target_offset(k)."""
    heads = MedusaHeads(MedusaConfig(hidden_size=V, vocab_size=V, num_heads=num_heads, projection="own"))
    for k, proj in enumerate(heads.projections):  # blocks stay zero: the identity
        proj.weight.data = torch.roll(torch.eye(V), shifts=head_target_offset(k), dims=0)
    return heads


def counting_sequence(prompt_len: int, total: int) -> torch.Tensor:
    """Junk prompt tokens, except the last one, which starts the counting run the response continues."""
    ids = (torch.arange(total) + 3) % V
    ids[: prompt_len - 1] = torch.tensor([7, 7, 1, 12, 0, 9, 9, 4][: prompt_len - 1])  # break the pattern
    return ids


def test_heads_right_by_construction_score_one_at_rank_zero():
    model = SimpleNamespace(base=OneHotBase(), heads=counting_heads(3))
    prompt_len, total = 6, 30
    result = head_rank_hits(model, counting_sequence(prompt_len, total), response_start=prompt_len, ranks=4, chunk=5)
    # head k is scored from the last prompt position t = prompt_len - 1 while t + offset(k) < total
    expected_counts = [total - head_target_offset(k) - (prompt_len - 1) for k in range(3)]
    assert result.counts.tolist() == expected_counts
    assert torch.equal(result.acc[:, 0], torch.ones(3, dtype=torch.double))
    assert torch.equal(result.acc[:, 1:], torch.zeros(3, 3, dtype=torch.double))
    assert torch.equal(result.top(3), torch.ones(3, dtype=torch.double))


def test_prompt_positions_and_a_wrong_offset_are_not_rewarded():
    """Scoring prompt sources, or predicting one token too near, would break the perfect score."""
    model = SimpleNamespace(base=OneHotBase(), heads=counting_heads(2))
    ids = counting_sequence(6, 24)
    assert head_rank_hits(model, ids, response_start=6).acc[:, 0].tolist() == [1.0, 1.0]
    assert head_rank_hits(model, ids, response_start=2).acc[:, 0].max() < 1.0  # junk prompt sources count now
    shifted = counting_heads(2)
    for k, proj in enumerate(shifted.projections):
        proj.weight.data = torch.roll(torch.eye(V), shifts=head_target_offset(k) - 1, dims=0)  # the base's offset
    assert head_rank_hits(SimpleNamespace(base=OneHotBase(), heads=shifted), ids, 6).hits[:, 0].sum() == 0


def test_accuracy_given_prefix_counts_only_positions_where_the_heads_before_were_right():
    """Counting heads on a sequence that jumps every 5 tokens: head k at t is right unless a jump lies in
    (t, t + offset(k)], so right heads cluster, and the conditional share exceeds the marginal one."""
    model = SimpleNamespace(base=OneHotBase(), heads=counting_heads(3))
    total, start = 40, 6
    ids, jumps = counting_sequence(start, total), set(range(10, total, 5))
    for j in sorted(jumps):
        ids[j:] = (ids[j:] + 7) % V  # from j on the run continues, shifted: the token at j is not ids[j-1] + 1
    got = head_rank_hits(model, ids, response_start=start, ranks=2)
    right = {
        (k, t): not jumps & set(range(t + 1, t + head_target_offset(k) + 1))
        for k in range(3)
        for t in range(start - 1, total - head_target_offset(k))
    }
    for k in range(3):
        scored = [t for t in range(start - 1, total - head_target_offset(k))]
        reached = [t for t in scored if all(right[j, t] for j in range(k))]
        assert int(got.prefix_counts[k]) == len(reached)
        assert int(got.prefix_hits[k, 0]) == sum(right[k, t] for t in reached)
        assert int(got.hits[k, 0]) == sum(right[k, t] for t in scored)
    assert torch.equal(got.acc_given_prefix[0], got.acc[0])
    assert got.acc_given_prefix[2, 0] > got.acc[2, 0]  # right heads cluster: not vacuous
    assert got.chain[0] == got.acc[0, 0] and 0 < got.chain[2] < got.chain[1] < got.chain[0]


def reference_hits(model, ids: torch.Tensor, response_start: int, ranks: int, edges: tuple[float, ...]):
    """One position and one head at a time, counting the candidates the head prefers to the emitted token; top-1
    hits and counts also by the bin (`edges`) of the base's probability of that token where it emitted it."""
    num_heads = model.heads.config.num_heads
    # in float, as evaluation scores the heads (decoding on a CPU proposes on int8 weights)
    projection = CandidateProjection.build(model.heads, model.base.get_output_embeddings(), model.projection_dtype)
    hits, counts = torch.zeros(num_heads, ranks, dtype=torch.long), torch.zeros(num_heads, dtype=torch.long)
    bin_hits = torch.zeros(num_heads, len(edges) + 1, dtype=torch.long)
    bin_counts = torch.zeros_like(bin_hits)
    candidates = projection.token(torch.arange(projection.weight.shape[-2])).tolist()
    with torch.no_grad():
        out = model.base(ids[None], output_hidden_states=True)
        hidden, probs = out.hidden_states[-1][0], out.logits[0].double().softmax(-1)
        for t in range(max(response_start - 1, 0), len(ids)):
            logits = projection.logits(model.heads.head_hidden(hidden[t]))  # (K, V') as the proposer sees them
            for k in range(num_heads):
                j = t + head_target_offset(k)
                if j >= len(ids):
                    continue
                counts[k] += 1
                b = sum(float(probs[j - 1, ids[j]]) >= edge for edge in edges)
                bin_counts[k, b] += 1
                if int(ids[j]) not in candidates:  # outside the candidate subset: never a hit
                    continue
                rank = int((logits[k] > logits[k, candidates.index(int(ids[j]))]).sum())
                if rank < ranks:
                    hits[k, rank] += 1
                bin_hits[k, b] += rank == 0
    return hits, counts, bin_hits, bin_counts


@pytest.mark.parametrize("projection, subset", [("shared", False), ("own", False), ("shared", True), ("own", True)])
def test_matches_slow_reference_on_a_tiny_model(projection, subset, monkeypatch):
    edges = (0.009, 0.0104, 0.012, 0.015)  # a random base gives every token ~1/96: bins around it, so all get used
    monkeypatch.setattr(evaluation, "CONFIDENCE_EDGES", edges)
    heads = make_heads(4, random=True, projection=projection)
    if subset:  # candidates only from 40 of the 96 tokens
        heads.set_vocab_subset(torch.randperm(96, generator=torch.Generator().manual_seed(2))[:40])
    model = MedusaModel(make_tiny_model("llama"), heads, tokenizer=object(), projection_dtype=torch.float32)
    torch.manual_seed(5)
    sequences = [torch.randint(0, 96, (n,)) for n in (40, 9, 3)]
    starts = [12, 8, 3]  # the last has no scorable position at all
    got = head_rank_accuracy(model, sequences, starts, ranks=6)
    want = None
    for ids, start in zip(sequences, starts):
        one = reference_hits(model, ids, start, 6, edges)
        want = one if want is None else tuple(a + b for a, b in zip(want, one))
    want_hits, want_counts, want_bin_hits, want_bin_counts = want
    assert torch.equal(got.counts, want_counts) and torch.equal(got.hits, want_hits)
    assert torch.equal(got.confidence_counts, want_bin_counts) and torch.equal(got.confidence_hits, want_bin_hits)
    assert torch.equal(got.confidence_counts.sum(1), got.counts) and (got.confidence_counts > 0).sum() >= 8
    torch.testing.assert_close(got.confidence_share.sum(1), torch.ones(4, dtype=torch.double))
    assert got.hits.sum() > 0  # random heads still hit sometimes: the comparison is not vacuous
    assert torch.all(got.acc.sum(1) <= 1)


def test_accuracy_by_group_splits_the_pooled_counts():
    """Per-category accuracy (`medusa accuracy`'s by_category): each group equals scoring its sequences alone,
    and the groups add up to the pooled result."""
    model = MedusaModel(
        make_tiny_model("qwen2"), make_heads(3, random=True), tokenizer=object(), projection_dtype=torch.float32
    )
    torch.manual_seed(7)
    sequences = [torch.randint(0, 96, (n,)) for n in (30, 25, 18, 22)]
    starts, groups = [10, 6, 4, 12], ["writing", "math", "writing", "coding"]
    total, by_group = head_rank_accuracy_by_group(model, sequences, starts, groups, ranks=4)
    pooled = head_rank_accuracy(model, sequences, starts, ranks=4)
    assert torch.equal(total.hits, pooled.hits) and torch.equal(total.counts, pooled.counts)
    assert sorted(by_group) == ["coding", "math", "writing"]
    writing = head_rank_accuracy(model, [sequences[0], sequences[2]], [starts[0], starts[2]], ranks=4)
    assert torch.equal(by_group["writing"].hits, writing.hits)
    assert torch.equal(by_group["writing"].counts, writing.counts)
    assert not torch.equal(by_group["math"].counts, by_group["coding"].counts)  # groups hold different positions
    with pytest.raises(ValueError, match="group labels"):
        head_rank_accuracy_by_group(model, sequences, starts, groups[:2])
    with pytest.raises(ValueError, match="4 sequences but 3 response starts"):
        head_rank_accuracy_by_group(model, sequences, starts[:3], groups)


def test_bad_arguments_are_named():
    model = SimpleNamespace(base=OneHotBase(), heads=counting_heads(1))
    with pytest.raises(ValueError, match="ranks must lie in"):
        head_rank_hits(model, torch.arange(8), 2, ranks=V + 1)
    with pytest.raises(ValueError, match="response_start 9 lies outside"):
        head_rank_hits(model, torch.arange(8), 9)
    with pytest.raises(ValueError, match="2 sequences but 1 response starts"):
        head_rank_accuracy(model, [torch.arange(8)] * 2, [1])


def test_questions_load_and_spread_over_categories(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i // 3], "turns": [f"q{i}", "follow-up"]} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    questions = load_questions(path)
    assert [q["turns"][0] for q in questions] == [f"q{i}" for i in range(6)]
    assert [q["category"] for q in spread(questions, 2)] == ["a", "b"]
    assert spread(questions, None) == questions and spread(questions, 10) == questions
    instruction = {"id": "task_0", "instruction": "Rewrite it.", "instances": [{"input": "A text.", "output": "-"}]}
    path.write_text(json.dumps(instruction) + "\n")  # self-instruct's layout: its prompt is the one turn
    assert load_questions(path) == [{"question_id": "task_0", "category": None, "turns": ["Rewrite it.\n\nA text."]}]
    path.write_text('{"question_id": 1, "category": "x"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1: expected \{question_id, category, turns"):
        load_questions(path)


def test_medusa_accuracy_answers_are_the_bases_own_greedy_answers(tmp_path):
    """`medusa accuracy` scores heads on the base's answers, decoded by the model's batched generate (its random
    heads never guessing): each equal to transformers' greedy generate of that question alone, and generate called
    once per batch of questions."""
    from medusa.answers import stop_and_pad_ids
    from medusa.cli.accuracy import answer_questions
    from tests.conftest import save_tiny_checkpoint

    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir, plan="off")
    questions = [{"question_id": i, "category": "c", "turns": ["word " * (1 + 3 * i)]} for i in range(5)]
    calls = []
    original = model.generate
    model.generate = lambda *args, **kwargs: (
        calls.append((kwargs["input_ids"].shape[0], kwargs["proposer"])) or original(*args, **kwargs)
    )
    sequences, starts, answered = answer_questions(model, questions, max_new_tokens=10, batch_size=2)
    assert (
        calls == [(2, "plain"), (2, "plain"), (1, "plain")] and answered == questions
    )  # (the questions come in order of length)
    eos_ids, _ = stop_and_pad_ids(model.base, model.tokenizer)
    for sequence, start in zip(sequences, starts):
        prompt = torch.tensor([sequence[:start]])
        alone = model.base.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=eos_ids or None)
        expected = alone[0, start:].tolist()
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos_ids), len(expected))
        assert sequence[start:] == expected[:cut]
