"""transformers' `custom_generate` hook: heads saved by save_pretrained decode through the base model's own
`generate(custom_generate=<heads dir>, trust_remote_code=True)`, with the same tokens as its plain greedy generate."""

import uuid

import pytest
import torch

from medusa import MedusaModel
from medusa.custom_generate import HOOK_DIR
from tests.conftest import FAMILIES, make_heads, make_tiny_model, tiny_tokenizer


@pytest.fixture(params=FAMILIES)
def saved(request, tmp_path):
    base = make_tiny_model(request.param)
    model = MedusaModel(base, make_heads(random=True), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    # transformers names the module it copies after the folder: one name per test, so none reads another's copy
    directory = tmp_path / f"heads_{uuid.uuid4().hex[:8]}"
    model.save_pretrained(directory)
    return base, directory


def test_the_base_models_generate_decodes_with_the_saved_heads(saved):
    base, directory = saved
    assert (directory / HOOK_DIR / "generate.py").is_file() and (directory / HOOK_DIR / "requirements.txt").is_file()
    prompt = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    reference = base.generate(**prompt, max_new_tokens=16, do_sample=False)
    out = base.generate(**prompt, max_new_tokens=16, custom_generate=str(directory), trust_remote_code=True)
    assert torch.equal(out, reference)
    # our loop ran (transformers' own output carries no stats), on the model it was called on
    out = base.generate(
        **prompt,
        max_new_tokens=16,
        custom_generate=str(directory),
        trust_remote_code=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference) and out.stats.new_tokens == 16 and out.stats.steps <= 16


def test_the_hook_runs_only_when_trusted(saved):
    base, directory = saved
    with pytest.raises(ValueError, match="trust_remote_code"):
        base.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, custom_generate=str(directory))


def test_the_hook_names_where_the_heads_live(saved, tmp_path):
    base, directory = saved
    assert repr(str(directory.resolve())) in (directory / HOOK_DIR / "generate.py").read_text()
    # pushed to the Hub, it names the repo instead (the folder upload_folder sends)
    model = MedusaModel.from_pretrained(directory, base=base)
    model._save(tmp_path / "upload", heads_location="org/heads", revision="v1")
    hook = (tmp_path / "upload" / HOOK_DIR / "generate.py").read_text()
    assert "HEADS = 'org/heads'" in hook and "REVISION = 'v1'" in hook
