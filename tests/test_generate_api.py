"""generate called as transformers' generate is: the tokenizer's output, a GenerationConfig, max_length, stopping
criteria, stop strings, return_dict_in_generate, output_scores / output_logits; the same tokens (and logits) as the
base's own `generate` with those arguments, and snippets from transformers' generation docs run unchanged."""

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, TextStreamer
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.utils import GenerateDecoderOnlyOutput

from medusa import MedusaModel
from medusa.generate_args import resolve
from tests.conftest import FAMILIES, make_heads, make_tiny_model, tiny_tokenizer


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return MedusaModel(
        make_tiny_model(request.param),
        make_heads(random=True),
        tokenizer=tiny_tokenizer(),
        projection_dtype=torch.float32,
    )


def _inputs(model, text="the cat sat on"):
    return model.tokenizer(text, return_tensors="pt")


def test_tokenizer_output_and_generation_config_as_in_transformers(model):
    inputs = _inputs(model)
    config = GenerationConfig(max_new_tokens=9, do_sample=False)
    out = model.generate(**inputs, generation_config=config, return_dict_in_generate=True)
    expected = model.base.generate(**inputs, generation_config=config)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, expected)
    assert torch.equal(out[0], expected[0])  # as on transformers' tensor: the first sequence
    assert out.stats.new_tokens == 9


def test_max_length_and_a_plain_tensor_return(model):
    inputs = _inputs(model)
    out = model.generate(**inputs, max_length=inputs["input_ids"].shape[1] + 6, return_dict_in_generate=False)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, model.base.generate(**inputs, max_length=inputs["input_ids"].shape[1] + 6, do_sample=False))


class StopAfter(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_and_stop_strings_stop_where_transformers_stops(model):
    inputs = _inputs(model)
    full = model.generate(**inputs, max_new_tokens=16)
    prompt_length = inputs["input_ids"].shape[1]
    stop = int(full[0, prompt_length + 4])  # the fifth new token
    ours = model.generate(**inputs, max_new_tokens=16, stopping_criteria=[StopAfter(stop)])
    theirs = model.base.generate(**inputs, max_new_tokens=16, do_sample=False, stopping_criteria=[StopAfter(stop)])
    assert torch.equal(ours, theirs) and ours.shape[1] < full.shape[1]
    text = model.tokenizer.decode(full[0, prompt_length + 3 : prompt_length + 5])
    ours = model.generate(**inputs, max_new_tokens=16, stop_strings=[text])
    theirs = model.base.generate(
        **inputs, max_new_tokens=16, do_sample=False, stop_strings=[text], tokenizer=model.tokenizer
    )
    assert torch.equal(ours, theirs) and ours.shape[1] < full.shape[1]


def test_inputs_and_tokenizer_are_taken_by_their_transformers_names(model):
    """generate(inputs=..., tokenizer=..., stop_strings=...) as transformers' generate takes it, on a model loaded
    without a tokenizer too: the tokenizer given reads the stop strings."""
    inputs = _inputs(model)
    full = model.generate(**inputs, max_new_tokens=16)
    prompt_length = inputs["input_ids"].shape[1]
    text = model.tokenizer.decode(full[0, prompt_length + 3 : prompt_length + 5])
    bare = MedusaModel(model.base, model.heads, projection_dtype=torch.float32)  # no tokenizer of its own
    ours = bare.generate(inputs=inputs["input_ids"], tokenizer=model.tokenizer, max_new_tokens=16, stop_strings=[text])
    theirs = model.base.generate(
        inputs=inputs["input_ids"], max_new_tokens=16, do_sample=False, stop_strings=[text], tokenizer=model.tokenizer
    )
    assert torch.equal(ours, theirs) and theirs.shape[1] < full.shape[1]


def test_settings_follow_transformers_precedence():
    base = make_tiny_model("llama")
    settings = resolve(base, 5, None, dict(do_sample=True), 0.09, 0.3)
    assert (settings.sampling.top_k, settings.sampling.top_p, settings.sampling.temperature) == (50, None, 1.0)
    assert resolve(base, 5, None, dict(do_sample=True, top_k=0), 0.09, 0.3).sampling.top_k is None  # 0: off
    base.generation_config.do_sample, base.generation_config.temperature = True, 0.7  # the model's defaults
    settings = resolve(base, 5, GenerationConfig(top_k=8, max_length=12), dict(temperature=0.5), 0.09, 0.3)
    assert settings.sampling.do_sample and settings.sampling.temperature == 0.5 and settings.sampling.top_k == 8
    assert settings.max_new_tokens == 7 and settings.return_dict_in_generate is False
    assert resolve(base, 5, None, {}, 0.09, 0.3).max_new_tokens == 128  # no length anywhere: our default
    base.generation_config.return_dict_in_generate = True  # a model's default counts, as in transformers
    assert resolve(base, 5, None, {}, 0.09, 0.3).return_dict_in_generate is True
    assert resolve(base, 5, None, dict(return_dict_in_generate=False), 0.09, 0.3).return_dict_in_generate is False


def test_the_default_return_is_the_sequences_tensor_as_in_transformers(model):
    inputs = _inputs(model)
    out = model.generate(**inputs, max_new_tokens=6)
    assert type(out) is torch.Tensor and out.dtype == torch.long
    assert torch.equal(out, model.base.generate(**inputs, max_new_tokens=6, do_sample=False))


def test_greedy_logits_and_scores_are_the_targets_as_transformers_reports_them(model):
    """output_logits / output_scores: one (1, V) float32 tensor per new token, the target's logits behind it (equal to
    transformers' own up to the float rounding of a tree forward), scores equal to logits when greedy."""
    inputs = _inputs(model)
    ours = model.generate(
        **inputs, max_new_tokens=10, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    theirs = model.base.generate(
        **inputs,
        max_new_tokens=10,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == len(ours.scores) == 10 == len(theirs.logits)
    for mine, reference, score in zip(ours.logits, theirs.logits, ours.scores):
        assert mine.shape == reference.shape and mine.dtype == torch.float32
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)
        assert torch.equal(score, mine)
    new = ours.sequences[0, inputs["input_ids"].shape[1] :]
    assert torch.equal(torch.stack(ours.logits)[:, 0].argmax(-1), new)  # each row chose its token
    assert model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True).logits is None  # only when asked


def test_sampled_scores_are_the_logits_after_transformers_warpers(model):
    inputs = _inputs(model)
    out = model.generate(
        **inputs,
        max_new_tokens=8,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        generator=torch.Generator().manual_seed(3),
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)]
    new = out.sequences[0, inputs["input_ids"].shape[1] :]
    assert len(out.scores) == len(new) == 8
    for logits, scores, token in zip(out.logits, out.scores, new):
        expected = logits
        for warp in warpers:
            expected = warp(out.sequences, expected)
        torch.testing.assert_close(scores, expected)
        assert scores[0, token] > float("-inf")  # the drawn token survived the warpers


