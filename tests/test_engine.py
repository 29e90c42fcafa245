"""Execution engines: the compiled engine (StaticCache, pre-packed weights) against the eager reference."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import medusa.hardware
import medusa.runtime.aot
import medusa.runtime.static
import medusa.runtime.torch_patches
from medusa import MedusaModel
from medusa.decode import prefill
from medusa.hardware import ISA_FLAGS, amx, cpu_flags, native_bf16
from medusa.loading import base_fingerprint
from medusa.runtime import CompiledEngine, EagerEngine, InductorEngine, engine_for, make_engine, prepacked_copy
from medusa.runtime.prepack import FusedMember, FusedProjections, OneDNNLinear, PackedLinear
from medusa.runtime.quantize import quantize_target
from medusa.runtime.verify import bias_over_rows, run_prefill, tree_attention_mask
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers
from tests.conftest import FAMILIES, make_heads, make_tiny_model, run_together
from tests.test_tree import HAND_TREE

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32: the pre-packed GEMMs sum in another order than eager's


def _verify(engine, model, prompt, candidates, max_length=64):
    state = prefill(model, prompt, SamplingConfig(), engine=engine, max_length=max_length)
    return state, engine.verify(state.cache, candidates, state.length)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree", [[], HAND_TREE], ids=["q=1", "tree"])
def test_compiled_logits_equal_eager(family, tree):
    model = make_tiny_model(family)
    torch.manual_seed(0)
    prompt = torch.randint(1, 90, (1, 11))
    buffers = build_buffers(TreeSpec(tree, 3), 3)
    candidates = Candidates(tokens=torch.randint(1, 90, (buffers.num_nodes,)), tree=buffers)
    compiled = CompiledEngine(model)
    assert compiled.prepacked  # CPU, fp32: the path under test
    eager_state, eager = _verify(EagerEngine(model), model, prompt, candidates)
    static_state, static = _verify(compiled, model, prompt, candidates)
    torch.testing.assert_close(static_state.new_hidden, eager_state.new_hidden, **TOL)
    torch.testing.assert_close(static.logits, eager.logits, **TOL)
    torch.testing.assert_close(static.hidden, eager.hidden, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_commit_equals_eager_commit(family):
    """Commit a path that is not a prefix of the rows (nodes 0, 1, 3, 6), then the next verify agrees."""
    model = make_tiny_model(family)
    torch.manual_seed(1)
    prompt = torch.randint(1, 90, (1, 9))
    buffers = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    tokens = torch.randint(1, 90, (buffers.num_nodes,))
    accepted = torch.tensor([0, 1, 3, 6])
    follow = Candidates(tokens=torch.randint(1, 90, (buffers.num_nodes,)), tree=buffers)
    results = []
    for engine in (EagerEngine(model), CompiledEngine(model)):
        state, _ = _verify(engine, model, prompt, Candidates(tokens=tokens, tree=buffers))
        engine.commit(state.cache, state.length, accepted)
        results.append(engine.verify(state.cache, follow, state.length + 4).logits)
    torch.testing.assert_close(results[1], results[0], **TOL)
    # and both equal a fresh run over the committed sequence
    committed = torch.cat([prompt[0], tokens[accepted]])[None]
    _, fresh = _verify(EagerEngine(model), model, committed, follow)
    torch.testing.assert_close(results[1], fresh.logits, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("proposer", ["plain", "medusa", "dynamic", "hybrid"])
def test_compiled_engine_greedy_identity(family, proposer):
    base = make_tiny_model(family)
    model = MedusaModel(base, make_heads(random=True), projection_dtype=torch.float32)
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4]])
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    out = model.generate(prompt, max_new_tokens=40, proposer=proposer, engine="compiled", return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert out.stats.new_tokens == 40


@pytest.mark.parametrize("family", FAMILIES)
def test_the_graphed_verify_from_a_past_tensor_equals_verify_and_repeats(family):
    """What a CUDA graph of the verify replays (CompiledEngine.forward_from), run here on a CPU: on a fixed-size cache
    with the past's length given as a tensor, its logits and features equal verify's over the written rows, and a
    second call with the same arguments (a graph's warm-up runs it twice) gives the same and leaves the cache's
    write position where one call does. Its mask compiles with fullgraph=True: no host value enters it."""
    model = make_tiny_model(family)
    torch.manual_seed(3)
    prompt = torch.randint(1, 90, (1, 11))
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    candidates = Candidates(tokens=torch.randint(1, 90, (tree.num_nodes,)), tree=tree)
    engine = CompiledEngine(model, torch_compile=False, prepack=False)
    _, reference = _verify(engine, model, prompt, candidates)
    fixed = engine._static_cache(medusa.runtime.static.GuardedStaticLayer, 64)
    engine.prefill(fixed, prompt)
    bias, past = tree.attention_bias(model.dtype, "cpu"), torch.tensor(prompt.shape[1])
    with torch.inference_mode():
        for _ in range(2):
            logits, hidden = engine.forward_from(fixed, (), candidates.tokens, tree.depth, bias, past)
            torch.testing.assert_close(logits, reference.logits, **TOL)
            torch.testing.assert_close(hidden, reference.hidden, **TOL)
            assert int(fixed.layers[-1].cumulative_length) == prompt.shape[1] + tree.num_nodes
    expected = torch.full((tree.num_nodes, 64), torch.finfo(model.dtype).min)  # past visible, tree, unwritten hidden
    expected[:, :11], expected[:, 11 : 11 + tree.num_nodes] = 0, bias
    graphed_mask = torch.compile(bias_over_rows, fullgraph=True, dynamic=False)(bias, past, 64)
    assert torch.equal(graphed_mask[0, 0], expected)
    assert torch.equal(tree_attention_mask(candidates, 11, model.dtype, 64)[0, 0], expected)


def test_cache_is_kept_and_grown_only_when_needed():
    model = MedusaModel(make_tiny_model("llama"), make_heads(random=True), projection_dtype=torch.float32)
    engine = model.engine("compiled")
    assert engine is engine_for(model.base, "compiled")  # built once per base model
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=10, engine="compiled")
    first = engine._cache
    model.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=12, engine="compiled")
    assert engine._cache is first  # fits: reused
    long = model.generate(
        torch.tensor([[3, 4, 5] * 40]), max_new_tokens=30, engine="compiled", return_dict_in_generate=True
    )
    assert engine._cache is not first and long.stats.new_tokens == 30


def test_prepacked_copy_shares_parameters_and_leaves_the_model_alone():
    model = make_tiny_model("qwen2")
    packed = prepacked_copy(model)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(type(m) is not nn.Linear for m in packed.modules())
    original = {id(p) for p in model.parameters()}
    assert {id(p) for p in packed.parameters()} <= original  # shared, never copied


def test_unknown_engine_is_named():
    model = MedusaModel(make_tiny_model("llama"), make_heads())
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=2, engine="fast")
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("jit", model.base)


def test_isa_limits_from_the_environment_are_honoured(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not any(f.startswith(("avx512", "amx")) for f in cpu_flags())
    assert not native_bf16("cpu")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # AVX-512 without bf16
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert not native_bf16("cpu")


def test_amx_is_seen_unless_onednn_is_held_below_it(monkeypatch):
    """AMX is seen where the CPU has it (hardware.amx: int8 and int4 one-token packages without it); a oneDNN limit
    below AMX hides it, and the packages then compile without it too (hardware.amx_held_back)."""
    monkeypatch.setattr(medusa.hardware, "_cpuinfo", lambda: ("an AMX CPU", frozenset(ISA_FLAGS)))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert amx("cpu") and not amx("meta")
    assert not medusa.hardware.amx_held_back()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not amx("cpu") and native_bf16("cpu") and medusa.hardware.amx_held_back()


def test_w8a8_takes_inductors_template_with_vnni_else_fbgemm_else_nothing(monkeypatch):
    monkeypatch.setattr(medusa.hardware, "vector_int8_gemm", lambda device="cpu": True)
    assert medusa.hardware.w8a8_kernel("cpu") == "template"
    monkeypatch.setattr(medusa.hardware, "vector_int8_gemm", lambda device="cpu": False)  # an AVX2 CPU
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["x86", "fbgemm"])
    assert medusa.hardware.w8a8_kernel("cpu") == "fbgemm" and medusa.hardware.w8a8_kernel("cuda") is None
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["qnnpack"])  # an Arm build of torch
    assert medusa.hardware.w8a8_kernel("cpu") is None


FAST_INDUCTOR = {"freezing": True}  # the inductor engine's settings less max-autotune's GEMM benchmarking: tests
# check what is compiled and loaded, not how fast it runs


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_ahead_of_time_packages_match_eager_and_load_in_a_new_engine(family, tmp_path, monkeypatch):
    """engine='inductor' on CPU compiles the verify forward ahead of time into $MEDUSA_CACHE/aoti: its logits and
    hidden states equal eager's at one token and a tree, in a cache of the first size and of a larger one (one
    package serves both), and a new engine on the same weights (as a new process) loads the package instead of
    compiling; other weights get another package."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", FAST_INDUCTOR)
    model = make_tiny_model(family)
    torch.manual_seed(2)
    prompt = torch.randint(1, 90, (1, 7))
    trees = [build_buffers(TreeSpec(tree, 3), 3) for tree in ([], HAND_TREE)]
    candidates = [Candidates(tokens=torch.randint(1, 90, (b.num_nodes,)), tree=b) for b in trees]
    first = make_engine("inductor", model)
    ran, run = [], medusa.runtime.aot.run
    monkeypatch.setattr(medusa.runtime.aot, "run", lambda runner, *a, **k: ran.append(runner) or run(runner, *a, **k))
    for engine in (first, make_engine("inductor", model)):
        for c in candidates:
            for max_length in (64, 700):  # caches of 512 and 1024 rows
                eager_state, eager = _verify(EagerEngine(model), model, prompt, c)
                state, ahead = _verify(engine, model, prompt, c, max_length=max_length)
                assert state.cache.layers[0].max_cache_len == (512 if max_length == 64 else 1024)
                torch.testing.assert_close(ahead.logits, eager.logits, **TOL)
                torch.testing.assert_close(ahead.hidden, eager.hidden, **TOL)
        assert engine.ahead_of_time and ran == [engine.package] * 4  # the package ran every step, at both sizes
        ran.clear()
    assert first.compile_seconds > 0 and engine.compile_seconds == 0.0  # the second one loaded it
    # a package attends over the rows written; a step that fills the allocation to its last row is left to the
    # uncompiled forward, and agrees as well
    tree = candidates[1]
    long_prompt = torch.randint(1, 90, (1, 512 - tree.tokens.numel()))
    assert not medusa.runtime.aot.takes(512, long_prompt.shape[1], tree.tokens.numel())
    assert medusa.runtime.aot.takes(512, long_prompt.shape[1] - 1, tree.tokens.numel())
    _, eager = _verify(EagerEngine(model), model, long_prompt, tree, max_length=512)
    _, full = _verify(engine, model, long_prompt, tree, max_length=512)
    torch.testing.assert_close(full.logits, eager.logits, **TOL)
    (package,) = (tmp_path / "aoti").glob("*.pt2")  # one for both sizes
    other = make_tiny_model(family, seed=1)
    options = dict(options=medusa.runtime.static.inductor_cpu_options(model))
    assert medusa.runtime.aot.package_path(other, weights=base_fingerprint(other), **options) != package
    assert medusa.runtime.aot.package_path(model, weights=base_fingerprint(model), **options) == package


