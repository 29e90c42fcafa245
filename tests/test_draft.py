"""Classic speculative decoding with a draft model: greedy identity, the draft's cache follows the target's commits,
vocabulary checks, statistics and misuse. (Its sampling distribution is proven in test_distribution.py.)"""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import medusa.draft
from medusa import MedusaModel
from medusa.acceptance import get_rule
from medusa.decode import DecodeStats, decode
from medusa.draft import DraftModel, DraftProposer
from medusa.runtime import CompiledEngine, InductorEngine
from medusa.sampling import SamplingConfig, target_probs
from tests.conftest import VOCAB, make_heads, make_tiny_model
from tests.test_distribution import tiny_tokenizer

TOKENIZER = tiny_tokenizer(VOCAB)


def draft_model(target, draft, gamma):
    return MedusaModel.from_draft_model(
        target=target, draft=draft, num_speculative_tokens=gamma, tokenizer=TOKENIZER, draft_tokenizer=TOKENIZER
    )


def greedy_reference(base, prompt, max_new_tokens, **kwargs):
    return base.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


@pytest.mark.parametrize("family, draft_family", [("llama", "llama"), ("qwen2", "qwen2"), ("llama", "qwen2")])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_draft_output_is_plain_greedy_output(family, draft_family, gamma):
    target, draft = make_tiny_model(family), make_tiny_model(draft_family, seed=1)
    model = draft_model(target, draft, gamma)
    for seed in range(2):
        prompt = torch.randint(1, 90, (1, 4 + 5 * seed), generator=torch.Generator().manual_seed(seed))
        out = model.generate(prompt, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(out.sequences, greedy_reference(target, prompt, 40))
        assert set(out.stats.proposed_lengths) == {gamma}


def test_a_perfect_draft_is_always_accepted():
    target = make_tiny_model("llama")
    out = draft_model(target, target, 4).generate(
        torch.tensor([[5, 6, 7]]), max_new_tokens=41, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, greedy_reference(target, torch.tensor([[5, 6, 7]]), 41))
    assert out.stats.accepted_lengths == [5] * 8  # 1 (prefill) + 8 x 5 = 41
    assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_tokens == 41 / 9


def test_stop_token_inside_an_accepted_draft():
    target = make_tiny_model("qwen2")
    model = draft_model(target, target, 3)
    prompt = torch.tensor([[5, 6, 7, 8]])
    free = greedy_reference(target, prompt, 30)[0, 4:].tolist()
    for stop in dict.fromkeys(free[2:10]):
        want = greedy_reference(target, prompt, 30, eos_token_id=stop, pad_token_id=0)
        assert torch.equal(model.generate(prompt, max_new_tokens=30, eos_token_id=stop), want), stop


class CheckedDraftProposer(DraftProposer):
    """Checks every proposal against the draft run from scratch on the committed tokens (no cache)."""

    def propose(self, state):
        candidates = super().propose(state)
        sequence = list(state.tokens)
        for i, token in enumerate(candidates.tokens[1:].tolist()):
            logits = self.draft(torch.tensor([sequence])).logits[0, -1]
            want = target_probs(logits, self.sampling) if self.sampling.do_sample else None
            if want is None:
                assert token == int(logits.argmax()), (len(state.tokens), i)
            else:
                torch.testing.assert_close(candidates.draft_probs[i + 1], want, atol=1e-5, rtol=1e-4)
            sequence.append(token)
        self.checked = getattr(self, "checked", 0) + 1
        return candidates


def noisy_copy(model, sigma=0.005, seed=9):
    """A draft that mostly agrees with the target: steps see full, partial and no acceptance."""
    draft = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * sigma)
    return draft


