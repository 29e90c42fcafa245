"""Execution engines: how the target's public `forward` runs over its KV cache (prefill, verify, commit).

- `eager`: transformers' DynamicCache, grown by each forward and cut back by each commit. The exact reference: greedy
  output is token-identical to transformers' `generate`.
- `compiled`: transformers' StaticCache (allocated once and kept, written in place; the commit copies the accepted
  rows in place) over a copy of the target whose linear layers hold oneDNN pre-packed weights on CPU (medusa.prepack;
  parameters shared). Its layers show attention only the rows written so far, as a DynamicCache does. With
  `torch_compile=True` (the default on CUDA: CUDA graphs) the verify forward runs through `torch.compile` instead,
  with fixed-size layers and a mask over the whole allocation.

Measured on a 2-core AVX-512 CPU (SmolLM2-135M fp32, 300-token context, ms per forward over q tokens): eager 62.7 /
81.7 at q=1 / 16; pre-packed 30.2 / 45.6; inductor with freezing 35.9 / 79.5 after 32-34 s of compiling per query
length. So on CPU the engine pre-packs and does not run inductor unless asked.

- `inductor`: the compiled engine's StaticCache with the verify forward run through `torch.compile`. On a CPU,
  inductor freezes the weights and generates C++ GEMM micro-kernels for them (max-autotune's CPP backend). On a 2-core
  AVX2-only AMD EPYC (SmolLM2 fp32, 256-token context, a whole step as the plan times it) it took 55 / 63 / 90 / 106
  ms with 1 / 2 / 4 / 6 tree nodes where the pre-packed copy took 89 / 124 / 142 / 154, after 6-8 minutes of
  compiling two graphs (one token; every other length as one dynamic shape). A graph compiled for one fixed length
  is no faster (4 nodes 61.8 ms against the dynamic graph's 60.5; 8 nodes 95.7 against 94.2, 200-token context):
  the ~8.5 ms each further node adds is this CPU's fp32 GEMM throughput, so one dynamic graph stays. Freezing alone
  (no C++ GEMM templates) compiles the package in 161 s instead of 272-327, but a one-token forward then takes 55 ms
  against 42 (2 / 4 / 8 tokens: 59 / 69 / 88 ms), and plain decoding is what every call falls back to. With the
  templates alone among the GEMM choices and inductor's parses kept (`parses_kept`) a 2-core AVX-512 EPYC compiles it
  in 90 s instead of 168 (C++ compiler 37 s of it, export and freezing's trace 30 s, lowering 17 s, py-spy), and in
  71 s with the package's wrapper (12 s) compiled beside its kernels (10 s) and inductor's ISA probe (7 s) beside the
  export and freezing's trace (medusa.aot: each ran on one core while the other idled); the traced query length (2)
  does not change the kernels' speed (traced at 4 or 8: the same 1-16 token timings).
  torch.compile would compile again in every new process (torch 2.13 bypasses its FX graph cache for a graph holding
  oneDNN-packed weights, "mkldnn tensors unpickleable", and its AOT autograd cache under freezing: 4-7 minutes each
  time here), so on a CPU this engine compiles ahead of time instead (medusa.aot: torch.export + AOTInductor, the
  same inductor settings): one package per cache size, once per machine, in `$MEDUSA_CACHE/aoti`, loaded by later
  processes in about a second. It is paid when a cache is allocated (`warm_up`, or a call that needs a larger cache),
  never between a call's steps. On CUDA the verify forward runs through torch.compile with CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from medusa import aot, kv_cache
from medusa.heads import base_features
from medusa.loading import base_fingerprint, cache_root
from medusa.prepack import can_prepack, prepacked_copy
from medusa.propose import Candidates
from medusa.tree import TreeSpec, build_buffers, chain
from medusa.verify import VerifyOutput, verify, verify_inputs

logger = logging.getLogger(__name__)

ENGINES = ("eager", "compiled", "inductor")
ENGINES_ATTRIBUTE = "_medusa_engines"  # where engine_for keeps a model's engines
CACHE_ROUNDING = 64  # static caches are sized in steps of this many rows, so nearby lengths reuse one cache
# torch.compile's caches: 512 rows, then doubling (attention reads the whole allocation under a mask in a compiled
# graph, and each size compiles graphs of its own: minutes on a small CPU)
COMPILED_MIN_ROWS = 512
# inductor on CPU: frozen (pre-packed) weights and its own C++ GEMM templates, aten's kernels where none applies
INDUCTOR_CPU_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


@contextlib.contextmanager
def parses_kept():
    """While compiling: inductor parses the same text again for every GEMM it renders (torch 2.13): its C++ GEMM
    template (a fresh jinja2 Environment each time: `KernelTemplate._template_from_string`) and the template's index
    expressions (`sympy.parse_expr` of "m_start", "k_end - k_start"...: `parse_expr_with_index_symbols`). Keep what
    was parsed for the same text during the compile instead; what is rendered is unchanged. SmolLM2's package spent
    50 of its 283 s parsing templates on the AVX2 EPYC, and a fifth of its lowering parsing expressions on the AVX-512
    one (py-spy). Another torch without these functions compiles as it is."""
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


@dataclass(frozen=True)
class PrefillOutput:
    logits: torch.Tensor  # (V,): the target's next-token logits after the prompt
    hidden: torch.Tensor  # (T, F): what heads read at every prompt position (medusa.heads.base_features)


@torch.inference_mode()
def run_prefill(model, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
    """One ordinary forward over the prompt (1, T) into `cache`, logits kept for its last position only."""
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    return PrefillOutput(out.logits[0, -1], base_features(out.hidden_states, feature_layers)[0])


def use_medusa_inductor_cache() -> None:
    """Compiled graphs go to `$MEDUSA_CACHE/inductor`, beside the converted models and plans, unless the user chose a
    place: torch's default is under /tmp (gone at reboot), and torch writes it into the environment once used."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