@pytest.mark.slow
def test_the_batch_package_runs_on_the_single_sequence_packages_weights(tmp_path, monkeypatch):
    """Both packages hold the same frozen weights: once both are loaded, the batch package runs on the other's copy
    (one in memory, not two) and its rows still equal each prompt decoded alone. Loading leaves no file extracted."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    base = make_tiny_model("llama")
    engine = engine_for(base, "inductor")  # the engine's own settings: FAST_INDUCTOR's weights are oneDNN's, not shared
    engine.warm_up(progress=False, batches=True)
    assert engine.batch_package.weights_of is engine.package
    single, batch = (package.runner.extract_constants_map(False) for package in (engine.package, engine.batch_package))
    assert single and all(batch[name].data_ptr() == tensor.data_ptr() for name, tensor in single.items())
    rows = torch.tensor([[5, 6, 7, 8, 9, 5, 6], [9, 8, 7, 6, 5, 4, 3]])
    stats = []
    monkeypatch.setattr(
        medusa.runtime.aot, "run_rows", lambda *a, run=medusa.runtime.aot.run_rows: stats.append(1) or run(*a)
    )
    out = MedusaModel(base, make_heads(random=True)).generate(
        rows, attention_mask=torch.ones_like(rows), max_new_tokens=20, engine="inductor"
    )
    for row, prompt in zip(out, rows):
        reference = base.generate(
            prompt[None], attention_mask=torch.ones(1, 7, dtype=torch.long), max_new_tokens=20, do_sample=False
        )
        assert row.tolist() == reference[0].tolist()
    assert stats  # the batch package ran the steps
    assert [path.name for path in (tmp_path / "aoti").iterdir() if not path.name.endswith((".pt2", ".lock"))] == []


def test_a_package_whose_constants_share_a_name_keeps_its_own_weights():
    """inductor names the activation scales of every w8a8 GEMM it lowers alike (`x_scale`), and a package takes
    weights by name: such a package keeps its own copy, and the runner is not asked to take any (torch's runtime
    printed an error for the names it missed). Packages whose names are their own share, as before."""

    class Runner:
        def __init__(self, names: dict[str, str]):
            self.names, self.updates = names, []

        def get_constant_names_to_original_fqns(self):
            return self.names

        def extract_constants_map(self, use_inactive):
            return {name: torch.ones(2) for name in self.names.values()}

        def update_constant_buffer(self, *args):
            self.updates.append(args)

        def swap_constant_buffer(self):
            pass

        def free_inactive_constant_buffer(self):
            pass

    def package(names):
        loaded = object.__new__(medusa.runtime.aot.Package)
        loaded.runner = Runner(names)
        return loaded

    weights = {"w_0": "layers.0.weight", "w_1": "layers.1.weight"}
    single, batch = package(weights), package(weights)
    assert batch.share_weights(single) and batch.weights_of is single and len(batch.runner.updates) == 1
    scales = {**weights, "x_scale_0": "x_scale", "x_scale_1": "x_scale"}
    single, batch = package(scales), package(scales)
    assert not batch.share_weights(single) and batch.runner.updates == []


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_package_compiled_without_weights_reads_the_models_own(family, tmp_path, monkeypatch):
    """A package compiled with OWN_WEIGHTS_OPTIONS (w8a8 on fbgemm, whose GEMMs pack what they are given) holds no
    weights: it reads the model's own, so an in-place change to one shows in its next step. Its logits and hidden
    states match eager's, at one token and at a tree."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", FAST_INDUCTOR)
    monkeypatch.setattr(medusa.runtime.static, "sums_on_fbgemm", lambda model: True)
    model = make_tiny_model(family)
    torch.manual_seed(3)
    prompt = torch.randint(1, 90, (1, 7))
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    steps = [
        Candidates(tokens=torch.randint(1, 90, (1,)), tree=build_buffers(TreeSpec([], 3), 3)),
        Candidates(tokens=torch.randint(1, 90, (tree.num_nodes,)), tree=tree),
    ]
    engine = make_engine("inductor", model)
    for change in (False, True):
        if change:
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(2)  # in place: the package must see it
        for candidates in steps:
            _, eager = _verify(EagerEngine(model), model, prompt, candidates)
            _, ours = _verify(engine, model, prompt, candidates)
            torch.testing.assert_close(ours.logits, eager.logits, **TOL)
            torch.testing.assert_close(ours.hidden, eager.hidden, **TOL)
    assert engine.ahead_of_time and engine.package is not None and engine.one_token_package is None