@pytest.mark.parametrize(
    "rule, sampling",
    [
        ("greedy", SamplingConfig()),
        ("speculative", SamplingConfig(do_sample=True, temperature=0.9, top_k=20)),
        ("rejection", SamplingConfig(do_sample=True, temperature=0.02)),  # p(x) is the acceptance: peak it
        ("typical", SamplingConfig(do_sample=True, temperature=0.1)),
    ],
)
def test_draft_cache_follows_what_the_target_commits(rule, sampling):
    target = make_tiny_model("llama")
    generator = torch.Generator().manual_seed(0)
    proposer = CheckedDraftProposer(noisy_copy(target), 3, sampling, VOCAB, generator)
    out = decode(
        target,
        proposer,
        get_rule(rule),
        torch.tensor([[4, 5, 6]]),
        max_new_tokens=40,
        sampling=sampling,
        stop_ids=set(),
        generator=generator,
    )
    assert out.stats.new_tokens == 40 and proposer.checked == out.stats.steps - 1
    assert len(set(out.stats.accepted_lengths)) > 2  # rejections at several depths and full acceptances


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(do_sample=True, temperature=0.9)])
def test_draft_on_a_static_cache_follows_commits_and_grows(monkeypatch, sampling):
    """On the compiled engine the draft's cache has a fixed size: rejected rows are overwritten in place, and a full
    cache is replaced by a larger one the committed tokens are fed into again. Every proposal is still the draft's
    own run from scratch, and greedy output is the target's."""
    monkeypatch.setattr(medusa.draft, "DRAFT_CACHE_HEADROOM", 1)  # 64-row caches: the run outgrows two of them
    target = make_tiny_model("qwen2")
    draft = noisy_copy(target)
    engine = CompiledEngine(draft)
    generator = torch.Generator().manual_seed(0)
    proposer = CheckedDraftProposer(draft, 3, sampling, VOCAB, generator, engine=engine)
    rows = []
    observe = proposer.observe
    proposer.observe = lambda state, accepted: (rows.append(proposer.rows), observe(state, accepted))
    out = decode(
        target,
        proposer,
        get_rule("speculative" if sampling.do_sample else "greedy"),
        torch.tensor([[4, 5, 6]]),
        max_new_tokens=150,
        sampling=sampling,
        stop_ids=set(),
        generator=generator,
    )
    assert proposer.checked == out.stats.steps - 1 and sorted(set(rows)) == [64, 128, 192]
    if not sampling.do_sample:
        prompt = torch.tensor([[4, 5, 6]])
        assert torch.equal(out.sequences, greedy_reference(target, prompt, 150))


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_int8_self_draft_keeps_greedy_identity_and_shares_the_embedding(family):
    target = make_tiny_model(family)
    model = MedusaModel.from_draft_model(target=target, draft="int8", num_speculative_tokens=3, tokenizer=TOKENIZER)
    assert model.draft.get_input_embeddings() is target.get_input_embeddings()
    assert model.draft.name_or_path.endswith("(int8 draft)")  # how compile progress lines name it
    assert type(model.draft.get_output_embeddings().weight).__name__ == "Int8Tensor"  # torchao's int8 weights
    assert target.get_output_embeddings().weight.dtype == torch.float32  # the target is untouched
    prompt = torch.tensor([[5, 17, 33, 2]])
    out = model.generate(prompt, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_reference(target, prompt, 24))
    assert out.stats.acceptance_rate > 0.5  # int8 per channel: the draft mostly agrees with the target
    with pytest.raises(ValueError, match="unknown quantized draft 'int3'"):
        medusa.draft.quantized_draft(target, "int3")
    # the inductor engine compiles plain weights ahead of time (medusa.runtime.aot); torchao's go through torch.compile
    assert not InductorEngine(model.draft).ahead_of_time
    assert InductorEngine(target).ahead_of_time


def test_draft_cache_when_the_bonus_repeats_a_rejected_draft_token():
    """A lossy rule may commit d_1 as its bonus after rejecting it: the draft must still feed the last token."""
    draft = make_tiny_model("llama", seed=2)
    proposer = CheckedDraftProposer(draft, 3, SamplingConfig(), VOCAB)
    state = SimpleNamespace(tokens=[4, 5, 6, 7], root_token=torch.tensor(7))
    drafted = proposer.propose(state).tokens[1:].tolist()
    state.tokens.append(drafted[0])  # accepted nothing, bonus == d_1 (already in the draft's cache)
    state.root_token = torch.tensor(drafted[0])
    proposer.observe(state, [drafted[0]])
    proposer.propose(state)  # checks the proposal against the draft run from scratch
    assert proposer.checked == 2


def test_draft_with_a_larger_output_layer_is_cut_to_the_target_vocabulary():
    target = make_tiny_model("llama")
    config = LlamaConfig(**{**target.config.to_dict(), "vocab_size": VOCAB + 8})  # padded rows past the tokenizer
    torch.manual_seed(3)
    draft = AutoModelForCausalLM.from_config(config).eval()
    model = draft_model(target, draft, 3)
    prompt = torch.tensor([[3, 9, 27]])
    assert torch.equal(model.generate(prompt, max_new_tokens=30), greedy_reference(target, prompt, 30))
    out = model.generate(prompt, max_new_tokens=30, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert out.max() < VOCAB


def test_a_draft_with_another_tokenizer_is_refused():
    target, draft = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="tokenizer differs from the target's.*share one tokenizer"):
        MedusaModel.from_draft_model(
            target=target, draft=draft, tokenizer=TOKENIZER, draft_tokenizer=tiny_tokenizer(VOCAB, prefix="other")
        )
    config = LlamaConfig(**{**target.config.to_dict(), "vocab_size": VOCAB - 6})
    small = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="cannot score every token"):
        draft_model(target, small, 2)


