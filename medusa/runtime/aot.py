"""The inductor engine's verify forward compiled ahead of time (AOTInductor): once per machine, into
`$MEDUSA_CACHE/aoti`, and loaded from there by every later process in a few seconds.

`torch.compile` compiles again in each new process on a CPU (torch bypasses its caches for a graph holding
oneDNN-packed frozen weights: minutes there). `torch.export` traces the target's public forward over a static cache
whose tensors are inputs, written in place, with the query length, the rows attended and the cache's size dynamic;
AOTInductor compiles that with the inductor engine's settings (frozen weights, C++ GEMM templates) into one package
that serves every cache size (one for single sequences, one for batches). A package holds the weights it was compiled
with, so its file name hashes every weight, the dtype, this CPU, its threads and the versions of torch, transformers
and this format (about the weights' size each; delete them freely, they are compiled again when needed; past
`$MEDUSA_AOT_CACHE_GB`, default 8, the least recently used are deleted). It returns every layer's hidden states, so
one package serves heads that read any of them (`feature_layers`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils import _pytree as pytree
from transformers import StaticCache

from medusa.fileio import atomic_file, atomic_write_text, one_at_a_time
from medusa.hardware import amx_held_back, describe
from medusa.loading import base_fingerprint, cache_root
from medusa.runtime.attention import ROW_INVARIANT_SDPA, kv_dtype
from medusa.runtime.kv_cache import KeptDtypeLayer
from medusa.runtime.quantize import precision_of
from medusa.runtime.torch_patches import (
    FP32_PREFETCH_ROWS,
    FP32_REGISTER_BLOCKS,
    HALF_PREFETCH_ROWS,
    INT8_PREFETCH_ROWS,
    micro_kernels_without_amx,
    no_gemm_choice,
    prefetching_micro_kernels,
    probe_vector_isas_meanwhile,
    wrapper_compiled_beside_kernels,
)
from medusa.runtime.verify import (
    WINDOW_BLOCK,
    base_features,
    by_layer_type,
    sliding_layers,
    sliding_window,
    with_cache,
)

logger = logging.getLogger(__name__)

AOT_FORMAT = 6  # bump when what is exported changes (2: medusa's attention, 3: the rows written, 4: kv_dtype's
# cache, 5: the cache's size dynamic, 6: a batch's rows written by index_put), so old packages are not loaded
ROW_INVARIANT_FORMAT = 4  # the same for what only w8a8 exports (attention.reduction_sdpa): 2, the values read
# where they lie; 3, fbgemm's sums as a library op; 4, sibling projections on fbgemm fused
# A package that holds no weights and reads the model's own tensors (`own_weights`): w8a8 on fbgemm, whose GEMMs are
# calls out of the package that pack the weights they are given once (docs/engines.md).
OWN_WEIGHTS_OPTIONS = {"freezing": False, "aot_inductor.package_constants_in_so": False}
DEFAULT_CACHE_GB = 8  # a few models' packages (one for single sequences and one for batches each)
STALE_EXTRACTION_S = 600  # a package's library is extracted, loaded and deleted within seconds
MAX_QUERY = 256  # the most tokens one verify forward may take (a tree's nodes)
MAX_BATCH = 64  # the most rows a batch's package takes at once (a larger batch runs on the eager runner)
MAX_ROWS = 1 << 20  # the largest cache a package takes (a larger one runs on the eager runner)
GEMM_BACKENDS = "max_autotune_gemm_backends"
# An option of ours among inductor's (so the package key carries it; taken out before inductor sees them): the package
# compiles without AMX micro-kernels (torch_patches.micro_kernels_without_amx)
WITHOUT_AMX = "medusa_without_amx"
# A small module's package (`compiled_module`): its weights held in it, no freezing (its GEMMs are calls out to
# medusa's fbgemm op or aten's kernels; what compiling removes is the eager calls between them)
MODULE_OPTIONS = {"freezing": False}


class WrittenRowsLayer(KeptDtypeLayer):
    """transformers' static layer over given tensors that hands attention only their rows `first` .. `visible` (the
    rows written, this step's included; a sliding layer's from where its window starts: verify.window_mask): a step
    costs the context it reads, not the cache's allocation. New rows are written in the given tensors' dtype
    (runtime.attention.kv_dtype); with `starts` (B,), each batch row's at its own start (a batch's rows keep their
    own lengths: kv_cache.RowsCache), else after the rows already written."""

    def __init__(self, max_cache_len: int, visible: int, starts: torch.Tensor | None = None, first: int = 0):
        super().__init__(max_cache_len=max_cache_len)
        self.visible, self.starts, self.first = visible, starts, first

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.starts is None:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
        else:
            self.write_at(self.starts, *self.kept(key_states, value_states))
            keys, values = self.keys, self.values
        return keys[:, :, self.first : self.visible], values[:, :, self.first : self.visible]


def takes(rows: int, past_length: int, query: int) -> bool:
    """Whether a package runs a step of `query` tokens after `past_length` in a cache of `rows` rows: at most MAX_QUERY
    tokens, attending over fewer rows than the whole allocation (what it was exported for), at most MAX_ROWS rows."""
    return query <= MAX_QUERY and past_length + query < rows <= MAX_ROWS


def _cache_over(
    config, keys: list[torch.Tensor], values: list[torch.Tensor], length: torch.Tensor, visible: int, window_first=0
) -> StaticCache:
    """A transformers StaticCache whose layers are the given tensors (written in place by the forward), `length`
    rows already written (a 0-d tensor; (B,): each batch row's), attention shown the first `visible` rows (a sliding
    layer's from `window_first` on)."""
    starts = length if length.dim() else None
    cache = StaticCache(config=config, max_cache_len=keys[0].shape[2])
    cache.layers = [
        WrittenRowsLayer(keys[0].shape[2], visible, starts, window_first if sliding else 0)
        for sliding in sliding_layers(config)
    ]
    for layer, k, v in zip(cache.layers, keys, values):
        layer.keys, layer.values = k, v
        if starts is None:
            layer.cumulative_length = length.clone()  # each layer advances its own count
        layer.max_batch_size, layer.num_heads, layer.head_dim = k.shape[0], k.shape[1], k.shape[3]
        layer.dtype, layer.device, layer.is_initialized = k.dtype, k.device, True
        layer.kept_dtype = k.dtype
    return cache


class VerifyStep(nn.Module):
    """What is exported: one forward of the target over N tokens with a (1, 1, N, past + N) mask, into a static cache
    given as per-layer tensors, attending over the rows written -> (logits (N, V), hidden states (layers + 1, 1, N,
    H)); a sliding-window model's sliding layers read only the last `window.shape[-1]` of those rows, under `window`
    (verify.window_mask), its other layers every row under `mask`. `batched`: B rows of N tokens each, (B, 1, N,
    visible) mask, `length` (B,) each row's start -> (logits (B, N, V), hidden states (layers + 1, B, N, H))."""

    def __init__(self, model, batched: bool = False):
        super().__init__()
        self.model, self.batched = model, batched

    def forward(
        self, input_ids, position_ids, mask, length, keys: list[torch.Tensor], values: list[torch.Tensor], window=None
    ):
        visible = mask.shape[-1]
        first = 0 if window is None else visible - window.shape[-1]
        cache = _cache_over(self.model.config, keys, values, length, visible, first)
        if window is not None:  # a sliding-window model (its batches run eagerly: InductorEngine.batch_ahead_of_time)
            mask = by_layer_type(self.model.config, mask, window)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            **with_cache(self.model, cache),
            use_cache=True,
            output_hidden_states=True,
        )
        return (out.logits if self.batched else out.logits[0]), torch.stack(out.hidden_states)


