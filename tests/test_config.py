"""medusa/train/config.py: one Config for both entry points; the heads section is MedusaConfig; every option documented.
(Refused values and their messages: tests/test_inputs.py::BAD_CONFIGS, rendered into docs/refused_inputs.md.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, VOCAB

from medusa.config import MedusaConfig
from medusa.heads import MedusaHeads
from medusa.heads_io import save_heads
from medusa.train.config import FILLED_IN, Config, HeadsConfig, load_config, parse_args
from medusa.train.trainer import build_heads

REPO = Path(__file__).resolve().parent.parent


def test_the_heads_section_is_medusa_config():
    """A field added to MedusaConfig is a training option with no other edit (and reaches the saved heads)."""
    medusa = {f.name for f in dataclasses.fields(MedusaConfig)}
    assert {f.name for f in dataclasses.fields(HeadsConfig)} == medusa | {"init_from"}
    assert issubclass(HeadsConfig, MedusaConfig) and set(FILLED_IN) <= medusa


def test_build_heads_keeps_every_field_of_the_section():
    cfg = load_config(
        None,
        [
            "--heads.num_heads",
            "2",
            "--heads.copy_ngram",
            "3",
            "--heads.vocab_subset_size",
            "7",
            "--heads.condition_on_next_token",
            "true",
            "--heads.tree",
            "[[0], [1], [0, 0]]",
        ],
    )
    heads = build_heads(cfg.heads, HIDDEN, VOCAB, torch.nn.Linear(HIDDEN, VOCAB, bias=False), "a/base")
    for f in dataclasses.fields(MedusaConfig):
        if f.name not in FILLED_IN:
            assert getattr(heads.config, f.name) == getattr(cfg.heads, f.name), f.name
    assert (heads.config.hidden_size, heads.config.vocab_size, heads.config.base_model_name_or_path) == (
        HIDDEN,
        VOCAB,
        "a/base",
    )


def test_init_from_supplies_what_the_section_does_not_name(tmp_path):
    saved = MedusaConfig(
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_heads=2,
        condition_on_next_token=True,
        context_window=4,
        copy_ngram=3,
        tree=[[0], [0, 0]],
    )
    save_heads(MedusaHeads(saved), tmp_path)
    cfg = load_config(None, ["--heads.init_from", str(tmp_path)])
    for name in ("num_heads", "condition_on_next_token", "context_window", "copy_ngram", "tree"):
        assert getattr(cfg.heads, name) == getattr(saved, name), name
    assert load_config(None, ["--heads.init_from", str(tmp_path), "--heads.copy_ngram", "0"]).heads.copy_ngram == 0


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(str(path)), Config)


def test_help_lists_every_option_with_its_text(capsys):
    import draccus.argparsing

    with pytest.raises(SystemExit):
        parse_args("description", ["--help"])
    shown = capsys.readouterr().out
    actions = [
        a for a in draccus.argparsing.ArgumentParser(Config).parser._actions if any("." in s for s in a.option_strings)
    ]
    options = {s for a in actions for s in a.option_strings}
    expected = {
        f"--{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section.default_factory())
    }
    assert options == expected
    for action in actions:
        assert action.option_strings[0] in shown
        assert action.help and not action.help.startswith("(default"), f"{action.option_strings[0]} has no help text"


def test_overrides_win_over_the_file_and_read_as_yaml():
    cfg = load_config(
        str(REPO / "configs" / "smollm2-135m-cpu.yaml"),
        [
            "--training.lr",
            "2e-3",
            "--training.max_steps",
            "null",
            "--training.lora_target_modules",
            "[q_proj, v_proj]",
            "--data.sources",
            "{bench:gsm8k: '0:10'}",
        ],
    )
    assert cfg.training.lr == 2e-3 and cfg.training.max_steps is None
    assert cfg.training.lora_target_modules == ["q_proj", "v_proj"] and cfg.data.sources == {"bench:gsm8k": "0:10"}
    assert cfg.training.epochs == 3  # the file's, untouched


def test_init_from_heads_gain_a_vocabulary_subset_the_section_asks_for(tmp_path):
    """The subset is taken from the data after the weights load: init_from's heads may have none, or another size."""
    save_heads(MedusaHeads(MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=2)), tmp_path)
    cfg = load_config(None, ["--heads.init_from", str(tmp_path), "--heads.vocab_subset_size", "7"])
    heads = build_heads(cfg.heads, HIDDEN, VOCAB, torch.nn.Linear(HIDDEN, VOCAB, bias=False), None)
    assert heads.config.vocab_subset_size is None  # train.py then calls set_vocab_subset with 7 frequent tokens