def _bf16_step_and_tree_match_eager(engine_name: str):
    """A tiny bf16 llama's one-token step and tree verify on `engine_name` match eager's within bf16 rounding (another
    GEMM sums in another order). -> the engine."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    torch.manual_seed(3)
    prompt = torch.randint(1, 90, (1, 7))
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    engine = make_engine(engine_name, model)
    close = dict(atol=3e-2, rtol=3e-2)
    for candidates in (
        Candidates(tokens=torch.randint(1, 90, (1,)), tree=build_buffers(TreeSpec([], 3), 3)),
        Candidates(tokens=torch.randint(1, 90, (tree.num_nodes,)), tree=tree),
    ):
        _, eager = _verify(EagerEngine(model), model, prompt, candidates)
        _, ours = _verify(engine, model, prompt, candidates)
        torch.testing.assert_close(ours.logits, eager.logits, **close)
        torch.testing.assert_close(ours.hidden, eager.hidden, **close)
    return engine


@pytest.mark.slow
def test_a_bf16_package_without_amx_runs_the_prefetching_template_and_matches_eager(tmp_path, monkeypatch):
    """bf16 where AMX is absent (or held back, as here on a CPU with it): every GEMM of the package, one-token steps
    included, is inductor's C++ template widening the weights in registers and asking for them ahead (no oneDNN, no
    one-token package of aten's GEMV); its logits and hidden states match eager's within bf16 rounding."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_gemm_template

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # the engine's own settings: its GEMM template
    picked, create = [], cpp_gemm_template.create_micro_gemm

    def recording(*args, **kwargs):
        micro_gemm = create(*args, **kwargs)
        picked.append(type(micro_gemm).__name__)
        return micro_gemm

    monkeypatch.setattr(cpp_gemm_template, "create_micro_gemm", recording)
    engine = _bf16_step_and_tree_match_eager("inductor")
    assert engine.ahead_of_time and engine.package is not None and engine.one_token_package is None
    assert picked and set(picked) == {"PrefetchingCppMicroGemmFP32Vec"}


