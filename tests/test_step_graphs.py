"""The step's small functions that run as CUDA graphs on a GPU (medusa.runtime.StepGraph): the heads' proposal and
the greedy acceptance. A CUDA graph holds only pure tensor code with fixed shapes; torch.compile's `fullgraph=True`
refuses anything else (a host sync, a data-dependent shape), so compiling each here, on a CPU, keeps them capturable.
The captured path itself is tested on a GPU in tests/test_gpu.py."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from medusa import MedusaConfig, MedusaHeads, MedusaModel
from medusa.acceptance import greedy, greedy_path
from medusa.decode import prefill
from medusa.ngram import chain_tensor, copy_guesses, put_first
from medusa.propose import CandidateProjection, MedusaProposer
from medusa.runtime import StepGraph, VerifyOutput
from medusa.runtime import graphs as step_graphs
from medusa.runtime.kv_cache import keep_rows, row_mover
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers
from tests.conftest import FAMILIES, HIDDEN, VOCAB, make_tiny_model
from tests.test_tree import HAND_TREE


def heads_of(kind: str) -> MedusaHeads:
    """Random heads: 'plain' (Medusa-1, copy guesses), 'path' (the shipped kind: next token, path, copy guesses,
    a candidate vocabulary subset)."""
    torch.manual_seed(3)
    path = kind == "path"
    heads = MedusaHeads(
        MedusaConfig(
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            num_heads=3,
            condition_on_next_token=path,
            condition_on_path=path,
            copy_ngram=3,
        )
    )
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if path:
        heads.set_vocab_subset(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:40])
    return heads


def proposer_for(family: str, kind: str):
    """A proposer as a GPU builds one: plain fp32 heads and projection (a CPU's are int8 and oneDNN-packed, which
    torch.compile does not trace)."""
    model = MedusaModel(make_tiny_model(family), heads_of(kind), projection_dtype=torch.float32)
    return model, gpu_like_proposer(model)


def gpu_like_proposer(model) -> MedusaProposer:
    weight = model.heads.candidate_weight(model.base.get_output_embeddings()).detach().contiguous()
    projection = CandidateProjection(weight, getattr(model.heads, "vocab_subset", None))
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    return MedusaProposer(model.heads, projection, tree, model.base.get_input_embeddings())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["plain", "path"])
def test_the_proposal_compiles_as_one_graph_equal_to_eager_and_again_for_the_next_call(family, kind):
    model, proposer = proposer_for(family, kind)
    torch._dynamo.reset()
    compiled = torch.compile(proposer.guess, fullgraph=True, dynamic=False, backend="aot_eager")
    root = torch.tensor(7)
    again = gpu_like_proposer(model)  # built as generate builds one each call (outside inference mode)
    with torch.inference_mode():
        for chain in ([], [9, 4, 11], [9]):  # no copy, one per head, one for head 0 only
            hidden = torch.randn(HIDDEN)
            copies = chain_tensor(chain, 3)
            eager = proposer.guess(hidden, root, copies)
            assert torch.equal(compiled(hidden, root, copies), eager)
            if chain:
                assert eager[1] == chain[0]  # node 1 (rank 0 of head 0) holds the copy
        # a proposer of the next generate call (new tree buffers) traces to the same graph: guess reads nothing of
        # its instance but the tree's values and shapes
        with torch._dynamo.config.patch(error_on_recompile=True):
            recompiled = torch.compile(again.guess, fullgraph=True, dynamic=False, backend="aot_eager")
            assert torch.equal(recompiled(hidden, root, copies), eager)


@pytest.mark.parametrize("kind", ["plain", "path"])
def test_propose_is_the_tensor_guess_on_the_steps_copy_chain(kind):
    """propose = read + copy chain (host) + guess: the copy guess of the state's tokens lands first under the root."""
    model, proposer = proposer_for("llama", kind)
    state = prefill(model.base, torch.tensor([[5, 6, 7, 8, 5, 6]]), SamplingConfig())
    state.root_token, state.tokens = torch.tensor(7), [5, 6, 7, 8, 5, 6, 7]  # "5 6 7" repeats: the copy chain is 8 ...
    candidates = proposer.propose(state)
    assert candidates.tokens[1] == 8
    chain = chain_tensor(proposer.step_copies(state), 3)
    with torch.inference_mode():
        assert torch.equal(candidates.tokens, proposer.guess(state.last_hidden, state.root_token, chain))


