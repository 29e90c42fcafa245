"""What proposes, compiled ahead of time on a CPU (medusa.propose.compile_proposal): the same numbers as the eager
modules, cached per machine, used by a call on an engine that compiles ahead of time, and never a reason to fail."""

import warnings

import pytest
import torch

import medusa.plan
import medusa.propose
import medusa.runtime.aot
from medusa import MedusaModel
from medusa.propose import Compiled, build_medusa_proposer, compile_proposal, eager_modules
from medusa.runtime.prepack import Int8Linear, PackedLinear
from medusa.tree import TreeSpec, build_buffers, chain
from tests.conftest import HIDDEN, context_heads, make_tiny_model

pytestmark = pytest.mark.slow  # compiles a few small packages (seconds each)


@pytest.fixture(scope="module")
def shared_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("medusa-cache")


@pytest.fixture
def cache(shared_directory, monkeypatch):
    """One cache for this file's tests: the same tiny models and heads compile once (the one test that counts
    compiles takes a fresh cache of its own)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(shared_directory))
    return shared_directory


def _model(family="llama"):
    return MedusaModel(make_tiny_model(family), context_heads())


def test_compiled_modules_compute_what_the_eager_ones_compute_at_every_row_count(cache):
    model = _model()
    heads, projection = model.proposal_heads, model.candidate_projection
    compiled, eager = compile_proposal(heads, projection, progress=False), eager_modules(heads, projection)
    assert isinstance(compiled.context_read, Compiled) and len(compiled.path_logits) == heads.config.num_heads
    torch.manual_seed(0)
    window = heads.context.window
    for rows, counts in ((1, [1]), (1, [window]), (3, [2, 1, 2]), (2, [window, 3])):  # a batch's rows, each its own
        keys, values, _ = heads.context.empty_past("cpu", torch.float32, batch=rows)
        past = (torch.randn_like(keys), torch.randn_like(values), torch.tensor([9, 70, 3][:rows]))
        width = max(counts)
        inputs = (torch.randn(rows, width, HIDDEN), torch.randn(rows, width, HIDDEN), *past, torch.tensor(counts))
        for got, expected in zip(compiled.context_read(*inputs), eager.context_read(*inputs)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for head, (got_head, eager_head) in enumerate(zip(compiled.path_logits, eager.path_logits)):
        for paths in (1, 3, 7):
            hidden, embedded = torch.randn(paths, HIDDEN), torch.randn(paths, head + 1, HIDDEN)
            torch.testing.assert_close(got_head(hidden, embedded), eager_head(hidden, embedded), rtol=1e-4, atol=1e-3)


def test_more_rows_than_a_package_takes_run_the_module():
    calls = []
    compiled = Compiled(lambda *x: calls.append("package") or [x[0]], lambda *x: calls.append("module") or x[0], 4)
    compiled(torch.zeros(4, 2), torch.zeros(1))
    compiled(torch.zeros(5, 2), torch.zeros(1))
    assert calls == ["package", "module"]


def test_packages_are_compiled_once_and_loaded_after(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = _model()
    compiled = []
    real = medusa.runtime.aot._compile
    monkeypatch.setattr(medusa.runtime.aot, "_compile", lambda *a, **k: compiled.append(a[2]) or real(*a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compile_proposal(model.proposal_heads, model.candidate_projection, progress=False) is not None
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]  # torch's own, about its internals
    first = len(compiled)
    assert first == 1 + model.config.num_heads and all(path.exists() for path in compiled)
    assert compile_proposal(model.proposal_heads, model.candidate_projection, progress=False) is not None
    assert len(compiled) == first  # loaded from the cache
    with torch.no_grad():
        model.heads.context.qkv.weight.mul_(2)  # other weights: other packages (each is keyed by all the heads')
    model.refresh_candidate_projection()
    compile_proposal(model.proposal_heads, model.candidate_projection, progress=False)
    assert len(compiled) == 2 * first
    assert {type(m) for m in model.proposal_heads.modules()} & {Int8Linear, PackedLinear}  # they propose on these
    compile_proposal(model.heads, model.candidate_projection, progress=False)  # the float heads: the same parameters
    assert len(compiled) == 3 * first  # packages of their own, not the int8 copy's


class _Scores(torch.nn.Module):
    """One class whose forward returns one of two things by an attribute: a change of code that leaves the weights,
    the layers and the inputs as they were (DraftStep's logits -> log-probabilities, session 67)."""

    def __init__(self, normalised: bool):
        super().__init__()
        self.normalised = normalised
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        scores = self.linear(x)
        return scores.log_softmax(-1) if self.normalised else scores


def test_a_module_whose_code_computes_something_else_gets_a_package_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    compiled = []
    real = medusa.runtime.aot._compile
    monkeypatch.setattr(medusa.runtime.aot, "_compile", lambda *a, **k: compiled.append(a[2]) or real(*a, **k))
    exported = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exported.append(a[0]) or real_export(*a, **k))
    torch.manual_seed(0)
    raw, normalised = _Scores(False), _Scores(True)
    normalised.load_state_dict(raw.state_dict())
    x = torch.randn(2, 4)
    shapes = ({0: torch.export.Dim("rows", min=1, max=8)},)

    def run(module):
        return medusa.runtime.aot.compiled_module(module, (x,), shapes, "scores", "scores", progress=False)(x)

    torch.testing.assert_close(run(raw), raw(x).detach())
    torch.testing.assert_close(run(normalised), normalised(x).detach())  # not the raw scores' package
    assert len(compiled) == 2 and compiled[0] != compiled[1]
    torch.testing.assert_close(run(raw), raw(x).detach())
    assert len(compiled) == 2 and len(exported) == 2  # the same code again: loaded, its program's digest remembered
    raw.linear.weight.data.mul_(2)  # other weights, the same program: a package of its own, its digest remembered
    torch.testing.assert_close(run(raw), raw(x).detach())
    assert len(compiled) == 3 and len(exported) == 3
    unfiled = type("Unfiled", (_Scores,), {"__module__": "a_notebook_cell"})(True)  # code no file holds
    unfiled.load_state_dict(normalised.state_dict())
    assert medusa.runtime.aot.source_digest(unfiled) is None
    for _ in range(2):  # nothing to key a remembered digest by: exported at each load, its package loaded
        torch.testing.assert_close(run(unfiled), normalised(x).detach())
    assert len(compiled) == 4 and len(exported) == 5


