"""Everything that runs the target: the engines behind one protocol, and what they are built from (pre-packed and
int8 weights, ahead-of-time packages, the tree-verify forward, the KV commit, the attention kernel). The rest of the
library imports this package only, never its modules; private torch and transformers names stay in here
(torch_patches names each, with the versions it was checked on).

Engines, each a class of its own:
- `eager`: transformers' DynamicCache and the model as it is; the exact reference.
- `compiled`: transformers' StaticCache over a copy of the target with pre-packed weights on a CPU; torch.compile with
  CUDA graphs on a GPU.
- `inductor`: the compiled engine with the verify forward compiled by inductor (ahead of time on a CPU).
- `inductor_onednn`: the inductor engine whose trees run a package with oneDNN's GEMMs (bf16 without AMX on a CPU).
What a step costs on each, where it was measured: docs/engines.md.
"""

from __future__ import annotations

from typing import Protocol

import torch

from medusa.runtime.aot import compiled_module
from medusa.runtime.eager import EagerEngine
from medusa.runtime.graphs import StepGraph, upload_ids
from medusa.runtime.inductor import (
    InductorEngine,
    InductorOneDNNEngine,
    onednn_batches_may_pay,
    onednn_trees_may_pay,
)
from medusa.runtime.kv_cache import RowsCache
from medusa.runtime.prepack import (
    Int8Weight,
    can_int8,
    can_prepack,
    int8_copy,
    int8_linear,
    pack,
    packed_linear,
    prepacked_copy,
    quantize_int8,
)
from medusa.runtime.quantize import QUANTIZED, dequantize_target, precision_of, quantize_target
from medusa.runtime.static import ENGINES_ATTRIBUTE, CompiledEngine, engines_set_aside
from medusa.runtime.threads import releases_openmp_pool, runs_the_target
from medusa.runtime.torch_patches import meta_nonzero_takes_all
from medusa.runtime.verify import PrefillOutput, VerifyOutput, base_features, layer_masks, verify, with_cache
from medusa.tree import Candidates

ENGINES = ("eager", "compiled", "inductor", "inductor_onednn")
# an engine whose one-token steps run another's package: plain decoding on it is that engine's (the plan's yardstick
# names the other)
ONE_TOKEN_STEPS_OF = {"inductor_onednn": "inductor"}
_ENGINE_CLASSES = {
    "eager": EagerEngine,
    "compiled": CompiledEngine,
    "inductor": InductorEngine,
    "inductor_onednn": InductorOneDNNEngine,
}

__all__ = [
    "ENGINES",
    "ONE_TOKEN_STEPS_OF",
    "CompiledEngine",
    "EagerEngine",
    "Engine",
    "InductorEngine",
    "InductorOneDNNEngine",
    "Int8Weight",
    "QUANTIZED",
    "PrefillOutput",
    "RowsCache",
    "StepGraph",
    "VerifyOutput",
    "base_features",
    "can_int8",
    "can_prepack",
    "batch_engine",
    "compile_seconds",
    "compiled_module",
    "engine_for",
    "engines_set_aside",
    "int8_copy",
    "int8_linear",
    "layer_masks",
    "make_engine",
    "meta_nonzero_takes_all",
    "onednn_batches_may_pay",
    "onednn_trees_may_pay",
    "pack",
    "packed_linear",
    "precision_of",
    "prepacked_copy",
    "quantize_int8",
    "quantize_target",
    "releases_openmp_pool",
    "runs_the_target",
    "dequantize_target",
    "verify",
    "upload_ids",
    "with_cache",
]


class Engine(Protocol):
    """How the target runs over its KV cache. Building one prepares the target (packing, compiling hooks); the decode
    loop then calls new_cache, prefill, verify and commit; warm_up compiles ahead of any timing."""

    name: str  # one of ENGINES
    compile_seconds: float  # spent compiling so far

    def new_cache(self, max_length: int):
        """A KV cache for a call of up to `max_length` rows (prompt + new tokens + a proposal's nodes)."""

    def warm_up(self, progress: bool = True, max_length: int | None = None, batches: bool = False) -> float:
        """Compile now what calls of up to `max_length` rows will run (`batches`: batches of up to that many rows
        per sequence too). -> seconds spent compiling."""

    def prefill(self, cache, input_ids: torch.Tensor, feature_layers=()) -> PrefillOutput:
        """One forward over the prompt (1, T) into `cache`."""

    def verify(self, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
        """One forward over the candidates' N tokens with their tree mask, written at rows past_length .. + N."""

    def commit(self, cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
        """Keep the accepted nodes' rows (past_length + accepted_nodes) at past_length .. + a; drop the rest."""

    def truncate(self, cache, length: int) -> None:
        """Forget every row past `length` (a verify that is not committed)."""

    def new_rows_cache(self, max_rows: int) -> RowsCache:
        """A batch's KV cache (medusa.batch) for up to `max_rows` rows per sequence."""

    def prefill_row(self, cache: RowsCache, row: int, at: int, input_ids, feature_layers=()) -> PrefillOutput:
        """One prompt (1, T) prefilled as `prefill` runs it for one sequence, into a cache of its own, its rows then
        placed at batch row `row` of `cache`, positions at .. at + T (medusa.batch: a row that prefills alone)."""

    def batch_forward(self, cache: RowsCache, ids, mask, positions, feature_layers=(), logits_to_keep=None):
        """A batch's forward over (B, n) tokens at their positions under `mask` (B, 1, n, width), each row's written
        at its own length in `cache` -> (logits (B, n or logits_to_keep, V), what heads read (B, n, F))."""


def make_engine(name: str, model, **options) -> Engine:
    if name not in _ENGINE_CLASSES:
        raise ValueError(f"unknown engine {name!r}: use one of {list(ENGINES)}")
    return _ENGINE_CLASSES[name](model, **options)


def engine_for(model, name: str) -> Engine:
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


def batch_engine(model) -> str:
    """The engine a batch runs on when the call names none: for an fp32 target on a CPU that packs weights, the
    compiled engine's pre-packed copy (half the time of aten's GEMMs, rows identical to transformers'); elsewhere the
    eager one (bf16 and int8 GEMMs packed round differently from aten's, and int8 gains nothing: docs/engines.md)."""
    fp32 = precision_of(model) == "float32"
    return "compiled" if fp32 and can_prepack(model.device, model.dtype) else "eager"
