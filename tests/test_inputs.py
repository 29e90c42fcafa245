"""Bad inputs to generate are refused by name (parameter, value, fix), never silently changed."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from medusa import MedusaModel
from tests.conftest import VOCAB, make_heads, make_tiny_model

PROMPT = [[3, 4, 5, 6]]


@pytest.fixture(scope="module")
def model():
    return MedusaModel(make_tiny_model("llama"), make_heads(random=True), projection_dtype=torch.float32)


BAD_CALLS = [
    # (name, arguments to generate, exception, words the message must hold)
    ("float ids", dict(input_ids=torch.tensor([[1.0, 2.0]])), TypeError, "integer token ids"),
    ("bool ids", dict(input_ids=torch.tensor([[True, False]])), TypeError, "integer token ids"),
    ("float in a list", dict(input_ids=[[1, 2.5]]), TypeError, "integer token ids"),
    ("id = vocabulary size", dict(input_ids=[[1, VOCAB]]), ValueError, "outside the model's vocabulary"),
    ("negative id", dict(input_ids=[[-1, 2]]), ValueError, "outside the model's vocabulary"),
    (
        "right-padded mask in the dict",
        dict(input_ids={"input_ids": torch.tensor(PROMPT), "attention_mask": torch.tensor([[1, 1, 1, 0]])}),
        ValueError,
        "pad on the left",
    ),
    ("padded attention_mask", dict(attention_mask=torch.tensor([[0, 1, 1, 1]])), ValueError, "pads the prompt"),
    ("a dict without input_ids", dict(input_ids={"ids": PROMPT}), ValueError, "needs 'input_ids'"),
    ("eos as a string", dict(eos_token_id="</s>"), TypeError, "eos_token_id"),
    ("max_new_tokens=True", dict(max_new_tokens=True), ValueError, "max_new_tokens"),
    ("temperature as a string", dict(do_sample=True, temperature="0.7"), TypeError, "temperature"),
    ("top_k=True", dict(do_sample=True, top_k=True), ValueError, "top_k"),
    ("greedy with a negative temperature", dict(temperature=-1.0), ValueError, "temperature"),
    ("greedy with top_p 1.5", dict(top_p=1.5), ValueError, "top_p"),
    ("do_sample as a string", dict(do_sample="yes"), TypeError, "do_sample"),
    ("an empty tree", dict(tree=[]), ValueError, "tree=[] holds no paths"),
    ("a tree as a dict", dict(tree={"paths": [[0]]}), TypeError, "tree must be"),
    ("a tree as an int", dict(tree=3), TypeError, "tree must be"),
    (
        "a rank above the vocabulary",
        dict(tree=[[0], [1], [2]] + [[r] for r in range(3, VOCAB + 1)]),
        ValueError,
        "rank",
    ),
    ("an unknown proposer", dict(proposer="beam"), ValueError, "unknown proposer"),
    ("max_new_tokens positionally", dict(generation_config=8), TypeError, "pass settings by keyword"),
    ("repetition_penalty", dict(repetition_penalty=1.2), ValueError, "does not support repetition_penalty=1.2"),
    (
        "no_repeat_ngram_size in a GenerationConfig",
        dict(generation_config=GenerationConfig(no_repeat_ngram_size=3)),
        ValueError,
        "does not support no_repeat_ngram_size=3",
    ),
    ("beam search", dict(num_beams=4), ValueError, "does not support num_beams=4"),
    ("a logits processor", dict(logits_processor=[lambda ids, scores: scores]), ValueError, "logits_processor"),
    ("an assistant model", dict(assistant_model=object()), ValueError, "MedusaModel.from_draft_model(target, draft)"),
    ("transformers' prompt lookup", dict(prompt_lookup_num_tokens=3), ValueError, "pass proposer='prompt_lookup'"),
    ("the prompt twice", dict(inputs=PROMPT), ValueError, "both inputs and input_ids"),
    ("an unknown argument", dict(temprature=0.7), TypeError, "unexpected arguments ['temprature']"),
    (
        "max_length inside the prompt",
        dict(max_new_tokens=None, max_length=3),
        ValueError,
        "max_length=3 leaves no room",
    ),
    ("stop_strings without a tokenizer", dict(stop_strings=["."]), ValueError, "stop_strings needs the tokenizer"),
]


@pytest.mark.parametrize("name, kwargs, error, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_by_name(model, name, kwargs, error, words):
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=re.escape(words)):
        model.generate(**kwargs)


def test_tree_files_that_are_not_trees_are_named(model, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{ paths: ")
    with pytest.raises(ValueError, match="not valid JSON"):
        model.generate(PROMPT, max_new_tokens=2, tree=str(broken))
    no_paths = tmp_path / "no_paths.json"
    no_paths.write_text(json.dumps({"nodes": [[0]]}))
    with pytest.raises(ValueError, match="no 'paths' key"):
        model.generate(PROMPT, max_new_tokens=2, tree=str(no_paths))


def test_good_variants_are_accepted_as_what_they_mean(model):
    """An all-ones mask, ids in a dict, eos as a tensor or list: the same output as the plain form."""
    reference = model.generate(PROMPT, max_new_tokens=12)
    inputs = {"input_ids": torch.tensor(PROMPT), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    assert torch.equal(model.generate(inputs, max_new_tokens=12), reference)
    assert torch.equal(model.generate(torch.tensor(PROMPT, dtype=torch.int32), max_new_tokens=12), reference)
    stop = int(reference[0, 6])  # the third new token
    for eos in (torch.tensor([stop]), [stop], stop):
        out = model.generate(PROMPT, max_new_tokens=12, eos_token_id=eos)
        assert out[0, -1] == stop and out.shape[1] <= 7


def test_trees_shrink_near_the_end_of_a_learned_position_window():
    """GPT-2 (32 learned positions): a 20-token prompt + 12 new tokens fills the window exactly; deep trees must not
    reach past it (they used to crash mid-generation where transformers succeeds)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    model = MedusaModel(base, make_heads(random=True, hidden=32), projection_dtype=torch.float32)
    prompt = torch.randint(1, VOCAB, (1, 20))
    reference = base.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    for proposer in ("medusa", "dynamic", "hybrid"):
        out = model.generate(prompt, max_new_tokens=12, proposer=proposer, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
        assert torch.equal(out, reference), proposer


@pytest.mark.parametrize(
    "text, words",
    [
        ("[]", "not an object of heads settings"),
        ("null", "not an object of heads settings"),
        ('{"hidden_size": 64, "vocab_size": 96, "num_heads": true}', "num_heads must be a positive integer"),
        ('{"hidden_size": 64, "vocab_size": 96, "vocab_subset_size": "5"}', "vocab_subset_size"),
        ('{"hidden_size": 64, "vocab_size": 96, "format_version": "1"}', "format_version must be an integer"),
        ('{"vocab_size": 96}', "lacks ['hidden_size']"),
    ],
)
def test_bad_heads_configs_are_named_with_their_file(tmp_path, text, words):
    from medusa.config import CONFIG_NAME, MedusaConfig

    (tmp_path / CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        MedusaConfig.load(tmp_path)
    assert str(tmp_path / CONFIG_NAME) in str(caught.value)


def test_heads_without_a_base_name_and_pickled_adapters_are_refused(tmp_path):
    from tests.conftest import save_tiny_checkpoint

    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    config = json.loads((heads_dir / "medusa_config.json").read_text())
    (heads_dir / "medusa_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="do not name their base model"):
        MedusaModel.from_pretrained(heads_dir)
    MedusaModel.from_pretrained(heads_dir, base=base_dir)  # naming it works
    (heads_dir / "adapter_config.json").write_text("{}")
    (heads_dir / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="never loaded"):
        MedusaModel.from_pretrained(heads_dir, base=base_dir)


BAD_CONFIGS = [
    # (name, overrides of the training / data-generation config (no file: the defaults), words the message holds)
    ("unknown section", ["--trainng.lr", "1e-3"], "unknown section(s) ['trainng']"),
    ("unknown key", ["--training.learning_rate", "1e-3"], "training.learning_rate"),
    ("a heads field training fills in", ["--heads.hidden_size", "576"], "heads.hidden_size is filled in by training"),
    ("bool as a string", ["--training.medusa2", '"no"'], "training.medusa2 must be true or false"),
    (
        "bool as a string",
        ["--training.precompute_hidden", '"false"'],
        "training.precompute_hidden must be true or false",
    ),
    ("integer as a string", ["--data.batch_size", '"16"'], "data.batch_size must be an integer"),
    ("integer as a bool", ["--training.max_steps", "true"], "training.max_steps"),
    ("number as a word", ["--training.lr", "fast"], "training.lr must be a number"),
    ("string as a number", ["--model.dtype", "16"], "model.dtype must be a string"),
    ("list as a string", ["--data.extra_dirs", "data/more"], "data.extra_dirs"),
    ("top_p above 1", ["--data.top_p", "7"], "data.top_p must lie in (0, 1]"),
    ("negative max_prompt_tokens", ["--data.max_prompt_tokens", "-5"], "data.max_prompt_tokens must be positive"),
    ("zero temperature", ["--data.temperature", "0"], "data.temperature must be > 0"),
    ("greedy_fraction above 1", ["--data.greedy_fraction", "1.5"], "data.greedy_fraction must lie in [0, 1]"),
    ("zero learning rate", ["--training.lr", "0"], "training.lr is 0"),
    ("negative weight decay", ["--training.weight_decay", "-0.1"], "training.weight_decay must be >= 0"),
    ("zero batch size", ["--training.batch_size", "0"], "training.batch_size must be >= 1"),
    ("one checkpoint kept", ["--training.keep_checkpoints", "1"], "training.keep_checkpoints must be >= 2"),
    ("lora_dropout of 1", ["--training.lora_dropout", "1"], "training.lora_dropout must lie in [0, 1)"),
    ("unknown batch unit", ["--training.batch_unit", "rows"], "training.batch_unit must be one of"),
    ("unknown projection", ["--heads.projection", "tied"], "heads.projection must be one of"),
    ("no heads", ["--heads.num_heads", "0"], "heads.num_heads must be a positive integer"),
    (
        "path heads without the root token",
        ["--heads.condition_on_path", "true"],
        "heads.condition_on_path needs heads.condition_on_next_token",
    ),
    (
        "reference answers for prompts alone",
        ["--data.reference_answers", "true", "--data.answer", "false"],
        "data.reference_answers gives every prompt its source's answer",
    ),
    ("Medusa-2 on cached hidden states", ["--training.medusa2", "true"], "precompute_hidden false for Medusa-2"),
    (
        "gradient checkpointing of Medusa-1's frozen base",
        ["--training.gradient_checkpointing", "true"],
        "Medusa-1's base is frozen",
    ),
    ("unknown base quantization", ["--model.quantize", "int4"], "model.quantize must be one of"),
    ("an override without a section", ["--lr", "1e-3"], "must look like --section.key value"),
]


@pytest.mark.parametrize("name, overrides, words", BAD_CONFIGS, ids=[f"{c[0]} {c[1][0]}" for c in BAD_CONFIGS])
def test_bad_config_is_refused_by_name(name, overrides, words):
    from medusa.train.config import load_config

    with pytest.raises(ValueError, match=re.escape(words)):
        load_config(None, overrides)


REFUSED_DOC = Path(__file__).resolve().parent.parent / "docs" / "refused_inputs.md"


def refused_inputs_table(model) -> str:
    """The docs table of refused generate inputs, rendered from BAD_CALLS and the messages they actually raise."""
    lines = [
        "# Inputs `generate` refuses, and what it says",
        "",
        "Generated from `tests/test_inputs.py::BAD_CALLS` (`UPDATE_DOCS=1 pytest tests/test_inputs.py` rewrites "
        "it; the test fails when it is out of date). Tiny llama, prompt `[[3, 4, 5, 6]]`, vocabulary of "
        f"{VOCAB}.",
        "",
        "| input | error | message |",
        "|---|---|---|",
    ]
    for name, kwargs, error, _ in BAD_CALLS:
        try:
            model.generate(**{"input_ids": PROMPT, "max_new_tokens": 4, **kwargs})
            message = "(accepted!)"
        except error as err:
            message = str(err).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {name} | {error.__name__} | {message} |")
    return "\n".join(lines) + "\n"


def refused_config_table() -> str:
    """The docs table of refused training / data-generation config values, from BAD_CONFIGS and their messages."""
    from medusa.train.config import load_config

    lines = [
        "",
        "## Training and data-generation config values `medusa/train/config.py` refuses",
        "",
        "From `tests/test_inputs.py::BAD_CONFIGS`: each override on its own (`--section.key value` on the "
        "command line of train/train.py or train/generate_data.py; a YAML file's keys are read alike).",
        "",
        "| case | override | message |",
        "|---|---|---|",
    ]
    for name, overrides, _ in BAD_CONFIGS:
        try:
            load_config(None, overrides)
            message = "(accepted!)"
        except ValueError as err:
            message = str(err).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {name} | `{' '.join(overrides)}` | {message} |")
    return "\n".join(lines) + "\n"


def test_the_docs_table_of_refused_inputs_is_current(model):
    table = refused_inputs_table(model) + refused_config_table()
    if os.environ.get("UPDATE_DOCS") == "1":
        REFUSED_DOC.write_text(table)
    assert "(accepted!)" not in table
    assert REFUSED_DOC.is_file() and REFUSED_DOC.read_text() == table, (
        "docs/refused_inputs.md is out of date: rerun with UPDATE_DOCS=1"
    )