def test_a_compile_that_fails_leaves_the_eager_proposal_and_says_so(cache, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(medusa.propose, "compiled_module", broken)
    model = _model()
    with caplog.at_level("WARNING"):
        assert compile_proposal(model.proposal_heads, model.candidate_projection, progress=False) is None
    assert "no compiler here" in caplog.text and "eagerly" in caplog.text


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_a_call_on_the_inductor_engine_proposes_compiled_and_its_output_is_plain_decodings(cache, family):
    model = _model(family)
    prompt = torch.tensor([[5, 9, 2, 7, 11, 3]])
    expected = model.base.generate(prompt, max_new_tokens=20, do_sample=False)
    assert model.compiled_proposal is None
    got = model.generate(prompt, max_new_tokens=20, proposer="dynamic", engine="inductor")
    assert isinstance(model.compiled_proposal.context_read, Compiled)
    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(chain(3)), 3))
    assert proposer.modules is model.compiled_proposal
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # a batch on this engine: its rows one at a time on the engine's graphs, returned as transformers' batch
    ids, mask = torch.tensor([[0, 0, 5, 9, 2, 7], [4, 8, 1, 6, 10, 12]]), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=12, proposer="dynamic", engine="inductor")
    assert torch.equal(batch, model.base.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))


def test_calibration_times_the_proposal_decoding_runs(cache, monkeypatch):
    """The plan weighs options by what their proposal costs in decoding: on the inductor engine, compiled; the
    eager engine alone leaves it eager."""
    model = _model()
    model.accuracy = [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]]
    medusa.plan.measure(model, ["eager"], sizes=(1, 2), repeats=1, context=8, progress=False)
    assert model.compiled_proposal is None
    timed = []
    real = medusa.propose.MedusaProposer.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        timed.append(self.modules)

    monkeypatch.setattr(medusa.propose.MedusaProposer, "__init__", recording)
    medusa.plan.measure(model, ["inductor"], sizes=(1, 2), repeats=1, context=8, progress=False)
    assert isinstance(model.compiled_proposal.context_read, Compiled)
    assert timed and all(modules is model.compiled_proposal for modules in timed)
