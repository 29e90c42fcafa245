"""The EAGLE-3 drafter: training-time test computes what decoding computes, and decoding with it is exact."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from medusa import MedusaModel
from medusa.eagle3 import (
    COPY_NGRAM,
    Eagle3Draft,
    Eagle3Model,
    additive_mask,
    default_aux_layers,
    unrolled_outputs,
    unrolled_visibility,
)
from medusa.sampling import SamplingConfig
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_tiny_model

AUX = [0, 1]  # the tiny targets have 2 layers: the residual streams entering each


def random_draft(target, seed: int = 3, draft_vocab: int = VOCAB // 2, scale: float = 0.5) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(target.config, AUX, draft_vocab, VOCAB)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=scale / parameter.shape[-1] ** 0.5)
    draft.set_vocabulary(torch.randperm(VOCAB)[:draft_vocab].sort().values)
    return draft.eval()


def test_default_aux_layers_are_eagle3s_low_middle_and_high():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layers(32) == [2, 16, 29]  # Llama-3.1-8B, as EAGLE-3 picks them


def test_the_unrolled_mask_shows_each_step_what_its_cache_holds():
    visible = unrolled_visibility(3, 2)
    assert visible.tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_training_time_test_computes_what_decoding_computes(family):
    """Every anchor of the unrolled training forward against a decode-style run: the committed positions fed on a
    fresh cache, then one drafted token at a time. A mask that let a step see another anchor's drafts (or its own
    future) would differ here."""
    target = make_tiny_model(family)
    draft = random_draft(target)
    embed = target.get_input_embeddings()
    length, steps = 9, 3
    ids = torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, length, len(AUX) * HIDDEN, generator=torch.Generator().manual_seed(1))
    unrolled = unrolled_outputs(draft, embed, features, ids, steps)
    for anchor in (0, 3, length - 1 - steps):
        cache = DynamicCache()
        n = anchor + 1
        mask = additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32)
        hidden = draft(draft.fuse(features[:, :n]), embed(ids[:, 1 : n + 1]), torch.arange(n)[None], mask, cache)
        hidden = hidden[:, -1:]
        torch.testing.assert_close(hidden[0, 0], unrolled[0][0, anchor], atol=1e-5, rtol=1e-5)
        for step in range(1, steps):
            rows = cache.get_seq_length() + 1
            mask = additive_mask(torch.ones(1, rows, dtype=torch.bool), torch.float32)
            token = ids[:, anchor + step + 1 : anchor + step + 2]
            hidden = draft(hidden, embed(token), torch.tensor([[anchor + step]]), mask, cache)
            torch.testing.assert_close(hidden[0, 0], unrolled[step][0, anchor], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("depth", [1, 4])
def test_greedy_output_is_the_targets_greedy_output(family, depth):
    target = make_tiny_model(family)
    model = Eagle3Model(target, random_draft(target), num_speculative_tokens=depth)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    want = target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert max(out.stats.proposed_lengths) == depth


def test_a_draft_that_guesses_right_is_always_accepted():
    """An oracle in place of the draft's output layer: it names the token of the target's greedy continuation at the
    position each row drafts for (the row's position, as the proposer hands it to the draft, plus two). Every chain is
    then accepted whole; a proposer that fed the draft the wrong positions would not line up with it."""
    target = make_tiny_model("llama")
    draft = random_draft(target, draft_vocab=VOCAB)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    sequence = target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0]
    model = Eagle3Model(target, draft, num_speculative_tokens=3)
    positions, forward = [], model.proposal_draft.forward

    def recording(hidden, token_embeds, position_ids, *args, **kwargs):
        positions[:] = position_ids[0].tolist()
        return forward(hidden, token_embeds, position_ids, *args, **kwargs)

    def oracle(hidden):  # the rows of the last run, or its last row alone
        logits = torch.full((hidden.shape[0], VOCAB), -1e9)
        for row, position in enumerate(positions[-hidden.shape[0] :]):
            logits[row, sequence[position + 2]] = 0.0
        return logits

    model.proposal_draft.forward, model.proposal_draft.logits = recording, oracle
    out = model.generate(prompt, max_new_tokens=33, return_dict_in_generate=True)
    assert torch.equal(out.sequences[0], sequence[: 7 + 33])
    assert out.stats.accepted_lengths == [4] * 8  # 1 (prefill) + 8 steps of 4 = 33 tokens


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(aux=[0, 1, 5]), "reads the target's layers"),
        (dict(vocab=VOCAB + 4), "maps a vocabulary of"),
    ],
)
def test_a_draft_for_another_target_is_refused(change, message):
    target = make_tiny_model("llama")
    draft = Eagle3Draft(target.config, change.get("aux", AUX), 8, change.get("vocab", VOCAB))
    with pytest.raises(ValueError, match=message):
        Eagle3Model(target, draft)


def test_bad_vocabularies_are_named():
    target = make_tiny_model("llama")
    draft = Eagle3Draft(target.config, AUX, 4, VOCAB)
    with pytest.raises(ValueError, match="distinct target ids in ascending order"):
        draft.set_vocabulary(torch.tensor([3, 2, 5, 7]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 96\)"):
        draft.set_vocabulary(torch.tensor([3, 5, 7, 200]))
    draft.set_vocabulary(torch.tensor([3, 5, 7, 90]))
    assert draft.target_ids.tolist() == [3, 5, 7, 90]
    assert draft.t2d.nonzero().flatten().tolist() == [3, 5, 7, 90]


@pytest.mark.parametrize("format", ["speculators", "eagle3"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()  # not inference_mode: the int8 copy the model proposes with tracks its weights' versions
def test_a_saved_draft_loads_back_to_the_same_logits(tmp_path, format, family):
    from medusa.eagle3_io import is_eagle3, load_eagle3, save_eagle3

    target = make_tiny_model(family)
    draft = random_draft(target)
    save_eagle3(
        draft,
        tmp_path / "draft",
        format=format,
        verifier="org/target",
        verifier_architectures=["X"],
        embed_tokens=target.get_input_embeddings().weight,
    )
    assert is_eagle3(tmp_path / "draft")
    loaded, config = load_eagle3(tmp_path / "draft")
    features = torch.randn(1, 6, len(AUX) * HIDDEN, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    embed = target.get_input_embeddings()
    for want, got in zip(
        unrolled_outputs(draft, embed, features, ids, 2), unrolled_outputs(loaded, embed, features, ids, 2)
    ):
        assert torch.equal(draft.logits(want), loaded.logits(got))
    assert torch.equal(loaded.target_ids, draft.target_ids)
    if format == "speculators":
        assert config["speculators_config"]["verifier"] == {"name_or_path": "org/target", "architectures": ["X"]}
        assert config["norm_before_residual"] is False  # vLLM assumes True where the key is absent
        assert config["transformer_layer_config"]["model_type"] == family
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    model = MedusaModel.from_draft_model(target, str(tmp_path / "draft"))
    assert isinstance(model, Eagle3Model)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    want = target.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=12), want)


def test_unreadable_drafts_are_named(tmp_path):
    import json

    from medusa.eagle3_io import load_eagle3, save_eagle3

    target = make_tiny_model("llama")
    with pytest.raises(ValueError, match="holds no EAGLE-3 draft"):
        load_eagle3(tmp_path)
    directory = save_eagle3(random_draft(target), tmp_path / "draft", embed_tokens=target.get_input_embeddings().weight)
    config = json.loads((directory / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not record which target layers"):
        load_eagle3(directory)
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 1]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor fc.weight has shape \(64, 128\), its config implies \(64, 192\)"):
        load_eagle3(directory)
    (directory / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_eagle3(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        load_eagle3(directory)


def test_export_adds_the_targets_embeddings_and_refuses_heads_formats(tmp_path, capsys):
    from safetensors.torch import load_file

    from medusa.cli.export import main as export
    from medusa.eagle3_io import load_eagle3, save_eagle3
    from medusa.loading import load_base
    from tests.test_train import save_tiny_base

    base_dir = save_tiny_base(tmp_path / "base")
    target, _ = load_base(str(base_dir))
    draft = random_draft(target)
    save_eagle3(draft, tmp_path / "draft", verifier=str(base_dir), verifier_architectures=["LlamaForCausalLM"])
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "draft" / "model.safetensors"))
    for format in ("speculators", "eagle3"):
        out = export([str(tmp_path / "draft"), str(tmp_path / format), "--format", format, "--base-name", "org/t"])
        weights = load_file(str(out / "model.safetensors"))
        assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
        loaded, config = load_eagle3(out)
        assert torch.equal(loaded.fc.weight, draft.fc.weight)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert load_eagle3(tmp_path / "speculators")[1]["speculators_config"]["verifier"]["name_or_path"] == "org/t"
    with pytest.raises(SystemExit):
        export([str(tmp_path / "draft"), str(tmp_path / "x"), "--format", "vllm"])
    assert "holds an EAGLE-3 draft: export it with --format speculators or eagle3" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.inference_mode()
def test_each_tree_node_expands_into_what_the_draft_says_along_its_path(family):
    """Every node's children in a drafted tree are the likeliest tokens of the draft's logits computed by feeding the
    node's path one token at a time on a copy of the committed cache: the tree mask shows each node exactly its
    ancestors, at the right positions."""
    import copy

    from medusa.decode import prefill

    target = make_tiny_model(family)
    draft = random_draft(target, scale=1.0)
    for projection in (draft.layers[0].self_attn.q_proj, draft.layers[0].self_attn.k_proj):
        projection.weight.mul_(8.0)  # sharp attention: a row shown or hidden, or a position off by one, shows
    embed = target.get_input_embeddings()
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    state = prefill(target, prompt, SamplingConfig(), feature_layers=AUX)
    model = Eagle3Model(target, draft, num_speculative_tokens=4, num_nodes=24, topk=3, int8=False, copy_ngram=0)
    candidates = model.make_proposer(None, None, SamplingConfig(), None).propose(state)
    tokens, parent = candidates.tokens.tolist(), candidates.tree.parent.tolist()
    depth = candidates.tree.depth.tolist()
    assert len(tokens) == 24 and max(depth) >= 3
    # siblings with children of their own: a mask that showed a node its parent's siblings would differ
    assert len({parent[i] for i in range(1, 24) if depth[i] == 3}) > 1

    length = state.length
    cache = DynamicCache()
    following = torch.tensor([state.tokens[1 : length + 1]])
    mask = additive_mask(torch.ones(length, length, dtype=torch.bool).tril(), torch.float32)
    root_hidden = draft(
        draft.fuse(state.new_hidden[None, :, HIDDEN:]), embed(following), torch.arange(length)[None], mask, cache
    )[:, -1:]

    def path_logits(node: int) -> torch.Tensor:
        path = []
        while node:
            path.insert(0, tokens[node])
            node = parent[node]
        rows, hidden = copy.deepcopy(cache), root_hidden
        for step, token in enumerate(path):
            visible = additive_mask(torch.ones(1, rows.get_seq_length() + 1, dtype=torch.bool), torch.float32)
            hidden = draft(hidden, embed(torch.tensor([[token]])), torch.tensor([[length + step]]), visible, rows)
        return draft.logits(hidden[0, -1])

    for node in range(len(tokens)):
        children = {tokens[i] for i in range(1, len(tokens)) if parent[i] == node}
        if children:
            # a node's children in the cut are the likeliest of its top-k (scores add the same parent score)
            top = set(draft.target_ids[path_logits(node).topk(len(children)).indices].tolist())
            assert children == top, (node, children, top)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.inference_mode()
def test_a_drafted_tree_tries_the_copy_chain_first_where_the_text_repeats(family):
    """Where the last tokens occurred before, the tree holds what followed them (medusa.ngram.copy_chain) as the
    root's first child and down its path, whatever the draft says; with copy_ngram=0 it holds the draft's own."""
    from medusa.decode import prefill
    from medusa.ngram import copy_chain

    target = make_tiny_model(family)
    draft = random_draft(target)
    proposers = {
        copy: Eagle3Model(target, draft, num_speculative_tokens=3, num_nodes=6, topk=3, int8=False, copy_ngram=copy)
        for copy in (4, 0)
    }
    changed = 0
    for seed in range(6):
        prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        # a tiny random model's greedy text soon repeats itself: decode some, then stand just before its last token
        text = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        state = prefill(target, text[:, :-1], SamplingConfig(), feature_layers=AUX)
        copies = copy_chain(torch.tensor(state.tokens), 4, 3)
        if not copies:
            continue
        trees = {}
        for copy, model in proposers.items():
            candidates = model.make_proposer(None, None, SamplingConfig(), None).propose(state)
            trees[copy] = (candidates.tokens.tolist(), candidates.tree.parent.tolist())
        tokens, parent = trees[4]
        node = 0
        for token in copies:  # the copy chain is a path from the root, each step its node's first child
            node = next(i for i in range(1, len(tokens)) if parent[i] == node)
            assert tokens[node] == token, (seed, copies, tokens, parent)
        changed += trees[0][0][1] != copies[0]
    assert changed > 0  # the draft alone would have guessed otherwise


@pytest.mark.parametrize("family", FAMILIES)
def test_a_drafted_tree_keeps_greedy_identity(family):
    target = make_tiny_model(family)
    model = Eagle3Model(target, random_draft(target), num_speculative_tokens=3, num_nodes=8, topk=3)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    want = target.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert max(out.stats.proposed_lengths) <= 3


DECODED = {"tau": {"eagle3": {"2": 1.9, "4": 3.6}}, "nodes": {"eagle3": {"2": 2.0, "4": 4.0}}, "source": "a test"}


def test_the_plan_times_the_drafts_decoded_tree_sizes_and_keeps_them_apart_from_other_drafts(tmp_path, monkeypatch):
    from medusa.plan import load_or_calibrate, plan_key

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    target = make_tiny_model("llama")
    model = Eagle3Model(target, random_draft(target), num_speculative_tokens=3)
    model.decoded_taus = DECODED
    plan = model.calibrate(progress=False, compile=False)
    timed = {(o["engine"], o["proposer"], o["num_nodes"]) for o in plan.options}
    for engine in plan.latency_ms:
        assert {(engine, "plain", 1), (engine, "eagle3", 2), (engine, "eagle3", 4)} <= timed
    assert all(o["step_ms"] > 0 for o in plan.options)
    assert plan.proposer == "plain" or (plan.proposer, len(plan.tree) + 1) in {("eagle3", 2), ("eagle3", 4)}
    assert load_or_calibrate(model, progress=False, compile=False) == plan  # cached: read back, not measured again
    key = plan_key(model, ("eager",))
    with torch.no_grad():
        model.draft.fc.weight.mul_(2)
    assert plan_key(model, ("eager",))["heads"] != key["heads"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_planned_tree_guarded_online_keeps_greedy_identity_through_plain_steps(family):
    """A plan whose plain step is unbeatable: each window of guesses loses, the guard decodes plainly for a while
    (the draft reads those positions later: Eagle3Proposer.skip), then guesses again."""
    from medusa.plan import Plan
    from medusa.tree import chain

    target = make_tiny_model(family)
    model = Eagle3Model(target, random_draft(target), num_speculative_tokens=3)
    model.plan = Plan(engine="eager", proposer="eagle3", tree=chain(3), expected_speedup=2.0, plain_ms=1e-6, reason="")
    assert model.default_engine == "eager" and model.default_sampling_rule == "rejection"  # a tree's rule
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    want = target.generate(prompt, max_new_tokens=90, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=90, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    proposed = out.stats.proposed_lengths
    first_plain = proposed.index(0)
    assert max(proposed[:first_plain]) > 0 and max(proposed[first_plain:]) > 0  # guessing resumed after plain steps
    assert max(out.stats.verified_nodes) == 4


def test_decoded_taus_written_beside_a_draft_reach_its_plan(tmp_path, monkeypatch, capsys):
    from medusa.cli.accuracy import main as accuracy
    from medusa.cli.calibrate import main as calibrate
    from medusa.eagle3_io import save_eagle3
    from tests.conftest import save_tiny_checkpoint

    base, _ = save_tiny_checkpoint(tmp_path, "llama")
    target = make_tiny_model("llama")  # the saved base's shapes: what the draft is built for
    save_eagle3(
        random_draft(target),
        tmp_path / "draft",
        format="speculators",
        verifier=str(base),
        verifier_architectures=["LlamaForCausalLM"],
        embed_tokens=target.get_input_embeddings().weight,
    )
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "x", "turns": ["hello there"]}\n')
    args = ["--taus", "--eagle3", str(tmp_path / "draft"), "--base", str(base), "--questions", str(questions)]
    accuracy([*args, "--gamma", "2", "--max-new-tokens", "12", "--out", str(tmp_path / "taus.json"), "--heads-dir"])
    model = MedusaModel.from_draft_model(str(base), str(tmp_path / "draft"), plan="off")
    taus = model.decoded_taus["tau"]["eagle3"]
    assert set(taus) == {"2", "4", "6", "8", "12", "16", "24"} and all(value >= 1 for value in taus.values())
    assert "--eagle3" in model.decoded_taus["source"] and model.decoded_taus["copy_ngram"] == COPY_NGRAM
    # taus decoded with another copy guess do not say what this one accepts: the plan goes without them
    other = MedusaModel.from_draft_model(str(base), str(tmp_path / "draft"), plan="off", copy_ngram=0)
    assert other.copy_ngram == 0 and other.decoded_taus is None
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    plan = calibrate(["--eagle3", str(tmp_path / "draft"), "--base", str(base), "--no-compile"])
    assert {str(o["num_nodes"]) for o in plan["options"] if o["proposer"] == "eagle3"} == set(taus)
    with pytest.raises(SystemExit):
        accuracy(["--eagle3", str(tmp_path / "draft"), "--out", str(tmp_path / "x.json")])  # scoring is for heads
    assert "add --taus" in capsys.readouterr().err


def test_plan_and_engine_are_refused_for_a_draft_model():
    target, draft = make_tiny_model("llama"), make_tiny_model("llama")
    with pytest.raises(ValueError, match="apply to EAGLE-3 drafts"):
        MedusaModel.from_draft_model(target, draft, engine="compiled")
    with pytest.raises(ValueError, match="copy_ngram apply to EAGLE-3 drafts"):
        MedusaModel.from_draft_model(target, draft, copy_ngram=2)


@pytest.mark.parametrize("kind", ["eagle3", "draft model"])
def test_a_loaded_target_keeps_its_precision(kind):
    """A bf16 target handed over as a model stays bf16: it was converted to float32 in place, under the Medusa model
    that shared it (whose engines then decoded garbage)."""
    target = make_tiny_model("llama").to(torch.bfloat16)
    draft = random_draft(target) if kind == "eagle3" else make_tiny_model("llama").to(torch.bfloat16)
    model = MedusaModel.from_draft_model(target, draft, plan="off") if kind == "eagle3" else None
    model = model or MedusaModel.from_draft_model(target, draft)
    assert model.target is target and target.dtype == torch.bfloat16
    assert MedusaModel.from_draft_model(target, draft, dtype="float32").target.dtype == torch.float32  # when asked


def test_a_draft_is_named_by_the_package_a_directory_or_a_hub_id(tmp_path, monkeypatch):
    """`embedded:<name>` finds a shipped draft and lists them for an unknown name; heads and the embedded base, the
    draft-model names and a causal LM's repo resolve to no draft; a Hub repo fetches its config.json first and its
    weights only when that declares an EAGLE-3 draft, which then loads as one."""
    from medusa.eagle3_io import SHIPPED_DRAFT, is_eagle3, resolve_draft, save_eagle3
    from medusa.hub import EMBEDDED_HEADS_ROOT
    from tests.test_hub import serve

    shipped = resolve_draft(SHIPPED_DRAFT)
    assert shipped == EMBEDDED_HEADS_ROOT / "smollm2-135m-instruct-eagle3" and is_eagle3(shipped)
    with pytest.raises(
        FileNotFoundError, match=r"no embedded EAGLE-3 drafts named 'nope'.*smollm2-135m-instruct-eagle3"
    ):
        resolve_draft("embedded:nope")
    for other in ("embedded:smollm2-135m-instruct", "embedded:smollm2-135m-instruct-medusa1", "int8", "early-exit:2"):
        assert resolve_draft(other) is None, other

    target = make_tiny_model("llama")
    save_eagle3(random_draft(target), tmp_path / "source", embed_tokens=target.get_input_embeddings().weight)
    (tmp_path / "snapshot").mkdir()
    hub = serve(monkeypatch, tmp_path / "source", tmp_path / "snapshot")
    model = MedusaModel.from_draft_model(target, "org/tiny-eagle3", plan="off")
    assert isinstance(model, Eagle3Model) and [c["allow_patterns"] for c in hub.calls][0] == ["config.json"]
    assert any("*.safetensors" in c["allow_patterns"] for c in hub.calls[1:])
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    want = target.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=8), want)

    make_tiny_model("llama").save_pretrained(tmp_path / "lm")  # a causal LM's repo: its config only
    (tmp_path / "lm-snapshot").mkdir()
    hub = serve(monkeypatch, tmp_path / "lm", tmp_path / "lm-snapshot")
    assert resolve_draft("org/tiny-lm") is None
    assert [c["allow_patterns"] for c in hub.calls] == [["config.json"]]


def test_the_shipped_draft_is_for_the_embedded_target_and_keeps_its_decoded_taus():
    from medusa.eagle3_io import SHIPPED_DRAFT, load_eagle3, resolve_draft
    from medusa.loading import DEFAULT_BASE
    from medusa.plan import DRAFT_PROPOSER, load_draft_taus

    directory = resolve_draft(SHIPPED_DRAFT)
    draft, config = load_eagle3(directory)
    assert config["speculators_config"]["verifier"]["name_or_path"] == DEFAULT_BASE
    assert draft.aux_layers == default_aux_layers(30) and draft.t2d.numel() == 49152 and draft.d2t.numel() == 8192
    assert int(draft.t2d.sum()) == 8192 and bool((draft.target_ids[1:] > draft.target_ids[:-1]).all())
    decoded = load_draft_taus(directory)
    assert decoded["copy_ngram"] == COPY_NGRAM  # decoded as it proposes by default, or the plan would drop them
    taus = decoded["tau"][DRAFT_PROPOSER]
    assert list(taus) == ["2", "4", "6", "8", "12", "16", "24"] and taus["8"] > 1.5  # a trained draft's
    assert "embedded:smollm2-135m-instruct-eagle3" in (directory / "README.md").read_text()
