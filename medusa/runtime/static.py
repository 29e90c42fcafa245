"""The compiled engine: transformers' StaticCache (allocated once, written in place; the commit copies the accepted
rows in place) over a copy of the target whose linear layers hold oneDNN pre-packed weights on a CPU (parameters
shared). Its layers show attention only the rows written so far, as a DynamicCache does. With `torch_compile=True`
(the default on CUDA: CUDA graphs) the verify forward runs through `torch.compile` instead, with fixed-size layers and
a mask over the whole allocation. What each costs where: docs/engines.md."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time

import torch
from transformers import StaticCache

from medusa.loading import cache_root
from medusa.runtime.aot import OWN_WEIGHTS_OPTIONS
from medusa.runtime.attention import ROW_INVARIANT_SDPA, kv_dtype
from medusa.runtime.graphs import StepGraph, upload_ids
from medusa.runtime.kv_cache import KeptDtypeLayer, RowsCache, keep_rows, row_mover
from medusa.runtime.prepack import can_prepack, plain_weights, prepacked_copy
from medusa.runtime.quantize import QUANTIZED, precision_of, sums_on_fbgemm
from medusa.runtime.torch_patches import parses_kept, use_inductor_cache
from medusa.runtime.verify import (
    PrefillOutput,
    VerifyOutput,
    bias_over_rows,
    forward_nodes,
    prefill_in_chunks,
    prefills_in_chunks,
    rows_forward,
    run_prefill,
    verify,
)
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

logger = logging.getLogger(__name__)

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
# attention written as reductions (attention.row_invariant_sdpa): inductor would inline the rotary embedding of the
# queries into the score reduction, computing it again for every key, unless pointwise results of more than this many
# operations are stored first (its CPU default: 50; docs/engines.md)
REALIZE_OPCOUNT, ROW_INVARIANT_REALIZE_OPCOUNT = "realize_cpu_opcount_threshold", 5
# On a GPU the verify runs as CUDA graphs captured by hand around inductor's kernels (one per cache and node count), not
# through torch.compile's CUDA graphs (a guard check and a graph tree's launch per call): a plain step a third cheaper
# on an H200 (docs/benchmarks/h200-verify-graphs). MEDUSA_VERIFY_GRAPHS=0: torch.compile's graphs instead
VERIFY_GRAPHS = os.environ.get("MEDUSA_VERIFY_GRAPHS", "1") != "0"
ENGINES_ATTRIBUTE = "_medusa_engines"  # where medusa.runtime.engine_for keeps a model's engines


def inductor_cpu_options(model) -> dict:
    """inductor's settings on a CPU for `model`. Every precision's GEMMs take its C++ template first: bf16 and fp16
    ones on AMX's tile units where the CPU has them, else widened to fp32 in registers with their weights asked for
    ahead, which beat oneDNN's and aten's GEMV (docs/engines.md, "bf16 without AMX"). Float targets have the linear
    layers that read one input (q/k/v, gate/up) concatenated into one GEMM each (fewer, larger calls); a quantized
    target does not (its concatenated pattern leaves the template: a slower step, docs/engines.md)."""
    options = dict(INDUCTOR_CPU_OPTIONS)
    if getattr(model.config, "_attn_implementation", None) == ROW_INVARIANT_SDPA:
        options[REALIZE_OPCOUNT] = ROW_INVARIANT_REALIZE_OPCOUNT
    if sums_on_fbgemm(model):  # nothing for inductor to freeze: it reads the weights fbgemm packed for the model
        options.update(OWN_WEIGHTS_OPTIONS)
    if precision_of(model) not in QUANTIZED:
        options["cpp.enable_concat_linear"] = True
    return options


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


class PrefixStaticLayer(KeptDtypeLayer):
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


class GuardedStaticLayer(KeptDtypeLayer):
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
    the whole allocation under a mask, so a larger cache costs every step (docs/engines.md). Sliding-window layers keep
    every row, as the others do (runtime.verify.layer_masks).
    """

    name = "compiled"
    ahead_of_time = False  # the inductor engine's packages (medusa.runtime.inductor) instead of torch.compile

    def __init__(self, model, torch_compile: bool | None = None, prepack: bool | None = None):
        start = time.perf_counter()
        self.model = model
        self.torch_compile = model.device.type == "cuda" if torch_compile is None else torch_compile
        # inductor packs weights itself (freezing) and cannot lower ours; torchao's quantized weights stay as they are
        self.prepacked = (
            (can_prepack(model.device, model.dtype) and not self.torch_compile and plain_weights(model))
            if prepack is None
            else prepack
        )
        with engines_set_aside(model):
            self.runner = self._runner_for(model)
            self.eager_runner = self._eager_runner_for(self.runner)
        self.verify_runner = self.eager_runner
        cuda = model.device.type == "cuda"
        self.verify_graphs = VERIFY_GRAPHS and cuda and self.torch_compile and not self.ahead_of_time
        self._graphed: dict[tuple, StepGraph] = {}  # (cache, feature layers) -> its verify's graphs, one per N
        self._row_movers: dict[int, StepGraph] = {}  # a GPU cache's first tensor -> its commit's graphs, one per a
        if self.torch_compile:
            use_inductor_cache(cache_root() / "inductor")
        if self.torch_compile and not self.ahead_of_time:
            self.verify_runner = torch.compile(
                self.runner,
                mode="reduce-overhead" if cuda and not self.verify_graphs else None,
                dynamic=False,  # dynamic only where verify marks it (the query length)
            )
        self._cache: StaticCache | None = None  # the last one handed out
        self._sized: dict[int, StaticCache] = {}  # torch.compile: rows -> cache, each with graphs of its own
        self.setup_seconds = time.perf_counter() - start  # packing; compiling happens as caches are allocated
        self.label = os.path.basename(str(getattr(model, "name_or_path", "") or "")) or type(model).__name__
        self.compile_seconds = 0.0

    def new_rows_cache(self, max_rows: int) -> RowsCache:
        """A batch's cache (torch.compile's graphs take one sequence: a batch runs eagerly on the runner, the
        pre-packed copy where this engine packs), its rows kept as one sequence's cache keeps them."""
        return RowsCache(self.model.config, max_rows, kv_dtype(self.runner))

    def batch_forward(self, cache: RowsCache, ids, mask, positions, feature_layers=(), logits_to_keep=None):
        return rows_forward(self.eager_runner, cache, ids, mask, positions, feature_layers, logits_to_keep)

    def _runner_for(self, model):
        """What runs the forward (and what is compiled): a pre-packed copy where this engine packs, else the model."""
        return prepacked_copy(model) if self.prepacked else model

    def _eager_runner_for(self, runner):
        """What runs uncompiled beside what is compiled (a prompt, a batch's prompts, a step no graph takes): `runner`
        here; the inductor engine's runs on oneDNN."""
        return runner

    def _compile_config(self):
        """inductor's settings for this engine's compiles (which happen inside calls): set around each call, as
        torch.compile's `options=` did not reach the GEMM template choice (docs/engines.md)."""
        cpu = self.torch_compile and self.model.device.type != "cuda"
        return torch._inductor.config.patch(inductor_cpu_options(self.model)) if cpu else contextlib.nullcontext()

    @torch.inference_mode()  # a cache made under it (warm_up's) is written in place here
    def new_cache(self, max_length: int, progress: bool = True) -> StaticCache:
        rows = -(-max_length // CACHE_ROUNDING) * CACHE_ROUNDING
        if self.torch_compile:  # each size is a graph to compile: few sizes, doubling
            rows = max(COMPILED_MIN_ROWS, 1 << (rows - 1).bit_length())
        if self.torch_compile and rows in self._sized:  # the smallest compiled size that fits: reads no more
            self._cache = self._sized[rows]
        elif self.torch_compile:  # a size of its own, kept for the calls that fit; compiled now, not mid-call
            self._cache = self._sized[rows] = self._static_cache(GuardedStaticLayer, rows)
            self._compile_for(self._cache, progress)
        elif self._cache is None or self._cache.layers[0].max_cache_len < rows:
            # shapes may vary: attend over the written rows only
            self._cache = self._static_cache(PrefixStaticLayer, rows)
        self._set_length(self._cache, 0)
        return self._cache

    def _static_cache(self, layer_class, rows: int) -> StaticCache:
        """A StaticCache of `rows` rows whose layers are `layer_class`, keeping their rows in the runner's kv_dtype."""
        cache = StaticCache(config=self.model.config, max_cache_len=rows)
        cache.layers = [layer_class(rows) for _ in cache.layers]
        kept = kv_dtype(self.runner)
        for layer in cache.layers:
            layer.kept_dtype = kept
        return cache

    @staticmethod
    def _set_length(cache: StaticCache, length: int) -> None:
        """Where the next forward writes: transformers' static layers keep that count themselves, in place. Set with
        two multi-tensor kernels, not a fill per layer: a step sets it twice (verify, commit), and on a GPU those 60
        fills were most of a plain step's 111 kernel launches (docs/benchmarks/h100-step-graphs)."""
        counts = _write_positions(cache)
        if counts:
            torch._foreach_zero_(counts)
            torch._foreach_add_(counts, length)
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = length
            if isinstance(layer, PrefixStaticLayer):
                layer.length = length

    def _start_step(self, cache, candidates: Candidates, past_length: int, set_length: bool = True) -> int:
        """Check that the step's N nodes fit in `cache` and (set_length) write from past_length on. -> its rows."""
        n, rows = candidates.tokens.numel(), cache.layers[0].max_cache_len
        if past_length + n > rows:
            raise RuntimeError(f"the static cache has {rows} rows; this step needs {past_length + n}")
        if set_length:
            self._set_length(cache, past_length)
        return rows

    @torch.inference_mode()
    def prefill(self, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
        self._set_length(cache, 0)
        if prefills_in_chunks(self.eager_runner, input_ids.shape[1]):  # a sliding-window model's long prompt
            return prefill_in_chunks(self.eager_runner, cache, input_ids, feature_layers)
        return run_prefill(self.eager_runner, cache, input_ids, feature_layers)

    def prefill_row(self, cache: RowsCache, row: int, at: int, input_ids, feature_layers=()) -> PrefillOutput:
        """Into a cache of its own as a CPU's new_cache makes it, uncompiled (a compiled size would compile graphs),
        whatever this engine compiles."""
        own = self._static_cache(PrefixStaticLayer, input_ids.shape[1])
        out = self.prefill(own, input_ids, feature_layers)
        cache.place([row], own.layers, input_ids.shape[1], at)
        return out

    @torch.inference_mode()
    def verify(self, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
        """One forward over the N nodes, written at rows past_length .. past_length + N; the mask shows the past and
        the tree's ancestry (and, for torch.compile's fixed shapes, (1, 1, N, rows) hides the rows beyond)."""
        graphed = self.verify_graphs and self.verify_runner is not self.eager_runner
        rows = self._start_step(cache, candidates, past_length, set_length=not graphed)  # a graph sets it itself
        # prefix layers show attention past + N rows, as in the eager engine; fixed-size ones the whole allocation
        mask_rows = None if isinstance(cache.layers[0], PrefixStaticLayer) else rows
        try:
            if graphed:
                return self._graphed_verify(cache, candidates, past_length, tuple(feature_layers))
            with self._compile_config():
                return verify(self.verify_runner, cache, candidates, past_length, feature_layers, mask_rows)
        except Exception as err:  # noqa: BLE001 - a compiler failure must not end generation: run uncompiled
            if self.verify_runner is self.eager_runner:
                raise
            logger.warning(
                "torch.compile failed (%s: %s); the compiled engine runs uncompiled from now on",
                type(err).__name__,
                err,
            )
            self.verify_runner = self.eager_runner
            self._set_length(cache, past_length)
            return verify(self.eager_runner, cache, candidates, past_length, feature_layers, mask_rows)

    def _graphed_verify(self, cache, candidates: Candidates, past_length: int, feature_layers: tuple) -> VerifyOutput:
        """verify as one CUDA graph replay (the first call of each node count captures it): the tokens, the tree and
        the past's length go in as tensors, so nothing a step changes is baked into the graph."""
        key = (id(cache), feature_layers)
        if key not in self._graphed:
            self._graphed[key] = StepGraph(functools.partial(self.forward_from, cache, feature_layers), "the verify")
        graph = self._graphed[key]
        tree, device = candidates.tree, candidates.tokens.device
        bias = tree.attention_bias(self.runner.dtype, device)
        logits, hidden = graph(candidates.tokens, tree.depth, bias, upload_ids(past_length, device))
        return VerifyOutput(logits=logits, hidden=hidden)

    def forward_from(self, cache, feature_layers, tokens, depth, bias, past) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify over a fixed-size cache as tensor work alone: N tokens (N,), the tree's depth (N,) and bias (N, N)
        written after `past` rows (a 0-d long tensor), which also sets where the cache writes; -> logits (N, V),
        features (N, F). Calling it again with the same arguments does the same thing (a graph's warm-up runs it)."""
        counts = _write_positions(cache)
        torch._foreach_copy_(counts, [past] * len(counts))
        mask = bias_over_rows(bias, past, cache.layers[0].max_cache_len)
        positions = (past + depth)[None]
        out = forward_nodes(self.verify_runner, cache, tokens[None], positions, mask, feature_layers, fixed_width=True)
        return out.logits, out.hidden

    @torch.inference_mode()  # hands back caches made under it (their tensors are inference tensors)
    def warm_up(self, progress: bool = True, max_length: int | None = None, batches: bool = False) -> float:
        """Compile the verify graphs now for every cache a call of up to `max_length` rows (prompt + new tokens +
        tree) will use, so that neither timing nor `generate` pays for it: minutes per size on a small CPU, less
        once inductor's on-disk cache has them (a call that needs a larger cache later compiles its own as it is
        allocated). Batches run eagerly here (`batches`: nothing more to do). -> seconds spent (0 when nothing was
        compiled)."""
        if not self.torch_compile:
            return 0.0
        before = self.compile_seconds
        max_length = max_length or COMPILED_MIN_ROWS
        # each size the caches come in, up to the one max_length needs
        sizes = [COMPILED_MIN_ROWS]
        while sizes[-1] < max_length:
            sizes.append(sizes[-1] * 2)
        sizes = [rows for rows in sizes if rows not in self._sized]  # as new_cache keys them
        for rows in sizes:
            self.new_cache(rows, progress)  # allocates and compiles
        return self.compile_seconds - before

    @torch.inference_mode()
    @parses_kept()  # while compiling only: entered around every verify, it made each verify dearer
    def _compile_for(self, cache: StaticCache, progress: bool) -> None:
        self.compile_seconds += self._compile_graphs(cache, progress)

    def _compile_graphs(self, cache: StaticCache, progress: bool) -> float:
        """Run the verify forward once per graph on `cache` (a scratch prompt, then set back): one token, and two
        (every other length shares that dynamic graph; dynamo specialises a length of 1). -> seconds spent."""
        start, rows = time.perf_counter(), cache.layers[0].max_cache_len
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
        if progress:
            print(f"\rcompiled {self.label} for {rows} cached rows in {seconds:.0f} s{' ' * 70}", file=sys.stderr)
        return seconds

    @torch.inference_mode()
    def commit(self, cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
        """Rows past_length + accepted_nodes (src) -> past_length .. past_length + a (dst), in place; rows beyond are
        stale and masked out by the next verify."""
        if accepted_nodes.tolist() != list(range(accepted_nodes.numel())):  # a prefix of the rows stays where it is
            self._row_mover(cache)(upload_ids(past_length, accepted_nodes.device), accepted_nodes)
        self._set_length(cache, past_length + accepted_nodes.numel())

    def _row_mover(self, cache: StaticCache):
        """keep_rows over every layer of `cache`: on a GPU one graph per accepted length (launched one by one, its
        two kernels a tensor cost an 8B-shaped step half a verify: docs/benchmarks/h200-verify-graphs)."""
        tensors = [rows for layer in cache.layers for rows in (layer.keys, layer.values)]
        if tensors[0].device.type != "cuda":  # nothing to capture; caches come and go there
            return functools.partial(keep_rows, tensors)
        key = id(tensors[0])  # the mover holds that tensor: the id is not reused while the entry lives
        if key not in self._row_movers:
            self._row_movers[key] = row_mover(tensors)
        return self._row_movers[key]

    @torch.inference_mode()
    def truncate(self, cache, length: int) -> None:
        self._set_length(cache, length)


def _write_positions(cache: StaticCache) -> list[torch.Tensor]:
    """The device counts where a static cache's layers write next, each once (layers may share one: adding to a
    shared one twice would count twice)."""
    initialized = [layer.cumulative_length for layer in cache.layers if layer.is_initialized]
    return list({id(t): t for t in initialized}.values())
