"""What proposes runs on int8 weights on a CPU (medusa.runtime.int8_copy): close to the float layers, following
changes to their weights, and never changing what the target outputs."""

import pytest
import torch
from torch import nn

import medusa.model
import medusa.runtime.prepack
from medusa import MedusaModel
from medusa.propose import CandidateProjection
from medusa.runtime import Int8Weight, can_int8, int8_copy, quantize_int8
from medusa.runtime.prepack import FBGEMM_WEIGHT_TOP, INT8_BLOCK, Int8Linear, PackedLinear, int8_linear
from tests.conftest import FAMILIES, make_heads, make_tiny_model


@pytest.mark.parametrize("fbgemm", [True, False])
def test_int8_linear_is_close_to_the_float_layer_at_any_row_count(fbgemm, monkeypatch):
    monkeypatch.setattr(medusa.runtime.prepack, "fbgemm_available", lambda device: fbgemm)
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    quantized = Int8Linear(linear)
    assert quantized.int8.fbgemm == fbgemm
    for rows in (1, 3, 17):
        x = torch.randn(2, rows, 64)
        expected = linear(x)
        got = quantized(x)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_on_a_prompt_computes_what_the_kernel_computes_row_by_row(dtype, monkeypatch):
    import medusa.runtime.prepack

    monkeypatch.setattr(medusa.runtime.prepack, "native_bf16", lambda: False)  # fp32 prompts convert too (AVX2)
    torch.manual_seed(0)
    quantized, scales = quantize_int8(torch.randn(48, 64))
    rows = torch.randn(70, 64, dtype=dtype)
    assert medusa.runtime.prepack.dequantizing_pays(rows.shape[0], dtype)
    assert not medusa.runtime.prepack.dequantizing_pays(1, dtype)
    together = int8_linear(rows, quantized, scales)  # a prompt's rows: a float GEMM over the converted weights
    alone = torch.cat([int8_linear(row[None], quantized, scales) for row in rows])  # aten's weight-only kernel
    assert together.shape == alone.shape == (rows.shape[0], 48) and together.dtype == dtype
    # both are the product with the dequantised weights, up to bf16 roundings (8 bits of mantissa: 1/128 relative)
    weight = quantized.float() * scales.float()[:, None]
    exact = rows.float() @ weight.T
    bound = (rows.float().abs() @ weight.abs().T) / 64 + 1e-3
    assert ((together.float() - exact).abs() <= bound).all() and ((alone.float() - exact).abs() <= bound).all()


def test_proposing_on_fbgemm_multiplies_the_input_rounded_as_a_whole_by_the_levels():
    """fbgemm rounds its whole input to uint8 (one scale and zero point from its minimum and maximum) and multiplies
    by weights within FBGEMM_WEIGHT_TOP levels: each output is within half an input step per weight of the float
    product with the dequantised weights (fbgemm's AVX2 path saturates pairs of products beyond those levels:
    test_precision's test_fbgemm_sums_stay_exact_where_avx2_saturates_pairs_of_products)."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    x = torch.randn(5, 64) * 4
    int8 = Int8Weight.of(weight)
    assert int8.fbgemm and int8.quantized.abs().max() == FBGEMM_WEIGHT_TOP and int8.scales.dtype == torch.float32
    dequantized = int8.quantized.float() * int8.scales[:, None]
    step = (x.max() - x.min()) / 255
    bound = 0.5 * step * dequantized.abs().sum(1) + 1e-4
    got = int8.linear(x)
    assert got.shape == (5, 48) and ((got - x @ dequantized.T).abs() <= bound).all()
    torch.testing.assert_close(int8.linear(x[None], torch.ones(48))[0], got + 1)  # any leading dims, a bias


def test_without_fbgemm_proposing_runs_on_atens_kernel(monkeypatch):
    monkeypatch.setattr(medusa.runtime.prepack, "fbgemm_available", lambda device: False)
    weight, x = torch.randn(48, 64), torch.randn(3, 64)
    int8 = Int8Weight.of(weight)
    assert not int8.fbgemm and int8.quantized.abs().max() == 127
    torch.testing.assert_close(int8.linear(x), int8_linear(x, *quantize_int8(weight)))


def test_quantized_weights_round_trip_within_half_a_step_per_row():
    weight = torch.randn(7, 32) * torch.logspace(-3, 1, 7)[:, None]  # rows of very different sizes
    quantized, scales = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (7,)
    error = (quantized.float() * scales.float()[:, None] - weight).abs()
    assert (error <= 0.51 * scales.float()[:, None] + 0.01 * weight.abs()).all()  # rounding + bf16 scales


def test_int8_linear_follows_in_place_changes_to_the_shared_weight():
    linear = nn.Linear(32, 16)
    quantized = Int8Linear(linear)
    x = torch.randn(2, 32)
    with torch.no_grad():
        linear.weight.mul_(-3.0)
    expected = linear(x)
    assert (quantized(x) - expected).abs().max() <= 0.02 * expected.abs().max()


def test_widths_the_kernel_cannot_take_stay_in_float():
    """aten's int8 kernel crashes on inputs that are not a multiple of 16 wide: such layers keep float weights."""
    assert can_int8("cpu", 2 * INT8_BLOCK) and not can_int8("cpu", INT8_BLOCK + 8) and not can_int8("meta", 64)
    model = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 8))
    copied = int8_copy(model)
    assert isinstance(copied[0], Int8Linear) and isinstance(copied[1], (PackedLinear, nn.Linear))
    assert not isinstance(copied[1], Int8Linear)
    assert copied[0].weight is model[0].weight  # shared, not copied
    x = torch.randn(3, 64)
    assert (copied(x) - model(x)).abs().max() <= 0.02 * model(x).abs().max()


