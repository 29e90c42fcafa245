"""Integration on the real embedded SmolLM2-135M-Instruct (fp32): greedy identity, loading, the shipped heads."""

import functools
import time

import pytest
import torch

from medusa import MedusaModel
from medusa.loading import convert_gguf, default_gguf_path, gguf_cache_dir
from tests.conftest import make_heads

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works, with an example in Python.",
    "What are the health benefits of green tea?",
    "Summarize the causes of the French Revolution in a few sentences.",
    "Give me three tips for writing a good cover letter.",
]
# Tokens per step of the shipped plain Medusa-1 heads on a 2-node chain over PROMPTS[:3]: 1.19 measured (1.23, 1.20,
# 1.14); untrained heads stay near 1.0
MEDUSA1_MIN_TAU = 1.1


def _chat(model, text):
    return model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )


@pytest.fixture(scope="module")
def shipped():
    return MedusaModel.from_pretrained()


@pytest.fixture(scope="module")
def plain_greedy(shipped):
    """transformers' greedy generate on the base for a chat prompt, computed once per (prompt, length) in a process:
    several tests compare against the same references, each seconds of eager decoding."""

    @functools.cache
    def generate(text: str, max_new_tokens: int) -> torch.Tensor:
        return shipped.base.generate(**_chat(shipped, text), max_new_tokens=max_new_tokens, do_sample=False)

    return generate


def test_gguf_is_converted_once():
    cached = convert_gguf(default_gguf_path())
    assert cached == gguf_cache_dir(default_gguf_path()) and (cached / "config.json").is_file()
    stamp = (cached / "config.json").stat().st_mtime
    start = time.perf_counter()
    assert convert_gguf(default_gguf_path()) == cached
    assert (cached / "config.json").stat().st_mtime == stamp and time.perf_counter() - start < 1.0


def test_shipped_heads_greedy_identity_and_they_are_trained(shipped, plain_greedy):
    taus = []
    for text in PROMPTS:
        out = shipped.generate(_chat(shipped, text), max_new_tokens=128, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain_greedy(text, 128)), text
        taus.append(out.stats.mean_accepted_tokens)
    # The shipped heads on their default 3-node tree accept ~1.56 tokens a step on these prompts; untrained heads
    # stay near 1.0. Candidate ids rounded to bf16 on saving (a bug once) still give ~1.41, but lose uniqueness.
    assert sum(taus) / len(taus) > 1.35, taus
    subset = shipped.heads.vocab_subset
    assert subset.dtype == torch.long and subset.unique().numel() == subset.numel() == shipped.config.vocab_subset_size