@pytest.mark.slow
def test_bf16_trees_on_the_onednn_engine_run_a_package_without_the_template_and_match_eager(tmp_path, monkeypatch):
    """`inductor_onednn`: a one-token step runs the template's package, a tree a package of its own whose GEMMs are
    aten's (oneDNN's for bf16: no micro-kernel of inductor's template in it); both match eager within bf16
    rounding."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_gemm_template

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    picked, create = [], cpp_gemm_template.create_micro_gemm
    monkeypatch.setattr(cpp_gemm_template, "create_micro_gemm", lambda *a, **k: picked.append(1) or create(*a, **k))
    templates_by_backends, compile_package = {}, medusa.runtime.aot.compile_package

    def recording(program, path, options):
        picked.clear()
        compile_package(program, path, options)
        templates_by_backends[options[medusa.runtime.aot.GEMM_BACKENDS]] = len(picked)

    monkeypatch.setattr(medusa.runtime.aot, "compile_package", recording)
    ran, run = [], medusa.runtime.aot.run
    monkeypatch.setattr(medusa.runtime.aot, "run", lambda runner, *a, **k: ran.append(runner) or run(runner, *a, **k))
    engine = _bf16_step_and_tree_match_eager("inductor_onednn")
    assert engine.trees_package is not None and ran == [engine.package, engine.trees_package]
    assert templates_by_backends["ATEN"] == 0 < templates_by_backends["CPP,ATEN"]
    assert len(list((tmp_path / "aoti").glob("verify-*.pt2"))) == 2


def _batch_step(engine, model, rows: int = 3, context: int = 7, n: int = 3, sliced: bool = False):
    """A batch of `rows` prompts of `context` tokens prefilled on `engine`, then one step of `n` tokens each (a
    chain; `sliced`: its inputs slices of the whole sequences', not tensors of their own) -> that step's (logits
    (rows, n, V), hidden)."""
    torch.manual_seed(5)
    ids = torch.randint(1, 90, (rows, context + n))
    causal = torch.ones((context + n, context + n), dtype=torch.bool).tril()
    mask = torch.where(causal, 0.0, torch.finfo(model.dtype).min).to(model.dtype)[None, None].repeat(rows, 1, 1, 1)
    positions = torch.arange(context + n)[None].repeat(rows, 1)
    with torch.inference_mode():
        cache = engine.new_rows_cache(context + n + 1)
        cache.start(rows)
        engine.batch_forward(
            cache, ids[:, :context], mask[:, :, :context, :context], positions[:, :context], logits_to_keep=1
        )
        cache.advance(context)
        step = ids[:, context:], mask[:, :, context:], positions[:, context:]
        return engine.batch_forward(cache, *(x if sliced else x.clone() for x in step))


@pytest.mark.slow
def test_a_bf16_batch_on_the_onednn_engine_runs_a_package_of_aten_gemms_and_matches_eager(tmp_path, monkeypatch):
    """`inductor_onednn`'s batches (several rows' tokens a step, as a tree's) run a package of their own whose GEMMs
    are all aten's (oneDNN's for bf16: no micro-kernel of inductor's template); its rows match eager's within bf16
    rounding, and are the same where the step's inputs are slices of longer tensors (a package reads its inputs with
    the strides it was compiled for). The inductor engine's batch package keeps the template."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_gemm_template

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    picked, create = [], cpp_gemm_template.create_micro_gemm
    monkeypatch.setattr(cpp_gemm_template, "create_micro_gemm", lambda *a, **k: picked.append(1) or create(*a, **k))
    compiled, compile_package = [], medusa.runtime.aot.compile_package

    def recording(program, path, options):
        picked.clear()
        compile_package(program, path, options)
        compiled.append((options[medusa.runtime.aot.GEMM_BACKENDS], len(picked)))

    monkeypatch.setattr(medusa.runtime.aot, "compile_package", recording)
    ran, run_rows = [], medusa.runtime.aot.run_rows
    monkeypatch.setattr(medusa.runtime.aot, "run_rows", lambda runner, *a: ran.append(runner) or run_rows(runner, *a))
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = make_engine("inductor_onednn", model)
    logits, hidden = _batch_step(engine, model)
    eager_logits, eager_hidden = _batch_step(EagerEngine(model), model)
    assert ran == [engine.batch_package] and compiled == [("ATEN", 0)]
    assert torch.equal(_batch_step(engine, model, sliced=True)[0], logits)
    close = dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(logits, eager_logits, **close)
    torch.testing.assert_close(hidden, eager_hidden, **close)
    template = make_engine("inductor", model)
    template.new_rows_cache(16, progress=False)
    assert compiled[1][0] == "CPP,ATEN" and compiled[1][1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_weight_only_one_token_steps_on_amx_run_a_package_compiled_without_amx(precision, tmp_path, monkeypatch):
    """A weight-only int8 / int4 target on a CPU with AMX: one-token steps run a package of their own, compiled with
    no AMX micro-kernel to pick (its vector kernels stream the weights faster at one row), matching eager within bf16
    rounding; a tree still runs the main package, whose GEMMs may take AMX's. Without AMX, or at other precisions,
    there is no such package."""
    import contextlib

    from medusa.hardware import vector_int4

    if precision == "int4" and not vector_int4():
        pytest.skip("aten's int4 kernel is a reference loop under torch's AVX2 kernels")
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", FAST_INDUCTOR)
    monkeypatch.setattr(medusa.runtime.inductor, "amx", lambda device: True)
    compiled_without_amx, without_amx = [], medusa.runtime.aot.micro_kernels_without_amx

    @contextlib.contextmanager
    def recorded():
        with without_amx():
            compiled_without_amx.append(True)
            yield

    monkeypatch.setattr(medusa.runtime.aot, "micro_kernels_without_amx", recorded)
    ran, run = [], medusa.runtime.aot.run
    monkeypatch.setattr(medusa.runtime.aot, "run", lambda runner, *a, **k: ran.append(runner) or run(runner, *a, **k))
    model = quantize_target(make_tiny_model("llama", dtype=torch.bfloat16), precision)
    torch.manual_seed(3)
    prompt = torch.randint(1, 90, (1, 7))
    root = Candidates(tokens=torch.randint(1, 90, (1,)), tree=build_buffers(TreeSpec([], 3), 3))
    engine = make_engine("inductor", model)
    assert engine.one_token_without_amx
    _, ours = _verify(engine, model, prompt, root)
    _, eager = _verify(EagerEngine(model), model, prompt, root)
    close = dict(atol=3e-2, rtol=3e-2)  # bf16 activations: another GEMM sums in another order
    torch.testing.assert_close(ours.logits, eager.logits, **close)
    torch.testing.assert_close(ours.hidden, eager.hidden, **close)
    assert engine.package is not None and ran == [engine.one_token_package] != [None]
    assert compiled_without_amx == [True]  # the one-token package; the main one as it is
    tree = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    _verify(engine, model, prompt, Candidates(tokens=torch.randint(1, 90, (tree.num_nodes,)), tree=tree))
    assert ran[-1] is engine.package
    (one_token,) = (tmp_path / "aoti").glob("*-one-token-*.pt2")
    assert not InductorEngine(make_tiny_model("llama")).one_token_without_amx  # fp32
    assert not InductorEngine(make_tiny_model("llama", dtype=torch.bfloat16)).one_token_without_amx
    monkeypatch.setattr(medusa.runtime.inductor, "amx", lambda device: False)
    assert not InductorEngine(model).one_token_without_amx


def test_an_unreadable_package_is_compiled_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    path = medusa.runtime.aot.package_path(model, FAST_INDUCTOR, "weights")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    compiled = []
    monkeypatch.setattr(medusa.runtime.aot, "_export", lambda model, one_token, batched: compiled.append(model))
    monkeypatch.setattr(
        torch._inductor,
        "aoti_compile_and_package",
        lambda program, package_path, inductor_configs: open(package_path, "wb").close(),
    )
    monkeypatch.setattr(medusa.runtime.aot, "Package", lambda p: "runner" if compiled else 1 / 0)
    runner, _ = medusa.runtime.aot.load_or_compile(model, FAST_INDUCTOR, "weights", progress=False)
    assert runner == "runner" and compiled == [model]
    assert f"compiled package {path} is unreadable" in caplog.text
    assert not list(path.parent.glob(".*tmp*"))  # written under a temporary name, then renamed


def test_processes_wanting_one_package_compile_it_once(tmp_path, monkeypatch):
    """Two processes (threads here: the lock is per open file) needing one package: the second waits for the first's
    compile and loads what it wrote."""
    import threading
    import time

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = make_tiny_model("llama")
    compiled = []

    def slow_export(model, one_token, batched):
        compiled.append(threading.current_thread().name)
        time.sleep(0.5)

    monkeypatch.setattr(medusa.runtime.aot, "_export", slow_export)
    monkeypatch.setattr(
        torch._inductor,
        "aoti_compile_and_package",
        lambda program, package_path, inductor_configs: open(package_path, "wb").close(),
    )
    monkeypatch.setattr(medusa.runtime.aot, "Package", lambda p: "runner")
    results = {}

    def load(name):
        results[name] = medusa.runtime.aot.load_or_compile(model, FAST_INDUCTOR, "weights", progress=False)

    run_together(load)
    assert len(compiled) == 1
    assert {name: runner for name, (runner, _) in results.items()} == {"first": "runner", "second": "runner"}
    assert sorted(seconds > 0 for _, seconds in results.values()) == [False, True]  # only one paid for compiling


@pytest.mark.slow
def test_inductor_engine_greedy_identity_across_cache_sizes(tmp_path, monkeypatch):
    """engine='inductor': one package serves trees of every size in caches of every size: larger caches are allocated
    as calls need them (64, 128, then 512 rows here) and compile nothing more, and the output is plain greedy's."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(medusa.runtime.static, "INDUCTOR_CPU_OPTIONS", FAST_INDUCTOR)
    monkeypatch.setattr(medusa.runtime.static, "COMPILED_MIN_ROWS", 64)
    base = make_tiny_model("llama")
    model = MedusaModel(base, make_heads(random=True), projection_dtype=torch.float32)
    engine = model.engine("inductor")  # compiles here, as its first cache (64 rows) is allocated
    assert engine.compile_seconds > 0 and engine.ahead_of_time
    spent = engine.compile_seconds
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4]])
    calls = (("plain", 20), ("medusa", 80), ("dynamic", 400))
    for _ in range(2):  # the second time round, every size is allocated already
        for proposer, new_tokens in calls:
            reference = base.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False
            )
            out = model.generate(prompt, max_new_tokens=new_tokens, proposer=proposer, engine="inductor")
            assert torch.equal(out, reference), proposer
    assert engine.compile_seconds == spent  # the larger caches compiled nothing
    assert sorted(engine._sized) == [64, 128, 512] and len(list((tmp_path / "aoti").glob("*.pt2"))) == 1
    model.generate(prompt, max_new_tokens=20, proposer="plain", engine="inductor")
    assert engine._cache.layers[0].max_cache_len == 64  # a short call after a long one: the small cache again
    assert engine.ahead_of_time  # nothing fell back to the uncompiled forward
    assert engine.warm_up() == 0.0  # and warming up again is free


def test_the_inductor_engine_on_cpu_compiles_ahead_of_time():
    """The inductor engine on CPU compiles ahead of time: no torch.compile wrapper; the compiled engine never does."""
    engine = InductorEngine(make_tiny_model("qwen2"))
    assert not CompiledEngine(make_tiny_model("qwen2"), torch_compile=True).ahead_of_time
    assert engine.ahead_of_time and engine.verify_runner is engine.eager_runner and not engine.prepacked


@pytest.mark.parametrize("family", FAMILIES)
def test_the_inductor_engine_compiles_plain_linears_and_runs_prompts_on_onednn(family):
    """On a CPU the package is compiled from nn.Linear layers (inductor lowers those to its GEMM templates), while a
    prompt runs eagerly on oneDNN over the same weights, to what the plain layers give."""
    model = make_tiny_model(family)
    engine = InductorEngine(model)
    assert all(type(m) is not OneDNNLinear for m in engine.runner.modules())
    assert all(type(m) is not nn.Linear for m in engine.eager_runner.modules())
    assert {id(p) for p in engine.eager_runner.parameters()} <= {id(p) for p in model.parameters()}
    prompt = torch.randint(1, 90, (1, 23), generator=torch.Generator().manual_seed(3))
    outputs = []
    for runner in (engine.runner, engine.eager_runner):
        out = run_prefill(runner, DynamicCache(config=model.config), prompt, (0, 1))
        outputs.append((out.logits, out.hidden))
    for plain, onednn in zip(*outputs):
        torch.testing.assert_close(onednn, plain, rtol=1e-5, atol=1e-5)


def test_onednn_layers_equal_their_layer_and_follow_in_place_changes_to_its_weight():
    linear = nn.Linear(8, 5)
    onednn = OneDNNLinear(linear)
    x = torch.randn(2, 3, 8)[:, 1:]  # not contiguous
    torch.testing.assert_close(onednn(x), linear(x))
    with torch.no_grad():
        linear.weight.mul_(3.0)
    torch.testing.assert_close(onednn(x), linear(x))


def test_compiling_parses_each_text_once_and_puts_inductor_back(monkeypatch):
    """While the engine compiles, inductor's parsers keep what they parsed (a C++ GEMM template and an index expression
    are parsed once, not once per GEMM); outside it they are inductor's own again, and give the same."""
    import sympy
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_template_kernel
    from torch._inductor.codegen.common import KernelTemplate

    template_parser = KernelTemplate.__dict__["_template_from_string"]
    expression_parser = cpp_template_kernel.parse_expr_with_index_symbols
    source = "{% for i in range(n) %}{{ i }},{% endfor %}"
    seen = {}

    def compiling(*args, **kwargs):  # what the engine's compile sees; it turns an exception here into a warning
        seen["templates"] = [KernelTemplate._template_from_string(source) for _ in range(2)]
        parse = cpp_template_kernel.parse_expr_with_index_symbols
        seen["expressions"] = [parse("k_end - k_start"), parse("k_end - k_start"), parse(["k_end - k_start", 3])[0]]
        seen["freezing"] = torch._inductor.config.freezing
        return "runner", 0.0

    monkeypatch.setattr(medusa.runtime.aot, "load_or_compile", compiling)
    engine = InductorEngine(make_tiny_model("llama"))
    engine.new_cache(16, progress=False)
    first, second = seen["templates"]
    expression = seen["expressions"][0]
    assert second is first
    assert seen["expressions"][1] is expression and seen["expressions"][2] is expression
    assert seen["freezing"] and engine.package == "runner"
    assert KernelTemplate.__dict__["_template_from_string"] is template_parser
    assert cpp_template_kernel.parse_expr_with_index_symbols is expression_parser
    again = KernelTemplate._template_from_string(source)
    assert again is not first and again.render(n=3) == first.render(n=3) == "0,1,2,"
    assert sympy.simplify(expression_parser("k_end - k_start") - expression) == 0