def test_from_draft_model_loads_directories(tmp_path):
    for name, seed in (("target", 0), ("draft", 1)):
        make_tiny_model("qwen2", seed=seed).save_pretrained(tmp_path / name)
        TOKENIZER.save_pretrained(tmp_path / name)
    model = MedusaModel.from_draft_model(
        target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), num_speculative_tokens=2
    )
    assert isinstance(model, DraftModel) and model.tokenizer is not None
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(prompt, max_new_tokens=12), greedy_reference(model.base, prompt, 12))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree=[[0]]), "draft model proposes a chain"),
        (dict(proposer="medusa"), "proposes with its draft model"),
        (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
        (dict(acceptance="nope"), "unknown acceptance rule"),
    ],
)
def test_bad_generate_arguments_are_named(kwargs, message):
    target = make_tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        draft_model(target, target, 2).generate(torch.tensor([[1, 2]]), max_new_tokens=4, **kwargs)


def test_bad_construction_is_named():
    target = make_tiny_model("llama")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        draft_model(target, target, 0)
    with pytest.raises(ValueError, match="no draft model given"):
        MedusaModel.from_draft_model(target=target, tokenizer=TOKENIZER)


def test_speculative_rule_without_a_draft_is_named():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True))
    with pytest.raises(ValueError, match="needs the draft model's probabilities"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=8, do_sample=True, acceptance="speculative")


def test_acceptance_rate_counts_the_guesses_the_rule_reached():
    # steps: 0 of 2 accepted (1 reached), 2 of 2 (2 reached), 1 of 2 (2 reached): alpha = 3 / 5
    stats = DecodeStats(accepted_lengths=[1, 3, 2], proposed_lengths=[2, 2, 2])
    assert stats.acceptance_rate == pytest.approx(0.6)
    assert DecodeStats().acceptance_rate == 0.0


def test_the_draft_context_window_is_checked():
    target = make_tiny_model("llama")
    config = LlamaConfig(**{**target.config.to_dict(), "max_position_embeddings": 40})
    short = AutoModelForCausalLM.from_config(config).eval()
    model = draft_model(target, short, 5)
    assert model.generate(torch.tensor([[1, 2]]), max_new_tokens=30).shape == (1, 32)
    with pytest.raises(ValueError, match="draft model would see up to .* = 41 tokens, beyond its context window of 40"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=34)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_early_exit_draft_shares_the_target_and_keeps_greedy_identity(family):
    from medusa.draft import early_exit_draft

    target = make_tiny_model(family)
    layers = len(target.get_decoder().layers)
    draft = early_exit_draft(target, 1)
    # The target is untouched; the draft owns no weights (every parameter is the target's tensor).
    assert len(target.get_decoder().layers) == layers and target.config.get_text_config().num_hidden_layers == layers
    target_params = {p.data_ptr() for p in target.parameters()}
    assert {p.data_ptr() for p in draft.parameters()} <= target_params
    # Its logits are the target's first layer followed by the target's final norm and lm_head.
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[1]  # after the first decoder layer
        expected = target.get_output_embeddings()(target.get_decoder().norm(hidden))
        torch.testing.assert_close(draft(ids).logits, expected, atol=1e-5, rtol=1e-5)
    model = MedusaModel.from_draft_model(
        target=target, draft="early-exit:1", num_speculative_tokens=3, tokenizer=TOKENIZER
    )
    prompt = torch.tensor([[5, 17, 33, 2]])
    out = model.generate(prompt, max_new_tokens=20)
    assert torch.equal(out, greedy_reference(target, prompt, 20, min_new_tokens=20))


@pytest.mark.parametrize(
    "spec, message", [("early-exit:2", "1 <= num_layers < 2"), ("early-exit:x", "number of layers")]
)
def test_bad_early_exit_drafts_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        MedusaModel.from_draft_model(target=make_tiny_model("llama"), draft=spec, tokenizer=TOKENIZER)
