"""Several prompts in one generate (medusa.batch): every row is that prompt decoded alone with plain greedy, and the
whole output is what transformers' batched generate returns (left-padded prompts, rows that end early padded)."""

import pytest
import torch
from transformers import StoppingCriteria, TextStreamer

import medusa.batch
import medusa.decode
import medusa.propose
import medusa.runtime.aot
from medusa import MedusaModel
from medusa.acceptance import get_rule
from medusa.batch import (
    ALONE_FROM,
    PREFILL_SLACK,
    BatchDecoding,
    decode_batch,
    left_padded,
    prefill_groups,
    split_padded,
    time_batch_step,
)
from medusa.propose import CandidateProjection, PlainProposer
from medusa.runtime import can_prepack, engine_for
from medusa.sampling import SamplingConfig
from tests.conftest import FAMILIES, VOCAB, make_heads, make_tiny_model, tiny_tokenizer
from tests.test_greedy import OracleProposer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [12], [20, 21, 22, 23], [30, 31, 30, 31, 30, 31, 30]]


class RowOneStopsAtSix(StoppingCriteria):
    """Row 1 of PROMPTS (its prompt: [12]) stops after 6 new tokens."""

    def __call__(self, ids, scores, **kwargs):
        return torch.tensor([int(ids[0, 0]) == 12 and ids.shape[1] >= 7])


def padded(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def alone(base, prompt, max_new_tokens, **kwargs):
    ids = torch.tensor([prompt])
    return base.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("proposer", ["medusa", "dynamic", "prompt_lookup", "hybrid"])
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_each_row_is_its_prompt_decoded_alone(family, proposer, engine):
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    ids, mask = padded(PROMPTS)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=24,
        proposer=proposer,
        engine=engine,
        return_dict_in_generate=True,
    )
    width = ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        assert out.sequences[row, width:].tolist() == alone(base, prompt, 24)[0, len(prompt) :].tolist(), (
            row,
            proposer,
        )
    assert torch.equal(out.sequences, base.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False))
    assert out.stats.new_tokens == 24 * len(PROMPTS) and out.stats.steps < 24  # some guesses were accepted


def test_rows_that_end_early_are_padded_as_transformers_pads_them():
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    ids, mask = padded(PROMPTS)
    free = base.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    stop = int(free[1, ids.shape[1] + 3])  # row 1's fourth new token: row 1 (and any row emitting it) ends early
    kwargs = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=stop, pad_token_id=1)
    theirs = base.generate(ids, do_sample=False, **kwargs)
    ours = model.generate(ids, **kwargs)
    assert torch.equal(ours, theirs)
    assert (ours[1, ids.shape[1] + 4 :] == 1).all()  # padded after its stop token
    for row, prompt in enumerate(PROMPTS):  # and each row is still the prompt decoded alone
        single = alone(base, prompt, 20, eos_token_id=stop)[0, len(prompt) :].tolist()
        assert ours[row, ids.shape[1] : ids.shape[1] + len(single)].tolist() == single


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_left_when_others_finish_take_the_layout_of_their_number(family, monkeypatch):
    """A batch whose trees the plan chose re-budgets them as rows finish (as continuous batching does): four rows a
    2-node dynamic tree each, the rows left after one stops 3 nodes each, then (one row) 5; every row is still its
    prompt decoded alone, and what later layouts expect counts only the steps of the layout's own tree."""
    import medusa.dynamic_tree
    from medusa.decode import BatchLayout

    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    trees = {4: [[0]], 3: [[0], [0, 0]], 2: [[0], [0, 0]], 1: [[0], [0, 0], [1], [0, 1]]}
    monkeypatch.setattr(
        MedusaModel,
        "batch_layout",
        lambda self, lengths, *args: BatchLayout("eager", False, "dynamic", trees[len(lengths)], 1.5),
    )
    proposed, propose_batch = [], medusa.dynamic_tree.DynamicTreeProposer.propose_batch

    def recorded(proposers, states):
        proposed.append((len(proposers), proposers[0].num_nodes))
        return propose_batch(proposers, states)

    monkeypatch.setattr(medusa.dynamic_tree.DynamicTreeProposer, "propose_batch", staticmethod(recorded))
    observed = []
    monkeypatch.setattr(MedusaModel, "observe_batch", lambda self, layout, stats: observed.append(stats))

    ids, mask = padded(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, stopping_criteria=[RowOneStopsAtSix()])
    for row, prompt in enumerate(PROMPTS):
        single = alone(base, prompt, 6 if row == 1 else 20)[0, len(prompt) :].tolist()
        assert out[row, ids.shape[1] : ids.shape[1] + len(single)].tolist() == single
    assert proposed == [(rows, len(trees[rows]) + 1) for rows, _ in proposed]
    assert proposed[0][0] == 4 and proposed[-1][0] < 4  # the rows left stepped on without the finished ones
    # what the plan learns from: only the steps of the layout's 2-node tree
    stats = observed[0]
    assert len(set(stats.verified_nodes)) > 1
    counted = []
    monkeypatch.undo()
    model.acceptance.add = lambda tau, accepted: counted.append(accepted)
    model.observe_batch(BatchLayout("eager", False, "dynamic", trees[4], 1.5), stats)
    assert len(counted[0]) == stats.verified_nodes.count(2)


