"""transformers' `generate` arguments -> this library's settings, with transformers' precedence: arguments to the call,
then the `generation_config` passed, then the base model's `generation_config`, then transformers' defaults. So
`model.generate(**inputs, do_sample=True)` samples from the distribution `model.base.generate(**inputs,
do_sample=True)` samples from (top_k=50 included, as transformers applies it when nothing sets top_k)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteriaList, StopStringCriteria

from medusa.sampling import SamplingConfig

# transformers' values for fields nobody set (GenerationConfig._get_default_generation_params, transformers 5);
# one deviation: with no length set anywhere, 128 new tokens rather than transformers' max_length of 20.
DEFAULTS = dict(do_sample=False, temperature=1.0, top_k=50, top_p=1.0)
DEFAULT_MAX_NEW_TOKENS = 128
# Fields that change which token is chosen in ways a tree verify does not reproduce (yet): refused by name, with
# the value that leaves them off. Fields not named here (pad_token_id, bos_token_id, use_cache...) do not matter.
UNSUPPORTED = dict(
    num_beams=1,
    num_return_sequences=1,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    min_length=0,
    min_new_tokens=None,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    min_p=None,
    bad_words_ids=None,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
    sequence_bias=None,
    penalty_alpha=None,
    guidance_scale=None,
    output_attentions=False,
    output_hidden_states=False,
    watermarking_config=None,
    prompt_lookup_num_tokens=None,
)
# Unsupported settings whose job this library does another way: the refusal names that way
ALTERNATIVES = {
    "prompt_lookup_num_tokens": "pass proposer='prompt_lookup' (guesses copied from the context, as transformers' "
    "prompt lookup does; 'hybrid' adds the heads' guesses)",
}
# transformers' generate arguments that do not change one unpadded sequence's tokens: taken and ignored
ACCEPTED = {"pad_token_id", "bos_token_id", "use_cache", "cache_implementation", "token_type_ids"}


@dataclass
class GenerateSettings:
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_id: object  # None: the tokenizer's (see medusa.decode.stop_token_ids)
    stop_strings: object
    return_dict_in_generate: bool  # as in transformers: False returns the sequences tensor alone
    output_scores: bool  # with return_dict_in_generate: the processed logits behind each new token
    output_logits: bool  # with return_dict_in_generate: the target's raw logits behind each new token
    pad_token_id: int | None  # what a batch's rows that end early are padded with (None: end of sequence)


def resolve(
    base,
    prompt_length: int,
    generation_config: GenerationConfig | None,
    arguments: dict,
    posterior_threshold: float,
    posterior_alpha: float,
) -> GenerateSettings:
    """`arguments`: generate's keyword arguments as given (None: not given)."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers GenerationConfig, got "
            f"{type(generation_config).__name__} {generation_config!r}: build one with "
            "GenerationConfig(max_new_tokens=...), "
            "or pass settings by keyword (generate(ids, max_new_tokens=64), as in transformers)"
        )

    def settings(config) -> dict:
        return {k: v for k, v in config.to_dict().items() if v is not None} if config is not None else {}

    asked = [{k: v for k, v in arguments.items() if v is not None}, settings(generation_config)]  # by the caller
    model_default = settings(getattr(base, "generation_config", None))

    def value(name, default=None, layers=(*asked, model_default)):
        return next((layer[name] for layer in layers if name in layer), default)

    for name, off in UNSUPPORTED.items():
        if value(name, off) not in (off, None):
            fix = ALTERNATIVES.get(name, f"pass {name}={off!r}, or call model.base.generate for it")
            raise ValueError(
                f"generate does not support {name}={value(name)!r} (a transformers generation setting that "
                f"the tree verify does not reproduce exactly): {fix}"
            )
    max_new_tokens = value("max_new_tokens")
    if max_new_tokens is None and value("max_length") is not None:
        max_length = value("max_length")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= prompt_length:
            raise ValueError(
                f"max_length={max_length!r} leaves no room after the {prompt_length}-token prompt: "
                "pass a larger max_length or max_new_tokens"
            )
        max_new_tokens = max_length - prompt_length
    top_k, top_p = value("top_k", DEFAULTS["top_k"]), value("top_p", DEFAULTS["top_p"])
    sampling = SamplingConfig(
        do_sample=value("do_sample", DEFAULTS["do_sample"]),
        temperature=value("temperature", DEFAULTS["temperature"]),
        top_k=None if top_k == 0 else top_k,  # transformers: 0 turns top-k off
        top_p=None if top_p == 1.0 else top_p,
        posterior_threshold=posterior_threshold,
        posterior_alpha=posterior_alpha,
    )
    return GenerateSettings(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        sampling=sampling,
        eos_token_id=value("eos_token_id"),
        stop_strings=value("stop_strings"),
        return_dict_in_generate=bool(value("return_dict_in_generate", False)),
        output_scores=bool(value("output_scores", False)),
        output_logits=bool(value("output_logits", False)),
        pad_token_id=value("pad_token_id"),
    )


# generate arguments of transformers that are not generation settings, refused with what they are and the way out
BASE_GENERATE = "call model.base.generate for it"
UNSUPPORTED_ARGUMENTS = {
    "logits_processor": ("logits processors", BASE_GENERATE),
    "prefix_allowed_tokens_fn": ("constrained decoding", BASE_GENERATE),
    "synced_gpus": ("synced GPUs", BASE_GENERATE),
    "negative_prompt_ids": ("guidance", BASE_GENERATE),
    "assistant_model": (
        "an assistant model",
        "MedusaModel.from_draft_model(target, draft) decodes with a draft model (Leviathan et al.) in this loop",
    ),
}


def refuse_unknown(unknown: dict) -> None:
    """generate's **kwargs: what transformers takes and we can ignore passes, the rest is named."""
    for name, (what, fix) in UNSUPPORTED_ARGUMENTS.items():
        if unknown.get(name):
            raise ValueError(f"generate does not support {name} ({what}): {fix}")
    rest = sorted(set(unknown) - set(UNSUPPORTED_ARGUMENTS) - set(UNSUPPORTED) - ACCEPTED)
    if rest:
        raise TypeError(f"generate got unexpected arguments {rest}: see help(model.generate) for what it takes")


def stopping(criteria, stop_strings, tokenizer):
    """A callable (ids (1, T)) -> bool from transformers' stopping criteria and stop strings, or None."""
    criteria = StoppingCriteriaList(list(criteria or []))
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: load the model with one (from_pretrained does)")
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
    if not criteria:
        return None
    return lambda ids: bool(torch.as_tensor(criteria(ids, None)).any())