def test_copy_guesses_from_a_list_or_a_tensor_agree_and_follow_only_the_chains_path():
    chain = [9, 4, 11]
    paths = torch.tensor([[9, 4], [9, 5], [3, 4]])
    for given in (chain, chain_tensor(chain, 5)):
        assert copy_guesses(given, 2, paths).tolist() == [11, -1, -1]
        assert copy_guesses(given, 0, None).tolist() == [9]
        assert copy_guesses(given, 1, paths[:, :1]).tolist() == [4, 4, -1]
    assert copy_guesses([9], 1, paths[:, :1]).tolist() == [-1, -1, -1]  # the chain ends before head 1


def test_put_first_moves_or_inserts_the_copy_and_keeps_the_order():
    top = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert put_first(top, torch.tensor([2, 0, -1])).tolist() == [[2, 1, 3], [0, 4, 5], [7, 8, 9]]


def test_greedy_acceptance_compiles_as_one_graph_equal_to_eager():
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    torch._dynamo.reset()
    compiled = torch.compile(greedy_path, fullgraph=True, dynamic=False, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(tree.num_nodes, VOCAB, generator=generator)
        tokens = logits.argmax(-1)[tree.parent]  # every guess right ...
        tokens[torch.randint(1, tree.num_nodes, (2,), generator=generator)] = 0  # ... but a few
        path, packed = greedy_path(tokens, logits, tree.parent, tree.leaf_paths)
        compiled_path, compiled_packed = compiled(tokens, logits, tree.parent, tree.leaf_paths)
        assert torch.equal(compiled_path, path) and torch.equal(compiled_packed, packed)
        accepted = greedy(Candidates(tokens, tree), VerifyOutput(logits, logits), SamplingConfig())
        assert accepted.tokens[-1] == int(logits[accepted.nodes[-1]].argmax())  # the bonus: the last node's argmax
        assert all(tokens[n] == logits[tree.parent[n]].argmax() for n in accepted.nodes[1:])


def test_step_graphs_run_their_function_as_it_is_on_a_cpu():
    calls = []
    graph = StepGraph(lambda x: calls.append(x) or x + 1, "a test function")
    assert torch.equal(graph(torch.ones(2)), torch.full((2,), 2.0))
    assert len(calls) == 1 and graph.captured == 0


def test_a_step_graph_that_fails_to_capture_warns_once_and_runs_eagerly(monkeypatch, caplog):
    def broken(fn, args):
        raise RuntimeError("no graph today")

    monkeypatch.setattr(step_graphs, "_on_gpu", lambda args: True)
    monkeypatch.setattr(step_graphs, "_Captured", broken)
    monkeypatch.setattr(step_graphs, "_FAILED", set())
    graph = StepGraph(lambda x: x * 2, "a test function")
    with caplog.at_level(logging.WARNING, logger="medusa.runtime.graphs"):
        assert torch.equal(graph(torch.ones(2)), torch.full((2,), 2.0))
        assert torch.equal(graph(torch.ones(2)), torch.full((2,), 2.0))
    assert graph.failed and StepGraph(lambda x: x, "a test function").failed  # the next call's too
    assert not StepGraph(lambda x: x, "another function").failed
    warnings = [r for r in caplog.records if "could not run as a CUDA graph" in r.getMessage()]
    assert len(warnings) == 1 and "a test function" in warnings[0].getMessage()


def test_a_step_graph_keeps_one_graph_per_input_shape_up_to_its_limit(monkeypatch):
    """The capture itself needs a GPU (tests/test_gpu.py); here a stand-in records what would be captured."""

    class Recorded:
        def __init__(self, fn, args):
            self.fn, self.shape = fn, args[0].shape

        def replay(self, args):
            assert args[0].shape == self.shape
            return self.fn(*args)

    monkeypatch.setattr(step_graphs, "_on_gpu", lambda args: True)
    monkeypatch.setattr(step_graphs, "_Captured", Recorded)
    monkeypatch.setattr(step_graphs, "MAX_SHAPES", 2)
    graph = StepGraph(lambda x: x + 1, "a test function")
    for n in (3, 3, 4, 3, 5):
        assert torch.equal(graph(torch.zeros(n)), torch.ones(n))
    assert graph.captured == 2  # 3 and 4; 5 ran eagerly


def test_the_context_layers_read_compiles_as_one_graph_per_row_count_and_equals_eager():
    """A step's read (heads with a context layer): the layer's state has one shape from the first read on (padded to
    its window), and its position count is a tensor, so the read of r rows is one fixed graph for every step."""
    from tests.conftest import context_heads  # noqa: PLC0415

    model = MedusaModel(make_tiny_model("llama"), context_heads(), projection_dtype=torch.float32)
    proposer = gpu_like_proposer(model)
    layer = model.heads.context
    torch._dynamo.reset()
    compiled = torch.compile(proposer.read_rows, fullgraph=True, dynamic=False, backend="aot_eager")
    hidden, ids = torch.randn(1, 12, HIDDEN), torch.randint(1, VOCAB, (1, 12))
    two = torch.tensor([2])  # positions a step reads (a batch's rows: one here)
    with torch.inference_mode():
        past = layer.empty_past(hidden.device, hidden.dtype)
        assert past[0].shape[2] == layer.window - 1 and int(past[2]) == 0
        _, *past = proposer.read_rows(hidden[:, :2], ids[:, :2], *past, two)  # fewer positions than the window
        assert past[0].shape[2] == layer.window - 1 and int(past[2]) == 2
        whole = model.heads.contextualise(hidden, model.base.get_input_embeddings()(ids))[0][0]
        for start in (2, 4, 6, 8):  # steps of 2 rows: one graph
            eager = proposer.read_rows(hidden[:, start : start + 2], ids[:, start : start + 2], *past, two)
            graphed = compiled(hidden[:, start : start + 2], ids[:, start : start + 2], *past, two)
            for a, b in zip(graphed, eager):
                torch.testing.assert_close(a, b)
            torch.testing.assert_close(eager[0][0], whole[start + 1], rtol=1e-4, atol=1e-4)
            past = eager[1:]
    assert int(past[2]) == 10


def test_proposers_of_one_model_share_their_graphs_from_call_to_call():
    """generate builds a proposer per call; its graphs are the model's, so a GPU captures them once, not per call.
    A graph replays its first proposer's computation: the proposal of a later one equals its own."""
    from medusa.propose import build_medusa_proposer  # noqa: PLC0415

    model = MedusaModel(make_tiny_model("llama"), heads_of("path"), projection_dtype=torch.float32)
    build = lambda paths: build_medusa_proposer(model, build_buffers(TreeSpec(paths, 3), 3))  # noqa: E731
    first, second, other = build(HAND_TREE), build(HAND_TREE), build([[0], [0, 0]])
    assert second._guess is first._guess and second._read_graph is first._read_graph
    assert other._guess is not first._guess  # another tree, another graph
    hidden, root, copies = torch.randn(HIDDEN), torch.tensor(7), chain_tensor([9, 4], 3)
    with torch.inference_mode():
        assert torch.equal(second._guess(hidden, root, copies), second.guess(hidden, root, copies))
    model.refresh_candidate_projection()  # new weights to propose with: graphs of their own
    assert build(HAND_TREE)._guess is not first._guess


class CapturedOnACpu:
    """Stands in for a CUDA graph's capture where there is no GPU, doing what `_Captured` does to the state a function
    reads: two warm-up runs on static copies of the arguments, then each replay copies the call's arguments in and
    runs the function on those copies."""

    def __init__(self, fn, args):
        self.fn, self.inputs = fn, tuple(a.clone() for a in args)
        for _ in range(2):
            fn(*self.inputs)

    def replay(self, args):
        for static, given in zip(self.inputs, args):
            static.copy_(given)
        return self.fn(*self.inputs)


def test_the_kv_commit_survives_its_capture_and_moves_each_row_once(monkeypatch):
    """A commit moves rows it also reads: run on the call's own arguments, a capture's warm-ups would move them three
    times. row_mover captures each accepted length with an identity move instead, so the rows end as one move."""
    monkeypatch.setattr(step_graphs, "_on_gpu", lambda args: True)
    monkeypatch.setattr(step_graphs, "_Captured", CapturedOnACpu)
    torch.manual_seed(0)
    layers = [torch.randn(1, 2, 16, 4) for _ in range(3)]
    past, accepted = torch.tensor(5), torch.tensor([0, 2, 3, 6])
    expected = [rows.clone() for rows in layers]
    keep_rows(expected, 5, accepted)  # one move, uncaptured
    assert not torch.equal(expected[0][:, :, 6:9], layers[0][:, :, 6:9])  # the move changes what a repeat reads
    mover = row_mover(layers)
    mover(past, accepted)
    for rows, want in zip(layers, expected):
        assert torch.equal(rows, want)
    assert mover.captured == 1
    unguarded = [rows.clone() for rows in expected]
    StepGraph(functools.partial(keep_rows, unguarded), "a commit captured on its own arguments")(past, accepted)
    assert not torch.equal(unguarded[0], expected[0])  # what the identity capture prevents