def test_random_heads_greedy_identity(shipped, plain_greedy):
    config = shipped.config
    heads = make_heads(num_heads=config.num_heads, random=True, hidden=config.hidden_size, vocab=config.vocab_size)
    model = MedusaModel(shipped.base, heads, shipped.tokenizer, tree=[[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
    for text in PROMPTS:
        assert torch.equal(model.generate(_chat(model, text), max_new_tokens=128), plain_greedy(text, 128)), text


@pytest.mark.parametrize("proposer", ["medusa", None])  # None: what an untrained model guesses with, prompt lookup
def test_untrained_heads_greedy_identity_and_stats(shipped, proposer):
    model = MedusaModel.from_base(shipped.base, tokenizer=shipped.tokenizer)
    ids = _chat(model, PROMPTS[0])
    out = model.generate(ids, max_new_tokens=64, proposer=proposer, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.base.generate(**ids, max_new_tokens=64, do_sample=False))
    assert 1.0 <= out.stats.mean_accepted_tokens and out.stats.steps <= 64


def test_stops_at_eos_like_generate(shipped):
    ids = _chat(shipped, "Say just the word 'yes'.")
    reference = shipped.base.generate(**ids, max_new_tokens=100, do_sample=False)
    out = shipped.generate(ids, max_new_tokens=100)
    assert torch.equal(out, reference)
    assert out[0, -1].item() == shipped.tokenizer.eos_token_id


def test_compiled_engine_and_a_calibrated_plan_on_the_real_model(shipped, plain_greedy, tmp_path, monkeypatch):
    """The compiled engine (StaticCache, pre-packed weights) keeps every shipped-heads output equal to transformers'
    eager greedy generate, for plain decoding, the dynamic tree and the hybrid; a (short) calibration on this machine
    yields a plan whose default generate is equal too (a long prompt's as well, its tree sized for its context), and
    it is cached and read back."""
    import medusa.plan

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    assert shipped.accuracy is not None  # medusa_accuracy.json ships beside the heads
    monkeypatch.setattr(medusa.plan, "SIZES", (1, 4, 8))
    plan = medusa.plan.load_or_calibrate(shipped, progress=False)
    assert plan.latency_ms and plan.options and plan.plain_ms > 0
    assert medusa.plan.load_or_calibrate(shipped, progress=False).options == plan.options  # cached
    if plan.proposer == "dynamic":  # its trees timed at a long context too, each size
        assert plan.long_context == medusa.plan.LONG_CONTEXT and set(plan.long_latency_ms) == {"1", "4", "8"}
        assert set(plan.short_latency_ms) == {"1", "4", "8"}  # the same fit at CONTEXT, what growth is measured from
    assert set(plan.latency_ms[plan.engine]) == {"1", "4", "8"}  # the sizes this test times, no more
    try:
        shipped.plan = plan
        long_text = " ".join(PROMPTS * 40)  # about 2,300 tokens: the tree sized for that context, still exact
        assert torch.equal(shipped.generate(_chat(shipped, long_text), max_new_tokens=32), plain_greedy(long_text, 32))
        for text in PROMPTS[:3]:
            ids, reference = _chat(shipped, text), plain_greedy(text, 96)
            for kwargs in (
                dict(proposer="plain", engine="compiled"),
                dict(proposer="dynamic", engine="compiled", tree="smollm2-135m-cpu-bf16"),
                dict(proposer="hybrid", engine="compiled"),
                {},
            ):
                out = shipped.generate(ids, max_new_tokens=96, **kwargs)
                assert torch.equal(out, reference), (text, kwargs)
    finally:
        shipped.plan = None


def test_the_exportable_heads_keep_greedy_identity_and_export_to_both_layouts(shipped, plain_greedy, tmp_path):
    """The shipped plain Medusa-1 set (embedded:smollm2-135m-instruct-medusa1): greedy identity with more than one token
    a step, and each export layout (the base lm_head copied into every head) read back gives the heads' own logits on
    the real model's hidden states (over the candidate tokens medusa ranks)."""
    from medusa.heads_io import FORMATS, export_directory, import_heads, load_heads, resolve_heads

    name = "embedded:smollm2-135m-instruct-medusa1"
    plain = MedusaModel(shipped.base, load_heads(resolve_heads(name)), shipped.tokenizer)
    assert not (plain.config.context_window or plain.config.condition_on_next_token or plain.config.feature_layers)
    taus = []
    for text in PROMPTS[:3]:
        out = plain.generate(_chat(plain, text), max_new_tokens=96, tree=[[0], [0, 0]], return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain_greedy(text, 96)), text
        taus.append(out.stats.mean_accepted_tokens)
    assert sum(taus) / len(taus) > MEDUSA1_MIN_TAU, taus  # untrained heads stay near 1.0

    ids = _chat(plain, PROMPTS[1])["input_ids"]
    with torch.no_grad():
        hidden = shipped.base(ids, output_hidden_states=True).hidden_states[-1][0]
        ours = plain.heads(hidden, shipped.base.get_output_embeddings())
        subset = plain.heads.vocab_subset
        for fmt in FORMATS:
            out = export_directory(  # fp32: the stored bf16 would round the copied lm_head
                name,
                tmp_path / fmt,
                fmt,
                base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                dtype=torch.float32,
            )
            imported = import_heads(out).float()
            theirs = imported(hidden, shipped.base.get_output_embeddings())
            torch.testing.assert_close(theirs[..., subset], ours[..., subset], rtol=1e-4, atol=1e-4)


def test_make_demo_runs_both_precisions_and_says_which_to_pick(tmp_path):
    """The README's first command, cut short: one prompt, eight tokens, no plan (no compiling), llama.cpp absent (its
    column says why it did not run). fp32 stays identical to transformers; the quantised run (int8 with AMX, w8a8
    elsewhere) is judged against its own plain decoding."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"
    env = {**os.environ, "LLAMA_CPP_BIN": str(tmp_path / "no-llama.cpp")}
    done = subprocess.run(
        [sys.executable, str(script), "--prompts", "1", "--max-new-tokens", "8", "--plan", "off"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    from medusa.precision import fastest_quantized_cpu

    assert "== float32" in out and f"== {fastest_quantized_cpu()}" in out and "llama.cpp: not run" in out
    assert "identical to transformers' generate 1/1" in out
    assert "which to pick:" in out and "-> " in out


def test_a_batch_on_each_engine_is_each_prompt_decoded_alone(shipped, plain_greedy, monkeypatch):
    """Three chat prompts of different lengths, left-padded, decoded together with the shipped heads' tree on the
    compiled engine (eagerly, pre-packed) and on the inductor engine (its batch package, compiled once per machine):
    every row is transformers' greedy output for that prompt alone."""
    import medusa.runtime.aot

    texts = [PROMPTS[1], "Hi!", PROMPTS[3]]
    chats = [_chat(shipped, text)["input_ids"][0].tolist() for text in texts]
    width = max(map(len, chats))
    ids = torch.tensor([[0] * (width - len(c)) + c for c in chats])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chats])
    packaged, run_rows = [], medusa.runtime.aot.run_rows
    monkeypatch.setattr(medusa.runtime.aot, "run_rows", lambda *a, **k: packaged.append(1) or run_rows(*a, **k))
    for engine in ("compiled", "inductor"):
        out = shipped.generate(ids, attention_mask=mask, max_new_tokens=48, proposer="dynamic", engine=engine)
        for row, (text, chat) in enumerate(zip(texts, chats)):
            reference = plain_greedy(text, 48)[0, len(chat) :]
            assert out[row, width : width + len(reference)].tolist() == reference.tolist(), (engine, text)
    assert packaged  # the inductor engine's steps ran through its batch package


def test_requests_joining_a_running_batch_each_decode_as_alone(shipped, plain_greedy, monkeypatch):
    """Continuous batching on the inductor engine's batch package with the shipped heads: chat prompts join the
    running batch two steps apart with their own max_new_tokens; each is transformers' greedy output for it alone."""
    import medusa.runtime.aot
    from medusa.batch import GenerationRequest

    texts = [PROMPTS[1], "Hi!", PROMPTS[3], PROMPTS[4]]
    news = [48, 8, 40, 24]
    requests = [GenerationRequest(_chat(shipped, t)["input_ids"], max_new_tokens=n) for t, n in zip(texts, news)]
    schedule, calls = {0: requests[:2], 2: requests[2:3], 4: requests[3:]}, []
    packaged, run_rows = [], medusa.runtime.aot.run_rows
    monkeypatch.setattr(medusa.runtime.aot, "run_rows", lambda *a, **k: packaged.append(1) or run_rows(*a, **k))

    def take(room):
        calls.append(room)
        return schedule.get(len(calls) - 1, [])

    shipped.generate_continuously(take, engine="inductor", proposer="dynamic")
    for request, text, new in zip(requests, texts, news):
        assert torch.equal(request.result.result(timeout=0).sequences, plain_greedy(text, new)), text
    assert max(request.rows for request in requests) >= 3 and packaged


def test_the_shipped_eagle3_draft_keeps_greedy_identity_and_guesses(shipped, plain_greedy):
    """The shipped EAGLE-3 draft (embedded:smollm2-135m-instruct-eagle3) on its target: a dynamic tree and a chain
    give transformers' greedy output, with more than one token a step."""
    from medusa.eagle3_io import SHIPPED_DRAFT

    tree = MedusaModel.from_draft_model(
        shipped.base, SHIPPED_DRAFT, tokenizer=shipped.tokenizer, plan="off", num_nodes=6
    )
    chain = MedusaModel.from_draft_model(shipped.base, SHIPPED_DRAFT, tokenizer=shipped.tokenizer, plan="off")
    assert tree.target is shipped.base and tree.decoded_taus is not None
    taus = {"tree": [], "chain": []}
    for text in PROMPTS[:3]:
        for name, model in (("tree", tree), ("chain", chain)):
            out = model.generate(_chat(model, text), max_new_tokens=96, return_dict_in_generate=True)
            assert torch.equal(out.sequences, plain_greedy(text, 96)), (name, text)
            taus[name].append(out.stats.mean_accepted_tokens)
    # measured 1.80 (6 nodes, copy guess included) and 1.59 (chain of 5) on these prompts; session 64's draft 1.81 and
    # 1.55, session 62's 1.58 and 1.39; a random draft stays near 1.0
    assert sum(taus["tree"]) / 3 > 1.65 and sum(taus["chain"]) / 3 > 1.45, taus


def test_the_benchmark_runs_the_shipped_draft_on_the_embedded_model(tmp_path):
    import json

    from medusa.cli import bench
    from medusa.eagle3_io import SHIPPED_DRAFT

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [PROMPTS[2]]}) + "\n")
    argv = ["--questions", str(questions), "--out", str(tmp_path / "run"), "--max-new-tokens", "16", "--threads", "2"]
    summary = bench.main(argv + ["--engine", "eager", "--plan", "off", "--methods", "baseline,eagle3"])
    assert summary["settings"]["eagle3"] == SHIPPED_DRAFT and summary["overall"]["eagle3"]["identical"] is True
