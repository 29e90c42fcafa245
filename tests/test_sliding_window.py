"""Sliding-window models (Gemma 2 and 3, Qwen2 with `use_sliding_window`, Mistral): trees verified long past the
window decode exactly as plain greedy decoding does, on every engine, alone and in batches, with heads, prompt lookup
and a draft model. The tiny models' window (8) is far shorter than their sequences."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import medusa.runtime.aot
import medusa.runtime.static
from medusa import MedusaModel
from medusa.batch import left_padded
from medusa.decode import prefill
from medusa.hardware import native_bf16
from medusa.runtime import engine_for
from medusa.runtime.quantize import quantize_target
from medusa.runtime.static import CompiledEngine, GuardedStaticLayer, PrefixStaticLayer
from medusa.runtime.verify import (
    PREFILL_CHUNK,
    WINDOW_BLOCK,
    layer_masks,
    prefill_chunks,
    run_prefill,
    sliding_layers,
    sliding_window,
)
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain
from tests.conftest import SLIDING_CONFIGS, VOCAB, WINDOW, make_heads, make_tiny_model, tiny_tokenizer
from tests.test_engine import FAST_INDUCTOR
from tests.test_tree import HAND_TREE

SLIDING = sorted(SLIDING_CONFIGS)
TREE = [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
NEW = 40


def prompt_of(length: int, seed: int) -> list[int]:
    """Random tokens, their first half said again (prompt lookup finds copies)."""
    tokens = torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tokens + tokens[: length // 2]


def greedy(base, prompt: list[int], new: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = base.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def without_window(base):
    """The same weights with a window longer than any sequence here: what decoding would say if the window were lost."""
    config = base.config.__class__.from_dict(base.config.to_dict())
    config.sliding_window = 4096
    unwindowed = AutoModelForCausalLM.from_config(config).eval()
    unwindowed.load_state_dict(base.state_dict())
    return unwindowed


def medusa_of(base) -> MedusaModel:
    return MedusaModel(base, make_heads(4, random=True), tree=TREE)


@pytest.mark.parametrize("family", SLIDING)
def test_the_window_changes_what_these_models_say(family):
    """The sequences below outgrow the window, and the window changes their greedy output (so a verify that lost it
    would be caught)."""
    base = make_tiny_model(family, sliding=True)
    assert sliding_window(base.config) == WINDOW
    prompt = prompt_of(14, seed=1)
    assert greedy(base, prompt) != greedy(without_window(base), prompt)


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_trees_past_the_window_decode_as_plain_greedy(family, engine):
    base = make_tiny_model(family, sliding=True)
    model = medusa_of(base)
    for seed, length in ((1, 14), (2, 3)):  # prompts longer and shorter than the window; both outgrow it
        prompt = prompt_of(length, seed)
        expected = greedy(base, prompt)
        for proposer in ("medusa", "dynamic", "prompt_lookup"):
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW,
                proposer=proposer,
                engine=engine,
                return_dict_in_generate=True,
            )
            assert out.sequences[0, len(prompt) :].tolist() == expected, (proposer, length)
            if proposer == "prompt_lookup":  # copies accepted: trees committed past the window
                assert max(out.stats.accepted_lengths) > 1


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_batch_rows_past_the_window_decode_as_alone(family, engine):
    """Rows of very different lengths, left-padded (a row's padding shifts its cache rows from its positions: the
    window counts positions), each identical to its prompt decoded alone."""
    base = make_tiny_model(family, sliding=True)
    model = medusa_of(base)
    prompts = [prompt_of(length, seed) for seed, length in enumerate((2, 14, 7, 20))]
    expected = [greedy(base, prompt) for prompt in prompts]
    ids, mask = left_padded(prompts, 0)
    for proposer in ("dynamic", "prompt_lookup"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, proposer=proposer, engine=engine)
        assert [row[ids.shape[1] :].tolist() for row in out] == expected, proposer


def test_a_draft_model_past_the_window_keeps_greedy_identity():
    target = make_tiny_model("gemma3", sliding=True)
    model = MedusaModel.from_draft_model(
        target=target, draft="int8", num_speculative_tokens=3, tokenizer=tiny_tokenizer()
    )
    prompt = prompt_of(14, seed=3)
    for engine in ("eager", "compiled"):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, engine=engine, return_dict_in_generate=True)
        assert out.sequences[0, len(prompt) :].tolist() == greedy(target, prompt)
        assert out.stats.acceptance_rate > 0.5  # the draft's trees are accepted, past the window


@pytest.mark.slow
@pytest.mark.parametrize("family", SLIDING)
def test_the_inductor_package_verifies_past_the_window(family, tmp_path, monkeypatch):
    """The package's sliding layers read only the rows from where their window starts (rounded down to WINDOW_BLOCK,
    4 here so that the tiny window's steps start past row 0): greedy output stays plain's, and rows before the window
    are never read (NaN there changes nothing, where a read of them would turn the logits NaN). A batch runs eagerly
    on the same engine."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", FAST_INDUCTOR)
    monkeypatch.setattr(importlib.import_module("medusa.runtime.verify"), "WINDOW_BLOCK", 4)  # (the module)
    base = make_tiny_model(family, sliding=True)
    model = medusa_of(base)
    ran, run = [], medusa.runtime.aot.run
    monkeypatch.setattr(medusa.runtime.aot, "run", lambda *a, **k: ran.append(1) or run(*a, **k))
    prompt = prompt_of(14, seed=4)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, proposer="dynamic", engine="inductor")
    assert out[0, len(prompt) :].tolist() == greedy(base, prompt)
    engine = engine_for(base, "inductor")
    assert engine.package is not None and len(ran) > 0  # the steps ran in the package
    assert not engine.batch_ahead_of_time
    cache, past = engine.new_cache(64), len(prompt)
    engine.prefill(cache, torch.tensor([prompt]))
    candidates = Candidates(tokens=torch.tensor([3, 5, 7]), tree=build_buffers(TreeSpec(chain(2)), 2))
    read = engine.verify(cache, candidates, past)
    first = (past - WINDOW + 1) // 4 * 4  # where the sliding layers' read starts
    assert first > 0
    with torch.inference_mode():  # (the cache's tensors are inference tensors)
        for layer, sliding in zip(cache.layers, sliding_layers(base.config)):
            if sliding:
                layer.keys[:, :, :first], layer.values[:, :, :first] = torch.nan, torch.nan
    assert torch.equal(engine.verify(cache, candidates, past).logits, read.logits)
    assert torch.isnan(CompiledEngine.verify(engine, cache, candidates, past).logits).all()  # a whole read: NaN
    prompts = [prompt_of(5, seed=5), prompt]
    ids, mask = left_padded(prompts, 0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, proposer="dynamic", engine="inductor")
    for row, each in enumerate(prompts):
        assert out[row, ids.shape[1] :].tolist() == greedy(base, each)