def package_path(model, options: dict, weights: str, one_token: bool = False, batched: bool = False) -> Path:
    """Where the package for `model` (its `weights`: medusa.loading.base_fingerprint) lives."""
    attention = getattr(model.config, "_attn_implementation", None)
    key = {
        "format": AOT_FORMAT,
        "weights": weights,
        "dtype": str(model.dtype),
        "inductor": options,
        "transformers": transformers.__version__,
        **describe(model.device),
        **({"one_token": True} if one_token else {}),  # the main packages keep the names they had
        # a sliding-window model's sliding layers read from their window's first row on (verify.window_mask)
        **(
            {"sliding_window": window, "window_block": WINDOW_BLOCK} if (window := sliding_window(model.config)) else {}
        ),
        **({"batched": True} if batched else {}),
        **(
            {"fp32_register_blocks": FP32_REGISTER_BLOCKS, "fp32_prefetch_rows": FP32_PREFETCH_ROWS}
            if model.dtype == torch.float32
            else {}
        ),
        **({"int8_prefetch_rows": INT8_PREFETCH_ROWS} if precision_of(model) == "int8" else {}),
        **({"half_prefetch_rows": HALF_PREFETCH_ROWS} if precision_of(model) in ("bfloat16", "float16") else {}),
        **(
            {"attention": ROW_INVARIANT_SDPA, "attention_format": ROW_INVARIANT_FORMAT}
            if attention == ROW_INVARIANT_SDPA
            else {}
        ),
    }
    return keyed_package(f"{'batch' if batched else 'verify'}{'-one-token' if one_token else ''}", key)


