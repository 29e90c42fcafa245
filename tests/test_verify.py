"""The key invariant: one tree-verify forward gives every node the logits of running its path sequentially."""

import inspect

import torch
from transformers import DynamicCache

from medusa.runtime import kv_cache, verify, with_cache
from medusa.tree import Candidates, TreeSpec, build_buffers
from tests.conftest import make_tiny_model
from tests.test_tree import HAND_TREE


def _prefill(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache


def _sequential_logits(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def test_tree_logits_equal_sequential_paths(tiny_model):
    torch.manual_seed(0)
    prompt = torch.randint(1, 90, (1, 11))
    buffers = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    tokens = torch.randint(1, 90, (buffers.num_nodes,))
    cache = _prefill(tiny_model, prompt)
    out = verify(tiny_model, cache, Candidates(tokens=tokens, tree=buffers), prompt.shape[1])
    for node in range(buffers.num_nodes):
        path = [node]
        while path[-1] != 0:
            path.append(int(buffers.parent[path[-1]]))
        path_tokens = prompt[0].tolist() + tokens[list(reversed(path))].tolist()
        torch.testing.assert_close(out.logits[node], _sequential_logits(tiny_model, path_tokens), atol=1e-4, rtol=1e-4)


def test_commit_keeps_accepted_rows_and_next_step_matches(tiny_model):
    torch.manual_seed(1)
    prompt = torch.randint(1, 90, (1, 9))
    buffers = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    tokens = torch.randint(1, 90, (buffers.num_nodes,))
    cache = _prefill(tiny_model, prompt)
    verify(tiny_model, cache, Candidates(tokens=tokens, tree=buffers), prompt.shape[1])
    accepted = torch.tensor([0, 1, 3, 6])  # the deepest path
    kv_cache.commit(cache, prompt.shape[1], accepted)
    assert cache.get_seq_length() == prompt.shape[1] + 4

    committed = torch.cat([prompt[0], tokens[accepted]])
    fresh = _prefill(tiny_model, committed[None])
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([[7]])
    with torch.inference_mode():
        after_commit = tiny_model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(
        after_commit, _sequential_logits(tiny_model, committed.tolist() + [7]), atol=1e-4, rtol=1e-4
    )


def test_the_cache_goes_by_the_name_the_forward_takes():
    """transformers 5.23 renamed forward's past_key_values to cache (the old name warns, and goes in 5.40)."""
    model = make_tiny_model("llama")
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert list(with_cache(model, "the cache")) == [name] and with_cache(model, "the cache")[name] == "the cache"

    class OldForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None):
            return past_key_values

    assert with_cache(OldForward(), 1) == {"past_key_values": 1}


def test_a_trees_mask_over_exactly_its_rows_is_the_general_masks():
    """bias_over_rows builds a mask with nothing hidden beyond the tree (a package's step: as wide as the rows written)
    as the past's zeros and the tree's bias directly: the values, shape and dtype the general placement gives; a wider
    one (a fixed-width compiled shape) still hides the rows beyond, and a 0-d past takes the general way."""
    from medusa.runtime.verify import bias_over_rows  # medusa.runtime.verify: the function
    from medusa.tree import chain

    for spec in (TreeSpec(chain(0)), TreeSpec(HAND_TREE)):
        tree = build_buffers(spec)
        n = tree.num_nodes
        for dtype in (torch.float32, torch.bfloat16):
            bias = tree.attention_bias(dtype, torch.device("cpu"))
            for past in (0, 3, 100):
                for rows in (past + n, past + n + 6):
                    want = torch.full((n, rows), torch.finfo(dtype).min, dtype=dtype)
                    want[:, :past], want[:, past : past + n] = 0.0, bias
                    mask = bias_over_rows(bias, past, rows)
                    assert mask.dtype == dtype and torch.equal(mask, want[None, None]), (n, dtype, past, rows)
                    assert torch.equal(bias_over_rows(bias, torch.tensor(past), rows), mask)