def test_layer_masks_hide_exactly_what_the_window_leaves_out():
    base = make_tiny_model("gemma3", sliding=True)
    rows, queries = 30, 3
    mask = torch.zeros((2, 1, queries, rows))
    mask[0, 0, :, 25:] = torch.finfo(mask.dtype).min  # row 0: unwritten rows
    positions = torch.tensor([[20, 21, 21], [10, 11, 12]])
    offsets = [0, 4]  # row 1: 4 rows of padding before its tokens
    masks = layer_masks(base.config, mask, positions, offsets)
    assert torch.equal(masks["full_attention"], mask)
    hidden = masks["sliding_attention"] != 0
    for b in range(2):
        for q in range(queries):
            key_positions = torch.arange(rows) - offsets[b]
            far = positions[b, q] - key_positions >= WINDOW
            assert torch.equal(hidden[b, 0, q], far | (mask[b, 0, q] != 0)), (b, q)
    assert layer_masks(make_tiny_model("llama").config, mask, positions) is mask  # no sliding layer: as it was
    one_for_all = layer_masks(make_tiny_model("mistral", sliding=True).config, mask, positions, offsets)
    assert torch.equal(one_for_all, masks["sliding_attention"])  # no layer types: every layer's mask windowed


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_every_node_of_a_tree_past_the_window_gets_the_models_own_logits(family, engine):
    """Each node's logits (siblings and rejected branches too: what sampling reads) equal those of the model's own
    forward over the prompt and that node's path, long past the window."""
    base = make_tiny_model(family, sliding=True)
    prompt = torch.tensor([prompt_of(14, seed=6)])
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    candidates = Candidates(
        tokens=torch.randint(1, VOCAB, (tree.num_nodes,), generator=torch.Generator().manual_seed(7)), tree=tree
    )
    target = engine_for(base, engine)
    state = prefill(base, prompt, SamplingConfig(), engine=target, max_length=64)
    verified = target.verify(state.cache, candidates, state.length)
    for node in range(tree.num_nodes):
        path = [node]
        while path[-1] != 0:
            path.append(int(tree.parent[path[-1]]))
        ids = torch.cat([prompt[0], candidates.tokens[path[::-1]]])[None]
        with torch.no_grad():
            expected = base(ids).logits[0, -1]
        torch.testing.assert_close(verified.logits[node], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_window_read_from_a_block_boundary_attends_as_a_read_of_every_row(rows):
    """Why WINDOW_BLOCK: torch's flash kernel over keys that start on a multiple of it computes, bit for bit, what it
    computes over every key under the same mask (the rows before weigh exactly 0), where a start elsewhere rounds
    otherwise; the sliding layers' read keeps fp32 decoding what it was."""
    torch.manual_seed(0)
    keys, window = 2100, 512
    query = torch.randn(1, 4, rows, 64)
    key, value = torch.randn(1, 1, keys, 64), torch.randn(1, 1, keys, 64)
    positions = keys - rows + torch.arange(rows)
    hidden = (positions[:, None] - torch.arange(keys)[None] >= window) | (torch.arange(keys)[None] > positions[:, None])
    mask = torch.zeros(rows, keys).masked_fill(hidden, torch.finfo(torch.float32).min)[None, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    whole = sdpa(query, key, value, attn_mask=mask, enable_gqa=True)
    first = positions[0].item() - window + 1
    aligned = first // WINDOW_BLOCK * WINDOW_BLOCK
    assert 0 < aligned < first
    part = lambda at: sdpa(query, key[:, :, at:], value[:, :, at:], attn_mask=mask[..., at:], enable_gqa=True)  # noqa: E731
    assert torch.equal(part(aligned), whole)
    assert not torch.equal(part(first), whole)  # what the rounding down keeps away


def test_a_prompt_is_cut_every_chunk_and_a_few_last_rows_join_the_chunk_before():
    chunk = PREFILL_CHUNK
    assert prefill_chunks(chunk) == [(0, chunk)]
    assert prefill_chunks(2 * chunk + 100) == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, 2 * chunk + 100)]
    assert prefill_chunks(2 * chunk + 1) == [(0, chunk), (chunk, 2 * chunk + 1)]  # one row alone would be a GEMV
    assert prefill_chunks(chunk + chunk // 8) == [(0, chunk), (chunk, chunk + chunk // 8)]


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("length", [3 * PREFILL_CHUNK + 76, 3 * PREFILL_CHUNK + 6])
@pytest.mark.parametrize("reads", ["written rows", "whole allocation"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16", "w8a8"])
def test_a_long_prompt_prefills_in_chunks_bit_for_bit_as_in_one_forward(family, length, reads, precision, monkeypatch):
    """A sliding-window model's prompt longer than a chunk runs in chunks (a last few rows joined to the chunk before):
    logits, what heads read and every cache row equal one forward's over the whole prompt bit for bit, in a cache
    whose layers show attention the rows written (the compiled engine's) or the whole allocation (a compiled cache's);
    the sliding layers read only their window's key blocks (rows before it turned NaN once written change nothing,
    where a read of them would turn everything NaN). At each precision: w8a8 attends row-invariantly up to
    ROW_INVARIANT_ROWS rows, which a last chunk of a few rows would take."""
    if precision == "bfloat16" and not native_bf16():
        pytest.skip("bf16 where the CPU emulates it is refused at load; its engine keeps transformers' attention")
    base = make_tiny_model(family, dtype=torch.float32 if precision == "float32" else torch.bfloat16, sliding=True)
    if precision == "w8a8":
        quantize_target(base, "w8a8")
    engine = engine_for(base, "compiled")
    prompt = torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    layers = PrefixStaticLayer if reads == "written rows" else GuardedStaticLayer
    cache = engine._static_cache(layers, 4 * PREFILL_CHUNK)
    whole = run_prefill(engine.eager_runner, cache, prompt, (0,))
    rows = [layer.keys[:, :, :length].clone() for layer in cache.layers]
    verify_module = importlib.import_module("medusa.runtime.verify")
    reads, reading_rows = [], verify_module.reading_rows

    def poisoned(view_of, firsts, visible):  # a chunk's read: the sliding layers' rows before it made NaN first
        reads.append(firsts)
        with torch.inference_mode():
            for layer, first in zip(view_of.layers, firsts):
                layer.keys[:, :, :first], layer.values[:, :, :first] = torch.nan, torch.nan
        return reading_rows(view_of, firsts, visible)

    monkeypatch.setattr(verify_module, "reading_rows", poisoned)
    chunked = engine.prefill(cache, prompt, (0,))
    assert len(reads) == len(prefill_chunks(length)) == 4 - (length % PREFILL_CHUNK < PREFILL_CHUNK // 8)
    last = reads[-1]
    assert [first > 0 for first in last] == sliding_layers(base.config)  # the last chunk reads windows only
    assert torch.equal(chunked.logits, whole.logits) and torch.equal(chunked.hidden, whole.hidden)
    for layer, expected, first in zip(cache.layers, rows, last):
        assert torch.equal(layer.keys[:, :, first:length], expected[:, :, first:])
    assert cache.get_seq_length() == length
