"""EAGLE-3 drafts on disk, in the two layouts the serving engines read.

- "speculators" (this library's own, and what `vllm serve <dir>` loads): config.json with `speculators_model_type:
  eagle3`, `speculators_config` (algorithm, proposal method, verifier), `transformer_layer_config` (the target's config
  cut to one layer), `draft_vocab_size`, `norm_before_residual: false` (vLLM assumes true when absent),
  `eagle_aux_hidden_state_layer_ids`; model.safetensors with `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`.
  Exports (`medusa export`, `export_eagle3`) add the target's `embed_tokens`, as speculators' own checkpoints carry
  them: speculators 0.9.0's loader under transformers 5 leaves a draft without them with uninitialised embeddings
  (vLLM takes either). A draft this library keeps for itself (the shipped one) leaves them out: 56 MB for SmolLM2.
- "eagle3" (SafeAILab's original, which optimum-intel exports for OpenVINO GenAI): a flat one-layer config with
  `architectures: ["LlamaForCausalLMEagle3"]` and `draft_vocab_size`; weights named `midlayer.*` for `layers.0.*`.

Layer ids follow EAGLE-3 (and speculators, vLLM): id i is the residual stream entering layer i, transformers'
`hidden_states[i]`. Weights are safetensors only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from medusa.config import CONFIG_NAME as HEADS_CONFIG
from medusa.eagle3 import Eagle3Draft
from medusa.fileio import check_out_dir, write_directory
from medusa.hub import EMBEDDED_HEADS_ROOT, EMBEDDED_PREFIX, download, embedded, is_repo_id
from medusa.loading import DEFAULT_BASE, load_base
from medusa.plan import ACCURACY_NAME

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes
ORIGINAL_ARCHITECTURE = "LlamaForCausalLMEagle3"
FORMATS = ("speculators", "eagle3")
SHIPPED_DRAFT = "embedded:smollm2-135m-instruct-eagle3"  # trained for the embedded SmolLM2 (its card: README.md)


def is_eagle3(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds an EAGLE-3 draft in either layout."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return False
    return isinstance(config, dict) and (
        config.get("speculators_model_type") == "eagle3" or ORIGINAL_ARCHITECTURE in config.get("architectures", [])
    )


def resolve_draft(
    reference, *, token: str | bool | None = None, cache_dir=None, local_files_only: bool = False
) -> Path | None:
    """The local directory of the EAGLE-3 draft that `reference` names (`embedded:<name>`, a directory or a Hub repo
    id), or None where it names something else (a causal LM, for a draft model). A repo's config.json comes first:
    its weights follow only when it declares an EAGLE-3 draft. `token`, `cache_dir` and `local_files_only` go to
    huggingface_hub with a repo id."""
    text = str(reference)
    if text.startswith(EMBEDDED_PREFIX):
        name = text.removeprefix(EMBEDDED_PREFIX)
        if text == DEFAULT_BASE or (EMBEDDED_HEADS_ROOT / name / HEADS_CONFIG).is_file():
            return None  # the embedded base, or shipped heads
        return embedded(name, CONFIG, "EAGLE-3 drafts")
    if not is_repo_id(text):
        return Path(text) if is_eagle3(text) else None
    hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
    if not is_eagle3(download(text, [CONFIG], **hub)):
        return None
    return download(text, [CONFIG, "*.safetensors", ACCURACY_NAME, "README.md"], **hub)


def speculators_config(
    draft: Eagle3Draft, verifier: str | None, verifier_architectures: list[str], speculative_tokens: int, dtype
) -> dict:
    layer = draft.config.to_dict()
    layer["vocab_size"] = draft.t2d.numel()
    layer.pop("_name_or_path", None)
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": draft.d2t.numel(),
        "norm_before_residual": False,
        "target_hidden_size": draft.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(draft.aux_layers),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }


def original_config(draft: Eagle3Draft, dtype) -> dict:
    config = draft.config.to_dict()
    config.pop("_name_or_path", None)
    config.update(
        architectures=[ORIGINAL_ARCHITECTURE],
        vocab_size=draft.t2d.numel(),
        draft_vocab_size=draft.d2t.numel(),
        target_hidden_size=draft.config.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(draft.aux_layers),
        num_hidden_layers=1,
        tie_word_embeddings=False,
        dtype=str(dtype).removeprefix("torch."),
    )
    return config


def draft_state(draft: Eagle3Draft, format: str, dtype=None, embed_tokens: torch.Tensor | None = None) -> dict:
    """The draft's tensors under `format`'s names: floats in `dtype` (default: as held), d2t int64, t2d bool."""
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.startswith("rotary_emb."):
            continue  # recomputed from the config
        if format == "eagle3" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        if tensor.is_floating_point() and dtype is not None:
            tensor = tensor.to(dtype)
        state[name] = tensor.detach().cpu().contiguous()
    if embed_tokens is not None:
        state["embed_tokens.weight"] = embed_tokens.detach().to(dtype or embed_tokens.dtype).cpu().contiguous()
    return state


def save_eagle3(
    draft: Eagle3Draft,
    directory: str | os.PathLike,
    *,
    format: str = "speculators",
    verifier: str | None = None,
    verifier_architectures: list[str] = (),
    speculative_tokens: int = 5,
    dtype=None,
    embed_tokens: torch.Tensor | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write the draft to `directory` atomically in `format` ("speculators" or "eagle3"). `verifier`: the target's
    Hub id or directory (what vLLM and the speculators loader fetch the verifier from); `embed_tokens`: the target's
    input embeddings, stored with the draft (what other loaders need; this library uses the target's own)."""
    if format not in FORMATS:
        raise ValueError(f"unknown EAGLE-3 format {format!r}: use one of {FORMATS}")
    dtype = dtype or draft.fc.weight.dtype
    if format == "speculators":
        config = speculators_config(draft, verifier, list(verifier_architectures), speculative_tokens, dtype)
    else:
        config = original_config(draft, dtype)
    state = draft_state(draft, format, dtype, embed_tokens)

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    return write_directory(Path(directory), write)