def test_warm_up_compiles_every_cache_size_a_length_needs_once(monkeypatch):
    """warm_up(max_length) compiles each size a call up to that length would allocate (doubling from the smallest),
    so that a benchmark or server compiles before it times or serves; later calls find their size compiled."""
    compiled = []
    monkeypatch.setattr(CompiledEngine, "_compile_for", lambda self, cache, progress: compiled.append(cache))
    engine = InductorEngine(make_tiny_model("qwen2"))
    engine.warm_up(max_length=1500)
    assert [cache.layers[0].max_cache_len for cache in compiled] == [512, 1024, 2048]
    with torch.inference_mode():  # as generate runs: the caches' tensors become inference tensors
        engine.prefill(engine.new_cache(100), torch.tensor([[1, 2, 3]]))
    engine.warm_up(max_length=900)  # outside inference mode, over those caches: nothing to compile again
    assert engine.new_cache(100).layers[0].max_cache_len == 512  # written under inference mode, reset outside it
    assert engine.new_cache(700).layers[0].max_cache_len == 1024  # the smallest compiled size that fits
    assert engine.new_cache(3000).layers[0].max_cache_len == 4096  # a longer call compiles its own size
    assert len(compiled) == 4
    assert EagerEngine(make_tiny_model("qwen2")).warm_up(max_length=1500) == 0.0


def test_warm_up_for_batches_loads_the_batch_package(monkeypatch):
    """warm_up(batches=True) also loads the batch package, which serves batches of every width, so that a benchmark's
    first batch (or a server's first request) does not pay for loading it."""
    loaded = []

    def load(self, progress, options, label="", batched=False):
        loaded.append(batched)
        return "runner", 0.0

    monkeypatch.setattr(CompiledEngine, "_compile_for", lambda self, cache, progress: None)
    monkeypatch.setattr(InductorEngine, "_load_or_compile", load)
    engine = InductorEngine(make_tiny_model("qwen2"))
    engine.warm_up(max_length=1500)
    assert loaded == []  # one sequence's caches only
    engine.warm_up(max_length=1500, batches=True)
    assert loaded == [True]
    for max_rows in (100, 600, 1500, 5000):  # every batch finds the package loaded, whatever its cache's size
        assert engine.new_rows_cache(max_rows, progress=False).max_rows > max_rows  # aot.takes: fewer than it holds
    assert loaded == [True] and engine.batch_package == "runner"
    assert engine.new_rows_cache(1024, progress=False).max_rows == 2048


def test_shared_gqa_attention_is_transformers_sdpa_bit_for_bit():
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from medusa.runtime.attention import shared_gqa_sdpa

    torch.manual_seed(3)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query, key, value = torch.randn(1, 9, 6, 16), torch.randn(1, 3, 40, 16), torch.randn(1, 3, 40, 16)
    mask = torch.zeros(1, 1, 6, 40)
    mask[..., 34:] = torch.finfo(torch.float32).min  # a tree's pattern: some of the last rows hidden
    mask[0, 0, 0, 35] = 0.0
    for attention_mask in (mask, None):
        ours, _ = shared_gqa_sdpa(module, query, key, value, attention_mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.25)
        assert torch.equal(ours, theirs)