def test_rows_decoded_plainly_ask_for_no_layout_as_others_finish(monkeypatch):
    """Rows the plan decodes plainly together have no tree to re-budget when others finish: the layout is asked for
    once (asking again could time, in the middle of the call, a layout for an engine the plan had not timed)."""
    from medusa.decode import BatchLayout

    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    asked = []
    monkeypatch.setattr(
        MedusaModel,
        "batch_layout",
        lambda self, lengths, *args: asked.append(len(lengths)) or BatchLayout("eager", False, "plain", None, None),
    )

    ids, mask = padded(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, stopping_criteria=[RowOneStopsAtSix()])
    for row, prompt in enumerate(PROMPTS):
        single = alone(base, prompt, 6 if row == 1 else 12)[0, len(prompt) :].tolist()
        assert out[row, ids.shape[1] : ids.shape[1] + len(single)].tolist() == single
    assert asked == [len(PROMPTS)]


@pytest.mark.parametrize("engine", ["eager", "inductor"])
def test_rows_accepting_different_lengths_commit_each_its_own_path(engine, tmp_path, monkeypatch):
    """Per-row oracles wrong at different depths: every step, row r accepts exactly its own prefix, and the cache
    rows each commits stay right for the next step (the output is still plain greedy). On the inductor engine the
    steps run through its batch package, each row's tokens written at its own length."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    base = make_tiny_model("qwen2")
    prompts = [torch.tensor([p]) for p in PROMPTS]
    references = [alone(base, p, 40)[0].tolist() for p in PROMPTS]
    wrong_at = iter([None, 3, 1, 2])
    proposers = iter([OracleProposer(references[r], depth=4, wrong_at=next(wrong_at)) for r in range(len(PROMPTS))])
    packaged, run_rows = [], medusa.runtime.aot.run_rows
    monkeypatch.setattr(medusa.runtime.aot, "run_rows", lambda *a, **k: packaged.append(1) or run_rows(*a, **k))
    target = engine_for(base, engine)
    out = decode_batch(
        target,
        lambda: next(proposers),
        get_rule("greedy"),
        prompts,
        max_new_tokens=40,
        sampling=SamplingConfig(),
        stop_ids=set(),
        pad_token_id=0,
    )
    width = max(map(len, PROMPTS))
    for row, prompt in enumerate(PROMPTS):
        assert out.sequences[row, width:].tolist() == references[row][len(prompt) :]
    # a full oracle commits 5 a step and finishes first; then the others go on alone
    assert 5 in out.stats.accepted_lengths and 3 in out.stats.accepted_lengths and 1 in out.stats.accepted_lengths
    assert len(packaged) == (out.stats.steps - 1 if engine == "inductor" else 0)  # every step but the prefill


def tiny_drafted():
    """(a tiny llama target, the target with another tiny llama as its draft model, 3 tokens a step)."""
    target, tokenizer = make_tiny_model("llama"), tiny_tokenizer()
    drafted = MedusaModel.from_draft_model(
        target=target,
        draft=make_tiny_model("llama", seed=1),
        num_speculative_tokens=3,
        tokenizer=tokenizer,
        draft_tokenizer=tokenizer,
    )
    return target, drafted


def test_a_draft_model_decodes_a_batch_row_by_row_exactly():
    target, drafted = tiny_drafted()
    ids, mask = padded(PROMPTS)
    out = drafted.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False))


@pytest.mark.parametrize("num_nodes", [None, 4])
def test_an_eagle3_draft_decodes_a_batch_exactly(num_nodes):
    """Each row's draft reads the positions its row committed, at its next proposal."""
    from medusa.eagle3 import Eagle3Model
    from tests.test_eagle3 import random_draft

    target = make_tiny_model("llama")
    model = Eagle3Model(target, random_draft(target), num_speculative_tokens=3, num_nodes=num_nodes)
    ids, mask = padded(PROMPTS)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False))