def load_eagle3(directory: str | os.PathLike, device=None) -> tuple[Eagle3Draft, dict]:
    """An EAGLE-3 draft from `directory` (either layout) -> (draft, its config.json)."""
    directory = Path(directory)
    if not is_eagle3(directory):
        raise ValueError(
            f"{directory} holds no EAGLE-3 draft: expected {CONFIG} with speculators_model_type 'eagle3' (the "
            f"speculators layout) or architectures [{ORIGINAL_ARCHITECTURE!r}] (EAGLE-3's own)"
        )
    config = json.loads((directory / CONFIG).read_text())
    weights = directory / WEIGHTS
    if not weights.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(f"{weights} is missing (found {found}): EAGLE-3 drafts load from safetensors only")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{weights} is not a readable safetensors file ({err}): export the draft again") from err
    state = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    if "speculators_model_type" in config:
        layer = dict(config["transformer_layer_config"])
    else:
        layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size")}
    model_type = layer.pop("model_type", "llama")
    layer_config = AutoConfig.for_model(model_type, **layer)
    vocab = layer_config.vocab_size
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not aux:  # EAGLE-3's own checkpoints leave them to the target's depth, which the one-layer config lacks
        raise ValueError(
            f"{directory / CONFIG} does not record which target layers the draft reads: add "
            '"eagle_aux_hidden_state_layer_ids": [2, L // 2, L - 3] (L: the target\'s number of layers)'
        )
    draft = Eagle3Draft(layer_config, aux, draft_vocab, vocab)
    state.pop("embed_tokens.weight", None)  # the target's own embeddings are used
    if "d2t" not in state:  # speculators leaves the maps out when the draft vocabulary is the target's
        state["d2t"], state["t2d"] = draft.d2t.clone(), draft.t2d.clone()
    expected = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{weights}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                f"{tuple(expected[name].shape)}"
            )
    dtype = next(t.dtype for k, t in state.items() if t.is_floating_point())
    draft = draft.to(dtype)
    draft.load_state_dict(state, strict=False)
    return draft.to(device or "cpu").eval(), config


def export_eagle3(
    draft_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str,
    *,
    base=None,
    base_model_name_or_path: str | None = None,
    dtype=None,
    overwrite: bool = False,
) -> Path:
    """Write the draft in `draft_dir` to `out_dir` in `format` with the target's input embeddings, which the serving
    engines' loaders read from the file. `base`: the target to take them from (default: the verifier the draft
    names); `base_model_name_or_path`: the verifier written into the config (default: `base` or the draft's)."""
    draft, config = load_eagle3(draft_dir)
    named = (config.get("speculators_config") or {}).get("verifier") or {}
    source = base or named.get("name_or_path")
    if source is None:
        raise ValueError(f"{draft_dir} names no target (verifier): pass --base, the model the draft was trained on")
    target, _ = load_base(source, dtype=draft.fc.weight.dtype)
    out_dir = Path(out_dir)
    if out_dir.resolve() == Path(draft_dir).resolve():
        raise ValueError(f"export into a different directory than the source ({draft_dir})")
    check_out_dir(out_dir, overwrite)
    return save_eagle3(
        draft,
        out_dir,
        format=format,
        verifier=base_model_name_or_path or (str(base) if base is not None else named.get("name_or_path")),
        verifier_architectures=named.get("architectures") or list(target.config.architectures or []),
        speculative_tokens=_speculative_tokens(config),
        dtype=dtype,
        embed_tokens=target.get_input_embeddings().weight,
    )


def _speculative_tokens(config: dict) -> int:
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens", 5))
