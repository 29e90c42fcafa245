"""Heads on disk, in every layout medusa reads or writes. The one place that opens heads files.

medusa's own (native), written by `save_heads` and read by `load_heads`:
    medusa_config.json          MedusaConfig (format_version, base_model_name_or_path, tree, ...)
    medusa_heads.safetensors    the heads' state dict; shared-projection heads store only their blocks
    adapter_config.json + adapter_model.safetensors   Medusa-2 only: a LoRA adapter merged into the base
Official Medusa (FasterDecoding), also read by TGI and TensorRT-LLM:
    config.json                 medusa_num_heads, medusa_num_layers, base_model_name_or_path (+ hidden_size, vocab_size)
    medusa_lm_head.safetensors  {head}.{layer}.linear.weight (H, H), {head}.{layer}.linear.bias (H,),
                                {head}.{num_layers}.weight (V, H): the head's projection
    medusa_lm_head.pt           the same tensors, torch.save'd: all the official `medusa-llm` package reads. Written
                                for it, never read here
vLLM (`vllm/transformers_utils/configs/medusa.py`, `vllm/model_executor/models/medusa.py`):
    config.json                 model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size,
                                num_heads, num_hidden_layers, medusa_fc_bias, truncated_vocab_size
    model.safetensors           blocks.{head}.layers.{layer}.weight / .bias, lm_heads.{head}.weight (V, H),
                                and token_map (V',) when candidates come from a vocabulary subset

The foreign layouts give every head a full (V, H) projection, so heads that share the base `lm_head` export K copies
of it. Imported heads therefore always have `projection="own"`. A vocabulary subset (MedusaConfig.vocab_subset_size)
maps to vLLM's token_map + truncated_vocab_size; the official layout has none, so engines reading it rank the full
vocabulary. Pickles (`medusa_lm_head.pt`, `adapter_model.bin`) are never read (loading one can run code).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa.config import CONFIG_NAME, WEIGHTS_NAME, MedusaConfig
from medusa.eagle3_io import is_eagle3
from medusa.fileio import atomic_write_text, check_out_dir, write_directory
from medusa.heads import MedusaHeads, storage_state
from medusa.hub import EMBEDDED_PREFIX, download, embedded_heads, is_repo_id
from medusa.loading import base_hub_id, load_base

logger = logging.getLogger(__name__)

FORMATS = ("medusa", "vllm")  # "medusa": the official Medusa / TGI / TensorRT-LLM layout
FOREIGN_CONFIG = "config.json"
OFFICIAL_WEIGHTS = "medusa_lm_head.safetensors"
OFFICIAL_PICKLE = "medusa_lm_head.pt"
VLLM_WEIGHTS = "model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"  # Medusa-2: a LoRA adapter of the base, saved by peft beside the heads
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_OFFICIAL_PREFIX = "medusa_head."  # some conversions keep the official module name in front of every key
_VLLM_PREFIX = "medusa_heads."  # vLLM strips this prefix when it loads, so accept it too

# The small files that say which layout a Hub repo holds: medusa's own config, or the config.json of an official
# Medusa, vLLM or EAGLE-3 export (and of any base model).
LAYOUT_FILES = [CONFIG_NAME, FOREIGN_CONFIG]
# What a heads repo holds, in every layout load_heads reads (native, Medusa-2 adapter, official, vLLM) and its card.
HEADS_FILES = ["*.json", "*.safetensors", "README.md"]

_PICKLE_HELP = (
    "medusa never unpickles (loading a pickle can run arbitrary code). Convert it once, in an environment you "
    'trust, with:\n  python -c "import torch; from safetensors.torch import save_file; '
    "sd = torch.load('{pt}', map_location='cpu', weights_only=True); "
    "save_file({{k: v.contiguous() for k, v in sd.items()}}, '{st}', metadata={{'format': 'pt'}})\""
)


# ---------------------------------------------------------------------------------------------- native
def save_heads(
    heads: MedusaHeads, directory: Path, tree=None, extra: dict | None = None, dtype: torch.dtype | None = None
) -> None:
    """Write config + safetensors into an existing directory. Shared-projection heads save only their blocks.

    `dtype` (e.g. bfloat16) stores the weights in that precision; loading casts them to the base's dtype.
    """
    config = heads.config
    if tree is not None:
        config.tree = [list(p) for p in tree]
    if extra:
        config.extra = {**config.extra, **extra}
    state = storage_state(heads.state_dict(), dtype)
    save_file(
        state,
        str(directory / WEIGHTS_NAME),
        metadata={"format": "pt", "medusa_format_version": str(config.format_version)},
    )
    config.save(directory)


def load_heads_weights(heads: MedusaHeads, path: Path) -> None:
    """Load safetensors weights into `heads`, naming any missing, unexpected or mis-shaped tensor."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a heads directory needs {WEIGHTS_NAME} beside {CONFIG_NAME}")
    state, config = _read_safetensors(path), heads.config
    expected = heads.state_dict()
    what = f"{config.num_heads} heads x {config.num_layers} layers, projection={config.projection!r}"
    _check_keys(state, set(expected), path, what)
    _check_shapes(state, expected, path, config)
    heads.load_state_dict(state)


