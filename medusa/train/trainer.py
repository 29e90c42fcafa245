"""What has gradients: the heads (and, for Medusa-2, the LoRA-adapted base) with the loss as `forward`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from medusa.config import WEIGHTS_NAME, MedusaConfig
from medusa.heads import MedusaHeads
from medusa.heads_io import load_heads_weights
from medusa.loading import base_fingerprint, load_base
from medusa.train.batches import Conversation, data_fingerprint
from medusa.train.config import FILLED_IN, HeadsConfig, ModelConfig, TrainingConfig
from medusa.train.data import collate
from medusa.train.hidden_cache import CACHE_FORMAT, HiddenCache, build_hidden_cache, cache_lookback, last_hidden
from medusa.train.losses import base_kl_loss, medusa_heads_loss


class HeadTrainer(nn.Module):
    """The trainable heads (and, for Medusa-2, the LoRA-adapted base) with the loss as `forward`, so that one
    `accelerator.prepare` call wraps everything that has gradients in DDP."""

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head: nn.Module,
        cfg: TrainingConfig,
        base: nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
        embed_tokens: nn.Module | None = None,
    ):
        super().__init__()
        self.heads, self.lm_head, self.base, self.cfg = heads, lm_head, base, cfg
        self.compute_dtype = compute_dtype
        self.loss_over_candidates = cfg.loss_over_candidates and bool(heads.config.vocab_subset_size)
        # Only heads that read the next token need the embeddings (for tied models they are the lm_head's weight).
        self.embed_tokens = embed_tokens if heads.config.condition_on_next_token else None

    def train(self, mode: bool = True):
        super().train(mode)
        if self.base is not None and not self.cfg.medusa2:
            self.base.eval()  # a frozen base stays deterministic (no dropout)
        return self

    def forward(
        self,
        input_ids,
        loss_mask,
        attention_mask=None,
        hidden=None,
        topk: int = 0,
        normalizer=None,
        exact: bool = False,
    ) -> dict:
        """input_ids, loss_mask (B, T); either hidden (B, T, H) precomputed or attention_mask (B, T) for the base.

        normalizer (K + 1,): per-head (and, last, base-KL) divisors of the summed losses; None: local means.
        exact: float32 vocabulary projections (evaluation: no bf16 rounding ties inflating top-k accuracy).
        """
        compute_dtype = None if exact else self.compute_dtype
        ref_hidden = None
        layers = self.heads.config.feature_layers
        if hidden is None:
            if self.cfg.medusa2:
                hidden = last_hidden(self.base, input_ids, attention_mask, layers)
                with torch.no_grad(), self.base.disable_adapter():  # the frozen base: the KL reference
                    ref_hidden = last_hidden(self.base, input_ids, attention_mask)
            else:
                with torch.no_grad():
                    hidden = last_hidden(self.base, input_ids, attention_mask, layers)
        hidden = hidden.to(next(self.heads.parameters()).dtype)
        out = medusa_heads_loss(
            self.heads,
            hidden,
            input_ids,
            loss_mask,
            self.lm_head,
            decay=self.cfg.head_decay,
            coefficient=self.cfg.heads_coefficient,
            chunk_size=self.cfg.chunk_tokens,
            compute_dtype=compute_dtype,
            topk=topk,
            normalizer=None if normalizer is None else normalizer[:-1],
            embed_tokens=self.embed_tokens,
            candidates_only=self.loss_over_candidates,
            distill=self.cfg.distill and self.training,
        )  # evaluation scores the data's tokens
        result = {"loss": out.loss, "ce": out.ce, "correct": out.correct, "count": out.count}
        if ref_hidden is not None:
            # (with feature layers the heads read more than the last hidden state; the KL compares that one)
            kl, n = base_kl_loss(
                hidden[..., : ref_hidden.shape[-1]],
                ref_hidden,
                input_ids,
                loss_mask,
                self.lm_head,
                chunk_size=self.cfg.chunk_tokens,
                compute_dtype=compute_dtype,
                normalizer=None if normalizer is None else normalizer[-1].clamp(min=1e-9),
            )
            result.update(loss=out.loss + self.cfg.kl_weight * kl, kl=kl.detach(), kl_count=n)
        return result


def load_frozen_base(model_cfg: ModelConfig, device) -> nn.Module:
    """The base as training reads it, frozen, in model.dtype; with model.quantize int8 its decoder's linear layers
    hold torchao weight-only int8. The lm_head (the heads' shared projection) and the embeddings keep model.dtype:
    the heads are trained against, and later run with, the base's own output layer."""
    base, _ = load_base(model_cfg.base, dtype=model_cfg.dtype, device=device)
    base.requires_grad_(False)
    if model_cfg.quantize == "int8":
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError:
            raise ImportError(
                "model.quantize int8 quantizes the base with torchao, which is not installed: "
                "pip install 'medusa-spec[quant]' (or torchao), or set model.quantize none"
            ) from None
        quantize_(base.get_decoder(), Int8WeightOnlyConfig())
    return base


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant: it recomputes under autograd's
    saved-tensor hooks, so the frozen embeddings' output need not require grad (the reentrant variant needs peft's
    enable_input_require_grads) and LoRA dropout replays the same random mask."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # < 5.x
    enable({"use_reentrant": False})


