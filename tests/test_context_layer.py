"""Heads with a context layer (heads.context_window): attention over recent positions before the heads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from medusa import MedusaConfig, MedusaHeads, MedusaModel
from medusa.decode import prefill
from medusa.evaluation import head_rank_hits
from medusa.heads import ContextLayer, head_target_offset
from medusa.propose import build_medusa_proposer
from medusa.runtime import base_features
from medusa.sampling import SamplingConfig
from medusa.train.batches import Conversation
from medusa.train.hidden_cache import HiddenCache, cache_lookback, span_start
from medusa.train.losses import medusa_heads_loss
from medusa.tree import TreeSpec, build_buffers
from tests.conftest import CONTEXT_WINDOW as WINDOW
from tests.conftest import FAMILIES, HIDDEN, VOCAB, context_heads, make_tiny_model


def test_fresh_context_layer_is_the_identity_and_needs_the_next_token():
    layer = ContextLayer(HIDDEN, WINDOW)
    hidden = torch.randn(2, 7, HIDDEN)
    features, _ = layer(hidden, torch.randn(2, 7, HIDDEN))
    torch.testing.assert_close(features, hidden)
    heads = MedusaHeads(
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, condition_on_next_token=True, context_window=WINDOW)
    )
    with pytest.raises(ValueError, match="next_embedding"):
        heads.contextualise(hidden, None)
    with pytest.raises(ValueError, match="needs condition_on_next_token"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, context_window=4)
    with pytest.raises(ValueError, match="context_window"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, condition_on_next_token=True, context_window=-1)


def test_feature_layers_start_as_the_plain_context_layer_and_are_checked():
    """heads.feature_layers (EAGLE-3's fused features): a fresh feature map adds nothing, a trained one does; wrong
    widths, configs and layer indices are named errors."""
    torch.manual_seed(0)
    plain, fused = ContextLayer(HIDDEN, WINDOW), ContextLayer(HIDDEN, WINDOW, feature_layers=2)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    assert set(fused.load_state_dict(plain.state_dict(), strict=False).missing_keys) == {
        "feature_map.weight",
        "feature_norm_weight",
    }
    hidden, extra, following = torch.randn(1, 9, HIDDEN), 5 * torch.randn(1, 9, 2 * HIDDEN), torch.randn(1, 9, HIDDEN)
    both = torch.cat([hidden, extra], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(fused(both, following)[0], plain(hidden, following)[0])
        torch.nn.init.normal_(fused.feature_map.weight, std=0.05)
        assert (fused(both, following)[0] - plain(hidden, following)[0]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="base_features"):
        fused(hidden, following)
    with pytest.raises(ValueError, match="needs context_window"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, condition_on_next_token=True, feature_layers=[1])
    for bad in ([1, 1], [-1], "1"):
        with pytest.raises(ValueError, match="distinct layer indices"):
            MedusaConfig(
                hidden_size=HIDDEN, vocab_size=VOCAB, condition_on_next_token=True, context_window=4, feature_layers=bad
            )
    states = tuple(torch.randn(1, 3, HIDDEN) for _ in range(3))  # embeddings, layer 1, layer 2 (post-norm)
    assert base_features(states) is states[-1]
    assert torch.equal(base_features(states, [1, 0]), torch.cat([states[2], states[1], states[0]], dim=-1))
    with pytest.raises(ValueError, match="has 2 layers"):
        base_features(states, [2])
    with pytest.raises(ValueError, match="has 2 layers"):
        MedusaModel(make_tiny_model("llama"), context_heads(feature_layers=[0, 2]))


def test_incremental_context_equals_one_pass_and_sees_only_its_window():
    layer = context_heads().context
    hidden, following = torch.randn(1, 16, HIDDEN), torch.randn(1, 16, HIDDEN)
    with torch.no_grad():
        whole, _ = layer(hidden, following)
        past, pieces = None, []
        for start, end in ((0, 6), (6, 7), (7, 11), (11, 16)):  # prefill, then steps of 1..5 committed tokens
            out, past = layer(hidden[:, start:end], following[:, start:end], past)
            pieces.append(out)
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-4, atol=1e-4)
        assert past[0].shape[2] == WINDOW - 1 and past[2] == 16  # only what a later position can see is kept
        # position 15 sees positions 11..15: what lies before does not change it, and position 11 changes it
        changed = hidden.clone()
        changed[:, :11] = torch.randn(1, 11, HIDDEN)
        torch.testing.assert_close(layer(changed, following)[0][:, 15], whole[:, 15])
        changed[:, 11] = torch.randn(HIDDEN)
        assert (layer(changed, following)[0][:, 15] - whole[:, 15]).abs().max() > 1e-3


def test_cached_spans_hold_the_whole_window():
    """Training on cached spans computes the loss of the whole conversations; one position less of lookback does not."""
    torch.manual_seed(0)
    base, heads = make_tiny_model("llama"), context_heads()
    convs = [Conversation(torch.randint(2, VOCAB, (n,)).tolist(), start) for n, start in ((30, 12), (26, 9), (22, 15))]
    embed, lm_head = base.get_input_embeddings(), base.get_output_embeddings()

    def loss(hidden, ids, mask):
        return medusa_heads_loss(heads, hidden, ids, mask, lm_head, embed_tokens=embed).ce

    with torch.no_grad():
        full = [base(torch.tensor([c.ids]), output_hidden_states=True).hidden_states[-1][0] for c in convs]
        width = max(len(c.ids) for c in convs)
        ids = torch.zeros(len(convs), width, dtype=torch.long)
        mask, hidden = torch.zeros_like(ids), torch.zeros(len(convs), width, HIDDEN)
        for j, (c, h) in enumerate(zip(convs, full)):
            ids[j, : len(c.ids)], mask[j, c.response_start : len(c.ids)] = torch.tensor(c.ids), 1
            hidden[j, : len(c.ids)] = h.to(torch.bfloat16).float()  # what the cache stores
        expected = loss(hidden, ids, mask)
        lookback = cache_lookback(heads.config)
        assert lookback == head_target_offset(2) + WINDOW - 1
        for back, same in ((lookback, True), (lookback - 1, False)):
            spans = {r: h[span_start(c, back) :].to(torch.bfloat16) for r, (c, h) in enumerate(zip(convs, full))}
            batch = HiddenCache.assemble(convs, spans, back).batch(list(range(len(convs))))
            got = loss(batch["hidden"].float(), batch["input_ids"], batch["loss_mask"])
            assert torch.allclose(got, expected, atol=1e-5) == same, (back, got, expected)


@pytest.mark.parametrize("layers", [[], [0, 1]], ids=["last", "fused"])
def test_proposer_reads_what_evaluation_scores(layers):
    """The decode-time read (context layer fed step by step) equals the whole-sequence features head_rank_hits uses
    (both in float: on a CPU decoding proposes on int8 weights, medusa.runtime.int8_copy)."""
    torch.manual_seed(0)
    model = MedusaModel(
        make_tiny_model("qwen2"), context_heads(path=False, feature_layers=layers), tree=[[0], [0, 0], [0, 0, 0]]
    )
    model.proposal_heads = model.heads
    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(model.tree), 3))
    ids = torch.randint(2, VOCAB, (20,))
    embed = model.base.get_input_embeddings()
    with torch.no_grad():
        hidden = base_features(model.base(ids[None], output_hidden_states=True).hidden_states, layers)[0]
        assert hidden.shape[-1] == HIDDEN * (1 + len(layers))
        # what decoding carries: prefill's hidden states are these features
        torch.testing.assert_close(
            prefill(model.base, ids[None, :8], SamplingConfig(), feature_layers=layers).new_hidden, hidden[:8]
        )
        following = torch.cat([ids[1:], ids.new_zeros(1)])
        whole = model.heads.contextualise(hidden[None], embed(following)[None])[0][0]
        start = 0
        for end in (8, 9, 12, 14, 19):  # prefill 8 positions, then steps that commit 1, 3, 2, 5
            state = SimpleNamespace(
                new_hidden=hidden[start:end], length=end, tokens=ids[: end + 1].tolist(), last_hidden=hidden[end - 1]
            )
            torch.testing.assert_close(proposer.read(state), whole[end - 1])
            torch.testing.assert_close(proposer.read(state), whole[end - 1])  # a second read of one step: no change
            start = end
        with pytest.raises(RuntimeError, match="once per step"):
            proposer.read(SimpleNamespace(new_hidden=hidden[:2], length=40, tokens=ids.tolist(), last_hidden=hidden[1]))
        # steps without guesses (the guard's plain steps) only keep their positions; the next read takes them all
        proposer = build_medusa_proposer(model, build_buffers(TreeSpec(model.tree), 3))
        calls = []
        contextualise = proposer.heads.contextualise
        proposer.heads.contextualise = lambda hidden, *rest: (
            calls.append(hidden.shape[1]) or contextualise(hidden, *rest)
        )
        start = 0
        for end, guessing in ((8, True), (9, False), (12, False), (14, True), (19, True)):
            state = SimpleNamespace(
                new_hidden=hidden[start:end], length=end, tokens=ids[: end + 1].tolist(), last_hidden=hidden[end - 1]
            )
            if guessing:
                torch.testing.assert_close(proposer.read(state), whole[end - 1])
            else:
                proposer.skip(state)
            start = end
        # the prompt's 8 positions; the two skipped steps' 4 with the next step's 2; 5: each the last WINDOW of them,
        # all that reaches the output read and the keys kept (the reads above equal the whole sequence's)
        assert calls == [WINDOW, WINDOW, 5]
    # head_rank_hits scores the heads on those features: head 0 at position t reads whole[t] and ids[t + 1]
    got = head_rank_hits(model, ids, response_start=6, ranks=1)
    with torch.no_grad():
        rows = torch.arange(5, 20 - head_target_offset(0))
        logits = model.candidate_projection.head_logits(0, model.heads.run_head(0, whole[rows], embed(ids[rows + 1])))
        hits = (model.candidate_projection.token(logits.argmax(-1)) == ids[rows + head_target_offset(0)]).sum()
    assert int(got.hits[0, 0]) == int(hits) and int(got.counts[0]) == len(rows)


@pytest.mark.parametrize("layers", [[], [0, 1]], ids=["last", "fused"])
def test_a_batchs_rows_read_together_what_each_reads_alone(layers):
    """read_batch: rows that committed different numbers of positions (a prompt longer than the window, steps of 1
    to 5) read them in one call of the context layer, right-aligned, and each gets what its whole sequence gives."""
    torch.manual_seed(0)
    model = MedusaModel(make_tiny_model("llama"), context_heads(feature_layers=layers), tree=[[0], [0, 0]])
    model.proposal_heads = model.heads
    proposers = [build_medusa_proposer(model, build_buffers(TreeSpec(model.tree), 2)) for _ in range(3)]
    schedules = [[3, 1, 4, 1], [WINDOW + 5, 2, 1, 3], [9, 5, 5, 2]]  # positions each row commits, step by step
    embed, rows = model.base.get_input_embeddings(), []
    with torch.no_grad():
        for schedule in schedules:
            ids = torch.randint(2, VOCAB, (sum(schedule) + 1,))
            hidden = base_features(model.base(ids[None], output_hidden_states=True).hidden_states, layers)[0]
            whole = model.heads.contextualise(hidden[None, :-1], embed(ids[1:])[None])[0][0]
            rows.append((ids, hidden, whole))
        calls = []
        context_read = proposers[0].modules.context_read
        proposers[0].modules.context_read.forward = lambda *inputs: (
            calls.append(inputs[0].shape) or type(context_read).forward(context_read, *inputs)
        )
        for step in range(4):
            states = []
            for schedule, (ids, hidden, _) in zip(schedules, rows):
                start, end = sum(schedule[:step]), sum(schedule[: step + 1])
                states.append(
                    SimpleNamespace(
                        new_hidden=hidden[start:end], length=end, tokens=ids[: end + 1].tolist(), last_hidden=None
                    )
                )
            for _ in range(2):  # a second read of one step changes nothing
                reads = proposers[0].read_batch(proposers, states)
                for read, state, (_, _, whole) in zip(reads, states, rows):
                    torch.testing.assert_close(read, whole[state.length - 1], rtol=1e-4, atol=1e-4)
    # one call a step, as wide as its most positions (a prompt's last WINDOW)
    assert calls == [(3, WINDOW, HIDDEN * (1 + len(layers))), (3, 5, HIDDEN * (1 + len(layers)))] + [
        (3, max(s[step] for s in schedules), HIDDEN * (1 + len(layers))) for step in (2, 3)
    ]


@pytest.mark.parametrize("layers", [[], [0, 1]], ids=["last", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_context_heads_keep_greedy_identity_and_round_trip(tmp_path, family, layers):
    model = MedusaModel(
        make_tiny_model(family),
        context_heads(feature_layers=layers),
        tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    )
    prompt = torch.tensor([[5, 17, 33, 2, 8, 41, 9, 60]])
    expected = model.base.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30)
    for proposer in ("medusa", "dynamic", "hybrid"):
        out = model.generate(prompt, max_new_tokens=30, proposer=proposer)
        assert torch.equal(out, expected), (family, proposer)
    model.save_pretrained(tmp_path / "heads", dtype=torch.bfloat16)
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base=model.base)
    assert loaded.config.context_window == WINDOW and loaded.config.feature_layers == layers
    for name, value in model.heads.state_dict().items():
        torch.testing.assert_close(loaded.heads.state_dict()[name], value.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=30), expected)