def has_adapter(directory: Path) -> bool:
    """Whether a Medusa-2 LoRA adapter lies beside the heads (see `merge_adapter`); a pickled one is refused."""
    if not (directory / ADAPTER_CONFIG).is_file():
        return False
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise ValueError(
            f"{directory} holds a Medusa-2 adapter without {ADAPTER_WEIGHTS} (a pickled adapter_model.bin is "
            "never loaded): convert it once where you trust the file, e.g. `from safetensors.torch import "
            "save_file; save_file(torch.load('adapter_model.bin', weights_only=True), "
            "'adapter_model.safetensors')`"
        )
    return True


def merge_adapter(base, directory: Path):
    """The base with the Medusa-2 LoRA adapter saved in `directory` merged into its weights."""
    from peft import PeftModel  # an optional dependency (medusa-spec[train]): only Medusa-2 heads need it

    return PeftModel.from_pretrained(base, str(directory), use_safetensors=True).merge_and_unload().eval()


def adapter_files(directory: Path) -> dict[str, bytes]:
    """The Medusa-2 adapter's files as they lie beside the heads (kept so a re-save carries the adapter on)."""
    return {name: (directory / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}


CARD_NAME = "README.md"


def model_card(config: MedusaConfig, datasets: list[str] = (), location: str | None = None) -> str:
    """A model card for trained heads: YAML front matter the Hub reads (base_model as a Hub id, library_name, tags,
    datasets, metrics) from the config and the provenance training records in `config.extra`, then what the heads are
    and how to load them. `location`: where users load them from (a Hub repo id, or a directory), which then holds
    transformers' `custom_generate` hook too (`MedusaModel.save_pretrained` and `push_to_hub` write both)."""
    from huggingface_hub import ModelCardData

    training = config.extra.get("training", {})
    evaluation = {k: v for k, v in config.extra.get("eval", {}).items() if isinstance(v, dict)}
    base, method = config.base_model_name_or_path, training.get("method", "medusa-1")
    hub_id = base_hub_id(base)  # None for a local directory or GGUF file, which the Hub cannot link to
    data = ModelCardData(
        base_model=hub_id,
        library_name="medusa",
        datasets=list(datasets) or None,
        tags=["medusa", "speculative-decoding", method],
        metrics=["accuracy"] if evaluation else None,
    )
    rows = "\n".join(
        f"| {head} | " + " | ".join(f"{values.get(f'top{j}', float('nan')):.3f}" for j in (1, 5)) + " |"
        for head, values in sorted(evaluation.items())
    )
    facts = ", ".join(
        f"{key} {value}"
        for key, value in training.items()
        if key in ("steps", "epochs", "train_response_tokens", "wall_time_s", "processes", "mixed_precision")
    )
    target = (f"`{base}`" + (f" at revision `{config.revision}`" if config.revision else "")) if base else "their base"
    where = f'"{location}"' if location else "<this repo or directory>"
    # heads load onto the base they name, unless only this machine can find it
    load = f"MedusaModel.from_pretrained({where}" + (")" if hub_id else ', base="<base model>")')
    hook = (  # save_pretrained and push_to_hub write transformers' hook beside the heads; training does not
        f'With transformers alone, on the base model: `base.generate(**inputs, custom_generate="{location}", '
        "trust_remote_code=True)` (needs `pip install medusa-spec`).\n\n"
        if location
        else ""
    )
    return (
        f"---\n{data.to_yaml()}\n---\n\n# Medusa heads{f' for {base}' if base else ''}\n\n"
        f"{config.num_heads} heads ({method}) that propose the next tokens of {target} for lossless speculative "
        "decoding (the base verifies every token) with the medusa library:\n\n"
        f"```python\nfrom medusa import MedusaModel\n\nmodel = {load}\n```\n\n"
        + hook
        + (f"Training: {facts}.\n\n" if facts else "")
        + (
            f"Held-out accuracy (top-1 / top-5 per head):\n\n| head | top-1 | top-5 |\n|---|---|---|\n{rows}\n"
            if rows
            else ""
        )
    )


def resolve_heads(
    reference,
    revision: str | None = None,
    *,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path:
    """A heads directory, a Hub repo id or `embedded:<name>` -> the local directory holding its files. A repo's config
    files come first: its weights follow (and stay cached) only when those declare heads, so a base model's id costs
    no download. `token`, `cache_dir` and `local_files_only` go to huggingface_hub with a repo id."""
    if str(reference).startswith(EMBEDDED_PREFIX):
        return embedded_heads(str(reference).removeprefix(EMBEDDED_PREFIX), revision)
    if not is_repo_id(reference):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a Hub repo id, and {str(reference)!r} is a local path")
        return Path(reference)
    hub = {"revision": revision, "token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
    check_heads_repo(download(str(reference), LAYOUT_FILES, **hub), str(reference))
    return download(str(reference), HEADS_FILES, **hub)


def check_heads_repo(folder: Path, repo_id: str) -> None:
    """Raise unless the config files fetched into `folder` declare heads in a layout load_heads reads (native,
    official Medusa, vLLM), naming what `repo_id` holds instead (a base model, an EAGLE-3 draft) and how to load it."""
    if (folder / CONFIG_NAME).is_file() or foreign_layout(folder) is not None:
        return
    if is_eagle3(folder):
        raise ValueError(
            f"{repo_id!r} holds an EAGLE-3 draft, not Medusa heads: load it with MedusaModel.from_draft_model("
            f"<its target>, draft=huggingface_hub.snapshot_download({repo_id!r}))"
        )
    path = folder / FOREIGN_CONFIG
    config = _read_json(path) if path.is_file() else {}
    kind = config.get("model_type") or config.get("architectures")
    if kind:
        raise ValueError(
            f"{repo_id!r} is a base model (its {FOREIGN_CONFIG} declares {kind!r}), not Medusa heads; only its "
            f"config was downloaded. For untrained heads on it: MedusaModel.from_base({repo_id!r}); for trained heads "
            f"on it: MedusaModel.from_pretrained(<heads>, base={repo_id!r})"
        )
    raise FileNotFoundError(
        f"{repo_id!r} holds no Medusa heads: expected {CONFIG_NAME} (medusa), or {FOREIGN_CONFIG} with "
        "medusa_num_heads (official Medusa) or model_type 'medusa' (vLLM)"
    )


def load_heads(directory: str | os.PathLike) -> MedusaHeads:
    """Heads from a directory in any layout: native (medusa_config.json), official Medusa or vLLM."""
    directory = Path(directory)
    if (directory / CONFIG_NAME).is_file():
        heads = MedusaHeads(MedusaConfig.load(directory))
        load_heads_weights(heads, directory / WEIGHTS_NAME)
        return heads
    if foreign_layout(directory) is not None:
        return import_heads(directory)
    raise FileNotFoundError(
        f"{directory / CONFIG_NAME} is missing: not a medusa heads directory (expected {CONFIG_NAME} + "
        f"{WEIGHTS_NAME}), nor an official Medusa or vLLM export ({FOREIGN_CONFIG} with medusa_num_heads or "
        f"model_type 'medusa', beside {OFFICIAL_WEIGHTS} or *.safetensors)"
    )


# ---------------------------------------------------------------------------------------------- export
def projection_weights(heads: MedusaHeads, lm_head_weight: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The (V, H) projection of each of the K heads: their own, or `lm_head_weight` (the base's) when shared."""
    config = heads.config
    if heads.projections is not None:
        return [p.weight for p in heads.projections]
    if lm_head_weight is None:
        raise ValueError(
            "these heads share the base model's lm_head, and the export layouts need a full projection per head: "
            "pass the base lm_head weight (export_model(model, ...) or --base <base model>)"
        )
    if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"base lm_head weight has shape {tuple(lm_head_weight.shape)}, the heads need "
            f"({config.vocab_size}, {config.hidden_size}): pass the base model the heads were trained on"
        )
    return [lm_head_weight] * config.num_heads


def official_state_dict(heads: MedusaHeads, lm_head_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Heads -> official Medusa tensors: `{h}.{layer}.linear.weight/bias` (H, H)/(H,), `{h}.{L}.weight` (V, H)."""
    num_layers = heads.config.num_layers
    state = {}
    for h, (blocks, proj) in enumerate(zip(heads.blocks, projection_weights(heads, lm_head_weight))):
        for layer, block in enumerate(blocks):
            state[f"{h}.{layer}.linear.weight"] = block.linear.weight
            state[f"{h}.{layer}.linear.bias"] = block.linear.bias
        state[f"{h}.{num_layers}.weight"] = proj
    return state


def vllm_state_dict(heads: MedusaHeads, lm_head_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Heads -> vLLM tensors: `blocks.{h}.layers.{layer}.weight/bias` (H, H)/(H,), `lm_heads.{h}.weight` (V, H)."""
    state = {}
    for h, (blocks, proj) in enumerate(zip(heads.blocks, projection_weights(heads, lm_head_weight))):
        for layer, block in enumerate(blocks):
            state[f"blocks.{h}.layers.{layer}.weight"] = block.linear.weight
            state[f"blocks.{h}.layers.{layer}.bias"] = block.linear.bias
        state[f"lm_heads.{h}.weight"] = proj
    subset = getattr(heads, "vocab_subset", None)
    if subset is not None:  # vLLM slices the full lm_heads to these rows itself
        state["token_map"] = subset
    return state


def official_config(config: MedusaConfig, base_model_name_or_path: str | None = None) -> dict:
    return {
        "base_model_name_or_path": base_model_name_or_path or config.base_model_name_or_path,
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


def vllm_config(config: MedusaConfig, base_model_name_or_path: str | None = None) -> dict:
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "truncated_vocab_size": config.vocab_subset_size or config.vocab_size,  # < vocab_size: token_map rows only
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": True,  # our residual blocks always carry a bias
        # vLLM versions that know this flag keep one lm_head for all heads (less GPU memory); older ones load the
        # K identical copies we write anyway.
        "original_lm_head": config.projection == "shared",
        "base_model_name_or_path": base_model_name_or_path or config.base_model_name_or_path,
    }


EXPORTABLE_FLAGS = (
    "--heads.context_window 0 --heads.feature_layers '[]' --heads.condition_on_next_token false "
    "--heads.condition_on_path false"
)


def check_exportable(config: MedusaConfig) -> None:
    """Raise naming every input of these heads that the foreign layouts (plain Medusa-1 heads) cannot express."""
    inputs = []
    if config.context_window:
        inputs.append(f"a context layer over the last {config.context_window} positions (context_window)")
    if config.feature_layers:
        inputs.append(f"the hidden states of layers {config.feature_layers} (feature_layers)")
    if config.condition_on_next_token:
        inputs.append("the next token's embedding (condition_on_next_token)")
    if config.condition_on_path:
        inputs.append("for head k, the k path tokens after it (condition_on_path)")
    if inputs:
        raise ValueError(
            "these heads read " + "; ".join(inputs) + ", which the official Medusa, TGI, TensorRT-LLM and vLLM Medusa "
            "layouts cannot express (they hold plain Medusa-1 heads over the last hidden state): serve them with "
            f"medusa, or train exportable heads with {EXPORTABLE_FLAGS}"
        )


def export_heads(
    heads: MedusaHeads,
    out_dir: str | os.PathLike,
    format: str,
    *,
    lm_head_weight: torch.Tensor | None = None,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `heads` in another engine's layout (`format` in FORMATS) into `out_dir`, atomically.

    `lm_head_weight` (V, H): the base model's output projection, needed when the heads share it.
    `dtype`: cast the weights (e.g. torch.float16 for serving; token ids stay integers); default: the heads' own dtype.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: use one of {FORMATS}")
    config = heads.config
    check_exportable(config)
    check_out_dir(Path(out_dir), overwrite)
    if format == "medusa" and config.vocab_subset_size:
        logger.warning(
            "the official layout cannot carry the %d-token candidate subset: engines will rank the full "
            "vocabulary (vLLM's layout keeps it as token_map)",
            config.vocab_subset_size,
        )
    if config.copy_ngram:
        logger.warning(
            "copy_ngram %d is a medusa ranking rule, not weights: the exported heads guess without it (vLLM "
            "and TGI have n-gram speculators of their own)",
            config.copy_ngram,
        )
    if format == "medusa" and config.num_layers > 1:
        logger.warning(
            "the official Medusa code repeats one ResBlock instance per head, so it ties the %d layers "
            "exported here; TGI and vLLM build distinct layers",
            config.num_layers,
        )
    base_name = base_model_name_or_path or config.base_model_name_or_path
    if base_name is None or str(base_name).startswith("embedded:"):
        logger.warning(
            "config.json names base %r, which other engines cannot resolve: pass the Hub id or path "
            "of the base model (base_model_name_or_path / --base-name)",
            base_name,
        )
    if format == "medusa":
        state, cfg, weights_name = (
            official_state_dict(heads, lm_head_weight),
            official_config(config, base_name),
            OFFICIAL_WEIGHTS,
        )
    else:
        state, cfg, weights_name = vllm_state_dict(heads, lm_head_weight), vllm_config(config, base_name), VLLM_WEIGHTS
    params = list(heads.parameters())
    dtype = dtype or (params[0].dtype if params else None)  # keep the heads' dtype unless told
    state = storage_state(state, dtype)
    seen = set()
    for k, v in state.items():  # safetensors refuses tensors that share memory (the K copies of a shared lm_head)
        if v.data_ptr() in seen:
            state[k] = v.clone()
        seen.add(state[k].data_ptr())

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / weights_name), metadata={"format": "pt"})
        if format == "medusa":  # the official FasterDecoding loader reads only this torch.save file (we never read it)
            torch.save(state, tmp / OFFICIAL_PICKLE)
        atomic_write_text(tmp / FOREIGN_CONFIG, json.dumps(cfg, indent=2))

    return _write_directory(Path(out_dir), write, overwrite)


def export_model(model, out_dir: str | os.PathLike, format: str, **kwargs) -> Path:
    """Export a loaded `MedusaModel`'s heads; a shared projection is copied from its base `lm_head`."""
    lm_head = model.base.get_output_embeddings()
    if model.heads.projections is None:
        _check_no_bias(lm_head)
    return export_heads(model.heads, out_dir, format, lm_head_weight=lm_head.weight, **kwargs)


def export_directory(
    heads_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str,
    *,
    base=None,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a heads directory (native, official or vLLM layout) to `format` in `out_dir`.

    The base model (`base`, else the one the heads name) is loaded only when the heads share its lm_head.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: use one of {FORMATS}")
    heads_dir, out_dir = resolve_heads(heads_dir), Path(out_dir)  # a directory, Hub id or embedded:<name>
    if out_dir.resolve() == heads_dir.resolve():
        raise ValueError(f"export into a different directory than the source ({heads_dir})")
    check_out_dir(out_dir, overwrite)  # before the (possibly slow) base model load
    heads = load_heads(heads_dir)
    check_exportable(heads.config)  # before the base model load
    if (heads_dir / "adapter_config.json").is_file():
        logger.warning(
            "%s carries a LoRA adapter (Medusa-2): other engines need the merged base too; save it with "
            "MedusaModel.from_pretrained(dir).base.save_pretrained(path) and pass --base-name path",
            heads_dir,
        )
    lm_head_weight = None
    if heads.projections is None:
        source = base if base is not None else heads.config.base_model_name_or_path
        logger.warning("heads share the base lm_head: loading base %r to copy it into every head", source)
        model, _ = load_base(source)
        lm_head = model.get_output_embeddings()
        _check_no_bias(lm_head)
        lm_head_weight = lm_head.weight
    if base_model_name_or_path is None and isinstance(base, (str, os.PathLike)):
        base_model_name_or_path = str(base)
    return export_heads(
        heads,
        out_dir,
        format,
        lm_head_weight=lm_head_weight,
        base_model_name_or_path=base_model_name_or_path,
        dtype=dtype,
        overwrite=overwrite,
    )


def _check_no_bias(lm_head) -> None:
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError(
            "the base lm_head has a bias, which the official and vLLM layouts cannot carry: "
            "these heads cannot be exported with a shared projection"
        )


def _write_directory(out_dir: Path, write, overwrite: bool) -> Path:
    """Write an export atomically; another layout's leftovers would mislead foreign_layout, so they go."""
    check_out_dir(out_dir, overwrite)
    return write_directory(out_dir, write, stale=(OFFICIAL_WEIGHTS, OFFICIAL_PICKLE, VLLM_WEIGHTS))


# ---------------------------------------------------------------------------------------------- import
def foreign_layout(directory: str | os.PathLike) -> str | None:
    """Which foreign layout `directory` holds: "medusa" (official), "vllm", or None (e.g. native heads)."""
    directory = Path(directory)
    if (directory / OFFICIAL_WEIGHTS).is_file() or (directory / OFFICIAL_PICKLE).is_file():
        return "medusa"
    if not (directory / FOREIGN_CONFIG).is_file():
        return None
    cfg = _read_json(directory / FOREIGN_CONFIG)
    if "medusa_num_heads" in cfg:
        return "medusa"
    if cfg.get("model_type") == "medusa":
        return "vllm"
    return None


def import_heads(directory: str | os.PathLike) -> MedusaHeads:
    """Heads (projection "own") from an official Medusa or vLLM directory; raises naming what is wrong."""
    directory = Path(directory)
    layout = foreign_layout(directory)
    if layout == "medusa":
        return _import_official(directory)
    if layout == "vllm":
        return _import_vllm(directory)
    raise FileNotFoundError(
        f"{directory} is not a heads directory: expected {CONFIG_NAME} + {WEIGHTS_NAME} (medusa), "
        f"{FOREIGN_CONFIG} with medusa_num_heads + {OFFICIAL_WEIGHTS} (official Medusa), "
        f"or {FOREIGN_CONFIG} with model_type 'medusa' + *.safetensors (vLLM)"
    )


def _import_official(directory: Path) -> MedusaHeads:
    weights = directory / OFFICIAL_WEIGHTS
    if not weights.is_file():
        pt = directory / OFFICIAL_PICKLE
        if pt.is_file():
            raise ValueError(
                f"{pt} is a pickle and {weights.name} is missing: " + _PICKLE_HELP.format(pt=pt, st=weights)
            )
        raise FileNotFoundError(f"{weights} is missing: an official Medusa directory needs it beside {FOREIGN_CONFIG}")
    config_path = directory / FOREIGN_CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} is missing: official Medusa heads need it (medusa_num_heads, "
            "medusa_num_layers, base_model_name_or_path)"
        )
    cfg = _read_json(config_path)
    num_heads, num_layers = _positive_int(cfg, "medusa_num_heads", config_path), cfg.get("medusa_num_layers", 1)
    if not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"{config_path}: medusa_num_layers must be a non-negative integer, got {num_layers!r}")
    state = _strip_prefix(_read_safetensors(weights), _OFFICIAL_PREFIX)
    renames = {}  # official key -> native key
    for h in range(num_heads):
        for layer in range(num_layers):
            renames[f"{h}.{layer}.linear.weight"] = f"blocks.{h}.{layer}.linear.weight"
            renames[f"{h}.{layer}.linear.bias"] = f"blocks.{h}.{layer}.linear.bias"
        renames[f"{h}.{num_layers}.weight"] = f"projections.{h}.weight"
    _check_keys(state, set(renames), weights, f"{num_heads} heads x {num_layers} layers ({config_path.name})")
    vocab, hidden = state[f"0.{num_layers}.weight"].shape
    config = MedusaConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=num_heads,
        num_layers=num_layers,
        projection="own",
        base_model_name_or_path=cfg.get("base_model_name_or_path"),
        extra={"imported_from": "official medusa", "source": str(directory)},
    )
    _check_declared_sizes(cfg, config, config_path)
    return _build_heads(config, {renames[k]: v for k, v in state.items()}, weights)


def _import_vllm(directory: Path) -> MedusaHeads:
    config_path = directory / FOREIGN_CONFIG
    cfg = _read_json(config_path)
    num_heads = _positive_int(cfg, "num_heads" if "num_heads" in cfg else "medusa_num_heads", config_path)
    num_layers = cfg.get("num_hidden_layers", cfg.get("medusa_num_layers", 1))
    if not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"{config_path}: num_hidden_layers must be a non-negative integer, got {num_layers!r}")
    hidden, vocab = _positive_int(cfg, "hidden_size", config_path), _positive_int(cfg, "vocab_size", config_path)
    subset_size = cfg.get("truncated_vocab_size") or vocab
    if not isinstance(subset_size, int) or not 0 < subset_size <= vocab:
        raise ValueError(
            f"{config_path}: truncated_vocab_size must lie in [1, vocab_size={vocab}], got {subset_size!r}"
        )
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}: a vLLM Medusa directory needs {VLLM_WEIGHTS}")
    state = {}
    for f in files:
        state.update(_strip_prefix(_read_safetensors(f), _VLLM_PREFIX))
    token_map = state.pop("token_map", None)  # (V',) candidate token ids, used only with a truncated vocabulary
    if subset_size < vocab and token_map is None:
        raise ValueError(
            f"{config_path}: truncated_vocab_size {subset_size} < vocab_size {vocab} needs a token_map "
            f"tensor in the weights, and none was found in {directory}"
        )
    bias = bool(cfg.get("medusa_fc_bias", False))
    shared = bool(cfg.get("original_lm_head", False))
    renames = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            renames[f"blocks.{h}.layers.{layer}.weight"] = f"blocks.{h}.{layer}.linear.weight"
            if bias:
                renames[f"blocks.{h}.layers.{layer}.bias"] = f"blocks.{h}.{layer}.linear.bias"
        if h == 0 or not shared:
            renames[f"lm_heads.{h}.weight"] = f"projections.{h}.weight"
    if shared:  # vLLM reads only lm_heads.0 then; copies for the other heads are allowed and ignored
        state = {k: v for k, v in state.items() if not (k.startswith("lm_heads.") and k != "lm_heads.0.weight")}
    where = files[0] if len(files) == 1 else directory
    _check_keys(
        state,
        set(renames),
        where,
        f"{num_heads} heads x {num_layers} layers, medusa_fc_bias={bias} ({config_path.name})",
    )
    config = MedusaConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=num_heads,
        num_layers=num_layers,
        projection="own",
        base_model_name_or_path=cfg.get("base_model_name_or_path"),
        vocab_subset_size=subset_size if subset_size < vocab else None,
        extra={"imported_from": "vllm", "source": str(directory)},
    )
    native = {renames[k]: v for k, v in state.items()}
    if config.vocab_subset_size:
        if state["lm_heads.0.weight"].shape[0] != vocab:  # truncated rows cannot be scored against the full vocabulary
            raise ValueError(
                f"{where}: lm_heads hold {state['lm_heads.0.weight'].shape[0]} rows, not the full "
                f"vocabulary of {vocab}: only full projections (plus token_map) can be imported"
            )
        native["vocab_subset"] = token_map.to(torch.long).flatten()
        if (
            native["vocab_subset"].numel() != subset_size
            or not 0 <= int(native["vocab_subset"].min())
            or int(native["vocab_subset"].max()) >= vocab
        ):
            raise ValueError(
                f"{where}: token_map must hold truncated_vocab_size={subset_size} token ids in [0, {vocab})"
            )
    for h in range(num_heads):
        if shared and h:  # own copies: untied, like any imported heads
            native[f"projections.{h}.weight"] = native["projections.0.weight"].clone()
        for layer in range(num_layers):
            if not bias:  # vLLM blocks without bias are ours with a zero bias
                w = native[f"blocks.{h}.{layer}.linear.weight"]
                native[f"blocks.{h}.{layer}.linear.bias"] = torch.zeros(hidden, dtype=w.dtype)
    return _build_heads(config, native, where)


