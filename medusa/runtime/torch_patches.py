"""Every workaround on torch's and transformers' internals, in one place.

Each entry of INTERNALS names what is reached into, the versions it was checked on and the upstream issue where there
is one; `moved_internals()` lists those no longer where they were, and tests/test_torch_patches.py fails on it, so an
upgrade shows at once which workaround to look at again. The patches below fall back to torch's own behaviour when
what they replace is missing: a moved internal costs speed, never correctness.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pkgutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CHECKED_ON = {"torch": "2.13.0", "transformers": "5.23.0"}


@dataclass(frozen=True)
class Internal:
    module: str  # where it lives
    name: str  # a dotted attribute path inside `module`
    why: str  # what we use it for
    upstream: str = ""  # the upstream issue or change, where one exists


INTERNALS = (
    Internal(
        "torch._inductor.codegen.common",
        "KernelTemplate._template_from_string",
        "parses_kept: inductor parses its C++ GEMM template again for every GEMM it renders",
    ),
    Internal(
        "torch._inductor.codegen.cpp_template_kernel",
        "parse_expr_with_index_symbols",
        "parses_kept: the template's index expressions are parsed again for every GEMM",
    ),
    Internal(
        "torch._inductor.cpp_builder",
        "CppBuilder.build",
        "wrapper_compiled_beside_kernels: AOTInductor builds the wrapper and the kernels one after the other",
    ),
    Internal(
        "torch._inductor.cpu_vec_isa",
        "valid_vec_isa_list",
        "probe_vector_isas_meanwhile: the ISA probe runs in a thread beside the export",
    ),
    Internal(
        "torch._inductor.select_algorithm",
        "NoValidChoicesError",
        "no_gemm_choice: a GEMM the C++ template cannot take is compiled again with aten's kernels",
    ),
    Internal(
        "torch._inductor.runtime.cache_dir_utils",
        "default_cache_dir",
        "use_medusa_inductor_cache: torch's default cache lives under /tmp",
    ),
    Internal(
        "torch._inductor",
        "aoti_compile_and_package",
        "the inductor engine's ahead-of-time packages on a CPU: torch.compile bypasses its caches for a graph "
        "holding oneDNN-packed frozen weights and compiles again in every process",
        "pytorch/pytorch#117888 (mkldnn tensors bypass the FX graph cache)",
    ),
    Internal(
        "torch._C._aoti",
        "AOTIModelContainerRunnerCpu",
        "running those packages (aot.Package): unlike torch's package loader, it hands a package's weights to another",
    ),
    Internal("torch.utils._pytree", "treespec_loads", "aot.Package: a package's outputs, by its call spec"),
    Internal(
        "torch._inductor.codegen.cpp_micro_gemm",
        "micro_gemm_configs",
        "prefetching_micro_kernels: the C++ GEMM template's AVX-512 fp32 micro-kernels held to 16 x 16 register blocks",
    ),
    Internal(
        "torch._inductor.codegen.cpp_micro_gemm",
        "CppMicroGemmFP32Vec.TEMPLATE_KERNEL",
        "prefetching_micro_kernels: the fp32 micro-kernel those configure, its weight loads preceded by a prefetch",
    ),
    Internal("torch._inductor.codegen.cpp_micro_gemm", "generate_gemm_config", "writing that 16 x 16 config"),
    Internal("torch._inductor.cpu_vec_isa", "VecAVX512", "which of its configs are AVX-512 ones"),
    Internal("torch._inductor.cpu_vec_isa", "VecAMX", "micro_kernels_without_amx: which of its configs are AMX ones"),
    Internal("torch._dynamo", "mark_static_address", "a static cache's tensors guarded per size"),
    Internal("torch", "ops.mkldnn._reorder_linear_weight", "pre-packed weights without compiling"),
    Internal("torch", "ops.mkldnn._linear_pointwise", "the pre-packed linear"),
    Internal(
        "torch",
        "ops.aten._weight_int8pack_mm",
        "int8 proposing; only input widths that are a multiple of 16 (others give wrong numbers or crash)",
        "pytorch/pytorch#136709 (crashes on other shapes)",
    ),
    Internal(
        "transformers.cache_utils",
        "StaticLayer.lazy_initialization",
        "the static engine's layers (prefix view, guarded addresses) and the AOT package's cache over given tensors",
    ),
    Internal("transformers.cache_utils", "StaticLayer.get_mask_sizes", "the prefix view's mask sizes"),
    Internal(
        "torch.fx.experimental._config",
        "meta_nonzero_assume_all_nonzero",
        "meta_nonzero_takes_all: scripts/training_memory.py runs the heads' masked loss on meta tensors",
    ),
)


def _resolve(internal: Internal):
    return pkgutil.resolve_name(f"{internal.module}:{internal.name}")


def moved_internals() -> list[str]:
    """The INTERNALS missing from the torch and transformers installed, each with why we need it."""
    import torch._inductor.compile_fx  # noqa: F401 - inductor's codegen modules import in this order only

    moved = []
    for internal in INTERNALS:
        try:
            _resolve(internal)
        except (ImportError, AttributeError, RuntimeError):
            moved.append(f"{internal.module}.{internal.name} ({internal.why})")
    return moved


@contextlib.contextmanager
def parses_kept():
    """While compiling: inductor parses the same text again for every GEMM it renders, its C++ GEMM template (a fresh
    jinja2 Environment each time) and the template's index expressions (sympy). Keep what was parsed for the same text
    during the compile instead; what is rendered is unchanged."""
    import torch._inductor.compile_fx  # noqa: F401 - loads inductor's codegen modules in their import order
    from torch._inductor.codegen import common, cpp_template_kernel

    replacements = []
    template = common.KernelTemplate.__dict__.get("_template_from_string")
    if isinstance(template, staticmethod):
        cached = staticmethod(functools.lru_cache(maxsize=None)(template.__func__))
        replacements.append((common.KernelTemplate, "_template_from_string", template, cached))
    parse = cpp_template_kernel.__dict__.get("parse_expr_with_index_symbols")
    if callable(parse):
        replacements.append((cpp_template_kernel, "parse_expr_with_index_symbols", parse, _text_kept(parse)))
    for owner, name, _, replacement in replacements:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original, _ in replacements:
            setattr(owner, name, original)


def _text_kept(parse):
    """`parse` with what it returned for each str or int argument kept (sympy expressions are immutable); other
    arguments (lists of them, expressions) pass through, and a list's items come back through the module's name."""
    parsed = {}

    def kept(expr):
        if not isinstance(expr, (str, int)):
            return parse(expr)
        key = (type(expr), expr)
        if key not in parsed:
            parsed[key] = parse(expr)
        return parsed[key]

    return kept


def probe_vector_isas_meanwhile() -> None:
    """Inductor finds which vector instruction sets this CPU and compiler can run (a test program compiled and loaded
    per set) when it first lowers a graph, on one core. Start that in a thread now, beside the export and freezing's
    trace (Python on the other core). Its result is cached in the process; should the thread fail or not be done,
    inductor probes again itself and reports what went wrong."""
    from torch._inductor import cpu_vec_isa

    def probe():
        with contextlib.suppress(Exception):
            cpu_vec_isa.valid_vec_isa_list()

    threading.Thread(target=probe, daemon=True, name="medusa-isa-probe").start()


@contextlib.contextmanager
def wrapper_compiled_beside_kernels():
    """AOTInductor compiles the package's wrapper and then its kernels, each on one core. While inside, the wrapper's
    object file compiles in a thread, beside the next thing built (the kernels), which then waits for it and raises
    its errors. A torch that names or builds its files otherwise compiles as it is."""
    from torch._inductor import cpp_builder

    builder = getattr(cpp_builder, "CppBuilder", None)
    build = getattr(builder, "build", None)
    if build is None:
        yield
        return
    pending = []

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="medusa-wrapper") as pool:

        def build_or_start(self):
            target = str(getattr(self, "_target_file", ""))
            if getattr(self, "_compile_only", False) and target.endswith(".wrapper.o"):
                pending.append(pool.submit(build, self))
                return None
            try:
                return build(self)
            finally:
                while pending:
                    pending.pop().result()

        builder.build = build_or_start
        try:
            yield
        finally:
            builder.build = build
            while pending:  # nothing was built after the wrapper: its errors still surface
                pending.pop().result()


# The register blocks inductor's C++ GEMM template may take for fp32 GEMMs on AVX-512. It ranks the larger ones first
# (8 x 48: 24 accumulators), and a verify of 3-8 query rows then costs about twice one row's; 16 x 16 blocks keep it
# flatter (docs/engines.md, "fp32 trees on AVX-512"). The package key carries them (aot.package_path).
FP32_REGISTER_BLOCKS = ((16, 16, 1),)
# How many rows of packed weights (k steps) ahead of its loads inductor's fp32 micro-kernel asks for them, into L2, by
# the weights' dtype: 8 KB in a block of 16 columns. As shipped it asks for none (int8's ask for the next row, and only
# where the template says so), and from 2 query rows on its arithmetic waits on memory instead of overlapping it
# (docs/engines.md, "fp32 trees: weights asked for ahead"). The package key carries them (aot.package_path).
FP32_PREFETCH_ROWS = 128
INT8_PREFETCH_ROWS = 512  # int8 weights (weight-only int8 without AMX: bf16 activations on the fp32 kernel)
HALF_PREFETCH_ROWS = 256  # bf16 and fp16 weights (without AMX: docs/engines.md, "bf16 without AMX")
# the stock kernel's loads of a vector of weights (full width, B not transposed), fp32, int8 and bf16 / fp16: the
# prefetch goes before each
FP32_WEIGHT_LOAD = "vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);"
INT8_WEIGHT_LOAD = "auto b32 = at::vec::convert_to_int32<int8_t>(B + k * ldb + col * VLEN);"
HALF_WEIGHT_LOAD = "auto b = VectorizedIn::loadu(B + k * ldb + col * VLEN, VLEN);"


def prefetching_kernel(stock: type) -> type | None:
    """A subclass of inductor's fp32 micro-kernel `stock` whose fp32, int8 and bf16 / fp16 weight loads each ask for
    the row FP32_PREFETCH_ROWS / INT8_PREFETCH_ROWS / HALF_PREFETCH_ROWS ahead (a row past the block's end is the next
    block's: the template packs them one after another; a prefetch never faults). None where the kernel's text has
    changed."""
    kernel = stock.TEMPLATE_KERNEL
    for load, rows in (
        (FP32_WEIGHT_LOAD, FP32_PREFETCH_ROWS),
        (INT8_WEIGHT_LOAD, INT8_PREFETCH_ROWS),
        (HALF_WEIGHT_LOAD, HALF_PREFETCH_ROWS),
    ):
        if kernel.count(load) != 1:
            return None
        ahead = f"B + (k + {rows}) * ldb + col * VLEN"
        kernel = kernel.replace(
            load, f"_mm_prefetch(reinterpret_cast<const char*>({ahead}), _MM_HINT_T1);\n            {load}"
        )
    return type(f"Prefetching{stock.__name__}", (stock,), {"TEMPLATE_KERNEL": kernel})


@contextlib.contextmanager
def micro_gemm_configs_edited(edit):
    """While inside, inductor's registry of C++ GEMM micro-kernel configs as `edit(cpp_micro_gemm)` leaves it (it
    replaces entries of `micro_gemm_configs`); inductor's own entries again after. A torch that keeps its micro-kernels
    elsewhere, or lacks what `edit` reaches for, compiles as it is."""
    try:
        import torch._inductor.compile_fx  # noqa: F401 - loads inductor's codegen modules in their own order
        from torch._inductor.codegen import cpp_micro_gemm as micro

        configs = micro.micro_gemm_configs
    except (ImportError, AttributeError):
        yield
        return
    saved = dict(configs)

    def restore():
        configs.clear()
        configs.update(saved)

    try:
        edit(micro)
    except (ImportError, AttributeError, KeyError):
        restore()
    try:
        yield
    finally:
        restore()


def prefetching_micro_kernels():
    """While inside, inductor's fp32 GEMM micro-kernels ask for their fp32, int8 or bf16 / fp16 weights ahead
    (prefetching_kernel), and its AVX-512 fp32 ones take FP32_REGISTER_BLOCKS only; other kernels are left as they are.
    A torch that has changed the kernel's text compiles with the blocks alone."""

    def edit(micro):
        import torch
        from torch._inductor.cpu_vec_isa import VecAVX512

        configs, kernel = micro.micro_gemm_configs, micro.CppMicroGemmFP32Vec
        stock = configs[kernel]
        narrow = micro.generate_gemm_config(VecAVX512, FP32_REGISTER_BLOCKS, input_dtype=torch.float)
        prefetching = prefetching_kernel(kernel)

        def fp32(config) -> bool:
            return config.input_dtype == config.input2_dtype == torch.float

        def ours(config) -> bool:  # what changes: fp32 GEMMs, and int8 / half weights' ones where loads prefetch
            weights = (torch.int8, torch.bfloat16, torch.float16)
            return fp32(config) or (prefetching is not None and config.input2_dtype in weights)

        changed = [c for c in stock if ours(c) and not (fp32(c) and c.vec_isa_cls is VecAVX512)] + narrow
        configs[kernel] = [c for c in stock if not ours(c)] + ([] if prefetching else changed)
        if prefetching:
            configs[prefetching] = changed

    return micro_gemm_configs_edited(edit)


