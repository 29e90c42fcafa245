"""Save/load round trip and every bad input named."""

import json

import pytest
import torch

from medusa import MedusaConfig, MedusaModel
from medusa.config import CONFIG_NAME, WEIGHTS_NAME
from tests.conftest import make_heads, make_tiny_model


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_save_load_round_trip(tmp_path, projection):
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=True, projection=projection, num_layers=2), tree=[[0], [1], [0, 0]])
    model.save_pretrained(tmp_path / "heads")
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base=base)
    for (name, a), (_, b) in zip(model.heads.state_dict().items(), loaded.heads.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.tree == [[0], [1], [0, 0]]
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(model.generate(prompt, max_new_tokens=20), loaded.generate(prompt, max_new_tokens=20))
    # shared projection stores only the blocks: no [V, H] matrix in the file
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "heads" / WEIGHTS_NAME)).keys()
    assert any("projections" in k for k in keys) == (projection == "own")


def test_distinct_block_instances():
    heads = make_heads(num_layers=3)
    ids = {id(block) for head in heads.blocks for block in head}
    assert len(ids) == 4 * 3


def test_fresh_heads_are_identity():
    heads = make_heads()
    hidden = torch.randn(2, 5, 64)
    for k in range(4):
        torch.testing.assert_close(heads.head_hidden(hidden)[k], hidden)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden=32), "hidden size 32"),
        (dict(vocab=50), "vocabulary of 50"),
    ],
)
def test_mismatched_heads_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MedusaModel(make_tiny_model("llama"), make_heads(**kwargs))


def test_missing_and_corrupt_files_are_named(tmp_path):
    base = make_tiny_model("llama")
    MedusaModel(base, make_heads()).save_pretrained(tmp_path / "h")
    with pytest.raises(FileNotFoundError, match="not a medusa heads directory"):
        MedusaModel.from_pretrained(tmp_path / "nowhere", base=base)
    (tmp_path / "h" / WEIGHTS_NAME).write_bytes(b"definitely not safetensors")
    with pytest.raises(ValueError, match="corrupt"):
        MedusaModel.from_pretrained(tmp_path / "h", base=base)
    (tmp_path / "h" / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        MedusaModel.from_pretrained(tmp_path / "h", base=base)
    (tmp_path / "h" / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        MedusaModel.from_pretrained(tmp_path / "h", base=base)


def test_weights_that_disagree_with_config_are_named(tmp_path):
    base = make_tiny_model("llama")
    MedusaModel(base, make_heads(num_heads=2)).save_pretrained(tmp_path / "h")
    config = json.loads((tmp_path / "h" / CONFIG_NAME).read_text())
    config["num_heads"] = 3
    (tmp_path / "h" / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        MedusaModel.from_pretrained(tmp_path / "h", base=base)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden_size=0, vocab_size=10), "hidden_size"),
        (dict(hidden_size=8, vocab_size=10, projection="tied"), "projection"),
        (dict(hidden_size=8, vocab_size=10, num_heads=2, tree=[[0, 0, 0]]), "no parent"),
        (dict(hidden_size=8, vocab_size=10, num_heads=2, tree=[[0], [0, 0], [0, 0, 0]]), "only 2 heads"),
        (dict(hidden_size=8, vocab_size=10, format_version=99), "newer"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MedusaConfig(**kwargs)


def test_unknown_config_key_is_named(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"hidden_size": 8, "vocab_size": 10, "num_headz": 3}))
    with pytest.raises(ValueError, match="num_headz"):
        MedusaConfig.load(tmp_path)


@pytest.mark.parametrize(
    "prompt, max_new_tokens, message",
    [
        (torch.zeros((1, 0), dtype=torch.long), 5, "prompt is empty"),
        (torch.ones((1, 510), dtype=torch.long), 5, "context window of 512"),
        (torch.ones((1, 600), dtype=torch.long), 1, "context window"),
        (torch.ones((1, 3), dtype=torch.long), 0, "max_new_tokens must be a positive"),
        (torch.ones((1, 3), dtype=torch.long), -2, "max_new_tokens must be a positive"),
        (torch.ones((1, 2, 3), dtype=torch.long), 5, r"or a left-padded batch \(B, T\)"),
    ],
)
def test_bad_generate_input_is_named(prompt, max_new_tokens, message):
    model = MedusaModel(make_tiny_model("llama"), make_heads())
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, max_new_tokens=max_new_tokens)


def test_bad_tree_argument_is_named():
    model = MedusaModel(make_tiny_model("llama"), make_heads(num_heads=2))
    with pytest.raises(ValueError, match="gap in ranks"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=3, tree=[[0], [2]])
    with pytest.raises(ValueError, match="only 2 heads"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=3, tree=[[0], [0, 0], [0, 0, 0]])


def test_vocab_subset_restricts_candidates_keeps_identity_and_round_trips(tmp_path):
    base = make_tiny_model("qwen2")
    heads = make_heads(random=True)
    subset = torch.arange(0, 96, 3)  # every third token
    heads.set_vocab_subset(subset)
    model = MedusaModel(base, heads, tree=[[0], [1], [0, 0], [0, 0, 0]])
    state = type("S", (), {"root_token": torch.tensor(5), "last_hidden": torch.randn(64)})()
    from medusa.propose import build_medusa_proposer
    from medusa.tree import TreeSpec, build_buffers

    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(model.tree, 4), 4))
    assert set(proposer.propose(state).tokens[1:].tolist()) <= set(subset.tolist())
    prompt = torch.tensor([[7, 8, 9]])
    reference = base.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=30), reference)
    model.save_pretrained(tmp_path / "h")
    loaded = MedusaModel.from_pretrained(tmp_path / "h", base=base)
    assert loaded.config.vocab_subset_size == 32 and torch.equal(loaded.heads.vocab_subset, subset)
    with pytest.raises(ValueError, match="vocab subset ids"):
        heads.set_vocab_subset(torch.tensor([0, 500]))


def test_heads_stored_in_bf16_keep_their_token_ids(tmp_path):
    """Storing bf16 halves the file; the integer candidate ids must not be rounded with the weights."""
    base = make_tiny_model("llama")
    heads = make_heads(random=True)
    subset = torch.arange(1, 96, 3)  # bf16 holds integers above 256 only approximately (a real vocab: 49k)
    heads.set_vocab_subset(subset)
    model = MedusaModel(base, heads, tree=[[0], [1], [0, 0]])
    model.save_pretrained(tmp_path / "h", dtype="bfloat16")
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "h" / WEIGHTS_NAME))
    assert stored["vocab_subset"].dtype == torch.int64 and torch.equal(stored["vocab_subset"], subset)
    assert all(v.dtype == torch.bfloat16 for k, v in stored.items() if k != "vocab_subset")
    loaded = MedusaModel.from_pretrained(tmp_path / "h", base=base)
    for name, value in loaded.heads.state_dict().items():  # weights cast back to the base's dtype, ids exact
        original = heads.state_dict()[name]
        expected = original.to(torch.bfloat16).float() if original.is_floating_point() else original
        assert value.dtype == original.dtype and torch.equal(value, expected), name
    prompt = torch.tensor([[7, 8, 9]])
    assert torch.equal(
        loaded.generate(prompt, max_new_tokens=20), base.generate(prompt, max_new_tokens=20, do_sample=False)
    )