def test_bf16_attention_runs_in_fp32_on_a_cpu():
    """bf16 queries, keys and values attend in fp32 (torch's CPU bf16 flash kernel is the slow one): exactly the fp32
    result rounded to bf16, and within bf16's rounding of transformers' own bf16 attention, masked or not."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from medusa.runtime.attention import shared_gqa_sdpa

    torch.manual_seed(4)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query, key, value = (torch.randn(1, heads, n, 16).bfloat16() for heads, n in ((9, 1), (3, 40), (3, 40)))
    mask = torch.zeros(1, 1, 1, 40, dtype=torch.bfloat16)
    mask[..., 30:] = torch.finfo(torch.bfloat16).min
    for attention_mask in (mask, None):
        ours, _ = shared_gqa_sdpa(module, query, key, value, attention_mask, scaling=0.25)
        fp32_mask = None if attention_mask is None else attention_mask.float()
        in_fp32, _ = shared_gqa_sdpa(module, query.float(), key.float(), value.float(), fp32_mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.25)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, in_fp32.bfloat16())
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


def test_a_change_to_the_row_invariant_attention_names_new_packages_for_its_targets_only(monkeypatch):
    """w8a8's attention (row_invariant_sdpa) is exported into its targets' packages: a new ROW_INVARIANT_FORMAT names
    new packages for them, so none compiled from the old attention is loaded, and leaves other targets' names alone."""
    from medusa.runtime.attention import use_row_invariant_sdpa

    plain, row_invariant = make_tiny_model("llama"), make_tiny_model("llama")
    use_row_invariant_sdpa(row_invariant)

    def paths():
        return [medusa.runtime.aot.package_path(m, {}, "weights") for m in (plain, row_invariant)]

    before = paths()
    monkeypatch.setattr(medusa.runtime.aot, "ROW_INVARIANT_FORMAT", medusa.runtime.aot.ROW_INVARIANT_FORMAT + 1)
    after = paths()
    assert after[0] == before[0] and after[1] != before[1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_reduction_attention_computes_each_query_as_plain_decoding_does(compiled):
    """reduction_sdpa (w8a8's attention): a query among others, and a tree node whose siblings sit between it and its
    parent, come out bit for bit as the same query attending alone over exactly its own keys (what plain decoding
    computes), eager and through inductor with the query rows and keys dynamic; and it is sdpa within rounding."""
    from medusa.runtime.attention import reduction_sdpa
    from medusa.runtime.static import INDUCTOR_CPU_OPTIONS

    def attend(query, key, value, mask):
        if compiled:
            for tensor, dim in ((query, 2), (key, 2), (value, 2), (mask, 2), (mask, 3)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return sdpa(query, key, value, mask, 0.125, True)

    sdpa = torch.compile(reduction_sdpa, dynamic=False) if compiled else reduction_sdpa
    torch.manual_seed(6)
    past, rows, hidden = 37, 6, torch.finfo(torch.float32).min  # more keys than a vector's lanes, not a multiple
    query, key, value = (
        torch.randn(1, 9, rows, 64),
        torch.randn(1, 3, past + rows, 64),
        torch.randn(1, 3, past + rows, 64),
    )
    chain = torch.zeros(1, 1, rows, past + rows).masked_fill(
        torch.ones(rows, past + rows).triu(past + 1).bool(), hidden
    )
    with torch.inference_mode(), torch._inductor.config.patch(INDUCTOR_CPU_OPTIONS):
        together = attend(query, key, value, chain)
        torch.testing.assert_close(
            together,
            torch.nn.functional.scaled_dot_product_attention(query, key, value, chain, scale=0.125, enable_gqa=True),
        )
        for i in range(rows):  # row i alone: the past and the chain's first i + 1 tokens
            keys = past + i + 1
            alone = attend(query[:, :, i : i + 1], key[:, :, :keys], value[:, :, :keys], torch.zeros(1, 1, 1, keys))
            assert torch.equal(together[:, :, i], alone[:, :, 0]), i
        for i in range(1, rows):  # a node at past + i whose parent is the last past row, siblings before it hidden
            mask = torch.zeros(1, 1, 1, past + rows)
            mask[..., past:] = hidden
            mask[..., past + i] = 0.0
            moved_key, moved_value = key.clone(), value.clone()
            moved_key[:, :, past + i], moved_value[:, :, past + i] = key[:, :, past], value[:, :, past]
            node = attend(query[:, :, :1], moved_key, moved_value, mask)
            alone = attend(
                query[:, :, :1], key[:, :, : past + 1], value[:, :, : past + 1], torch.zeros(1, 1, 1, past + 1)
            )
            assert torch.equal(node, alone), i


def test_row_invariant_attention_without_a_mask_is_causal_from_the_first_key():
    """Unmasked (transformers' prefill), row_invariant_sdpa is sdpa's causal attention, aligned to the first key: a
    static cache hands over its unwritten rows after the prompt's, and those must stay unseen."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from medusa.runtime.attention import row_invariant_sdpa

    torch.manual_seed(7)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query, key, value = torch.randn(1, 9, 5, 16), torch.randn(1, 3, 12, 16), torch.randn(1, 3, 12, 16)
    ours, _ = row_invariant_sdpa(module, query, key, value, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_caches_keep_fp32_rows_and_change_no_number(family, monkeypatch):
    """bf16 on a CPU attends in fp32 (shared_gqa_sdpa): a static cache keeps its rows widened once, as written
    (kv_dtype), and every logit and hidden state equals those of a cache kept in bf16 and widened at every step,
    through a tree's verify, a commit of a path that moves rows, and the next verify."""
    from medusa.runtime.attention import use_shared_gqa_sdpa

    model = make_tiny_model(family, dtype=torch.bfloat16)
    use_shared_gqa_sdpa(model)
    torch.manual_seed(5)
    prompt = torch.randint(1, 90, (1, 9))
    buffers = build_buffers(TreeSpec(HAND_TREE, 3), 3)
    first, follow = (Candidates(tokens=torch.randint(1, 90, (buffers.num_nodes,)), tree=buffers) for _ in range(2))
    results = {}
    for widened in (True, False):
        if not widened:
            monkeypatch.setattr(medusa.runtime.static, "kv_dtype", lambda model: None)
        engine = CompiledEngine(model, prepack=False)
        state, verified = _verify(engine, model, prompt, first)
        assert state.cache.layers[0].keys.dtype == (torch.float32 if widened else torch.bfloat16)
        engine.commit(state.cache, state.length, torch.tensor([0, 1, 3, 6]))
        after = engine.verify(state.cache, follow, state.length + 4)
        results[widened] = (state.new_hidden, verified.logits, verified.hidden, after.logits, after.hidden)
    for wide, narrow in zip(results[True], results[False]):
        assert torch.equal(wide, narrow)


def test_packed_layers_follow_in_place_changes_to_the_shared_weight():
    linear = nn.Linear(8, 5)
    packed = PackedLinear(linear)
    x = torch.randn(3, 8)
    torch.testing.assert_close(packed(x), linear(x))
    with torch.no_grad():
        linear.weight.mul_(3.0)
    torch.testing.assert_close(packed(x), linear(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_sibling_projections_are_fused_in_the_packed_copy(family):
    packed = prepacked_copy(make_tiny_model(family))
    layer = packed.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj"):
        assert isinstance(getattr(layer.self_attn, name), FusedMember)
    assert layer.mlp.gate_proj.group is layer.mlp.up_proj.group
    assert isinstance(layer.mlp.down_proj, PackedLinear)


def test_fused_projections_equal_their_layers_in_any_call_order():
    torch.manual_seed(4)
    linears = [nn.Linear(8, 6), nn.Linear(8, 3), nn.Linear(8, 3)]
    group = FusedProjections(linears)
    members = [FusedMember(group, i) for i in range(3)]
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    for order in ([0, 1, 2], [2, 0, 1]):
        for i in order:
            torch.testing.assert_close(members[i](x), linears[i](x))
    # the same member twice on one tensor, then another input half-way through a group: each recomputed
    torch.testing.assert_close(members[1](x), linears[1](x))
    torch.testing.assert_close(members[1](x), linears[1](x))
    torch.testing.assert_close(members[0](y), linears[0](y))
    with torch.no_grad():
        x.mul_(2.0)
        linears[2].weight.add_(1.0)
    torch.testing.assert_close(members[2](x), linears[2](x))
    torch.testing.assert_close(members[0](x), linears[0](x))


class _Projection(nn.Module):
    def __init__(self, both_activations: bool):
        super().__init__()
        self.linear, self.both_activations = nn.Linear(16, 16), both_activations

    def forward(self, x):
        y = self.linear(x)
        return y @ x.T if self.both_activations else y  # a GEMM of two activations has no C++ template


@pytest.mark.slow
@pytest.mark.parametrize("both_activations", [False, True])
def test_packages_try_the_gemm_template_alone_then_with_aten(tmp_path, monkeypatch, both_activations):
    """Compiling a package times no aten kernel against the C++ GEMM template unless a GEMM has no template, and
    then compiles again with aten's kernels: the package works either way."""
    tried, compile_package = [], torch._inductor.aoti_compile_and_package

    def recording(program, package_path, inductor_configs):
        tried.append(inductor_configs[medusa.runtime.aot.GEMM_BACKENDS])
        return compile_package(program, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recording)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    module, x = _Projection(both_activations).eval(), torch.randn(4, 16)
    with torch.no_grad():
        program = torch.export.export(module, (x,))
        medusa.runtime.aot.compile_package(program, tmp_path / "p.pt2", medusa.runtime.static.INDUCTOR_CPU_OPTIONS)
        out = torch._inductor.aoti_load_package(str(tmp_path / "p.pt2"))(x)
        torch.testing.assert_close(out, module(x))
    assert tried == (["CPP", "CPP,ATEN"] if both_activations else ["CPP"])


def test_micro_kernels_prefetch_fp32_int8_and_half_weights_and_take_16_by_16_fp32_blocks_only_while_compiling():
    """Inside prefetching_micro_kernels every fp32-, int8- and bf16/fp16-weight config of inductor's fp32 micro-kernel
    belongs to a kernel whose weight loads each ask for the row FP32_PREFETCH_ROWS / INT8_PREFETCH_ROWS /
    HALF_PREFETCH_ROWS ahead (a verify of 2-8 rows then costs little more than one row's), the AVX-512 fp32 ones with
    FP32_REGISTER_BLOCKS alone; every other kernel is as inductor ships it, and all of it is inductor's own again
    after."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.cpu_vec_isa import VecAVX512

    from medusa.runtime.torch_patches import (
        FP32_PREFETCH_ROWS,
        FP32_REGISTER_BLOCKS,
        HALF_PREFETCH_ROWS,
        INT8_PREFETCH_ROWS,
        prefetching_micro_kernels,
    )

    def fp32(config):
        return config.input_dtype == config.input2_dtype == torch.float

    def other_weights(config):
        return config.input2_dtype in (torch.int8, torch.bfloat16, torch.float16)

    before = dict(micro.micro_gemm_configs)
    stock = before[micro.CppMicroGemmFP32Vec]
    assert {tuple(c.register_blocking) for c in stock if fp32(c) and c.vec_isa_cls is VecAVX512} != set(
        FP32_REGISTER_BLOCKS
    )
    assert "_MM_HINT_T1" not in micro.CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    with prefetching_micro_kernels():
        inside = micro.micro_gemm_configs
        (prefetching,) = set(inside) - set(before)
        assert issubclass(prefetching, micro.CppMicroGemmFP32Vec)
        for rows, load in (
            (FP32_PREFETCH_ROWS, "vb[col] = Vectorized::loadu("),
            (INT8_PREFETCH_ROWS, "auto b32 ="),
            (HALF_PREFETCH_ROWS, "auto b = VectorizedIn::loadu("),
        ):
            prefetch = f"_mm_prefetch(reinterpret_cast<const char*>(B + (k + {rows}) * ldb + col * VLEN), _MM_HINT_T1);"
            assert f"{prefetch}\n            {load}" in prefetching.TEMPLATE_KERNEL
        assert not [c for c in inside[micro.CppMicroGemmFP32Vec] if fp32(c) or other_weights(c)]
        ours = inside[prefetching]
        assert [tuple(c.register_blocking) for c in ours if fp32(c) and c.vec_isa_cls is VecAVX512] == list(
            FP32_REGISTER_BLOCKS
        )
        assert [c for c in ours if not (fp32(c) and c.vec_isa_cls is VecAVX512)] == [
            c for c in stock if (fp32(c) and c.vec_isa_cls is not VecAVX512) or other_weights(c)
        ]
        assert inside[micro.CppMicroGemmFP32Vec] == [c for c in stock if not fp32(c) and not other_weights(c)]
    assert micro.micro_gemm_configs == before and micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec] is stock


def test_no_amx_micro_kernel_is_left_to_pick_only_while_compiling_without_amx():
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.cpu_vec_isa import VecAMX

    from medusa.runtime.torch_patches import micro_kernels_without_amx

    before = {kernel: list(configs) for kernel, configs in micro.micro_gemm_configs.items()}
    assert any(c.vec_isa_cls is VecAMX for configs in before.values() for c in configs)
    with micro_kernels_without_amx():
        inside = micro.micro_gemm_configs
        assert not any(c.vec_isa_cls is VecAMX for configs in inside.values() for c in configs)
        assert inside[micro.CppMicroGemmFP32Vec] == before[micro.CppMicroGemmFP32Vec]
    assert micro.micro_gemm_configs == before


def test_a_cpu_told_not_to_use_amx_compiles_packages_without_amx_micro_kernels(tmp_path, monkeypatch):
    """ONEDNN_MAX_CPU_ISA below AMX on a CPU with AMX: inductor's C++ GEMM template reads the CPU itself, so it is left
    no AMX micro-kernel to pick and a package is what a CPU without AMX compiles (the package key already differs:
    hardware.describe reads the limit)."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.cpu_vec_isa import VecAMX

    monkeypatch.setattr(medusa.hardware, "_cpuinfo", lambda: ("an AMX CPU", frozenset(ISA_FLAGS)))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    amx_offered = []

    def compiled(program, package_path, inductor_configs):
        amx_offered.append(any(c.vec_isa_cls is VecAMX for cs in micro.micro_gemm_configs.values() for c in cs))

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compiled)
    for limit in ("", "AVX512_CORE_BF16", "AVX2"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
        medusa.runtime.aot.compile_package(None, tmp_path / "package.pt2", {"freezing": True})
    assert amx_offered == [True, False, False]
    monkeypatch.setattr(medusa.hardware, "_cpuinfo", lambda: ("a CPU without AMX", frozenset(ISA_FLAGS[:6])))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")
    assert not medusa.hardware.amx_held_back()


@pytest.mark.slow
def test_an_fp32_package_is_compiled_with_those_kernels_and_keyed_by_them(tmp_path, monkeypatch):
    """A package's fp32 GEMMs take the prefetching kernel (with the narrowed blocks where inductor picks AVX-512, its
    AVX2 ones where it picks AVX2) even where inductor's own cache holds the same graph compiled without it, compute
    what the module computes, and a package's path changes with what its kernels were compiled with (a package
    compiled with others is not loaded): an fp32 one's with the blocks and the fp32 distance, an int8 one's with the
    int8 distance, a bf16 one's with the half-precision distance."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules in their import order
    from torch._inductor.codegen import cpp_gemm_template
    from torch._inductor.cpu_vec_isa import VecAVX512, pick_vec_isa

    from medusa.runtime.torch_patches import FP32_REGISTER_BLOCKS

    picked, create = [], cpp_gemm_template.create_micro_gemm

    def recording(*args, **kwargs):
        micro_gemm = create(*args, **kwargs)
        picked.append((type(micro_gemm).__name__, tuple(micro_gemm.register_blocking)))
        return micro_gemm

    monkeypatch.setattr(cpp_gemm_template, "create_micro_gemm", recording)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    module, x = nn.Linear(64, 96).eval(), torch.randn(5, 64)
    options = medusa.runtime.static.INDUCTOR_CPU_OPTIONS
    with torch.no_grad():
        program = torch.export.export(module, (x,))
        with monkeypatch.context() as without_prefetch:  # the same compile as a version without the prefetch
            without_prefetch.setattr(medusa.runtime.torch_patches, "prefetching_kernel", lambda stock: None)
            medusa.runtime.aot.compile_package(program, tmp_path / "before.pt2", options)
        assert picked and all(name == "CppMicroGemmFP32Vec" for name, _ in picked)
        picked.clear()
        medusa.runtime.aot.compile_package(program, tmp_path / "p.pt2", options)
        torch.testing.assert_close(torch._inductor.aoti_load_package(str(tmp_path / "p.pt2"))(x), module(x))
    assert picked and all(name == "PrefetchingCppMicroGemmFP32Vec" for name, _ in picked)
    blocks = {b for _, b in picked}
    if isinstance(pick_vec_isa(), VecAVX512):
        assert blocks <= set(FP32_REGISTER_BLOCKS)
    else:
        assert not blocks & set(FP32_REGISTER_BLOCKS)
    int8 = quantize_target(make_tiny_model("llama", dtype=torch.bfloat16), "int8")
    models = make_tiny_model("llama"), int8, make_tiny_model("llama", dtype=torch.bfloat16)  # fp32, int8, bf16

    def paths():
        return [medusa.runtime.aot.package_path(m, options={}, weights="w") for m in models]

    before = paths()
    monkeypatch.setattr(medusa.runtime.aot, "FP32_REGISTER_BLOCKS", ((8, 32, 1),))
    other_blocks = paths()
    monkeypatch.setattr(medusa.runtime.aot, "FP32_PREFETCH_ROWS", 64)
    other_fp32_distance = paths()
    monkeypatch.setattr(medusa.runtime.aot, "INT8_PREFETCH_ROWS", 64)
    other_int8_distance = paths()
    monkeypatch.setattr(medusa.runtime.aot, "HALF_PREFETCH_ROWS", 64)
    other_half_distance = paths()
    fp32, int8, bf16 = zip(before, other_blocks, other_fp32_distance, other_int8_distance, other_half_distance)
    assert len(set(fp32)) == 3 and fp32[2] == fp32[3] == fp32[4]
    assert int8[0] == int8[1] == int8[2] != int8[3] == int8[4]
    assert bf16[0] == bf16[1] == bf16[2] == bf16[3] != bf16[4]


def _builder(target: str, compile_only: bool = True):
    """A CppBuilder as AOTInductor makes them, for what wrapper_compiled_beside_kernels reads."""
    from torch._inductor.cpp_builder import CppBuilder

    builder = object.__new__(CppBuilder)
    builder._target_file, builder._compile_only = target, compile_only
    return builder


def test_the_wrapper_compiles_beside_the_kernels_and_the_link_waits(monkeypatch):
    """The wrapper's object file compiles while the kernels' does; the kernels' build returns only once the wrapper
    is built, the weights and the link run in order after them, and CppBuilder is put back."""
    import threading
    import time

    from torch._inductor.cpp_builder import CppBuilder

    events, lock = [], threading.Lock()

    def slow_build(self):
        name = self._target_file.rsplit(".", 2)[-2]
        with lock:
            events.append(("start", name))
        time.sleep(0.3 if name in ("wrapper", "kernel") else 0.01)
        with lock:
            events.append(("end", name))

    monkeypatch.setattr(CppBuilder, "build", slow_build)
    with medusa.runtime.torch_patches.wrapper_compiled_beside_kernels():
        _builder("m.wrapper.o").build()
        _builder("m.kernel.o").build()
        assert ("end", "wrapper") in events  # waited for by the kernels' build
        _builder("m.weights.o").build()
        _builder("m.link.so", compile_only=False).build()
    assert CppBuilder.build is slow_build
    starts = [name for kind, name in events if kind == "start"]
    assert starts[:2] == ["wrapper", "kernel"] and events.index(("end", "wrapper")) > events.index(("start", "kernel"))
    assert [e for e in events if e[1] in ("weights", "link")] == [
        ("start", "weights"),
        ("end", "weights"),
        ("start", "link"),
        ("end", "link"),
    ]


def test_a_failed_wrapper_compile_is_raised_by_the_next_build(monkeypatch):
    from torch._inductor.cpp_builder import CppBuilder

    def build(self):
        if self._target_file.endswith(".wrapper.o"):
            raise RuntimeError("the wrapper did not compile")

    monkeypatch.setattr(CppBuilder, "build", build)
    with pytest.raises(RuntimeError, match="the wrapper did not compile"):
        with medusa.runtime.torch_patches.wrapper_compiled_beside_kernels():
            _builder("m.wrapper.o").build()
            _builder("m.kernel.o").build()
    assert CppBuilder.build is build


def test_the_vector_isa_probe_runs_in_a_thread_and_its_failure_is_left_to_inductor(monkeypatch):
    import threading

    from torch._inductor import cpu_vec_isa

    called = threading.Event()
    threads = []

    def probe():
        threads.append(threading.current_thread())
        called.set()
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", probe)
    medusa.runtime.torch_patches.probe_vector_isas_meanwhile()
    assert called.wait(10) and threads[0] is not threading.main_thread()


def test_a_wrapper_compile_with_nothing_after_it_is_waited_for_on_leaving(monkeypatch):
    import time

    from torch._inductor.cpp_builder import CppBuilder

    done = []

    def build(self):
        time.sleep(0.2)
        done.append(self._target_file)

    monkeypatch.setattr(CppBuilder, "build", build)
    with medusa.runtime.torch_patches.wrapper_compiled_beside_kernels():
        _builder("m.wrapper.o").build()
        assert done == []  # compiling in its thread
    assert done == ["m.wrapper.o"]