def micro_kernels_without_amx():
    """While inside, inductor's C++ GEMM template has no AMX micro-kernels to pick (it ranks them first where the CPU
    has AMX, reading the CPU, not ONEDNN_MAX_CPU_ISA). For weight-only int8 and int4 one-token packages, whose vector
    kernels stream the weights faster at one row (docs/engines.md, "one-token int8 and int4 steps without AMX"), and
    for every package where the environment holds AMX back (hardware.amx_held_back)."""

    def edit(micro):
        from torch._inductor.cpu_vec_isa import VecAMX

        configs = micro.micro_gemm_configs
        for kernel, kernel_configs in list(configs.items()):
            configs[kernel] = [c for c in kernel_configs if c.vec_isa_cls is not VecAMX]

    return micro_gemm_configs_edited(edit)


def no_gemm_choice(err: BaseException | None) -> bool:
    """Whether `err` (or what it wraps) is inductor's 'no valid choices' for a GEMM."""
    from torch._inductor.select_algorithm import NoValidChoicesError

    while err is not None:
        if isinstance(err, NoValidChoicesError) or "NoValidChoicesError" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def use_inductor_cache(directory) -> None:
    """Compiled graphs go to `directory` unless the user chose a place: torch's default is under /tmp (gone at
    reboot), and torch writes it into the environment once used."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)


@contextlib.contextmanager
def meta_nonzero_takes_all():
    """nonzero (a boolean mask's selection) on meta tensors takes every element instead of failing for want of
    values: what the training memory estimate needs to run the heads' masked loss on the meta device."""
    from torch.fx.experimental import _config

    with _config.patch(meta_nonzero_assume_all_nonzero=True):
        yield
