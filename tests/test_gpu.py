"""The compiled engine on CUDA (torch.compile with CUDA graphs) against the eager reference, on tiny models.

Skipped without a GPU (CI has none); run on one with `pytest -m gpu`.
"""

import pytest
import torch

import medusa.runtime.static
from medusa import MedusaModel
from medusa.acceptance import GREEDY_PATH, greedy_path
from medusa.decode import prefill
from medusa.ngram import chain_tensor
from medusa.propose import build_medusa_proposer
from medusa.runtime import CompiledEngine, EagerEngine, engine_for
from medusa.runtime import graphs as step_graphs
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_heads, make_tiny_model
from tests.test_step_graphs import heads_of
from tests.test_tree import HAND_TREE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32 (no TF32): inductor's fused kernels sum in another order than eager's


VERIFY_GRAPHS = pytest.mark.parametrize(
    "verify_graphs", [False, True], ids=["compiled-graphs", "hand-captured"], indirect=True
)


@pytest.fixture
def verify_graphs(request, monkeypatch):
    """The verify through torch.compile's CUDA graphs, or captured by hand around inductor's kernels."""
    monkeypatch.setattr(medusa.runtime.static, "VERIFY_GRAPHS", request.param)
    return request.param


@VERIFY_GRAPHS
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_engine_logits_and_commit_equal_eager(family, verify_graphs):
    """One engine per family (each compile costs seconds): q=1, then a tree, then a commit of a path that is not a
    prefix of the rows and the verify after it, each equal to the eager engine's."""
    model = make_tiny_model(family).cuda()
    torch.manual_seed(0)
    prompt = torch.randint(1, 90, (1, 11), device="cuda")
    compiled, eager = CompiledEngine(model), EagerEngine(model)
    assert compiled.torch_compile and not compiled.prepacked  # CUDA: graphs, no CPU packing
    assert compiled.verify_graphs == verify_graphs
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3).to("cuda")
    chain = build_buffers(TreeSpec([], 3), 3).to("cuda")
    for buffers in (chain, tree):
        candidates = Candidates(tokens=torch.randint(1, 90, (buffers.num_nodes,), device="cuda"), tree=buffers)
        results = []
        for engine in (eager, compiled):
            state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=64)
            results.append(engine.verify(state.cache, candidates, state.length))
        torch.testing.assert_close(results[1].logits, results[0].logits, **TOL)
        torch.testing.assert_close(results[1].hidden, results[0].hidden, **TOL)
    accepted = torch.tensor([0, 1, 3, 6], device="cuda")
    follow = Candidates(tokens=torch.randint(1, 90, (tree.num_nodes,), device="cuda"), tree=tree)
    after = []
    for engine in (eager, compiled):
        state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=64)
        engine.verify(state.cache, candidates, state.length)
        engine.commit(state.cache, state.length, accepted)
        after.append(engine.verify(state.cache, follow, state.length + 4).logits)
    torch.testing.assert_close(after[1], after[0], **TOL)
    if verify_graphs:  # one cache, a graph per node count: 1 and 2 (the engine's warm-up), the tree's
        assert "the verify" not in step_graphs._FAILED
        assert [graph.captured for graph in compiled._graphed.values()] == [len({1, 2, tree.num_nodes})]


@VERIFY_GRAPHS
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_engine_greedy_identity(family, verify_graphs):
    base = make_tiny_model(family).cuda()
    model = MedusaModel(base, make_heads(random=True).cuda(), projection_dtype=torch.float32)
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4]], device="cuda")
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    for proposer in ("plain", "medusa", "dynamic", "hybrid"):
        out = model.generate(
            prompt, max_new_tokens=40, proposer=proposer, engine="compiled", return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, reference), proposer
        assert out.stats.new_tokens == 40
    assert not step_graphs._FAILED  # the proposal and the acceptance (and the verify, hand-captured) ran as graphs
    assert GREEDY_PATH.captured > 0
    engine = engine_for(base, "compiled")
    assert engine.verify_graphs == verify_graphs and bool(engine._graphed) == verify_graphs


