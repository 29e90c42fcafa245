"""The inductor engine: the compiled engine's StaticCache with the verify forward compiled by inductor. On a CPU it
compiles ahead of time (medusa.runtime.aot: torch.export + AOTInductor, frozen weights and inductor's C++ GEMM
templates), one package for every cache size, once per machine, loaded by later processes in a few seconds:
torch.compile would compile again in every process there (torch_patches.INTERNALS names why). A package is paid when
the first cache is allocated (`warm_up`, or the first call), never between a call's steps. torchao's quantized weights
and CUDA go through torch.compile (CUDA graphs on a GPU). What each costs where: docs/engines.md."""

from __future__ import annotations

import logging

import torch
from transformers import StaticCache

from medusa.hardware import amx, native_bf16
from medusa.loading import base_fingerprint
from medusa.runtime import aot, static
from medusa.runtime.attention import kv_dtype
from medusa.runtime.kv_cache import RowsCache
from medusa.runtime.prepack import attention_copy, onednn_copy, plain_weights
from medusa.runtime.quantize import precision_of
from medusa.runtime.static import CompiledEngine
from medusa.runtime.verify import VerifyOutput, sliding_window, verify_inputs, window_mask
from medusa.tree import Candidates

logger = logging.getLogger(__name__)


class InductorEngine(CompiledEngine):
    name = "inductor"

    def __init__(self, model, prepack: bool | None = None):
        self.ahead_of_time = model.device.type != "cuda" and plain_weights(model)
        self.package = None  # the loaded package's runner (every cache size)
        # weight-only int8 and int4 on a CPU with AMX: one-token steps run a package of their own compiled without AMX
        # micro-kernels, whose vector kernels stream the weights faster at one row (AMX's stay for trees)
        self.one_token_without_amx = (
            self.ahead_of_time and precision_of(model) in ("int8", "int4") and amx(model.device)
        )
        self.one_token_package = None  # that package's runner
        self.batch_package = None  # a batch's package's runner (run_rows)
        self._weights: str | None = None  # the base's fingerprint, which names its packages
        super().__init__(model, torch_compile=True, prepack=prepack)
        # a batch's package (aot.run_rows) on a CPU; a sliding-window model's batch runs eagerly (its masks per layer
        # type: medusa.batch)
        self.batch_ahead_of_time = self.ahead_of_time and sliding_window(model.config) is None

    def _runner_for(self, model):
        """On a CPU, a copy of the target (parameters shared) on medusa's attention (runtime.attention): what is
        compiled; inductor packs the weights itself."""
        if model.device.type == "cpu" and not self.prepacked:
            return attention_copy(model)
        return super()._runner_for(model)

    def _eager_runner_for(self, runner):
        """On a CPU, `runner` with its linears on oneDNN (prepack.onednn_copy, the weights shared): a prompt runs
        eagerly, and aten's float32 GEMM is MKL's, which lags oneDNN's on AMD CPUs (docs/engines.md)."""
        if runner.device.type == "cpu" and not self.prepacked:
            return onednn_copy(runner)
        return super()._eager_runner_for(runner)

    @torch.inference_mode()
    def verify(self, cache, candidates: Candidates, past_length: int, feature_layers=()) -> VerifyOutput:
        rows = cache.layers[0].max_cache_len
        n = candidates.tokens.numel()
        package = self.package if self.ahead_of_time else None
        if package is None or not aot.takes(rows, past_length, n):
            return super().verify(cache, candidates, past_length, feature_layers)
        # the package writes from `past_length` (an input), not from the cache layers' own counts, which commit sets
        # (and every forward outside a package sets first): setting them here too cost a step tens of microseconds
        self._start_step(cache, candidates, past_length, set_length=False)
        # the package attends over the rows written: the mask is as wide as them
        tokens, position_ids, mask = verify_inputs(candidates, past_length, self.model.dtype, past_length + n)
        window = window_mask(self.model.config, mask, position_ids, past_length)  # None: no sliding layers
        package = self._package_for(n)
        return VerifyOutput(*aot.run(package, cache, tokens, position_ids, mask, past_length, feature_layers, window))

    def _package_for(self, tokens: int):
        """The loaded package that runs a step of `tokens` query tokens."""
        return (self.one_token_package if tokens == 1 else None) or self.package

    def warm_up(self, progress: bool = True, max_length: int | None = None, batches: bool = False) -> float:
        """As the compiled engine's; `batches`: also load (or compile) the batch package, so that the first batch
        does not pay for it."""
        seconds = super().warm_up(progress, max_length)
        if batches:
            before = self.compile_seconds
            self._load_batch_package(progress)
            seconds += self.compile_seconds - before
        return seconds

    def new_rows_cache(self, max_rows: int, progress: bool = True) -> RowsCache:
        """A batch's cache: on a CPU, of the smallest size in doubling steps that holds more than `max_rows` rows
        (aot.takes), with the batch package loaded (or compiled now: minutes once on this machine, never between
        steps), its rows kept as the package keeps them; elsewhere, or where it fails, the compiled engine's (an eager
        batch on the runner)."""
        self._load_batch_package(progress)
        if not self.batch_ahead_of_time:
            return super().new_rows_cache(max_rows)
        rows = max(static.COMPILED_MIN_ROWS, 1 << max_rows.bit_length())  # > max_rows: see aot.takes
        return RowsCache(self.model.config, rows, kv_dtype(self.runner))

    def _load_batch_package(self, progress: bool) -> None:
        """Load (or compile) the batch package once, where batches run ahead of time; a failure leaves batches to the
        compiled engine's eager batch from then on."""
        if not self.batch_ahead_of_time or self.batch_package is not None:
            return
        try:
            self.batch_package, seconds = self._load_or_compile(progress, self._batch_options(), batched=True)
            self._share_weights(self.batch_package)
            self.compile_seconds += seconds
        except Exception as err:  # noqa: BLE001 - a compiler failure must not stop generation: run uncompiled
            logger.warning(
                "compiling a batch's package failed (%s: %s); batches run uncompiled on the %s engine from now on",
                type(err).__name__,
                err,
                self.name,
            )
            self.batch_ahead_of_time = False

    def batch_forward(self, cache: RowsCache, ids, mask, positions, feature_layers=(), logits_to_keep=None):
        """Through the batch's package where it takes the step (a prefill keeping only its last logits, a step
        longer than a package takes or of more than aot.MAX_BATCH rows, runs on the runner eagerly into the same
        cache)."""
        package = self.batch_package if self.batch_ahead_of_time else None
        if (
            package is None
            or logits_to_keep is not None
            or ids.shape[0] > aot.MAX_BATCH
            or not aot.takes(cache.max_rows, max(cache.lengths), ids.shape[1])
        ):
            return super().batch_forward(cache, ids, mask, positions, feature_layers, logits_to_keep)
        return aot.run_rows(package, cache, ids, positions, mask, feature_layers)

    def _compile_graphs(self, cache: StaticCache, progress: bool) -> float:
        """Load (or compile and save) the package, which serves every cache size, as the first cache is allocated;
        torch.compile where there is none. -> seconds spent compiling (none when the package was on disk or loaded)."""
        if not self.ahead_of_time:
            return super()._compile_graphs(cache, progress)
        if self.package is not None:
            return 0.0
        try:
            self.package, seconds = self._load_or_compile(progress, static.inductor_cpu_options(self.model))
            self._share_weights(self.package)
            return seconds + self._compile_one_token(progress)
        except Exception as err:  # noqa: BLE001 - a compiler failure must not stop generation: run uncompiled
            logger.warning(
                "compiling ahead of time failed (%s: %s); the %s engine runs uncompiled from now on",
                type(err).__name__,
                err,
                self.name,
            )
            self.ahead_of_time = False
            return 0.0

    def _share_weights(self, package: aot.Package) -> None:
        """Run `package` on the weights of another package of this engine already loaded where they are the same
        (frozen alike: the single-sequence and the batch packages), so that memory holds one copy, not one each."""
        if not aot.holds_weights(static.inductor_cpu_options(self.model)):
            return  # it reads the model's own weights: nothing to share
        for other in (self.package, self.batch_package, self.one_token_package):
            if other is None or other is package:
                continue
            try:
                if package.share_weights(other):
                    return
            except Exception as err:  # noqa: BLE001 - memory only: the package runs on its own copy
                logger.warning("a package keeps its own weights (%s: %s)", type(err).__name__, err)

    def _load_or_compile(self, progress: bool, options: dict, label: str = "", **kind):
        """aot.load_or_compile of this engine's runner with `options` (`kind`: one_token=True or batched=True for
        those packages; `label` names it while it compiles, the engine's label by default). -> (runner, seconds
        spent compiling)."""
        self._weights = self._weights or base_fingerprint(self.model)
        with self._compile_config():  # as for torch.compile: the GEMM template choice reads the global
            return aot.load_or_compile(self.runner, options, self._weights, label or self.label, progress, **kind)

    def _batch_options(self) -> dict:
        """inductor's settings for a batch's package: the single sequence's."""
        return static.inductor_cpu_options(self.model)

    def _compile_one_token(self, progress: bool) -> float:
        """Load (or compile) the one-token package where this engine runs one (`one_token_without_amx`): the
        engine's settings without AMX micro-kernels. A failure leaves one-token steps to the main package. -> seconds
        spent compiling."""
        if not self.one_token_without_amx:
            return 0.0
        options = {**static.inductor_cpu_options(self.model), aot.WITHOUT_AMX: True}
        try:
            self.one_token_package, seconds = self._load_or_compile(progress, options, one_token=True)
            self._share_weights(self.one_token_package)
            return seconds
        except Exception as err:  # noqa: BLE001 - the main package still serves one-token steps
            logger.warning(
                "compiling the one-token package failed (%s: %s); one-token steps run the main package",
                type(err).__name__,
                err,
            )
            self.one_token_without_amx = False
            return 0.0


