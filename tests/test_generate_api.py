"""generate called as transformers' generate is: the tokenizer's output, a GenerationConfig, max_length, stopping
criteria, stop strings, return_dict_in_generate; the same tokens as the base's own `generate` with those arguments."""

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria
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
    full = model.generate(**inputs, max_new_tokens=16).sequences
    prompt_length = inputs["input_ids"].shape[1]
    stop = int(full[0, prompt_length + 4])  # the fifth new token
    ours = model.generate(**inputs, max_new_tokens=16, stopping_criteria=[StopAfter(stop)]).sequences
    theirs = model.base.generate(**inputs, max_new_tokens=16, do_sample=False, stopping_criteria=[StopAfter(stop)])
    assert torch.equal(ours, theirs) and ours.shape[1] < full.shape[1]
    text = model.tokenizer.decode(full[0, prompt_length + 3 : prompt_length + 5])
    ours = model.generate(**inputs, max_new_tokens=16, stop_strings=[text]).sequences
    theirs = model.base.generate(
        **inputs, max_new_tokens=16, do_sample=False, stop_strings=[text], tokenizer=model.tokenizer
    )
    assert torch.equal(ours, theirs) and ours.shape[1] < full.shape[1]


def test_inputs_and_tokenizer_are_taken_by_their_transformers_names(model):
    """generate(inputs=..., tokenizer=..., stop_strings=...) as transformers' generate takes it, on a model loaded
    without a tokenizer too: the tokenizer given reads the stop strings."""
    inputs = _inputs(model)
    full = model.generate(**inputs, max_new_tokens=16).sequences
    prompt_length = inputs["input_ids"].shape[1]
    text = model.tokenizer.decode(full[0, prompt_length + 3 : prompt_length + 5])
    bare = MedusaModel(model.base, model.heads, projection_dtype=torch.float32)  # no tokenizer of its own
    ours = bare.generate(inputs=inputs["input_ids"], tokenizer=model.tokenizer, max_new_tokens=16, stop_strings=[text])
    theirs = model.base.generate(
        inputs=inputs["input_ids"], max_new_tokens=16, do_sample=False, stop_strings=[text], tokenizer=model.tokenizer
    )
    assert torch.equal(ours.sequences, theirs) and theirs.shape[1] < full.shape[1]


def test_settings_follow_transformers_precedence():
    base = make_tiny_model("llama")
    settings = resolve(base, 5, None, dict(do_sample=True), 0.09, 0.3)
    assert (settings.sampling.top_k, settings.sampling.top_p, settings.sampling.temperature) == (50, None, 1.0)
    assert resolve(base, 5, None, dict(do_sample=True, top_k=0), 0.09, 0.3).sampling.top_k is None  # 0: off
    base.generation_config.do_sample, base.generation_config.temperature = True, 0.7  # the model's defaults
    settings = resolve(base, 5, GenerationConfig(top_k=8, max_length=12), dict(temperature=0.5), 0.09, 0.3)
    assert settings.sampling.do_sample and settings.sampling.temperature == 0.5 and settings.sampling.top_k == 8
    assert settings.max_new_tokens == 7 and settings.return_dict_in_generate is None
    assert resolve(base, 5, None, {}, 0.09, 0.3).max_new_tokens == 128  # no length anywhere: our default
    base.generation_config.return_dict_in_generate = False  # a model's default does not change what generate returns
    assert resolve(base, 5, None, {}, 0.09, 0.3).return_dict_in_generate is None
