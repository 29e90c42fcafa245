"""Greedy Medusa output is token-for-token the base model's greedy `generate` (fp32)."""

import pytest
import torch
import transformers

from medusa import MedusaModel
from medusa.acceptance import get_rule
from medusa.decode import decode
from medusa.runtime import engine_for
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain
from tests.conftest import _COMMON, FAMILIES, VOCAB, make_heads, make_tiny_model

TREES = {"default": None, "wide": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]], "chain": [[0]]}


def _reference(base, prompt, max_new_tokens, **kwargs):
    return base.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("random_heads", [False, True], ids=["untrained", "random"])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_identity(family, random_heads, tree):
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=random_heads), tree=TREES[tree])
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(1, 90, (1, 5 + 4 * seed))
        out = model.generate(prompt, max_new_tokens=48, return_dict_in_generate=True)
        assert torch.equal(out.sequences, _reference(base, prompt, 48))
        assert out.stats.new_tokens == 48 and out.stats.steps >= 1
        assert sum(out.stats.accepted_lengths) + 1 >= 48  # every verify step commits at least one token


class OracleProposer:
    """Proposes the true greedy continuation as a chain, wrong from depth `wrong_at` on: tests deep acceptance."""

    def __init__(self, reference: list[int], depth: int, wrong_at: int | None):
        self.reference, self.wrong_at = reference, wrong_at
        self.tree = build_buffers(TreeSpec(chain(depth)), depth)
        self.max_nodes = self.tree.num_nodes

    def propose(self, state):
        n = len(state.tokens)  # state.tokens ends with the root token
        guess = self.reference[n : n + self.tree.num_nodes - 1]
        guess += [0] * (self.tree.num_nodes - 1 - len(guess))
        if self.wrong_at is not None:
            guess[self.wrong_at - 1] = (guess[self.wrong_at - 1] + 1) % VOCAB
        tokens = torch.tensor([int(state.root_token)] + guess)
        return Candidates(tokens=tokens, tree=self.tree)

    def observe(self, state, accepted_tokens):
        pass


@pytest.mark.parametrize("wrong_at, tau_per_step", [(None, 5), (3, 3), (1, 1)])
def test_oracle_chain_accepts_exactly_the_right_prefix(wrong_at, tau_per_step):
    base = make_tiny_model("llama")
    prompt = torch.tensor([[3, 4, 5]])
    reference = _reference(base, prompt, 60)
    proposer = OracleProposer(reference[0].tolist(), depth=4, wrong_at=wrong_at)
    out = decode(
        base, proposer, get_rule("greedy"), prompt, max_new_tokens=60, sampling=SamplingConfig(), stop_ids=set()
    )
    assert torch.equal(out.sequences, reference)
    # every full step commits the accepted prefix + the bonus token; the last step may be cut by max_new_tokens
    assert set(out.stats.accepted_lengths[:-1]) == {tau_per_step}
    assert out.stats.mean_accepted_tokens == pytest.approx(out.stats.new_tokens / out.stats.steps)


# Architectures beyond the tiny llama / qwen2 / gemma that every other test runs, each with what sets it apart: q/k
# norms (Qwen3), q/k/v and gate/up already fused in the checkpoint (Phi-3), a fused q/k/v with partial rotary and a
# parallel residual (GPT-NeoX), routed experts (Qwen2-MoE), layer norms with a logit scale (Cohere), biased
# projections and a GELU MLP (Starcoder2). Initialised wider than transformers' default, whose tiny Cohere and
# Starcoder2 repeat one token whatever they read (a wrong cache row would go unseen)
MORE_FAMILIES = {
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**_COMMON),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "cohere": lambda: transformers.CohereConfig(**_COMMON),
    "starcoder2": lambda: transformers.Starcoder2Config(**_COMMON),
}


@pytest.mark.parametrize("engine", ["eager", "compiled"])
@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_more_architectures_verify_chains_and_trees_exactly_on_each_engine(family, engine):
    """A chain right to depth 2 and wrong at 3, every step: each verify accepts 2 guesses and the bonus and rejects the
    rest; then random heads over a wide tree. Either way the output is transformers' greedy, on the eager engine and
    on the compiled one (on a CPU: the linears pre-packed, sibling projections fused)."""
    torch.manual_seed(0)
    config = MORE_FAMILIES[family]()
    config._attn_implementation, config.initializer_range = "sdpa", 0.2
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    reference = _reference(base, prompt, 40, pad_token_id=0)
    out = decode(
        base,
        OracleProposer(reference[0].tolist(), depth=4, wrong_at=3),
        get_rule("greedy"),
        prompt,
        max_new_tokens=40,
        sampling=SamplingConfig(),
        stop_ids=set(),
        engine=engine_for(base, engine),
    )
    assert torch.equal(out.sequences, reference)
    assert set(out.stats.accepted_lengths[:-1]) == {3}
    # random heads on a wide tree: rejections at every depth, an accepted path off the first branch moves cache rows
    model = MedusaModel(base, make_heads(random=True), tree=TREES["wide"])
    out = model.generate(prompt, max_new_tokens=40, engine=engine, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_token_in_the_middle_of_an_accepted_path(family):
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=True), tree=TREES["wide"])
    prompt = torch.tensor([[5, 6, 7, 8]])
    free = _reference(base, prompt, 40)[0, 4:].tolist()
    for stop in dict.fromkeys(free[3:12]):  # several stop tokens, wherever they fall within a step
        want = _reference(base, prompt, 40, eos_token_id=stop, pad_token_id=0)
        got = model.generate(prompt, max_new_tokens=40, eos_token_id=stop)
        assert torch.equal(got, want), stop
        assert got[0, -1] == stop


def test_several_stop_ids_and_exact_max_new_tokens():
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(), tree=TREES["wide"])
    prompt = torch.tensor([[1, 2, 3]])
    free = _reference(base, prompt, 30)[0, 3:].tolist()
    got = model.generate(prompt, max_new_tokens=30, eos_token_id=[free[20], free[9]])
    assert got[0, 3:].tolist() == free[:10]
    for n in (1, 2, 7, 13):
        assert model.generate(prompt, max_new_tokens=n).shape[1] == 3 + n


def test_streamer_receives_exactly_the_new_tokens():
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    model = MedusaModel(make_tiny_model("qwen2"), make_heads(random=True), tree=TREES["wide"])
    prompt = torch.tensor([[9, 8, 7]])
    streamer = Collect()
    out = model.generate(prompt, max_new_tokens=25, streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == [9, 8, 7]
    assert sum(streamer.chunks[1:], []) == out[0, 3:].tolist()


def test_accepts_batch_encoding_and_lists():
    model = MedusaModel(make_tiny_model("llama"), make_heads())
    a = model.generate({"input_ids": torch.tensor([[4, 5, 6]])}, max_new_tokens=5)
    b = model.generate([4, 5, 6], max_new_tokens=5)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs(dtype):
    base = make_tiny_model("llama", dtype=dtype)
    model = MedusaModel(base, make_heads(random=True))
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20)
    assert out.shape == (1, 23) and model.heads.blocks[0][0].linear.weight.dtype == dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_greedy_identity():
    base = make_tiny_model("llama").cuda()
    model = MedusaModel(base, make_heads(random=True))
    prompt = torch.tensor([[1, 2, 3]], device="cuda")
    assert torch.equal(model.generate(prompt, max_new_tokens=32), _reference(base, prompt, 32))
