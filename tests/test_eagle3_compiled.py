"""The EAGLE-3 draft's step compiled ahead of time on a CPU (medusa.eagle3.compile_draft_step): the same numbers as
the eager step at every row count, the same trees and chains in decoding, used by a call on the inductor engine,
and never a reason to fail."""

import pytest
import torch

import medusa.eagle3
from medusa.decode import prefill
from medusa.eagle3 import MAX_STEP_ROWS, DraftStep, Eagle3Model, compile_draft_step, kv_shape
from medusa.propose import Compiled
from medusa.sampling import SamplingConfig
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_tiny_model
from tests.test_eagle3 import AUX, random_draft

pytestmark = pytest.mark.slow  # compiles a few small packages (seconds each)


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """One package cache for this file's tests: the same tiny drafts compile once."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path_factory.getbasetemp() / "medusa-cache"))


def _model(family: str, **options) -> Eagle3Model:
    """A tiny target and a random draft (made outside inference mode: export cannot trace inference tensors)."""
    target = make_tiny_model(family)
    draft = random_draft(target, scale=1.0)
    with torch.no_grad():
        for projection in (draft.layers[0].self_attn.q_proj, draft.layers[0].self_attn.k_proj):
            projection.weight.mul_(8.0)  # sharp attention: a row shown or hidden, or a position off by one, shows
    return Eagle3Model(target, draft, **options)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("int8", [False, True])
@torch.no_grad()
def test_the_compiled_step_computes_what_the_eager_step_computes(family, int8):
    model = _model(family, int8=int8)
    compiled, eager = compile_draft_step(model.proposal_draft, progress=False), DraftStep(model.proposal_draft)
    last_row = DraftStep(model.proposal_draft, every_row=False)
    assert isinstance(compiled, Compiled)
    generator = torch.Generator().manual_seed(0)
    for rows, past in ((1, 1), (1, 40), (5, 9), (MAX_STEP_ROWS, 3)):
        kv = (past, *kv_shape(model.proposal_draft))
        inputs = (
            torch.randn(rows, HIDDEN, generator=generator),
            torch.randn(rows, HIDDEN, generator=generator),
            torch.arange(past, past + rows),
            torch.rand(rows, past, generator=generator) < 0.7,
            torch.eye(rows, dtype=torch.bool) | (torch.rand(rows, rows, generator=generator) < 0.3).tril(),
            torch.randn(kv, generator=generator),
            torch.randn(kv, generator=generator),
        )
        expected = eager(*inputs)
        # the step hands back log-probabilities (what ranking a tree reads), not the output layer's logits
        torch.testing.assert_close(expected[1].exp().sum(-1), torch.ones(rows))
        for got, wanted in zip(compiled(*inputs), expected, strict=True):
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
        # a prompt's feed asks for the last row's alone (int8 activations are rounded with one scale for the rows of
        # a call, so they are the log-probabilities of that row alone)
        alone = model.proposal_draft.logits(expected[0][-1:]).float().log_softmax(-1)
        torch.testing.assert_close(last_row(*inputs)[1], alone)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_nodes", [None, 12])
@torch.no_grad()
def test_compiled_and_eager_drafts_propose_the_same_guesses_step_after_step(family, num_nodes):
    """Each step's proposal (a chain, or a tree of 12 nodes 4 deep) is the same token for token whether the draft
    runs compiled or eagerly: the compiled step is fed the same rows, masks and positions. The proposals follow the
    target's own greedy text, so the cache grows and is cut back as in decoding. Float weights: int8 activations are
    rounded with one scale for the rows of a call, and a prompt's feed computes the last row's logits alone."""
    model = _model(family, num_speculative_tokens=4, num_nodes=num_nodes, topk=3, copy_ngram=0, int8=False)
    model.compiled_step = compile_draft_step(model.proposal_draft, progress=False)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    text = model.target.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0]
    compiled = model.make_proposer(None, None, SamplingConfig(), None)
    model.compiled_step = False
    eager = model.make_proposer(None, None, SamplingConfig(), None)
    assert compiled.compiled_step is not None and eager.compiled_step is None
    for length in range(6, 18, 3):  # three tokens committed a step
        state = prefill(model.target, text[None, :length], SamplingConfig(), feature_layers=AUX)
        got, expected = compiled.propose(state), eager.propose(state)
        assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.tree.parent, expected.tree.parent)
        assert compiled.rows == eager.rows > length


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_a_call_on_the_inductor_engine_drafts_compiled_and_its_output_is_plain_decodings(family):
    model = _model(family, num_speculative_tokens=3, num_nodes=8)
    prompt = torch.tensor([[5, 9, 2, 7, 11, 3]])
    expected = model.target.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert model.compiled_step is None
    got = model.generate(prompt, max_new_tokens=20, engine="inductor")
    assert isinstance(model.compiled_step, Compiled)
    assert model.make_proposer(None, None, SamplingConfig(), None).compiled_step is model.compiled_step
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_compile_that_fails_leaves_the_eager_step_and_says_so(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(medusa.eagle3, "compiled_module", broken)
    model = _model("llama", num_nodes=6)
    prompt = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with caplog.at_level("WARNING"):
        got = model.generate(prompt, max_new_tokens=10, engine="inductor")
    assert model.compiled_step is False and "no compiler here" in caplog.text and "eagerly" in caplog.text
    assert torch.equal(got, model.target.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0))
