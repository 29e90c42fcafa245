"""Precision as the user's choice (medusa.precision, medusa.runtime.quantize): int8, int4 and w8a8 targets on every
engine against their eager reference, speculative decoding exact relative to plain decoding of the same quantised
target, and the precisions this machine refuses."""

import copy
import os
import subprocess
import sys

import pytest
import torch

import medusa.precision
import medusa.runtime.prepack
import medusa.runtime.quantize
import medusa.runtime.static
from medusa import MedusaModel
from medusa.decode import prefill
from medusa.hardware import vector_int8_gemm
from medusa.plan import plan_key
from medusa.precision import ALLOW_EMULATED, activation_dtype, load_target
from medusa.runtime import (
    QUANTIZED,
    CompiledEngine,
    EagerEngine,
    InductorEngine,
    dequantize_target,
    precision_of,
    quantize_target,
)
from medusa.runtime.attention import ROW_INVARIANT_ROWS
from medusa.runtime.prepack import dequantizing_pays
from medusa.runtime.quantize import (
    FBGEMM_WEIGHT_TOP,
    INT4_DEQUANTIZED_FROM_ROWS,
    INT4_GROUP,
    FusedW8A8Member,
    Int4WeightLinear,
    Int8WeightLinear,
    QuantizedLinear,
    W8A8Linear,
    quantize_int4,
    quantize_rows,
    w8a8_linear,
)
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain
from tests.conftest import FAMILIES, make_heads, make_tiny_model, save_tiny_checkpoint
from tests.test_engine import _verify
from tests.test_tree import HAND_TREE

# bf16 activations: the compiled engine's pre-packed attention and aten's int8 kernel round where eager does not
INT8_TOL = dict(atol=3e-2, rtol=3e-2)
NEAR_TIE = 2**-5  # two logits within a few bf16 roundings of each other (relative to the largest logit)


def quantised_target(family: str, precision: str = "int8"):
    return quantize_target(make_tiny_model(family, dtype=torch.bfloat16), precision)