@contextlib.contextmanager
def engines_set_aside(model):
    """Leave the engines engine_for keeps on `model` out of it for a while: a copy of the model (pre-packed,
    quantized) must not copy them, and a compiled graph cannot be copied."""
    engines = model.__dict__.pop(ENGINES_ATTRIBUTE, None)
    try:
        yield model
    finally:
        if engines is not None:
            model.__dict__[ENGINES_ATTRIBUTE] = engines


class EagerEngine:
    """transformers' DynamicCache and the model as it is: the reference every other engine is tested against."""

    name = "eager"

    def __init__(self, model):
        self.model = model

    def new_cache(self, max_length: int):
        return DynamicCache(config=self.model.config)

    compile_seconds = 0.0

    def warm_up(self, progress: bool = True, max_length: int | None = None) -> float:
        return 0.0  # nothing to compile

    def prefill(self, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
        return run_prefill(self.model, cache, input_ids, feature_layers)

    def verify(self, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
        return verify(self.model, cache, candidates, past_length, feature_layers)

    def commit(self, cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
        kv_cache.commit(cache, past_length, accepted_nodes)

    @torch.inference_mode()
    def truncate(self, cache, length: int) -> None:
        """Drop every row past `length` (after a verify that is not committed, e.g. when timing)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)


class PrefixStaticLayer(StaticLayer):
    """transformers' static layer (allocated once, written in place) that hands attention only the rows written so
    far, as a DynamicCache does: an uncompiled forward then attends over past + q rows rather than the whole
    allocation, and a one-token step needs no mask. Not for torch.compile: the visible length varies."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.length = 0  # rows written, as a Python int (cumulative_length mirrors it on the device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.length += key_states.shape[-2]
        return keys[:, :, : self.length], values[:, :, : self.length]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        query_length = args[0] if args and isinstance(args[0], int) else kwargs.get("query_length", 0)
        return self.length + query_length, 0  # asked before the update

    def get_seq_length(self) -> int:
        return self.length


class GuardedStaticLayer(StaticLayer):
    """transformers' static layer, its tensors marked as fixed-address inputs as transformers marks them, but guarded:
    each cache size, at an address of its own, gets graphs of its own (inductor's, or CUDA graphs recorded for it)
    instead of failing an assertion in those compiled for another."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        for rows in (self.keys, self.values):
            torch._dynamo.mark_static_address(rows, guard=True)


class CompiledEngine:
    """StaticCache + pre-packed weights (CPU) + optionally torch.compile (CUDA graphs on a GPU).

    Uncompiled, one cache is kept between calls and reallocated only when a call needs more rows. Compiled, each size
    (512 rows, doubling) keeps its own cache and graphs, and a call runs on the smallest that fits it: attention reads
    the whole allocation under a mask, so a 2,048-row cache made an H100's one-token step 13.2 ms against 6.5 ms at
    512 rows (docs/benchmarks/h100-step-overhead.md). Sliding-window models run only
    while prompt + new tokens + tree fit inside the window (as in the eager engine's commit).
    """

    name = "compiled"

    def __init__(self, model, torch_compile: bool | None = None, prepack: bool | None = None):
        start = time.perf_counter()
        self.model = model
        self.torch_compile = model.device.type == "cuda" if torch_compile is None else torch_compile
        # inductor packs weights itself (freezing) and cannot lower ours
        self.prepacked = (
            (can_prepack(model.device, model.dtype) and not self.torch_compile) if prepack is None else prepack
        )
        self.runner = model
        if self.prepacked:
            with engines_set_aside(model):
                self.runner = prepacked_copy(model)
        self.verify_runner = self.runner
        # on a CPU, torch.compile's graphs would be compiled again in every process: ahead of time instead, once per
        # machine (medusa.aot), for plain weights (torchao's quantized ones stay with torch.compile); on CUDA,
        # torch.compile with CUDA graphs
        plain_weights = all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())
        self.ahead_of_time = self.torch_compile and model.device.type != "cuda" and plain_weights
        self._packages: dict[int, object] = {}  # ahead of time: cache rows -> the loaded package's runner
        self._weights: str | None = None  # the base's fingerprint, which names its packages
        if self.torch_compile:
            use_medusa_inductor_cache()
        if self.torch_compile and not self.ahead_of_time:
            self.verify_runner = torch.compile(
                self.runner,
                mode="reduce-overhead" if model.device.type == "cuda" else None,
                dynamic=False,  # dynamic only where verify marks it (the query length)
            )
        self._cache: StaticCache | None = None  # the last one handed out
        self._sized: dict[int, StaticCache] = {}  # torch.compile: rows -> cache, each with graphs of its own
        self.setup_seconds = time.perf_counter() - start  # packing; compiling happens as caches are allocated
        self.label = os.path.basename(str(getattr(model, "name_or_path", "") or "")) or type(model).__name__
        self.compile_seconds = 0.0
        text = model.config.get_text_config()
        self.window = (
            getattr(text, "sliding_window", None)
            if "sliding_attention" in (getattr(text, "layer_types", None) or ())
            else None
        )

    def _compile_config(self):
        """inductor's settings for this engine's compiles (which happen inside calls): set around each call, as
        torch.compile's `options=` did not reach the GEMM template choice (one-token forward 73 ms instead of 51)."""
        cpu = self.torch_compile and self.model.device.type != "cuda"
        return torch._inductor.config.patch(INDUCTOR_CPU_OPTIONS) if cpu else contextlib.nullcontext()

    @torch.inference_mode()  # a cache made under it (warm_up's) is written in place here
    def new_cache(self, max_length: int, progress: bool = True) -> StaticCache:
        if self.window is not None and max_length > self.window:
            raise ValueError(
                f"the compiled engine keeps sliding-window layers only inside their window ({self.window} tokens); "
                f"this call needs {max_length}: lower max_new_tokens or use engine='eager'"
            )
        rows = -(-max_length // CACHE_ROUNDING) * CACHE_ROUNDING
        if self.torch_compile:  # each size is a graph to compile: few sizes, doubling
            rows = max(COMPILED_MIN_ROWS, 1 << (rows - 1).bit_length())
        if self.window is not None:
            rows = min(rows, self.window)
        if self.torch_compile and rows in self._sized:  # the smallest compiled size that fits: reads no more
            self._cache = self._sized[rows]
        elif self.torch_compile:  # a size of its own, kept for the calls that fit; compiled now, not mid-call
            self._cache = StaticCache(config=self.model.config, max_cache_len=rows)
            self._cache.layers = [GuardedStaticLayer(rows) for _ in self._cache.layers]
            self._sized[rows] = self._cache
            self._compile_for(self._cache, progress)
        elif self._cache is None or self._cache.layers[0].max_cache_len < rows:
            self._cache = StaticCache(config=self.model.config, max_cache_len=rows)
            # shapes may vary: attend over the written rows only
            self._cache.layers = [PrefixStaticLayer(rows) for _ in self._cache.layers]
        self._set_length(self._cache, 0)
        return self._cache

    @staticmethod
    def _set_length(cache: StaticCache, length: int) -> None:
        """Where the next forward writes: transformers' static layers keep that count themselves, in place."""
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(length)
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = length
            if isinstance(layer, PrefixStaticLayer):
                layer.length = length

    @torch.inference_mode()
    def prefill(self, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
        self._set_length(cache, 0)
        return run_prefill(self.runner, cache, input_ids, feature_layers)

    @torch.inference_mode()
    def verify(self, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
        """One forward over the N nodes, written at rows past_length .. past_length + N; the mask shows the past and
        the tree's ancestry (and, for torch.compile's fixed shapes, (1, 1, N, rows) hides the rows beyond)."""
        n, rows = candidates.tokens.numel(), cache.layers[0].max_cache_len
        if past_length + n > rows:
            raise RuntimeError(f"the static cache has {rows} rows; this step needs {past_length + n}")
        self._set_length(cache, past_length)
        # prefix layers show attention past + N rows, as in the eager engine; fixed-size ones the whole allocation
        mask_rows = None if isinstance(cache.layers[0], PrefixStaticLayer) else rows
        package = self._packages.get(rows) if self.ahead_of_time and n <= aot.MAX_QUERY else None
        if package is not None:
            tokens, position_ids, mask = verify_inputs(candidates, past_length, self.model.dtype, rows)
            return VerifyOutput(*aot.run(package, cache, tokens, position_ids, mask, past_length, feature_layers))
        try:
            with self._compile_config():
                return verify(self.verify_runner, cache, candidates, past_length, feature_layers, mask_rows)
        except Exception as err:  # noqa: BLE001 - a compiler failure must not end generation: run uncompiled
            if self.verify_runner is self.runner:
                raise
            logger.warning(
                "torch.compile failed (%s: %s); the compiled engine runs uncompiled from now on",
                type(err).__name__,
                err,
            )
            self.verify_runner = self.runner
            self._set_length(cache, past_length)
            return verify(self.runner, cache, candidates, past_length, feature_layers, mask_rows)

    @torch.inference_mode()  # hands back caches made under it (their tensors are inference tensors)
    def warm_up(self, progress: bool = True, max_length: int | None = None) -> float:
        """Compile the verify graphs now for every cache a call of up to `max_length` rows (prompt + new tokens +
        tree) will use, so that neither timing nor `generate` pays for it: minutes per size on a small CPU, less
        once inductor's on-disk cache has them (a call that needs a larger cache later compiles its own as it is
        allocated). -> seconds spent (0 when nothing was compiled)."""
        if not self.torch_compile:
            return 0.0
        before = self.compile_seconds
        max_length = max_length or COMPILED_MIN_ROWS
        if self.window is not None:
            max_length = min(max_length, self.window)
        # each size the caches come in, up to the one max_length needs (a window may stop them short)
        sizes = [COMPILED_MIN_ROWS]
        while sizes[-1] < max_length:
            sizes.append(sizes[-1] * 2)
        if self.window is not None:
            sizes = sorted({min(rows, self.window) for rows in sizes})
        sizes = [rows for rows in sizes if rows not in self._sized]  # as new_cache keys them
        for rows in sizes:
            self.new_cache(rows, progress)  # allocates and compiles
        return self.compile_seconds - before

    @torch.inference_mode()
    @parses_kept()  # while compiling only: entered around every verify, it made each 0.4 ms dearer
    def _compile_for(self, cache: StaticCache, progress: bool) -> None:
        """Ahead of time: load (or compile and save) the package for `cache`'s size. Otherwise run the verify forward
        once per graph on `cache` (a scratch prompt, then set back): one token, and two (every other length shares
        that dynamic graph; dynamo specialises a length of 1)."""
        start, rows = time.perf_counter(), cache.layers[0].max_cache_len
        if self.ahead_of_time:
            try:
                self._weights = self._weights or base_fingerprint(self.model)
                with self._compile_config():  # as for torch.compile: the GEMM template choice reads the global
                    self._packages[rows], seconds = aot.load_or_compile(
                        self.runner, rows, INDUCTOR_CPU_OPTIONS, self._weights, self.label, progress
                    )
                self.compile_seconds += seconds
            except Exception as err:  # noqa: BLE001 - a compiler failure must not stop generation: run uncompiled
                logger.warning(
                    "compiling ahead of time failed (%s: %s); the %s engine runs uncompiled from now on",
                    type(err).__name__,
                    err,
                    self.name,
                )
                self.ahead_of_time = False
            return
        where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's cache")
        for n in (1, 2):
            if progress:
                print(
                    f"\rcompiling {self.label} for {'one-token' if n == 1 else 'multi-token'} steps over {rows} cached "
                    f"rows (torch.compile, in each new process; cache {where}), {time.perf_counter() - start:.0f} s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            self.prefill(cache, torch.zeros((1, 4), dtype=torch.long, device=self.model.device))
            tree = build_buffers(TreeSpec(chain(n - 1)), max(n - 1, 1)).to(self.model.device)
            tokens = torch.zeros(n, dtype=torch.long, device=self.model.device)
            self.verify(cache, Candidates(tokens=tokens, tree=tree), 4)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        if progress:
            print(f"\rcompiled {self.label} for {rows} cached rows in {seconds:.0f} s{' ' * 70}", file=sys.stderr)

    @torch.inference_mode()
    def commit(self, cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
        """Rows past_length + accepted_nodes (src) -> past_length .. past_length + a (dst), in place; rows beyond are
        stale and masked out by the next verify."""
        end = past_length + accepted_nodes.numel()
        if accepted_nodes.tolist() != list(range(accepted_nodes.numel())):  # a prefix of the rows stays where it is
            src = past_length + accepted_nodes
            for layer in cache.layers:
                for rows in (layer.keys, layer.values):  # (B, heads, rows, head_dim)
                    rows[:, :, past_length:end] = rows[:, :, src]  # the right side is gathered (copied) first
        self._set_length(cache, end)

    @torch.inference_mode()
    def truncate(self, cache, length: int) -> None:
        self._set_length(cache, length)


def make_engine(name: str, model, **options):
    if name == "eager":
        return EagerEngine(model)
    if name == "compiled":
        return CompiledEngine(model, **options)
    if name == "inductor":
        engine = CompiledEngine(model, torch_compile=True, **options)
        engine.name = "inductor"
        return engine
    raise ValueError(f"unknown engine {name!r}: use one of {list(ENGINES)}")


def engine_for(model, name: str):
    """The engine `name` for `model`, built once and kept with the model (every wrapper of one base, e.g. Medusa
    heads and a draft model, shares its pre-packed copy). Kept in the model's __dict__: not a submodule, so never
    saved, moved or counted as parameters."""
    engines = model.__dict__.setdefault(ENGINES_ATTRIBUTE, {})
    if name not in engines:
        engines[name] = make_engine(name, model)
    engines[name].warm_up()  # compiles once, before any generate or timing (a no-op after)
    return engines[name]


def compile_seconds(model) -> float:
    """Seconds the engines engine_for built for `model` have spent compiling so far."""
    return sum(engine.compile_seconds for engine in model.__dict__.get(ENGINES_ATTRIBUTE, {}).values())