def build_heads(
    heads_cfg: HeadsConfig,
    hidden_size: int,
    vocab_size: int,
    lm_head: nn.Module,
    base_ref: str | None,
    base_revision: str | None = None,
) -> MedusaHeads:
    """The heads section plus what the base fills in (`base_revision`: the commit of a Hub base) -> fresh heads
    (identity blocks; own projections copied from lm_head), or the weights of `heads.init_from` (whose config already
    supplied every field the section left out)."""
    fields = {f.name: getattr(heads_cfg, f.name) for f in dataclasses.fields(MedusaConfig)}
    config = MedusaConfig(
        **{
            **fields,
            "hidden_size": hidden_size,
            "vocab_size": vocab_size,
            "base_model_name_or_path": base_ref,
            "revision": base_revision,
            "extra": {},
        }
    )  # provenance starts afresh
    if heads_cfg.init_from is None:
        return MedusaHeads(config, base_lm_head=lm_head)
    source = Path(heads_cfg.init_from)
    found = MedusaConfig.load(source)
    for name, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if getattr(found, name) != want:
            raise ValueError(
                f"heads.init_from {source} was trained for {name} {getattr(found, name)} but the base "
                f"({base_ref}) has {want}: start from heads made for this base, or drop heads.init_from"
            )
    # the weights hold init_from's candidate ids; a subset the section asks for is taken from the data afterwards
    heads = MedusaHeads(dataclasses.replace(config, vocab_subset_size=found.vocab_subset_size))
    try:
        load_heads_weights(heads, source / WEIGHTS_NAME)
    except ValueError:  # the section changed the weights' layout: name what it changed
        changed = [
            f"{f.name}={getattr(found, f.name)!r} but the heads section asks for {getattr(config, f.name)!r}"
            for f in dataclasses.fields(MedusaConfig)
            if f.name not in FILLED_IN and getattr(found, f.name) != getattr(config, f.name)
        ]
        if not changed:
            raise
        raise ValueError(
            f"heads.init_from {source} has {'; '.join(changed)}: make them agree (or drop them from the "
            "heads section: init_from supplies them)"
        ) from None
    return heads