# the layers a quantised target holds (w8a8 on fbgemm: sibling projections fused, each in its place as a member)
LAYERS = {"int8": (Int8WeightLinear,), "int4": (Int4WeightLinear,), "w8a8": (W8A8Linear, FusedW8A8Member)}
# the largest logit change quantising makes, relative to the largest logit
DRIFT = {"int8": 0.15, "int4": 0.5, "w8a8": 0.2}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", QUANTIZED)
def test_a_quantised_target_has_quantised_linears_and_stays_near_its_float_self(family, precision):
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompt = torch.randint(1, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(prompt).logits.float()
        quantize_target(model, precision)
        after = model(prompt).logits.float()
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # every shape is one the kernels take here
    assert linears and not [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert all(type(m) in LAYERS[precision] for m in linears) and precision_of(model) == precision
    assert (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
        or not model.config.tie_word_embeddings
    )
    assert (after - before).abs().max() < DRIFT[precision] * before.abs().max()  # close, not equal


def test_int4_keeps_q4_1_weights_as_they_are_and_dequantises_them_back(monkeypatch):
    """Weights already on a 16-level grid per group of 32 (what transformers makes of a Q4_1 GGUF) come back exactly:
    the kernel over the identity returns them, and a row through the layer is that row times them."""
    torch.manual_seed(0)
    out_features, in_features = 48, 2 * INT4_GROUP
    levels = torch.randint(0, 16, (out_features, in_features)).float()
    levels[:, ::INT4_GROUP] = 0  # each group holds its minimum and maximum, as llama.cpp's Q4_1 blocks do
    levels[:, 1::INT4_GROUP] = 15
    step = torch.rand(out_features, 2, 1) + 0.01
    minimum = torch.randn(out_features, 2, 1)
    weight = (levels.view(out_features, 2, INT4_GROUP) * step + minimum).view(out_features, in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data.copy_(weight)
    layer = Int4WeightLinear(linear)
    torch.testing.assert_close(layer.weight, weight, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, in_features)
    torch.testing.assert_close(layer(x), x @ weight.T, atol=1e-4, rtol=1e-4)
    packed, scales_and_zeros, nibbles = quantize_int4(weight, torch.float32)
    assert packed.dtype == nibbles.dtype == torch.uint8 and packed.shape == nibbles.shape == (48, in_features // 2)
    assert scales_and_zeros.shape == (in_features // INT4_GROUP, out_features, 2)
    monkeypatch.setattr(medusa.runtime.prepack, "native_bf16", lambda: False)  # fp32 prompts dequantise (AVX2)
    prompt = torch.randn(INT4_DEQUANTIZED_FROM_ROWS, in_features)  # a prompt: a float GEMM, weights dequantised
    assert dequantizing_pays(INT4_DEQUANTIZED_FROM_ROWS, torch.float32)
    torch.testing.assert_close(layer(prompt), prompt @ weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree", [[], HAND_TREE], ids=["q=1", "tree"])
@pytest.mark.parametrize("precision", QUANTIZED)
def test_the_compiled_engine_runs_a_quantised_target_as_eager_does(family, tree, precision):
    model = quantised_target(family, precision)
    torch.manual_seed(0)
    prompt = torch.randint(1, 90, (1, 11))
    buffers = build_buffers(TreeSpec(tree, 3), 3)
    candidates = Candidates(tokens=torch.randint(1, 90, (buffers.num_nodes,)), tree=buffers)
    _, eager = _verify(EagerEngine(model), model, prompt, candidates)
    _, compiled = _verify(CompiledEngine(model), model, prompt, candidates)
    torch.testing.assert_close(compiled.logits.float(), eager.logits.float(), **INT8_TOL)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
@pytest.mark.parametrize("precision", QUANTIZED)
def test_speculation_on_a_quantised_target_is_its_plain_decoding(family, engine, precision):
    """Exactness is relative to plain decoding of the same quantised target on the same engine."""
    model = MedusaModel(quantised_target(family, precision), make_heads(random=True).to(torch.bfloat16))
    identical = 0
    for seed in range(3):
        prompt = torch.randint(1, 90, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        plain = model.generate(prompt, max_new_tokens=24, proposer="plain", engine=engine)[0].tolist()
        fast = model.generate(prompt, max_new_tokens=24, engine=engine)[0].tolist()
        at = next((i for i, (a, b) in enumerate(zip(plain, fast)) if a != b), None)
        identical += at is None
        if at is not None:  # several query tokens round otherwise than one in bf16: only a near-tie may swap
            with torch.no_grad():
                logits = model.base(torch.tensor([plain[:at]])).logits[0, -1].float()
            assert abs(logits[plain[at]] - logits[fast[at]]) <= NEAR_TIE * max(1.0, logits.abs().max()), (seed, at)
    assert identical >= 2


@pytest.mark.slow
@pytest.mark.parametrize("precision", QUANTIZED)
def test_the_inductor_engine_compiles_a_quantised_target_ahead_of_time(tmp_path, monkeypatch, precision):
    """The package holds the quantised weights (aten's weight-only op, lowered by inductor) and gives eager's
    logits."""
    import medusa.runtime.static

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", {"freezing": True})
    monkeypatch.setattr(medusa.runtime.static, "COMPILED_MIN_ROWS", 64)
    model = quantised_target("llama", precision)
    engine = InductorEngine(model)
    assert engine.ahead_of_time
    torch.manual_seed(0)
    prompt = torch.randint(1, 90, (1, 11))
    buffers = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    candidates = Candidates(tokens=torch.randint(1, 90, (buffers.num_nodes,)), tree=buffers)
    engine.warm_up(progress=False, max_length=64)
    assert engine.ahead_of_time and engine.package is not None  # compiled, not fallen back to the uncompiled forward
    _, eager = _verify(EagerEngine(model), model, prompt, candidates)
    _, compiled = _verify(engine, model, prompt, candidates)
    torch.testing.assert_close(compiled.logits.float(), eager.logits.float(), **INT8_TOL)


def test_unknown_and_slow_precisions_are_refused_with_the_fix(tmp_path, monkeypatch):
    base_dir, _ = save_tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"unknown dtype 'int3'.*float32.*int8"):
        load_target(str(base_dir), dtype="int3")
    monkeypatch.setattr(medusa.precision, "native_bf16", lambda device="cpu": False)
    monkeypatch.delenv(ALLOW_EMULATED, raising=False)
    # torch's AVX-512 kernels without bf16 (an AVX-512 CPU before Cooper Lake): the refusals name int8, on any CPU
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with pytest.raises(ValueError, match=r"no native bf16.*dtype='float32'.*dtype='int8'"):
        load_target(str(base_dir), dtype="bfloat16")
    assert activation_dtype("int8", "cpu") == torch.float32  # int8 weights, fp32 activations where bf16 is emulated
    monkeypatch.setattr(medusa.precision, "vector_int4", lambda device="cpu": False)  # torch's AVX2 kernels
    with pytest.raises(ValueError, match=r"int4 kernel.*reference loop.*dtype='int8'.*MEDUSA_ALLOW_EMULATED"):
        load_target(str(base_dir), dtype="int4")
    monkeypatch.setattr(medusa.precision, "w8a8_kernel", lambda device="cpu": None)  # neither VNNI nor fbgemm
    with pytest.raises(ValueError, match=r"w8a8.*AVX512-VNNI.*fbgemm.*dtype='int8'.*MEDUSA_ALLOW_EMULATED"):
        load_target(str(base_dir), dtype="w8a8")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # torch's AVX2 kernels
    with pytest.raises(ValueError, match=r"int8.*AVX2.*dtype='w8a8'.*dtype='float32'.*MEDUSA_ALLOW_EMULATED"):
        load_target(str(base_dir), dtype="int8")
    for slow in ("bfloat16", "int4"):  # their refusals name w8a8 rather than int8 there
        with pytest.raises(ValueError, match=r"dtype='w8a8'") as refusal:
            load_target(str(base_dir), dtype=slow)
        assert "dtype='int8'" not in str(refusal.value)
    assert activation_dtype("auto", "cpu") == torch.float32
    monkeypatch.setenv(ALLOW_EMULATED, "1")
    model, _ = load_target(str(base_dir), dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="CPU precision"):
        activation_dtype("int8", "cuda")


def test_the_plan_is_keyed_on_the_precision(tmp_path):
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    keys = {}
    for dtype in ("bfloat16", "int8"):
        model = MedusaModel.from_pretrained(heads_dir, base=base_dir, dtype=dtype, plan="off")
        keys[dtype] = plan_key(model, ("eager",))
    assert keys["int8"]["dtype"] == "int8" and keys["bfloat16"]["dtype"] == "bfloat16"


def test_inductor_takes_its_template_first_for_every_precisions_gemms():
    """fp32, bf16, fp16 and int8 GEMMs alike: inductor's C++ template, aten's kernels only where it has none (bf16 and
    fp16 included without AMX: widened in registers, their weights asked for ahead, they beat oneDNN and aten's GEMV
    there, docs/engines.md)."""
    from medusa.runtime.static import inductor_cpu_options

    backends = "max_autotune_gemm_backends"
    models = [make_tiny_model("llama", dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    assert [inductor_cpu_options(m)[backends] for m in (*models, quantised_target("llama"))] == ["CPP,ATEN"] * 4


def test_inductor_concatenates_float_projections_but_not_int8_ones():
    from medusa.runtime.static import inductor_cpu_options

    concat = "cpp.enable_concat_linear"
    assert inductor_cpu_options(make_tiny_model("llama"))[concat] is True
    assert inductor_cpu_options(make_tiny_model("llama", dtype=torch.bfloat16))[concat] is True
    assert not inductor_cpu_options(quantised_target("llama")).get(concat, False)


@pytest.mark.parametrize("precision", QUANTIZED)
def test_a_dequantised_target_computes_the_quantised_weights_in_float32(precision):
    """scripts/divergence.py's arbiter: every quantised layer an nn.Linear holding what it computed with, the tied
    projection's quantised weights included."""
    model = quantize_target(make_tiny_model("gemma"), precision)  # gemma ties its embeddings
    prompt = torch.randint(1, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantised = model(prompt).logits
        dequantize_target(model)
        exact = model(prompt).logits
    assert not [m for m in model.modules() if isinstance(m, QuantizedLinear)] and precision_of(model) == "float32"
    assert not torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    torch.testing.assert_close(exact, quantised, **INT8_TOL)  # the kernels round activations to bf16 on the way


@pytest.fixture(params=["template", "fbgemm"])
def w8a8_kernel(request, monkeypatch):
    """w8a8 targets built for either kernel (inductor's VNNI template, or fbgemm as on an AVX2 CPU). Uncompiled, the
    template's layers sum with torch._int_mm, exact where oneDNN has VNNI (an AVX2 CPU never takes the template)."""
    if request.param == "template" and not vector_int8_gemm():
        pytest.skip("torch._int_mm's sums saturate without AVX512-VNNI, where w8a8 takes fbgemm")
    monkeypatch.setattr(medusa.runtime.quantize, "w8a8_kernel", lambda device="cpu": request.param)
    return request.param


def test_w8a8_rounds_each_row_on_its_own_and_sums_exactly(w8a8_kernel):
    """A row's output is the same alone as among other rows (its own scale, integer sums), so a tree's verify computes
    each node's linears as plain decoding does; and it is the int8 levels' exact product, scaled."""
    torch.manual_seed(0)
    layer = W8A8Linear(torch.nn.Linear(64, 48))
    assert layer.fbgemm == (w8a8_kernel == "fbgemm")
    assert layer.weight_int8.abs().max() == (FBGEMM_WEIGHT_TOP if layer.fbgemm else 127)
    rows = torch.randn(7, 64, dtype=torch.bfloat16) * torch.logspace(-2, 2, 7)[:, None].bfloat16()  # scales apart
    together = layer(rows)
    for i in range(7):
        assert torch.equal(layer(rows[i : i + 1]), together[i : i + 1])
    levels, scales = quantize_rows(rows)
    assert levels.abs().max() == 127 and torch.equal(levels, levels.round())
    sums = levels.double() @ layer.weight_int8.double().T  # exact in float64 at these sizes
    expected = (sums.float() * (scales * layer.scales) + layer.bias).to(torch.bfloat16)
    torch.testing.assert_close(together, expected, atol=0, rtol=2**-7)  # one bf16 rounding


@pytest.mark.parametrize("family", FAMILIES)
def test_w8a8_on_fbgemm_fuses_sibling_projections_and_computes_what_each_computes_alone(family, monkeypatch):
    """On fbgemm (an AVX2 CPU) q/k/v and gate/up of a w8a8 target are one GEMM over one rounding of their input; each
    output row keeps its own scale, so the logits are bit for bit those of the layers apart, and the dequantised
    target (what divergence.py judges with) holds each member's own weights."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    monkeypatch.setattr(medusa.runtime.quantize, "w8a8_kernel", lambda device="cpu": "fbgemm")
    fused = quantize_target(copy.deepcopy(model), "w8a8")
    monkeypatch.setattr(medusa.runtime.quantize, "_fuse_w8a8_siblings", lambda model: None)
    apart = quantize_target(model, "w8a8")
    members = [m for m in fused.modules() if isinstance(m, FusedW8A8Member)]
    assert len(members) == 5 * fused.config.num_hidden_layers  # q, k, v, gate, up
    assert not [m for m in apart.modules() if isinstance(m, FusedW8A8Member)]
    prompt = torch.randint(1, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fused(prompt).logits, apart(prompt).logits)
    dequantized, expected = dequantize_target(fused).state_dict(), dequantize_target(apart).state_dict()
    assert dequantized.keys() == expected.keys()
    assert all(torch.equal(dequantized[name], expected[name]) for name in expected)


SATURATING_SUMS = """
import torch
from medusa.runtime.quantize import FBGEMM_WEIGHT_TOP, int8_sums
levels = torch.full((3, 256), 127.0)
levels[1] = -127
levels[2, ::2] = 0
for top in (FBGEMM_WEIGHT_TOP, 127):
    weight = torch.full((32, 256), top, dtype=torch.int8)
    weight[1::2] = -top
    exact = levels.double() @ weight.double().T
    print(top, torch.equal(int8_sums(levels, weight).double(), exact))
"""


@pytest.mark.slow
def test_fbgemm_sums_stay_exact_where_avx2_saturates_pairs_of_products():
    """AVX2's multiply-add of u8 by s8 saturates each pair of products at 16 bits: with w8a8's activations up to 255
    (levels around a zero point of 128), weights within FBGEMM_WEIGHT_TOP levels keep every sum exact; at 127 levels
    (shown here) they would not. fbgemm on its AVX2 kernels, whatever this CPU has."""
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
    run = subprocess.run([sys.executable, "-c", SATURATING_SUMS], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.split() == [str(FBGEMM_WEIGHT_TOP), "True", "127", "False"], run.stdout


@pytest.mark.slow
@pytest.mark.skipif(not vector_int8_gemm(), reason="inductor's int8 GEMM template needs AVX512-VNNI")
def test_w8a8_compiles_to_inductors_int8_gemm_template():
    """What makes w8a8 worth having: inductor's freezing pass lowers its pattern to the AVX512-VNNI GEMM template
    (a oneDNN call per GEMM otherwise: tens of microseconds each), computing what the uncompiled layer does."""
    from torch._inductor.utils import run_and_get_code

    from medusa.runtime.static import INDUCTOR_CPU_OPTIONS

    torch.manual_seed(0)
    layer = W8A8Linear(torch.nn.Linear(256, 192, bias=False)).eval()
    rows = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad(), torch._inductor.config.patch({**INDUCTOR_CPU_OPTIONS, "max_autotune_gemm_backends": "CPP"}):
        compiled, code = run_and_get_code(torch.compile(layer, dynamic=False), rows)
    assert "dpbusd" in "".join(code)  # the VNNI multiply-add of u8 by s8
    torch.testing.assert_close(compiled, layer(rows), atol=0, rtol=2**-7)
    with torch.no_grad():  # the same sums through the pattern uncompiled (quantized_decomposed's float reference)
        eager_pattern = torch.compile(
            lambda x: w8a8_linear(x, layer.weight_int8, layer.scales, layer.zeros), backend="eager"
        )(rows)
    torch.testing.assert_close(eager_pattern, layer(rows), atol=0, rtol=2**-7)


def _chain_and_one_at_a_time(engine, model, prompt: torch.Tensor, tokens: torch.Tensor):
    """The logits of `tokens` verified as one chain after `prompt`, and of the same tokens verified one at a time."""
    with torch.inference_mode():
        state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=128)
        chained = build_buffers(TreeSpec(chain(len(tokens) - 1)), len(tokens) - 1)
        together = engine.verify(state.cache, Candidates(tokens=tokens, tree=chained), state.length).logits.clone()
        state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=128)
        alone = build_buffers(TreeSpec([]), 1)
        rows = []
        for i, token in enumerate(tokens):
            rows.append(engine.verify(state.cache, Candidates(token[None], alone), state.length + i).logits[0].clone())
            engine.commit(state.cache, state.length + i, torch.tensor([0]))
    return together, torch.stack(rows)


def _last_sibling_and_plain(engine, model, prompt: torch.Tensor, tokens: torch.Tensor):
    """The logits at the last of tokens[1:] verified as siblings under tokens[0] (so it sits past the others in the
    cache), and at the same token after tokens[0] in plain decoding."""
    with torch.inference_mode():
        state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=128)
        siblings = build_buffers(TreeSpec([[i] for i in range(len(tokens) - 1)]), 1)
        tree = engine.verify(state.cache, Candidates(tokens=tokens, tree=siblings), state.length).logits[-1].clone()
        state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=128)
        alone = build_buffers(TreeSpec([]), 1)
        engine.verify(state.cache, Candidates(tokens[:1], alone), state.length)
        engine.commit(state.cache, state.length, torch.tensor([0]))
        plain = engine.verify(state.cache, Candidates(tokens[-1:], alone), state.length + 1).logits[0].clone()
    return tree, plain


W8A8_PROMPTS = (9, ROW_INVARIANT_ROWS + 5)  # prompt lengths either side of it (the prefill's two paths)


def _assert_every_node_as_plain_decoding(engine, model) -> None:
    """After prompts either side of ROW_INVARIANT_ROWS: a chain's verify equals its tokens verified one at a time, and
    a node past its siblings equals its token in plain decoding, bit for bit; and `engine` gives eager's logits."""
    tokens = torch.randint(1, 90, (6,), generator=torch.Generator().manual_seed(1))
    for length in W8A8_PROMPTS:
        prompt = torch.randint(1, 90, (1, length), generator=torch.Generator().manual_seed(length))
        together, alone = _chain_and_one_at_a_time(engine, model, prompt, tokens)
        assert torch.equal(together, alone), (length, (together - alone).abs().amax(-1))
        _, reference = _chain_and_one_at_a_time(EagerEngine(model), model, prompt, tokens)
        torch.testing.assert_close(alone.float(), reference.float(), **INT8_TOL)
        tree, plain = _last_sibling_and_plain(engine, model, prompt, tokens)
        assert torch.equal(tree, plain), length


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", [EagerEngine, CompiledEngine])
def test_a_w8a8_verify_computes_every_node_as_plain_decoding_does(family, engine, w8a8_kernel):
    """w8a8's exactness is by construction: each node of a tree's verify (in a chain, or past its siblings) comes out
    bit for bit as plain decoding computes that token (rounding activations to int8 would turn any difference into a
    level), and the prefill attends causally from the first cached row, as the eager engine's does."""
    model = quantised_target(family, "w8a8")
    engine = engine(model)
    _assert_every_node_as_plain_decoding(engine, model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_speculation_on_a_w8a8_target_is_identical_to_its_plain_decoding(family, engine, w8a8_kernel):
    """No near-ties to allow: every node is computed as plain decoding computes it."""
    model = MedusaModel(quantised_target(family, "w8a8"), make_heads(random=True).to(torch.bfloat16))
    for seed in range(3):
        prompt = torch.randint(1, 90, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed))
        plain = model.generate(prompt, max_new_tokens=24, proposer="plain", engine=engine)[0].tolist()
        for tree in (None, chain(3), HAND_TREE):
            fast = model.generate(prompt, max_new_tokens=24, engine=engine, tree=tree)[0].tolist()
            assert fast == plain, (seed, tree)


@pytest.mark.slow
@pytest.mark.skipif(not vector_int8_gemm(), reason="inductor's int8 GEMM template needs AVX512-VNNI")
def test_the_w8a8_package_computes_every_node_as_plain_decoding_does(tmp_path, monkeypatch):
    """The same bit for bit through the AOTInductor package on the engine's own settings (the int8 GEMM template):
    inductor's lowering of the attention must not depend on the number of query rows."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "COMPILED_MIN_ROWS", 128)
    model = quantised_target("llama", "w8a8")
    engine = InductorEngine(model)
    engine.warm_up(progress=False, max_length=128)
    assert engine.ahead_of_time and engine.package is not None
    _assert_every_node_as_plain_decoding(engine, model)


@pytest.mark.slow
def test_the_w8a8_package_on_fbgemm_reads_the_models_weights_and_computes_every_node_as_plain_decoding(
    tmp_path, monkeypatch
):
    """Where inductor has no int8 GEMM kernel (AVX2), the package calls fbgemm for its GEMMs: it holds no weights of
    its own, so fbgemm packs each of the model's weights once for the prefill and every step; and every node comes out
    bit for bit as plain decoding computes it."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "COMPILED_MIN_ROWS", 128)
    monkeypatch.setattr(medusa.runtime.quantize, "w8a8_kernel", lambda device="cpu": "fbgemm")
    packed = medusa.runtime.prepack._fbgemm_weights
    earlier = {key for key, entry in packed.items() if entry[0]() is not None}  # other tests' models, still alive
    model = quantised_target("llama", "w8a8")
    engine = InductorEngine(model)
    engine.warm_up(progress=False, max_length=128)
    assert engine.ahead_of_time and engine.package is not None
    _assert_every_node_as_plain_decoding(engine, model)
    layers = [m.weight_int8 for m in model.modules() if isinstance(m, W8A8Linear)]
    assert layers and all(packed[id(weight)][0]() is weight for weight in layers)
    new = [key for key, entry in packed.items() if entry[0]() is not None and key not in earlier]
    assert len(new) == len(layers)  # no copies packed as well