def onednn_trees_may_pay(model) -> bool:
    """Whether `InductorOneDNNEngine` is worth timing for `model`: a bf16 target compiled ahead of time on a CPU with
    native bf16 dot products (avx512_bf16) but no AMX, where inductor's template widens the weights to fp32 and a
    tree's rows each cost what arithmetic at fp32's pace costs."""
    return (
        model.device.type == "cpu"
        and plain_weights(model)
        and precision_of(model) == "bfloat16"
        and native_bf16(model.device)
        and not amx(model.device)
    )


def onednn_batches_may_pay(model) -> bool:
    """Whether a batch is worth timing on `InductorOneDNNEngine`, whose batch package runs every GEMM on aten's
    kernels: where its trees may pay (bf16), and for a float32 target compiled ahead of time on a CPU, where a batch
    of many rows is a GEMM of many rows and aten's float32 GEMM (MKL's, oneDNN's) outruns inductor's template and the
    compiled engine's eager batch (docs/engines.md, "float32 batches on aten's GEMMs")."""
    return onednn_trees_may_pay(model) or (
        model.device.type == "cpu" and plain_weights(model) and precision_of(model) == "float32"
    )


class InductorOneDNNEngine(InductorEngine):
    """The inductor engine whose steps of more than one token run a package of their own with every GEMM on aten's
    kernels, which for bf16 are oneDNN's (its weights packed when the package is frozen): on a CPU with avx512_bf16
    and no AMX, oneDNN's bf16 dot products keep a tree's cost nearly flat in its rows, where inductor's template
    widens the weights to fp32 and pays each row's arithmetic at fp32's pace. One-token steps (plain decoding, a
    step that guesses nothing) keep the template's package, the faster there. Which wins is the machine's: the plan
    times this engine beside `inductor` where it may pay (`onednn_trees_may_pay`); docs/engines.md, "bf16 trees on
    oneDNN"."""

    name = "inductor_onednn"

    def __init__(self, model, prepack: bool | None = None):
        self.trees_package = None  # the oneDNN package's runner
        super().__init__(model, prepack)

    def _package_for(self, tokens: int):
        return (self.trees_package if tokens > 1 else None) or super()._package_for(tokens)

    def _aten_options(self) -> dict:
        """The engine's settings with every GEMM on aten's kernels: its trees' package's and its batches'."""
        return {**static.inductor_cpu_options(self.model), aot.GEMM_BACKENDS: "ATEN"}

    def _batch_options(self) -> dict:
        """A batch's steps are several rows' tokens at once, a tree's case: the trees' settings."""
        return self._aten_options()

    def _compile_graphs(self, cache: StaticCache, progress: bool) -> float:
        """The template's package (for one-token steps), then the trees' (compiled once on this machine, minutes;
        a failure leaves trees to the template's package, with a warning)."""
        seconds = super()._compile_graphs(cache, progress)
        if not self.ahead_of_time or self.trees_package is not None:
            return seconds
        try:
            label = f"{self.label} (trees on oneDNN)"
            self.trees_package, more = self._load_or_compile(progress, self._aten_options(), label)
            return seconds + more
        except Exception as err:  # noqa: BLE001 - the template's package still serves trees
            logger.warning(
                "compiling the trees' oneDNN package failed (%s: %s); trees run the template's package",
                type(err).__name__,
                err,
            )
            return seconds