def param_groups(trainer: HeadTrainer, cfg: TrainingConfig) -> list[dict]:
    """Heads at training.lr (no decay on biases); LoRA adapters at training.lora_lr."""
    heads = [p for p in trainer.heads.parameters() if p.requires_grad]
    groups = [
        {"name": "heads", "params": [p for p in heads if p.ndim >= 2], "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        {"name": "heads_bias", "params": [p for p in heads if p.ndim < 2], "lr": cfg.lr, "weight_decay": 0.0},
    ]
    if cfg.medusa2:
        lora = [p for p in trainer.base.parameters() if p.requires_grad]
        groups.append({"name": "lora", "params": lora, "lr": cfg.lora_lr, "weight_decay": cfg.weight_decay})
    return [g for g in groups if g["params"]]


def precomputed_hidden(
    accelerator, cfg: TrainingConfig, base: nn.Module, convs, parts, mixed: str, lookback: int, feature_layers, log
) -> HiddenCache:
    """The frozen base's features (medusa.runtime.verify.base_features: the last hidden state, then `feature_layers`'
    residual streams) over each conversation from `lookback` positions before its response, computed once and kept
    under `cfg.cache_dir`: one file per data directory (`parts`: index ranges of `convs`), keyed by its data, the
    base, the precision and what is read, so adding a directory computes only its own file."""
    base_key = {
        "format": CACHE_FORMAT,
        "base": base_fingerprint(base),
        "dtype": str(base.dtype),
        "mixed_precision": mixed,
        "max_length": cfg.max_length,
        "lookback": lookback,
    }
    if feature_layers:  # (only then: the keys of existing caches stay valid)
        base_key["feature_layers"] = list(feature_layers)
    caches = []
    for part in parts:
        part_convs = [convs[i] for i in part]
        key_info = {**base_key, "data": data_fingerprint(part_convs)}
        key = hashlib.blake2b(json.dumps(key_info, sort_keys=True).encode(), digest_size=16).hexdigest()
        path = Path(cfg.cache_dir) / f"hidden-{key}.safetensors"
        caches.append(
            build_hidden_cache(
                accelerator, base, part_convs, lookback, path, key, cfg.precompute_batch_tokens, log, feature_layers
            )
        )
    return HiddenCache.concat(caches)


def build_trainer(
    accelerator,
    cfg: TrainingConfig,
    heads: MedusaHeads,
    base: nn.Module,
    convs: list[Conversation],
    mixed: str,
    parts: list[range],
    log,
):
    """-> (HeadTrainer, fetch(rows) -> forward kwargs on the device, per-conversation lengths for batching).

    With precompute_hidden the base runs once here and the batches carry its cached hidden states; otherwise the
    trainer holds the base (with LoRA adapters for Medusa-2) and runs it on every batch. `parts` are the index
    ranges of the conversations of each data directory: each part has its own cache file, so adding a data
    directory computes only the new part.
    """
    compute_dtype = torch.bfloat16 if mixed == "bf16" else None
    lm_head = base.get_output_embeddings()
    options = {"compute_dtype": compute_dtype, "embed_tokens": base.get_input_embeddings()}
    if cfg.precompute_hidden:
        # (with prompt_tokens the training conversations score from position 0, so their spans are whole anyway)
        cache = precomputed_hidden(
            accelerator, cfg, base, convs, parts, mixed, cache_lookback(heads.config), heads.config.feature_layers, log
        )

        def fetch(rows):
            return {k: v.to(accelerator.device) for k, v in cache.batch(rows).items()}

        lengths = (cache.offsets[1:] - cache.offsets[:-1]).tolist()
        return HeadTrainer(heads, lm_head, cfg, **options), fetch, lengths
    if cfg.medusa2:
        from peft import LoraConfig, get_peft_model

        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(base)
        base = get_peft_model(
            base,
            LoraConfig(
                r=cfg.lora_r,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=cfg.lora_target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    pad_id = base.config.pad_token_id if isinstance(base.config.pad_token_id, int) else 0  # masked out anyway

    def fetch(rows):
        batch = collate(
            [{"input_ids": convs[i].ids, "response_start": convs[i].response_start} for i in rows],
            pad_id,
            cfg.max_length,
        )
        return {
            "input_ids": batch.input_ids.to(accelerator.device),
            "loss_mask": batch.loss_mask.to(accelerator.device),
            "attention_mask": batch.attention_mask.to(accelerator.device),
        }

    return HeadTrainer(heads, lm_head, cfg, base=base, **options), fetch, [len(c.ids) for c in convs]