def test_batch_inputs_that_cannot_decode_exactly_are_refused_by_name():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True), tokenizer=tiny_tokenizer())
    ids, mask = padded(PROMPTS)
    with pytest.raises(ValueError, match="pad on the left"):
        model.generate(ids, attention_mask=mask.flip(-1), max_new_tokens=4)
    with pytest.raises(ValueError, match="all padding"):
        model.generate(ids, attention_mask=mask * torch.tensor([[1], [0], [1], [1]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="a list of one streamer per row \\(4 here"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, streamer=TextStreamer(tiny_tokenizer()))
    with pytest.raises(ValueError, match="a list of one streamer per row"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, streamer=[None, None])
    with pytest.raises(ValueError, match="one prompt streams with one streamer"):
        model.generate(ids[:1], max_new_tokens=4, streamer=[None])
    with pytest.raises(ValueError, match="unknown engine 'fastest'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, engine="fastest")


class RecordingStreamer:
    """transformers' streamer protocol, recorded: the prompt, then each put's tokens, then end."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert not self.ended, "a token after end()"
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_each_streamed_row_gets_its_prompt_then_its_own_tokens_as_kept_then_end(one_at_a_time, monkeypatch):
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    if one_at_a_time:  # the layout the plan picks where decoding rows alone is faster
        layout = medusa.decode.BatchLayout("eager", True, None, None)
        monkeypatch.setattr(MedusaModel, "batch_layout", lambda self, *args: layout)
    ids, mask = padded(PROMPTS)
    free = base.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    stop = int(free[1, ids.shape[1] + 3])  # row 1 ends early, at its fourth new token
    streamers = [RecordingStreamer(), RecordingStreamer(), None, RecordingStreamer()]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=stop, streamer=streamers)
    for row, (prompt, streamer) in enumerate(zip(PROMPTS, streamers)):
        if streamer is None:
            continue
        new = alone(base, prompt, 20, eos_token_id=stop)[0, len(prompt) :].tolist()
        assert streamer.puts[0] == prompt and streamer.ended == 1, row
        assert [t for put in streamer.puts[1:] for t in put] == new == out[row, ids.shape[1] :][: len(new)].tolist()
        assert all(streamer.puts[1:]), "an empty put"
    assert len(streamers[1].puts[1:]) < len(streamers[0].puts[1:])  # row 1 ended early; row 0 streamed on


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_with_a_context_layer_and_base_features_read_each_rows_own_positions(family):
    """The context layer reads each row's prompt (not its padding) and every position its steps commit; the heads
    read the row's own base-layer features."""
    from tests.conftest import context_heads

    base = make_tiny_model(family)
    model = MedusaModel(base, context_heads(feature_layers=[0, 1]), tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    ids, mask = padded(PROMPTS)
    for proposer in ("medusa", "dynamic", "hybrid"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, proposer=proposer)
        for row, prompt in enumerate(PROMPTS):
            single = model.generate(torch.tensor([prompt]), max_new_tokens=20, proposer=proposer)
            assert out[row, ids.shape[1] :].tolist() == single[0, len(prompt) :].tolist(), (family, proposer, row)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_budgeted_to_plain_steps_read_those_positions_when_they_guess_again(family):
    """A dynamic row budgeted to one node (the plan laying out plain steps for its batch's rows) guesses nothing; its
    heads' context layer reads the positions those steps committed with the next guessing step's, as one sequence's
    guard leaves them (MedusaProposer.skip), and every row is still its prompt decoded alone."""
    from medusa.batch import BatchDecoding
    from tests.conftest import context_heads

    base = make_tiny_model(family)
    model = MedusaModel(base, context_heads(feature_layers=[0, 1]), tree=[[0], [1], [0, 0]])
    ids, mask = padded(PROMPTS)
    sampling = SamplingConfig()
    batch = BatchDecoding(
        engine_for(base, "eager"),
        lambda: model.make_proposer("dynamic", None, sampling, None),
        get_rule("greedy"),
        split_padded(ids, mask),
        max_new_tokens=24,
        sampling=sampling,
        stop_ids=set(),
        feature_layers=model.feature_layers,
        pad_token_id=0,
    )
    for budget in (1, 1, 4, 1, 1, 1, 3):
        batch.budget_trees(budget)
        batch.step()
    while batch.active:
        batch.step()
    out = batch.output().sequences
    assert max(batch.stats.accepted_lengths) > 1  # guessing steps after plain ones accepted guesses
    for row, prompt in enumerate(PROMPTS):
        assert out[row, ids.shape[1] :].tolist() == alone(base, prompt, 24)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batchs_rows_propose_together_what_each_proposes_alone(family, monkeypatch):
    """The dynamic tree's rows propose with one context read and one head call per depth for all of them
    (propose_batch): every step's trees are those the rows propose one by one, and so is all they decode."""
    from tests.conftest import context_heads

    model = MedusaModel(
        make_tiny_model(family),
        context_heads(feature_layers=[0, 1]),
        tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    )
    # proposing on float weights: on a CPU's int8 copies (refresh_candidate_projection) a product quantizes its input
    # as a whole, so rows proposed together round differently from a row alone (the target verifies both exactly)
    model.proposal_heads = model.heads
    model.candidate_projection = CandidateProjection.build(model.heads, model.base.lm_head, torch.float32)
    ids, mask = padded(PROMPTS)
    together = medusa.batch.propose_rows
    one_by_one = lambda proposers, states: [p.propose(s) for p, s in zip(proposers, states)]  # noqa: E731
    head_calls = []
    path_logits = medusa.propose.MedusaProposer.path_logits
    monkeypatch.setattr(
        medusa.propose.MedusaProposer, "path_logits", lambda *args: head_calls.append(1) or path_logits(*args)
    )
    runs = []
    for propose in (together, one_by_one):
        trees, head_calls[:] = [], []

        def recorded(proposers, states, propose=propose, trees=trees):
            candidates = propose(proposers, states)
            trees.append([(c.tokens.tolist(), c.tree.parent.tolist()) for c in candidates])
            return candidates

        monkeypatch.setattr(medusa.batch, "propose_rows", recorded)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, proposer="dynamic")
        runs.append((out, trees, len(head_calls)))
    (out, trees, calls), (alone_out, alone_trees, alone_calls) = runs
    assert trees == alone_trees and torch.equal(out, alone_out)
    assert len(trees) > 5 and calls < alone_calls  # one call per depth for the batch, not per row


def test_one_left_padded_prompt_decodes_as_it_would_unpadded():
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    ids, mask = torch.tensor([[0, 0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert out[0, :2].tolist() == [0, 0] and out[0, 5:].tolist() == alone(base, [5, 6, 7], 12)[0, 3:].tolist()


def test_rows_of_like_lengths_prefill_together_and_a_long_one_alone():
    """A batch's prefill pads rows only to their group's longest: a uniform batch is one forward, as it was; one long
    prompt among short ones prefills alone; every group's padded tokens stay within PREFILL_SLACK of its own."""
    assert prefill_groups([100, 100, 100]) == [[0, 1, 2]]
    assert prefill_groups([779, 40, 65, 60]) == [[0], [1, 2, 3]]
    assert prefill_groups([13, 1, 4, 7]) == [[0], [3], [2], [1]]
    assert prefill_groups([ALONE_FROM, ALONE_FROM, 40, 40]) == [[0], [1], [2, 3]]  # long prompts prefill alone
    assert prefill_groups([ALONE_FROM - 1] * 2) == [[0, 1]]
    lengths = torch.randint(1, 900, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = prefill_groups(lengths)
    assert sorted(b for group in groups for b in group) == list(range(64)) and len(groups) < 64
    for group in groups:
        assert len(group) * max(lengths[b] for b in group) <= PREFILL_SLACK * sum(lengths[b] for b in group)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_a_batch_prefilled_in_groups_decodes_each_row_as_alone(engine, monkeypatch):
    """Rows of 13 and 12 tokens prefill in one forward, the 3-token row alone, each placed into the batch's cache at
    the end of its padding; the tree steps after read them there: every row is its prompt decoded alone."""
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    prompts = [list(range(5, 18)), list(range(20, 32)), [40, 41, 42]]
    target, prefilled = model.engine(engine), []
    forward, prefill_row = target.batch_forward, target.prefill_row

    def counted(cache, ids, *args, logits_to_keep=None, **kwargs):
        if logits_to_keep is not None:
            prefilled.append(("together", *ids.shape))
        return forward(cache, ids, *args, logits_to_keep=logits_to_keep, **kwargs)

    def counted_alone(cache, row, at, input_ids, *args):
        prefilled.append(("alone", *input_ids.shape))
        return prefill_row(cache, row, at, input_ids, *args)

    monkeypatch.setattr(target, "batch_forward", counted)
    monkeypatch.setattr(target, "prefill_row", counted_alone)
    ids, mask = padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, engine=engine, return_dict_in_generate=True)
    assert sorted(prefilled) == [("alone", 1, 3), ("together", 2, 13)]
    for row, prompt in enumerate(prompts):
        assert out.sequences[row, ids.shape[1] :].tolist() == alone(base, prompt, 16)[0, len(prompt) :].tolist()
    assert max(out.stats.accepted_lengths) > 1  # guesses were accepted: tree steps read the placed rows


def test_rows_cache_writes_and_commits_alike_in_step_and_apart():
    """A forward writes each row at its own length, whether the rows are in step (one slice for all) or not (a
    scatter); a commit whose paths are already in place moves nothing, one that is not moves each row's path."""
    from medusa.runtime import RowsCache

    config = make_tiny_model("llama").config
    torch.manual_seed(0)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    new = torch.randn(2, heads, 3, dim), torch.randn(2, heads, 3, dim)
    for lengths in ([4, 4], [4, 6]):
        cache = RowsCache(config, 16)
        cache.start(2)
        cache.lengths[:] = lengths
        keys, values = [layer.update(*new) for layer in cache.cache.layers][0]  # every layer: commit moves them all
        layer = cache.cache.layers[0]
        assert keys.shape[2] == values.shape[2] == max(lengths) + 3
        for b, length in enumerate(lengths):
            assert torch.equal(layer.keys[b, :, length : length + 3], new[0][b])
            assert torch.equal(layer.values[b, :, length : length + 3], new[1][b])
        before = layer.keys.clone()
        cache.commit([torch.tensor([0, 1]), torch.tensor([0])])  # in place: nothing moves
        assert torch.equal(layer.keys, before) and cache.lengths == [lengths[0] + 2, lengths[1] + 1]
        cache.lengths[:] = lengths
        cache.commit([torch.tensor([0, 2]), torch.tensor([0])])  # row 0 keeps its third position as its second
        assert torch.equal(layer.keys[0, :, lengths[0] + 1], new[0][0, :, 2])
        assert torch.equal(layer.keys[1], before[1])


def test_a_batch_runs_on_the_pre_packed_copy_where_the_cpu_packs_weights(monkeypatch):
    """With no engine named, a batch's forwards run on the compiled engine's copy with pre-packed weights where this
    CPU packs them (runtime.batch_engine), else on the target as it is; the rows stay exact either way."""
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=False), tokenizer=tiny_tokenizer(), projection_dtype=torch.float32)
    targets, real = [], medusa.decode.decode_batch
    monkeypatch.setattr(
        medusa.decode, "decode_batch", lambda target, *a, **k: targets.append(target) or real(target, *a, **k)
    )
    ids, mask = padded(PROMPTS)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    packs = can_prepack(base.device, base.dtype)
    assert [target.name for target in targets] == ["compiled" if packs else "eager"]
    assert torch.equal(out, base.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))


def test_a_batch_step_is_timed_as_decoding_runs_it():
    """The plan's whole-step timing (batch.time_batch_step) decodes as decode_batch does, heads that read base-layer
    features and a context layer included, with no row leaving the batch before the steps are timed."""
    from tests.conftest import context_heads

    base = make_tiny_model("qwen2")
    model = MedusaModel(base, context_heads(feature_layers=[0, 1]), tree=[[0], [1], [0, 0]])
    made = []

    def make_proposer():
        made.append(model.make_proposer("dynamic", None, SamplingConfig(), None))
        return made[-1]

    assert time_batch_step(model.engine("eager"), make_proposer, 3, 12, 2, model.feature_layers) > 0
    assert len(made) == 3


def test_left_padded_prompts_are_what_split_padded_reads_back():
    prompts = [[5, 6, 7], [8], [9, 10]]
    ids, mask = left_padded(prompts, 0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]] and mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert [row[0].tolist() for row in split_padded(ids, mask)] == prompts


@pytest.mark.parametrize(
    "family, sliding", [*((family, False) for family in FAMILIES), ("gemma3", True), ("mistral", True)]
)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prompt_in_a_batch_prefills_as_it_would_alone_bit_for_bit(family, sliding, engine, dtype, monkeypatch):
    """Prompts of ALONE_FROM tokens or more prefill alone (`Engine.prefill_row`), as one sequence's prefill runs them
    (attending causally; a sliding-window model's in chunks): the batch's cache rows of such a row, the features the
    heads read and its first token are bit for bit what decoding the prompt alone starts from, placed after its
    padding; the short rows prefill together. fp32: every row then decodes as it would alone."""
    base = make_tiny_model(family, dtype=dtype, sliding=sliding)
    target, alone_prefills = engine_for(base, engine), []
    prefill_row = target.prefill_row

    def counted(cache, row, at, input_ids, *args):
        alone_prefills.append(input_ids.shape[1])
        return prefill_row(cache, row, at, input_ids, *args)

    monkeypatch.setattr(target, "prefill_row", counted)
    lengths = [ALONE_FROM + 100, 20, ALONE_FROM + 40, 18]
    prompts = [torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    batch = BatchDecoding(
        target,
        lambda: PlainProposer(torch.device("cpu")),
        get_rule("greedy"),
        prompts,
        max_new_tokens=12,
        sampling=SamplingConfig(),
        stop_ids=set(),
        feature_layers=(0,),
        pad_token_id=0,
    )
    assert alone_prefills == [ALONE_FROM + 100, ALONE_FROM + 40]
    width = max(lengths)
    for row in (0, 2):
        prompt = prompts[row]
        alone_cache = target.new_cache(prompt.shape[1] + 1)
        reference = target.prefill(alone_cache, prompt, (0,))
        state, pad = batch.rows[row].state, width - prompt.shape[1]
        assert int(state.root_token) == int(reference.logits.argmax())
        assert torch.equal(state.new_hidden, reference.hidden)
        for layer, theirs in zip(batch.cache.cache.layers, alone_cache.layers):
            for rows, expected in ((layer.keys, theirs.keys), (layer.values, theirs.values)):
                assert torch.equal(rows[row, :, pad:width], expected[0, :, : prompt.shape[1]])
    if dtype == torch.float32:
        while batch.active:
            batch.step()
        for row, prompt in enumerate(prompts):
            expected = alone(base, prompt[0].tolist(), 12)[0, prompt.shape[1] :].tolist()
            assert batch.rows[row].new == expected