def test_a_cpu_model_proposes_on_int8_weights_and_its_float_heads_are_left_alone():
    model = MedusaModel(make_tiny_model("llama"), make_heads(num_heads=2, random=True))
    int8_layers = [m for m in model.proposal_heads.modules() if isinstance(m, Int8Linear)]
    assert int8_layers and not any(isinstance(m, Int8Linear) for m in model.heads.modules())
    assert model.candidate_projection.int8 is not None
    hidden = torch.randn(3, model.config.hidden_size)
    projection = model.candidate_projection
    exact = hidden @ projection.weight.float().T
    got = projection.head_logits(0, hidden).float()
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()


def test_an_int8_projection_is_asked_for_not_assumed():
    model = MedusaModel(make_tiny_model("qwen2"), make_heads(num_heads=2))
    lm_head = model.base.get_output_embeddings()
    assert CandidateProjection.build(model.heads, lm_head, torch.float32).int8 is None
    assert CandidateProjection.build(model.heads, lm_head, torch.float32, int8=True).int8 is not None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("proposer", ["medusa", "dynamic"])
def test_int8_proposing_leaves_greedy_output_identical(family, proposer):
    """The heads on int8 weights propose other guesses than in float, but the target verifies them: greedy output
    equals the base's own greedy decoding."""
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(num_heads=3, random=True, seed=1), tree=[[0], [1], [0, 0], [0, 0, 0]])
    assert model.candidate_projection.int8 is not None
    prompt = torch.tensor([[5, 9, 2, 7, 11]])
    expected = base.generate(prompt, max_new_tokens=24, do_sample=False)
    got = model.generate(prompt, max_new_tokens=24, proposer=proposer)
    assert torch.equal(got, expected)


def test_a_cpu_model_ranks_the_most_frequent_candidates_of_its_subset(monkeypatch):
    """The subset is ordered most frequent first (medusa.train.data.frequent_tokens): a CPU ranks its first
    CPU_CANDIDATES, the same rows of the same weights."""
    heads = make_heads(num_heads=2, random=True)
    heads.set_vocab_subset(torch.tensor([7, 3, 11, 2, 5, 1]))
    monkeypatch.setattr(medusa.model, "CPU_CANDIDATES", 4)
    model = MedusaModel(make_tiny_model("gemma"), heads)
    projection = model.candidate_projection
    assert projection.token_ids.tolist() == [7, 3, 11, 2]
    rows = model.base.get_output_embeddings().weight[[7, 3, 11, 2]]
    torch.testing.assert_close(projection.weight, rows.to(projection.weight.dtype))
    whole = CandidateProjection.build(heads, model.base.get_output_embeddings(), torch.float32)
    assert whole.token_ids.tolist() == [7, 3, 11, 2, 5, 1]  # elsewhere (evaluation, a GPU) the whole subset


def test_prepared_linears_trace_into_one_graph():
    """torch.compile over the heads' int8 copy (a context layer's read, say) must not break at each linear."""
    heads = int8_copy(nn.Sequential(nn.Linear(64, 32), nn.SiLU(), nn.Linear(32, 16)))
    x = torch.randn(2, 64)
    torch.testing.assert_close(torch.compile(heads, backend="eager", fullgraph=True)(x), heads(x))