@pytest.mark.parametrize("kind", ["plain", "path"])
def test_step_graphs_equal_their_functions_and_their_outputs_outlive_the_next_replay(kind):
    """Warm-up, recording, then replays of the heads' proposal and the greedy acceptance: each result equals the
    eager function's, and is still intact after the calls that follow it (outputs are copied out of the graph)."""
    model = MedusaModel(make_tiny_model("llama").cuda(), heads_of(kind).cuda(), projection_dtype=torch.float32)
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3).to("cuda")
    proposer = build_medusa_proposer(model, tree)
    root, generator = torch.tensor(7, device="cuda"), torch.Generator("cuda").manual_seed(0)
    proposals, acceptances = [], []
    with torch.inference_mode():
        for chain in ([], [9, 4, 11], [9], [9, 4, 11], [], [5]):
            hidden = torch.randn(HIDDEN, device="cuda", generator=generator)
            copies = chain_tensor(chain, 3, "cuda")
            proposals.append((proposer._guess(hidden, root, copies), proposer.guess(hidden, root, copies)))
            logits = torch.randn(tree.num_nodes, VOCAB, device="cuda", generator=generator)
            tokens = logits.argmax(-1)[tree.parent]
            tokens[len(acceptances) % tree.num_nodes] = 0  # one wrong guess, somewhere else each time
            args = (tokens, logits, tree.parent, tree.leaf_paths)
            acceptances.append((GREEDY_PATH(*args), greedy_path(*args)))
    for graphed, eager in proposals:
        assert torch.equal(graphed, eager)
    for (path, packed), (eager_path, eager_packed) in acceptances:
        assert torch.equal(path, eager_path) and torch.equal(packed, eager_packed)
    assert not step_graphs._FAILED and proposer._guess.captured == 1 and GREEDY_PATH.captured > 0


def test_cuda_graph_engine_runs_each_call_on_the_smallest_cache_that_fits():
    """Each size keeps its cache and graphs (attention reads the whole allocation, so a short call on a large cache
    pays for rows it never uses); the logits on either equal eager's, and a short call goes back to the small one."""
    model = make_tiny_model("llama").cuda()
    torch.manual_seed(2)
    prompt = torch.randint(1, 90, (1, 11), device="cuda")
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3).to("cuda")
    candidates = Candidates(tokens=torch.randint(1, 90, (tree.num_nodes,), device="cuda"), tree=tree)
    compiled, eager = CompiledEngine(model), EagerEngine(model)
    state = prefill(model, prompt, SamplingConfig(), engine=eager, max_length=64)
    reference = eager.verify(state.cache, candidates, state.length).logits
    caches = []
    for max_length in (64, 700, 64):
        state = prefill(model, prompt, SamplingConfig(), engine=compiled, max_length=max_length)
        caches.append(state.cache)
        torch.testing.assert_close(compiled.verify(state.cache, candidates, state.length).logits, reference, **TOL)
    assert [c.layers[0].max_cache_len for c in caches] == [512, 1024, 512]
    assert caches[2] is caches[0]


def test_context_heads_read_through_a_graph_keep_greedy_identity():
    """Heads with a context layer (the shipped kind): each step's read runs as a CUDA graph per row count; generate
    stays identical to transformers' greedy output, and the graphed read equals the eager one step after step."""
    from tests.conftest import context_heads  # noqa: PLC0415

    base = make_tiny_model("llama").cuda()
    model = MedusaModel(base, context_heads().cuda(), projection_dtype=torch.float32)
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]], device="cuda")
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    out = model.generate(
        prompt, max_new_tokens=40, proposer="medusa", tree=HAND_TREE, engine="compiled", return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, reference)
    again = model.generate(prompt, max_new_tokens=40, proposer="medusa", tree=HAND_TREE, engine="compiled")
    assert torch.equal(again, reference) and not step_graphs._FAILED
    guesses = [graph for key, graph in model.step_graphs.items() if key[0] == "guess"]
    assert len(guesses) == 1 and guesses[0].captured == 1  # the second call replayed the first call's graph
    proposer = build_medusa_proposer(model, build_buffers(TreeSpec(HAND_TREE, 3), 3).to("cuda"))
    hidden, ids = torch.randn(1, 20, HIDDEN, device="cuda"), torch.randint(1, VOCAB, (1, 20), device="cuda")
    eight, three = torch.tensor([8], device="cuda"), torch.tensor([3], device="cuda")  # positions each read takes
    with torch.inference_mode():
        past = model.heads.context.empty_past("cuda", hidden.dtype)
        _, *past = proposer.read_rows(hidden[:, :8], ids[:, :8], *past, eight)
        for start in range(8, 20, 3):
            graphed = proposer._read_graph(hidden[:, start : start + 3], ids[:, start : start + 3], *past, three)
            eager = proposer.read_rows(hidden[:, start : start + 3], ids[:, start : start + 3], *past, three)
            for a, b in zip(graphed, eager):
                torch.testing.assert_close(a, b)
            past = graphed[1:]
    assert proposer._read_graph.captured >= 1  # 3 rows here; generate's steps captured theirs