def test_stop_and_length_cut_the_logits_with_the_tokens(model):
    inputs = _inputs(model)
    full = model.generate(**inputs, max_new_tokens=12)
    stop = int(full[0, inputs["input_ids"].shape[1] + 5])
    out = model.generate(
        **inputs, max_new_tokens=12, eos_token_id=stop, return_dict_in_generate=True, output_logits=True
    )
    assert len(out.logits) == out.sequences.shape[1] - inputs["input_ids"].shape[1] == out.stats.new_tokens <= 6
    assert int(out.logits[-1].argmax()) == stop


def test_snippets_from_transformers_generation_docs_run_unchanged(model, capsys):
    """Five snippets as transformers' docs and model cards write them, with `model` a MedusaModel: the same results
    as with the base model."""
    tokenizer, base = model.tokenizer, model.base
    prompt = "the cat sat on"

    # 1. text generation (generation strategies guide): batch_decode over the returned tensor
    inputs = tokenizer(prompt, return_tensors="pt")
    outputs = model.generate(**inputs, max_new_tokens=8)
    text = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    assert text == tokenizer.batch_decode(
        base.generate(**inputs, max_new_tokens=8, do_sample=False), skip_special_tokens=True
    )

    # 2. model cards (Qwen2, SmolLM2): strip the prompt with zip over the batch
    model_inputs = tokenizer([prompt], return_tensors="pt")
    generated_ids = model.generate(**model_inputs, max_new_tokens=8)
    generated_ids = [
        output_ids[len(input_ids) :] for input_ids, output_ids in zip(model_inputs.input_ids, generated_ids)
    ]
    response = tokenizer.batch_decode(generated_ids, skip_special_tokens=True)[0]
    assert response == tokenizer.decode(outputs[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)

    # 3. slicing the new tokens off the tensor
    new_tokens = outputs[:, inputs.input_ids.shape[-1] :]
    assert new_tokens.shape == (1, 8)

    # 4. scores of the generated tokens (generation utilities guide)
    outputs = model.generate(**inputs, max_new_tokens=5, return_dict_in_generate=True, output_scores=True)
    transition_scores = model.compute_transition_scores(outputs.sequences, outputs.scores, normalize_logits=True)
    input_length = inputs.input_ids.shape[1]
    generated_tokens = outputs.sequences[:, input_length:]
    for tok, score in zip(generated_tokens[0], transition_scores[0]):
        assert 0.0 < float(torch.exp(score)) <= 1.0 and int(tok) < base.config.vocab_size
    reference = base.generate(
        **inputs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    expected = base.compute_transition_scores(reference.sequences, reference.scores, normalize_logits=True)
    torch.testing.assert_close(transition_scores, expected, atol=1e-4, rtol=1e-4)

    # 5. streaming (text generation streaming guide)
    streamer = TextStreamer(tokenizer)
    _ = model.generate(**inputs, streamer=streamer, max_new_tokens=8)
    printed = capsys.readouterr().out
    assert torch.equal(_, base.generate(**inputs, max_new_tokens=8, do_sample=False))
    assert tokenizer.decode(_[0, input_length:]).strip() in printed