def keyed_package(stem: str, key: dict) -> Path:
    """The package file for `key` (everything that changes what is compiled): `stem` and a digest of the key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root() / "aoti" / f"{stem}-{digest}.pt2"


def _export(model, one_token: bool = False, batched: bool = False):
    """torch.export of VerifyStep over a cache, its size (up to MAX_ROWS rows), the query length (1 .. MAX_QUERY; one
    token only with `one_token`) and the rows attended (fewer than the cache's: `takes`) dynamic; `batched`: the rows
    of a batch too (1 .. MAX_BATCH), each written at its own start."""
    config = model.config.get_text_config()
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = kv_dtype(model) or model.dtype  # what the engine's caches keep
    # examples that are neither 0 nor 1 (export would specialise on those)
    n, past, size, rows = (1 if one_token else 2), 3, (2 if batched else 1), 16
    blank = lambda: torch.zeros((size, heads, rows, head_dim), dtype=dtype, device=model.device)  # noqa: E731
    keys = [blank() for _ in range(config.num_hidden_layers)]
    values = [blank() for _ in range(config.num_hidden_layers)]
    starts = torch.tensor([past] * size if batched else past, device=model.device)
    example = (
        torch.zeros((size, n), dtype=torch.long, device=model.device),
        torch.arange(past, past + n, device=model.device)[None].expand(size, n).contiguous(),
        torch.zeros((size, 1, n, past + n), dtype=model.dtype, device=model.device),
        starts,
        keys,
        values,
    )
    query = None if one_token else torch.export.Dim("query", min=1, max=MAX_QUERY)
    visible = torch.export.Dim("visible", min=1, max=MAX_ROWS - 1)  # see `takes`
    cache_rows = torch.export.Dim("cache_rows", min=2, max=MAX_ROWS)
    if batched:
        rows_of = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        layers = [{0: rows_of, 2: cache_rows}] * config.num_hidden_layers
        shapes = ({0: rows_of, 1: query}, {0: rows_of, 1: query}, {0: rows_of, 2: query, 3: visible}, {0: rows_of})
    else:
        layers = [{2: cache_rows}] * config.num_hidden_layers
        shapes = ({1: query}, {1: query}, {2: query, 3: visible}, None)
    shapes = (*shapes, layers, layers)
    if sliding_window(model.config) is not None and not batched:  # its sliding layers' mask over the rows they read
        example += (torch.zeros((1, 1, n, past + n - 1), dtype=model.dtype, device=model.device),)
        shapes += ({2: query, 3: torch.export.Dim("window_rows", min=1, max=MAX_ROWS - 1)},)
    return torch.export.export(VerifyStep(model, batched).eval(), example, dynamic_shapes=shapes, strict=False)


def holds_weights(options: dict) -> bool:
    """Whether a package compiled with `options` holds its weights (else it reads the model's: OWN_WEIGHTS_OPTIONS)."""
    return options.get("aot_inductor.package_constants_in_so", True) is not False


def own_weights(runner: Package, model) -> None:
    """Point a package compiled without its weights (OWN_WEIGHTS_OPTIONS) at `model`'s own parameters and buffers, by
    the names export gave them (VerifyStep's): nothing is copied, and the package follows in-place changes."""
    step = VerifyStep(model)
    named = dict(step.named_parameters(remove_duplicate=False))  # tied weights under each name
    named.update(step.named_buffers(remove_duplicate=False))
    wanted = runner.constant_names().values()
    missing = [name for name in wanted if name not in named]
    if missing:
        raise RuntimeError(f"the package reads {missing[:3]}, which the model does not have")
    runner.use_weights({name: named[name] for name in wanted})


class Package:
    """A loaded AOTInductor package (a CPU one), called as the module it was exported from. torch's container runner
    runs its shared library, extracted from the package file into a folder beside it and deleted once loaded (torch's
    own loader extracts into /tmp per process, and a killed process left hundreds of MB there); unlike that loader,
    the runner can run on weights it is given, another package's among them (`share_weights`)."""

    def __init__(self, path: Path):
        folder = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                library = next(name for name in names if name.endswith(".so"))
                for name, suffix in ((library, ".so"), (library[: -len(".so")] + ".json", ".json")):
                    if name in names:  # the json: its calls out to custom ops (fbgemm's), if any
                        with open(os.path.join(folder, f"model{suffix}"), "wb") as out, archive.open(name) as data:
                            shutil.copyfileobj(data, out, 1 << 24)
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(os.path.join(folder, "model.so"), 1)
        finally:  # the runner keeps its mapping of the library: the files go with the process, however it ends
            shutil.rmtree(folder)
        self._outputs = pytree.treespec_loads(self.runner.get_call_spec()[1])
        self.weights_of: Package | None = None  # the package whose weights this one runs on (kept alive with it)

    def __call__(self, *args):
        inputs = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        return pytree.tree_unflatten(self.runner.run(inputs), self._outputs)

    def run_flat(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The package on its inputs already flat, in the order `__call__` flattens them -> its outputs flat: a
        step's verify without pytree's walks over its 60-odd cache tensors (tens of microseconds a step, more once
        the weights the step streamed have pushed the walked objects out of the CPU's caches)."""
        return self.runner.run(inputs)

    def constant_names(self) -> dict[str, str]:
        """{the package's own name: the exported module's name} of every weight it reads."""
        return self.runner.get_constant_names_to_original_fqns()

    def share_weights(self, other: Package) -> bool:
        """Run on `other`'s weights where they equal this package's in every name, shape, layout and value (two
        packages of one model, frozen alike), and free this one's copy. Weights held as oneDNN's opaque tensors are
        not compared, nor shared; nor are a package's whose constants do not each have a name of their own (inductor
        names the activation scales of a w8a8 GEMM it lowered alike, `x_scale`, and they can be handed over only by
        name). -> whether they were shared."""
        names = self.constant_names().values()
        if len(set(names)) != len(names):
            return False
        mine, theirs = self.runner.extract_constants_map(False), other.runner.extract_constants_map(False)
        if mine.keys() != theirs.keys() or not all(
            a.layout == b.layout == torch.strided
            and (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
            and torch.equal(a, b)
            for a, b in ((mine[name], theirs[name]) for name in mine)
        ):
            return False
        self.use_weights(theirs)
        self.weights_of = other
        return True

    def use_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Run on `tensors` ({the exported module's name: tensor}, every weight the package reads; the caller keeps
        them alive) and free the package's own copy, if it held one."""
        own = {name: key for key, name in self.constant_names().items()}
        self.runner.update_constant_buffer({own[name]: tensor for name, tensor in tensors.items()}, True, True, True)
        self.runner.swap_constant_buffer()  # the weights given become the active ones: the package's own, inactive
        self.runner.free_inactive_constant_buffer()


def _ticking(message: str):
    """Print `message` with the seconds elapsed every few seconds until the returned event is set."""
    done, start = threading.Event(), time.perf_counter()

    def tick():
        while not done.wait(5.0):
            print(f"\r{message}, {time.perf_counter() - start:.0f} s", end="", file=sys.stderr, flush=True)

    threading.Thread(target=tick, daemon=True).start()
    return done


def load_or_compile(
    model,
    options: dict,
    weights: str,
    label: str = "",
    progress: bool = True,
    one_token: bool = False,
    batched: bool = False,
):
    """The AOTInductor runner of `model`'s verify forward over a cache of any size: loaded from its package, or
    compiled (minutes on a small CPU) and saved there first. `one_token`: the one-token package; `batched`: the
    batch's (run_rows). A package compiled with OWN_WEIGHTS_OPTIONS reads `model`'s own weights. -> (runner, seconds
    spent compiling)."""
    kind = "one-token steps" if one_token else "a batch's steps" if batched else "steps"
    message = f"compiling {label or 'the target'} ahead of time for {kind}"
    path = package_path(model, options, weights, one_token, batched)
    export = lambda: _export(model, one_token, batched)  # noqa: E731
    runner, seconds = load_or_build(path, export, options, message, progress, cpu=model.device.type == "cpu")
    if not holds_weights(options):
        own_weights(runner, model)
    return runner, seconds


def compiled_module(module: nn.Module, example: tuple, dynamic_shapes, name: str, label: str, progress: bool = True):
    """The AOTInductor runner of a small CPU module's forward over `example`'s shapes (`dynamic_shapes` as
    torch.export takes them), its weights held in the package: loaded, or compiled once on this machine (seconds;
    `label` names it meanwhile) into a package named `name`. For what proposes (the heads' context read and path
    heads, the EAGLE-3 draft's step). The package is keyed by every weight, the kinds of layer that compute with them
    (int8_copy's layers keep their int8 weights beside the float parameters they share), the example's inputs and what
    the exported forward computes (`program_digest`): a change of code that changes what the module computes or
    returns compiles a package of its own, with no version for anyone to remember to bump."""
    module.eval()  # as it is exported (before its settings are read)
    key = {
        "format": AOT_FORMAT,
        "module": name,
        "inputs": [[list(x.shape), str(x.dtype)] for x in example],
        "weights": base_fingerprint(module),
        "layers": sorted({type(m).__qualname__ for m in module.modules()}),
        "transformers": transformers.__version__,
        **describe("cpu"),
    }

    def export():
        with torch.inference_mode(False), torch.no_grad():
            return torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)

    # exporting costs a few tenths of a second a module, at every load: the digest is kept beside the packages under
    # what the program is made from (the code, the layers' settings), and exported again only when that changes
    code = source_digest(module)
    memo = keyed_package(name, {**key, "code": code, "settings": settings(module)}).with_suffix(".program")
    program = None
    try:
        digest = memo.read_text() if code is not None else None
    except OSError:
        digest = None
    if digest is None:
        program = export()
        digest = program_digest(program)
        if code is not None:
            atomic_write_text(memo, digest)
    path = keyed_package(name, {**key, "program": digest})
    build = (lambda: program) if program is not None else export
    return load_or_build(path, build, MODULE_OPTIONS, f"compiling {label} ahead of time", progress, cpu=True)[0]


def program_digest(program: torch.export.ExportedProgram) -> str:
    """A digest of what an exported program computes: its graph's code, without the comments that name source files
    and lines, and the ranges of its dynamic sizes."""
    code = "\n".join(line for line in program.graph_module.code.splitlines() if not line.strip().startswith("#"))
    ranges = sorted(f"{symbol}: {bounds}" for symbol, bounds in program.range_constraints.items())
    return hashlib.sha256("\n".join([code, *ranges]).encode()).hexdigest()


def source_digest(module: nn.Module) -> str | None:
    """A digest of the Python code `module` runs as far as files tell: medusa's own and the files defining its layers'
    classes (another package's code beyond those is keyed by its version). None where a class has no file to read
    (defined in a notebook, say)."""
    medusa_root = Path(__file__).resolve().parents[1]
    try:
        files = {Path(inspect.getfile(type(layer))).resolve() for layer in module.modules()}
    except (TypeError, OSError):
        return None
    if not all(file.is_file() for file in files):
        return None
    return _files_digest(tuple(sorted(files | set(medusa_root.rglob("*.py")))))


@functools.lru_cache(maxsize=8)
def _files_digest(files: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def settings(module: nn.Module) -> dict:
    """Every layer's attributes that can steer its forward without being a weight: numbers, strings, flags, configs,
    and the shapes of tensors held outside its parameters (as DraftStep's `every_row` picks what it returns)."""
    found = {}
    for prefix, layer in module.named_modules():
        for attribute, value in vars(layer).items():
            if attribute.startswith("_"):
                continue
            if isinstance(value, transformers.PretrainedConfig):
                value = value.to_dict()
            elif isinstance(value, torch.Tensor):
                value = [list(value.shape), str(value.dtype)]
            found[f"{prefix}.{attribute}"] = json.loads(json.dumps(value, default=lambda _: None))
    return found


def load_or_build(path: Path, export, options: dict, message: str, progress: bool, cpu: bool):
    """The runner in the package at `path`, or, when there is none, `export()`'s program compiled with `options` into
    it first (`message` says so while it runs). -> (runner, seconds spent compiling)."""
    seen = _version(path)
    runner = _load(path) if seen else None
    seconds = 0.0
    if runner is None:
        # another process compiling the same package: wait for it (minutes of both cores each, else), load its result
        with one_at_a_time(path.with_name(f".{path.name}.lock"), f"compiling {path.name}"):
            runner = _load(path) if _version(path) not in (None, seen) else None
            if runner is None:
                runner, seconds = _compile(export, options, path, message, progress, cpu)
    return runner, seconds


def _version(path: Path):
    """Which file is at `path` (None: none), to tell a package another process wrote from the one found before."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _load(path: Path):
    """The runner in the package at `path`; None when it is unreadable (a warning: it is compiled again)."""
    try:
        runner = Package(path)
    except Exception as err:  # noqa: BLE001 - any unreadable package is compiled again
        logger.warning("compiled package %s is unreadable (%s: %s); compiling it again", path, type(err).__name__, err)
        return None
    _mark_used(path)
    return runner


def _mark_used(path: Path) -> None:
    """Set the package's access time (mounts often skip that on reads), which `prune` keeps the newest of; the
    modification time stays, since `_version` tells packages apart by it."""
    try:
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
    except OSError:  # a read-only cache or one pruned meanwhile: only the order of pruning suffers
        pass


def cache_limit_bytes() -> int:
    """How much the packages may take in all: `$MEDUSA_AOT_CACHE_GB` (default 8)."""
    value = os.environ.get("MEDUSA_AOT_CACHE_GB", str(DEFAULT_CACHE_GB))
    try:
        gigabytes = float(value)
    except ValueError:
        raise ValueError(
            f"MEDUSA_AOT_CACHE_GB={value!r} is not a number of GB; set it to e.g. 8, or unset it"
        ) from None
    return int(gigabytes * 2**30)


def prune(keep: Path) -> list[Path]:
    """Delete the least recently used packages beside `keep` until they and it fit in `cache_limit_bytes()`: each
    version of torch, transformers, the weights or this format compiles new packages of hundreds of MB, and the
    old ones are never read again. -> the packages deleted."""
    limit, deleted = cache_limit_bytes(), []
    for folder in keep.parent.glob(".*.pt2.*"):  # a library extracted by a process killed while loading it (Package)
        with contextlib.suppress(OSError):
            if folder.is_dir() and time.time() - folder.stat().st_mtime > STALE_EXTRACTION_S:
                shutil.rmtree(folder)
    others = []
    for package in keep.parent.glob("*.pt2"):
        try:
            others.append((package.stat(), package))
        except FileNotFoundError:  # another process pruned it meanwhile
            continue
    total = keep.stat().st_size
    for stat, package in sorted(others, key=lambda item: item[0].st_atime_ns, reverse=True):
        if package == keep:
            continue
        total += stat.st_size
        if total > limit:
            package.unlink(missing_ok=True)
            package.with_name(f".{package.name}.lock").unlink(missing_ok=True)
            deleted.append(package)
    if deleted:
        logger.warning(
            "deleted %d compiled packages not used lately from %s (over MEDUSA_AOT_CACHE_GB)", len(deleted), keep.parent
        )
    return deleted


def _compile(export, options: dict, path: Path, message: str, progress: bool, cpu: bool):
    start = time.perf_counter()
    message = f"{message} (AOTInductor, once on this machine; {path.parent})"
    done = _ticking(message) if progress else None
    if cpu:
        probe_vector_isas_meanwhile()
    try:
        with torch.inference_mode(False), torch.no_grad():
            program = export()
            with atomic_file(path, suffix=".pt2") as tmp:  # AOTInductor wants the suffix; a killed compile leaves none
                compile_package(program, tmp, options)
    finally:
        if done is not None:
            done.set()
    seconds = time.perf_counter() - start
    if progress:
        print(f"\r{message}: {seconds:.0f} s{' ' * 20}", file=sys.stderr)
    prune(keep=path)
    return Package(path), seconds


# torch's deprecations raised inside its own code as inductor compiles (torch 2.13: copying the graph's treespecs):
# nothing a user of medusa could change, printed at every first compile
TORCH_INTERNAL_WARNINGS = ((FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),)


def compile_package(program, path: Path, options: dict) -> None:
    """AOTInductor-compile `program` into the package file `path`. max-autotune would time each GEMM shape's C++
    template against aten's kernel (seconds of compiling per shape on a small CPU), and the template won every
    SmolLM2 shape, so the template alone is tried first; a graph with a GEMM it cannot take (two activations, say:
    no choice left) is compiled again with aten's kernels among the choices. `options[WITHOUT_AMX]`: without AMX
    micro-kernels, as everywhere the environment holds AMX back (hardware.amx_held_back)."""
    without_amx = options.get(WITHOUT_AMX, False) or amx_held_back()
    options = {key: value for key, value in options.items() if key != WITHOUT_AMX}
    template_only = {**options, GEMM_BACKENDS: "CPP"} if "CPP" in options.get(GEMM_BACKENDS, "") else None
    for settings in filter(None, (template_only, options)):
        try:
            # a copy of the settings: AOTInductor adds its own keys to the dict given
            with (
                warnings.catch_warnings(),
                torch._inductor.config.patch(settings),
                wrapper_compiled_beside_kernels(),
                prefetching_micro_kernels(),
                micro_kernels_without_amx() if without_amx else contextlib.nullcontext(),
            ):
                for category, message in TORCH_INTERNAL_WARNINGS:
                    warnings.filterwarnings("ignore", message, category)
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(path), inductor_configs=dict(settings)
                )
            return
        except Exception as err:
            if settings is options or not no_gemm_choice(err):
                raise
            logger.info("a GEMM has no C++ template; compiling again with aten's kernels among the choices")


def contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inputs as a package reads them: with the strides it was compiled for (contiguous ones), unchecked, so a
    slice of a larger tensor (a step's columns of a longer mask, say) would be read wrongly, silently."""
    return tuple(tensor.contiguous() for tensor in tensors)


def run(runner, cache: StaticCache, input_ids, position_ids, mask, past_length: int, feature_layers=(), window=None):
    """One verify forward through a loaded package, the cache's rows past_length .. + N written in place ->
    (logits (N, V), what the heads read (N, F): base_features). `window`: a sliding-window model's
    verify.window_mask."""
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    length = torch.tensor(past_length, device=input_ids.device)
    input_ids, position_ids, mask = contiguous(input_ids, position_ids, mask)
    windows = [] if window is None else [window.contiguous()]
    # the exported forward's (input_ids, position_ids, mask, length, keys, values[, window]) flat, as __call__ would
    # flatten them; it returns (logits, every layer's hidden states stacked)
    logits, hidden = runner.run_flat([input_ids, position_ids, mask, length, *keys, *values, *windows])
    return logits, base_features(hidden, feature_layers)[0]


def run_rows(runner, cache, ids, position_ids, mask, feature_layers=()):
    """A batch's forward (B, n) through its package (load_or_compile's `batched`), each row's tokens written at its
    own length in a kv_cache.RowsCache, attention over the mask's width -> (logits (B, n, V), what the heads read
    (B, n, F): base_features)."""
    keys = [layer.keys for layer in cache.cache.layers]
    values = [layer.values for layer in cache.cache.layers]
    starts = torch.tensor(cache.lengths, device=ids.device)
    ids, position_ids, mask = contiguous(ids, position_ids, mask)
    logits, hidden = runner.run_flat([ids, position_ids, mask, starts, *keys, *values])  # as `run`
    return logits, base_features(hidden, feature_layers)