def _build_heads(config: MedusaConfig, native: dict[str, torch.Tensor], where: Path) -> MedusaHeads:
    """Assign checked tensors to heads built on the meta device (skips initialising K random (V, H) matrices)."""
    with torch.device("meta"):
        heads = MedusaHeads(config)
    _check_shapes(native, heads.state_dict(), where, config)
    heads.load_state_dict(native, assign=True)
    return heads


def _read_json(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): the heads config is corrupt; re-export it") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}): the heads file is corrupt; re-save or re-export it"
        ) from err


def _strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}


def _positive_int(cfg: dict, key: str, path: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _check_keys(state: dict, expected: set[str], path: Path, what: str) -> None:
    """The tensor names the config implies, in the file's own naming (`what` describes the config)."""
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match its config ({what}): missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def _check_shapes(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path: Path, config: MedusaConfig
) -> None:
    """Every tensor (native names, keys already checked) has the shape the config implies."""
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)} (hidden {config.hidden_size}, vocab {config.vocab_size})"
            )


def _check_declared_sizes(cfg: dict, config: MedusaConfig, path: Path) -> None:
    for key in ("hidden_size", "vocab_size"):
        if key in cfg and cfg[key] != getattr(config, key):
            raise ValueError(f"{path}: {key} {cfg[key]} disagrees with the weights ({getattr(config, key)})")
