"""Train Medusa heads on self-distillation data with `accelerate`: one process, or DDP over several (CPU or GPU).

    accelerate launch train/train.py --config configs/smollm2-135m.yaml              # Medusa-1: frozen base
    accelerate launch train/train.py --config configs/smollm2-135m-medusa2.yaml      # Medusa-2: LoRA base + heads
    accelerate launch --num_processes 2 --cpu train/train.py --config configs/smollm2-135m.yaml   # DDP over gloo
    ... --training.max_steps 200 --training.lr 2e-3     # any `--section.key value` overrides the YAML
    ... --resume                                        # continue from the newest checkpoint

Reads the shards train/generate_data.py wrote to `data.out_dir`, holds out `training.eval_conversations` of them
(chosen by a hash of their tokens), and writes `training.output_dir`: medusa_config.json + medusa_heads.safetensors
(+ adapter_config.json / adapter_model.safetensors for Medusa-2), loadable with `MedusaModel.from_pretrained(dir)`.
With a frozen base (Medusa-1) the base's last hidden states are computed once and cached in `training.cache_dir`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from medusa.config import WEIGHTS_NAME, MedusaConfig  # noqa: E402
from medusa.data import collate, frequent_tokens  # noqa: E402
from medusa.fileio import write_directory  # noqa: E402
from medusa.heads import MedusaHeads, base_features, head_target_offset  # noqa: E402
from medusa.loading import DEFAULT_BASE, load_base, resolve_dtype  # noqa: E402
from medusa.losses import (BASE_TARGET_OFFSET, TOPK, base_kl_loss, head_weights, medusa_heads_loss,  # noqa: E402
                           scored_positions)
from medusa.heads_io import load_heads_weights, save_heads  # noqa: E402
from train.config import DataConfig, HeadsConfig, ModelConfig, TrainingConfig, parse_args  # noqa: E402

SECTIONS = {"model": ModelConfig, "data": DataConfig, "heads": HeadsConfig, "training": TrainingConfig}
CACHE_FORMAT = 1  # bump when the hidden-state cache layout changes, so old files are not read
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Fields that may change between a checkpoint and its resumption; every other setting must match.
RESUMABLE_CHANGES = {"output_dir", "checkpoint_dir", "cache_dir", "eval_every", "log_every", "save_every",
                     "keep_checkpoints", "report_to", "wandb_project", "run_name", "precompute_batch_tokens"}


# ====================================================================== data
@dataclass(frozen=True)
class Conversation:
    ids: list[int]  # prompt + response tokens, truncated to training.max_length
    response_start: int  # index of the first response token (< len(ids))

    @property
    def response_tokens(self) -> int:
        return len(self.ids) - self.response_start


def _shard_has_rows(shard: Path) -> bool:
    """A dataset saved with no rows has no arrow file, and `datasets.load_from_disk` fails on it (IndexError)."""
    state = shard / "state.json"
    return not state.is_file() or bool(json.loads(state.read_text()).get("_data_files", [None]))


def load_conversations(data_dir: str | Path, max_length: int, vocab_size: int,
                       prompt_only: bool = False) -> list[Conversation]:
    """Every conversation of the shards in `data_dir`, truncated; those with no response token left are dropped,
    unless `prompt_only` (training on prompt positions: data.answer false writes prompts without responses)."""
    from datasets import concatenate_datasets, load_from_disk

    from train.generate_data import SETTINGS_NAME, shard_dirs

    shards = shard_dirs(Path(data_dir))
    if not shards:
        raise FileNotFoundError(f"no data shards in {data_dir}: run train/generate_data.py first "
                                "(or point data.out_dir at the directory it wrote)")
    shards = [s for s in shards if _shard_has_rows(s)]
    if not shards:
        raise ValueError(f"the dataset in {data_dir} is empty (its shards hold no conversations): "
                         "run train/generate_data.py, or point data.out_dir at the directory it wrote")
    settings = Path(data_dir) / SETTINGS_NAME  # what generate_data made it with: was the data answered?
    answered = not settings.is_file() or json.loads(settings.read_text()).get("answer", True)
    if not answered and not prompt_only:
        raise ValueError(f"the dataset in {data_dir} holds prompts without responses (data.answer false): train on it "
                         "with training.prompt_tokens true (and training.distill true)")
    data = concatenate_datasets([load_from_disk(str(s)) for s in shards])
    missing = sorted({"input_ids", "response_start"} - set(data.column_names))
    if missing:
        raise ValueError(f"data in {data_dir} lacks column(s) {missing}: regenerate it with train/generate_data.py")
    columns = data.select_columns(["input_ids", "response_start"]).to_dict()
    convs = [Conversation(list(ids[:max_length]), min(int(rs), max_length))
             for ids, rs in zip(columns["input_ids"], columns["response_start"])
             if int(rs) < min(len(ids), max_length) or (prompt_only and len(ids) > 1)]
    if not convs:
        raise ValueError(f"the dataset in {data_dir} has {len(data)} conversations and none has a response token within "
                         f"training.max_length={max_length}: raise training.max_length or regenerate the data")
    top = max(max(c.ids) for c in convs)
    if top >= vocab_size:
        raise ValueError(f"data in {data_dir} holds token id {top} but the base vocabulary has {vocab_size} tokens: the "
                         "data was generated with another tokenizer; use the base it was made with (model.base)")
    return convs


def _conversation_hash(conv: Conversation) -> bytes:
    return hashlib.blake2b(torch.tensor(conv.ids).numpy().tobytes() + conv.response_start.to_bytes(8, "little"),
                           digest_size=16).digest()


def split_eval(convs: list[Conversation], n_eval: int) -> tuple[list[int], list[int]]:
    """(train indices, eval indices): the `n_eval` conversations with the smallest token hash are held out.

    Depends only on the conversations themselves, not on the seed or the shard order.
    """
    answered = [i for i in range(len(convs)) if convs[i].response_tokens]  # prompt-only rows are never held out
    if n_eval >= len(answered):
        raise ValueError(f"the data has {len(answered)} conversations with responses and training.eval_conversations="
                         f"{n_eval} leaves none to train on: lower training.eval_conversations or generate more data")
    ranked = sorted(answered, key=lambda i: (_conversation_hash(convs[i]), i))
    held_out = set(ranked[:n_eval])
    return [i for i in range(len(convs)) if i not in held_out], sorted(held_out)


def data_fingerprint(convs: list[Conversation]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for conv in convs:
        digest.update(_conversation_hash(conv))
    return digest.hexdigest()


def base_fingerprint(model: nn.Module) -> str:
    """Hash of every parameter and buffer: a fine-tuned base with the same name gets another cache."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def pack(order: list[int], lengths: list[int], batch_size: int, unit: str) -> list[list[int]]:
    """Cut `order` into batches of `batch_size` conversations, or of at most `batch_size` tokens (at least one)."""
    if unit == "sequences":
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    batches, current, tokens = [], [], 0
    for i in order:
        if current and tokens + lengths[i] > batch_size:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return batches + ([current] if current else [])


class StepPlan:
    """Which conversations each process reads at each optimizer step; a pure function of (seed, step)."""

    def __init__(self, train_idx: list[int], lengths: list[int], cfg: TrainingConfig, world: int):
        self.train_idx, self.lengths, self.cfg, self.world = train_idx, lengths, cfg, world
        self.per_step = world * cfg.grad_accum  # micro-batches consumed per optimizer step, all processes
        self._epochs: dict[int, list[list[int]]] = {}
        if self.steps_in_epoch(0) == 0:
            raise ValueError(
                f"one optimizer step needs {self.per_step} batches ({world} processes x grad_accum {cfg.grad_accum}) but "
                f"the {len(train_idx)} training conversations make {len(self.epoch_batches(0))}: lower "
                "training.batch_size or training.grad_accum, or generate more data")

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            order = [self.train_idx[i] for i in torch.randperm(len(self.train_idx), generator=gen).tolist()]
            self._epochs[epoch] = pack(order, self.lengths, self.cfg.batch_size, self.cfg.batch_unit)
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_batches(epoch)) // self.per_step

    def total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        return sum(self.steps_in_epoch(e) for e in range(self.cfg.epochs))

    def locate(self, step: int) -> tuple[int, int]:
        """Global optimizer step -> (epoch, step within that epoch)."""
        epoch = 0
        while step >= (n := self.steps_in_epoch(epoch)):
            step -= n
            epoch += 1
        return epoch, step

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """The grad_accum micro-batches process `rank` runs at optimizer step `step`."""
        epoch, within = self.locate(step)
        batches = self.epoch_batches(epoch)
        first = within * self.per_step
        return [batches[first + a * self.world + rank] for a in range(self.cfg.grad_accum)]

    def step_rows(self, step: int) -> list[int]:
        """Every conversation any process reads at optimizer step `step`."""
        return [i for rank in range(self.world) for rows in self.micro_batches(step, rank) for i in rows]


def loss_positions(convs: list[Conversation], num_heads: int) -> torch.Tensor:
    """(R, K + 1): positions each conversation contributes to each head's loss and (last) to the base KL."""
    offsets = [head_target_offset(k) for k in range(num_heads)] + [BASE_TARGET_OFFSET]
    return torch.tensor([[scored_positions(len(c.ids), c.response_start, o) for o in offsets] for c in convs],
                        dtype=torch.float64)


# ====================================================================== hidden-state cache
def cache_lookback(config: MedusaConfig) -> int:
    """How many positions before the first response token the heads read: a head at t targets up to t + the last
    head's offset, and a context layer reads the window of positions before t."""
    return head_target_offset(config.num_heads - 1) + max(config.context_window - 1, 0)


def span_start(conv: Conversation, lookback: int) -> int:
    """First position whose hidden state the heads need: `lookback` before the first response token (a head at t
    targets t + offset and, with a context layer, reads the window of positions before t)."""
    return max(0, conv.response_start - lookback)


@dataclass(frozen=True)
class HiddenCache:
    """The frozen base's last hidden states over the part of each conversation the heads read."""

    hidden: torch.Tensor  # (P, H) bfloat16: spans of every conversation, back to back
    ids: torch.Tensor  # (P,) long: the tokens at those positions
    offsets: torch.Tensor  # (R+1,) long: conversation r occupies rows offsets[r]:offsets[r+1]
    response_start: torch.Tensor  # (R,) long: first response row within conversation r's span

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """-> hidden (B, L, H), input_ids (B, L), loss_mask (B, L), right-padded to the longest span."""
        spans = [(int(self.offsets[r]), int(self.offsets[r + 1]), int(self.response_start[r])) for r in rows]
        width = max(end - start for start, end, _ in spans)
        hidden = self.hidden.new_zeros((len(rows), width, self.hidden.shape[1]))
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, (start, end, rs) in enumerate(spans):
            hidden[j, :end - start] = self.hidden[start:end]
            ids[j, :end - start] = self.ids[start:end]
            loss_mask[j, rs:end - start] = 1
        return {"hidden": hidden, "input_ids": ids, "loss_mask": loss_mask}

    def save(self, path: Path, key: str) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({"hidden": self.hidden, "ids": self.ids, "offsets": self.offsets,
                   "response_start": self.response_start}, str(tmp), metadata={"key": key})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, key: str) -> "HiddenCache | None":
        """The cache at `path` if it was written for `key`, else None."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            return cls(*(f.get_tensor(name) for name in ("hidden", "ids", "offsets", "response_start")))

    @classmethod
    def concat(cls, caches: list["HiddenCache"]) -> "HiddenCache":
        """Caches of consecutive conversation lists -> one cache over all of them, in order."""
        if len(caches) == 1:
            return caches[0]
        shifts = torch.tensor([0] + [int(c.offsets[-1]) for c in caches[:-1]]).cumsum(0)
        offsets = torch.cat([caches[0].offsets[:1]] + [c.offsets[1:] + shift for c, shift in zip(caches, shifts)])
        return cls(torch.cat([c.hidden for c in caches]), torch.cat([c.ids for c in caches]), offsets,
                   torch.cat([c.response_start for c in caches]))

    @classmethod
    def assemble(cls, convs: list[Conversation], spans: dict[int, torch.Tensor], lookback: int) -> "HiddenCache":
        starts = [span_start(c, lookback) for c in convs]
        lengths = [len(c.ids) - s for c, s in zip(convs, starts)]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        ids = torch.tensor([t for c, s in zip(convs, starts) for t in c.ids[s:]], dtype=torch.long)
        hidden = torch.cat([spans[r] for r in range(len(convs))])
        rs = torch.tensor([c.response_start - s for c, s in zip(convs, starts)], dtype=torch.long)
        return cls(hidden, ids, offsets, rs)


def last_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                feature_layers=()) -> torch.Tensor:
    """(B, T) -> (B, T, H): the base's last, post-norm hidden state (with feature layers, their features after it:
    medusa.heads.base_features); logits only for the last position (cheap)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1)
    return base_features(out.hidden_states, feature_layers)


def build_hidden_cache(accelerator, base: nn.Module, convs: list[Conversation], lookback: int, path: Path, key: str,
                       batch_tokens: int, log, feature_layers=()) -> HiddenCache:
    """Run the frozen base once over every conversation (each process a share) and cache what the heads read."""
    if path.is_file() and (cache := HiddenCache.load(path, key)) is not None:
        log(f"reusing precomputed hidden states {path}")
        return cache
    rank, world = accelerator.process_index, accelerator.num_processes
    lengths = [len(c.ids) for c in convs]
    order = sorted(range(len(convs)), key=lambda i: lengths[i])  # similar lengths together: little padding
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    batches = (batches + [current])[rank::world]
    spans: dict[int, torch.Tensor] = {}
    total = sum(lengths[i] for b in batches for i in b)
    bar = tqdm(total=total, unit="tok", desc="precompute hidden", disable=not accelerator.is_local_main_process)
    start = time.time()
    with torch.no_grad(), accelerator.autocast():
        for rows in batches:
            batch = collate([{"input_ids": convs[i].ids, "response_start": convs[i].response_start} for i in rows],
                            pad_id=0, max_length=max(lengths[i] for i in rows))
            hidden = last_hidden(base, batch.input_ids.to(accelerator.device), batch.attention_mask.to(accelerator.device),
                                 feature_layers)
            for j, i in enumerate(rows):
                spans[i] = hidden[j, span_start(convs[i], lookback):lengths[i]].to(torch.bfloat16).cpu()
            bar.update(sum(lengths[i] for i in rows))
    bar.close()
    log(f"precomputed hidden states of {total} tokens in {time.time() - start:.1f} s "
        f"({total / max(time.time() - start, 1e-9):.0f} tok/s per process)")
    if world == 1:
        cache = HiddenCache.assemble(convs, spans, lookback)
        cache.save(path, key)
        return cache
    from safetensors.torch import load_file, save_file

    part = path.with_name(f".{path.stem}.part-{rank}-of-{world}.safetensors")
    part.parent.mkdir(parents=True, exist_ok=True)
    mine = sorted(spans)
    hidden_size = base.config.get_text_config().hidden_size * (1 + len(feature_layers))
    save_file({"rows": torch.tensor(mine, dtype=torch.long),
               "lengths": torch.tensor([len(spans[i]) for i in mine], dtype=torch.long),
               "hidden": torch.cat([spans[i] for i in mine]) if mine else torch.zeros(0, hidden_size, dtype=torch.bfloat16)},
              str(part))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        spans = {}
        for r in range(world):
            other = path.with_name(f".{path.stem}.part-{r}-of-{world}.safetensors")
            parts = load_file(str(other))
            for i, piece in zip(parts["rows"].tolist(), parts["hidden"].split(parts["lengths"].tolist())):
                spans[i] = piece
            other.unlink()
        HiddenCache.assemble(convs, spans, lookback).save(path, key)
    accelerator.wait_for_everyone()
    return HiddenCache.load(path, key)


# ====================================================================== model
class HeadTrainer(nn.Module):
    """The trainable heads (and, for Medusa-2, the LoRA-adapted base) with the loss as `forward`, so that one
    `accelerator.prepare` call wraps everything that has gradients in DDP."""

    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, cfg: TrainingConfig, base: nn.Module | None = None,
                 compute_dtype: torch.dtype | None = None, embed_tokens: nn.Module | None = None,
                 loss_over_candidates: bool = False):
        super().__init__()
        self.heads, self.lm_head, self.base, self.cfg = heads, lm_head, base, cfg
        self.compute_dtype, self.loss_over_candidates = compute_dtype, loss_over_candidates
        # Only heads that read the next token need the embeddings (for tied models they are the lm_head's weight).
        self.embed_tokens = embed_tokens if heads.config.condition_on_next_token else None

    def train(self, mode: bool = True):
        super().train(mode)
        if self.base is not None and not self.cfg.medusa2:
            self.base.eval()  # a frozen base stays deterministic (no dropout)
        return self

    def forward(self, input_ids, loss_mask, attention_mask=None, hidden=None, topk: int = 0, normalizer=None,
                exact: bool = False) -> dict:
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
        out = medusa_heads_loss(self.heads, hidden, input_ids, loss_mask, self.lm_head, decay=self.cfg.head_decay,
                                coefficient=self.cfg.heads_coefficient, chunk_size=self.cfg.chunk_tokens,
                                compute_dtype=compute_dtype, topk=topk,
                                normalizer=None if normalizer is None else normalizer[:-1],
                                embed_tokens=self.embed_tokens, candidates_only=self.loss_over_candidates,
                                distill=self.cfg.distill and self.training)  # evaluation scores the data's tokens
        result = {"loss": out.loss, "ce": out.ce, "correct": out.correct, "count": out.count}
        if ref_hidden is not None:
            # (with feature layers the heads read more than the last hidden state; the KL compares that one)
            kl, n = base_kl_loss(hidden[..., :ref_hidden.shape[-1]], ref_hidden, input_ids, loss_mask, self.lm_head,
                                 chunk_size=self.cfg.chunk_tokens, compute_dtype=compute_dtype,
                                 normalizer=None if normalizer is None else normalizer[-1].clamp(min=1e-9))
            result.update(loss=out.loss + self.cfg.kl_weight * kl, kl=kl.detach(), kl_count=n)
        return result


def build_heads(heads_cfg: HeadsConfig, hidden_size: int, vocab_size: int, lm_head: nn.Module,
                base_ref: str | None) -> MedusaHeads:
    """Fresh heads (identity blocks; own projections copied from lm_head), or the weights of `heads.init_from`."""
    config = MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=heads_cfg.num_heads,
                          num_layers=heads_cfg.num_layers, projection=heads_cfg.projection,
                          condition_on_next_token=heads_cfg.condition_on_next_token,
                          condition_on_path=heads_cfg.condition_on_path, context_window=heads_cfg.context_window,
                          feature_layers=list(heads_cfg.feature_layers), copy_ngram=heads_cfg.copy_ngram,
                          base_model_name_or_path=base_ref)
    if heads_cfg.init_from is None:
        return MedusaHeads(config, base_lm_head=lm_head)
    source = Path(heads_cfg.init_from)
    found = MedusaConfig.load(source)
    for name, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if getattr(found, name) != want:
            raise ValueError(f"heads.init_from {source} was trained for {name} {getattr(found, name)} but the base "
                             f"({base_ref}) has {want}: start from heads made for this base, or drop heads.init_from")
    for name in ("num_heads", "num_layers", "projection", "condition_on_next_token", "condition_on_path",
                 "context_window", "feature_layers"):
        if getattr(found, name) != type(getattr(found, name))(getattr(heads_cfg, name)):  # (list vs tuple)
            raise ValueError(f"heads.init_from {source} has {name}={getattr(found, name)!r} but the heads section asks "
                             f"for {getattr(heads_cfg, name)!r}: make them agree")
    # Keep everything else the directory declares (tree, vocabulary subset, ...); provenance starts afresh.
    heads = MedusaHeads(dataclasses.replace(found, base_model_name_or_path=base_ref, copy_ngram=heads_cfg.copy_ngram,
                                            extra={}))
    load_heads_weights(heads, source / WEIGHTS_NAME)
    return heads


def param_groups(trainer: HeadTrainer, cfg: TrainingConfig) -> list[dict]:
    """Heads at training.lr (no decay on biases); LoRA adapters at training.lora_lr."""
    heads = [p for p in trainer.heads.parameters() if p.requires_grad]
    groups = [{"name": "heads", "params": [p for p in heads if p.ndim >= 2], "lr": cfg.lr, "weight_decay": cfg.weight_decay},
              {"name": "heads_bias", "params": [p for p in heads if p.ndim < 2], "lr": cfg.lr, "weight_decay": 0.0}]
    if cfg.medusa2:
        lora = [p for p in trainer.base.parameters() if p.requires_grad]
        groups.append({"name": "lora", "params": lora, "lr": cfg.lora_lr, "weight_decay": cfg.weight_decay})
    return [g for g in groups if g["params"]]


def check_distributed_type(accelerator) -> None:
    """Single process and DDP (any device) are supported; sharded launches are refused with the reason."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"train/train.py does not support {kind.value} yet: the fused head loss reads the lm_head weight directly "
            "and checkpoints read whole parameters, which FSDP / ZeRO-3 shard, and DeepSpeed owns gradient "
            "accumulation. Use DDP (`accelerate launch --multi_gpu --num_processes N train/train.py ...`): the heads "
            "are small and the frozen base is only needed once to precompute hidden states (see docs/training.md)")


def resolve_mixed_precision(setting: str, device: torch.device) -> str:
    """'auto' -> 'bf16' on a CUDA device that supports it or a CPU with bf16 instructions (AMX / AVX512-BF16)."""
    if setting != "auto":
        return setting
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    if device.type == "cpu" and Path("/proc/cpuinfo").is_file():
        flags = Path("/proc/cpuinfo").read_text()
        return "bf16" if ("amx_bf16" in flags or "avx512_bf16" in flags) else "no"
    return "no"


# ====================================================================== checkpoints
def checkpoint_root(cfg: TrainingConfig) -> Path:
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path("runs") / "checkpoints" / Path(cfg.output_dir).name


def latest_checkpoint(root: Path) -> Path | None:
    done = [p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None


def save_checkpoint(accelerator, root: Path, step: int, trainer: HeadTrainer, optimizer, scheduler, state: dict,
                    keep: int) -> Path:
    """Write step-XXXXXXXX/ atomically: a temporary folder, every process's RNG, then one rename by the main process."""
    from safetensors.torch import save_file

    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    save_file(rng, str(tmp / f"rng-{accelerator.process_index}.safetensors"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(trainer)
        weights = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(weights, str(tmp / "trainable.safetensors"))
        opt = optimizer.state_dict()
        tensors, scalars = {}, {}
        for pid, values in opt["state"].items():
            for name, value in values.items():
                if torch.is_tensor(value):
                    tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{pid}.{name}"] = value
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps({"param_groups": opt["param_groups"], "scalars": scalars}))
        (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict()))
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=2))  # last: marks complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(path: Path, trainer: HeadTrainer, optimizer, scheduler, rank: int, log) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG; return the saved trainer state."""
    from safetensors.torch import load_file

    weights = load_file(str(path / "trainable.safetensors"))
    params = {n: p for n, p in trainer.named_parameters() if p.requires_grad}
    if set(weights) != set(params) or any(weights[n].shape != params[n].shape for n in params):
        raise ValueError(f"checkpoint {path} holds other trainable weights than this run builds (different heads, "
                         "projection or LoRA settings): resume with the settings it was written with")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    tensors = load_file(str(path / "optimizer.safetensors"))
    meta = json.loads((path / "optimizer.json").read_text())
    state: dict[int, dict] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    rng_path = path / f"rng-{rank}.safetensors"
    if rng_path.is_file():
        rng = load_file(str(rng_path))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))
    else:
        log(f"warning: {rng_path.name} missing in {path}: random state not restored")
    return json.loads((path / "trainer_state.json").read_text())


def run_snapshot(heads_cfg: HeadsConfig, cfg: TrainingConfig, data_key: str, base_ref, world: int) -> dict:
    """Everything that decides the training trajectory: a checkpoint resumes only under the same snapshot."""
    training = {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_CHANGES}
    return {"heads": asdict(heads_cfg), "training": training, "data": data_key, "base": base_ref, "processes": world}


def check_snapshot(path: Path, saved: dict, current: dict) -> None:
    diffs = []
    for section in current:
        a, b = saved.get(section), current[section]
        if isinstance(b, dict) and isinstance(a, dict):
            diffs += [f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{section}: {a!r} -> {b!r}")
    if diffs:
        raise ValueError(f"cannot resume from {path}: the run changed ({'; '.join(diffs)}). Resume with the settings "
                         "it was written with, or start afresh with another training.checkpoint_dir")


# ====================================================================== evaluation and output
def reduce_sum(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum") if accelerator.num_processes > 1 else tensor


def summarise(ce_sum, correct, count, kl_sum=None, kl_count=None, num_heads: int = 0, prefix: str = "") -> dict:
    """Sums over positions -> {prefix}head{k}/ce, {prefix}head{k}/top{j} accuracies, {prefix}kl."""
    metrics = {}
    for k in range(num_heads):
        n = max(int(count[k]), 1)
        metrics[f"{prefix}head{k}/ce"] = float(ce_sum[k]) / n
        for j in range(correct.shape[1]):
            metrics[f"{prefix}head{k}/top{j + 1}"] = float(correct[k, j]) / n
    if kl_sum is not None:
        metrics[f"{prefix}kl"] = float(kl_sum) / max(int(kl_count), 1)
    return metrics


@torch.no_grad()
def evaluate(accelerator, trainer: HeadTrainer, batches: list[list[int]], fetch, num_heads: int) -> dict:
    """Top-1..top-5 accuracy and cross-entropy per head on the held-out conversations (all processes share them)."""
    model = accelerator.unwrap_model(trainer)
    model.eval()
    ce_sum = torch.zeros(num_heads, dtype=torch.float64)
    correct = torch.zeros(num_heads, TOPK, dtype=torch.long)
    count = torch.zeros(num_heads, dtype=torch.long)
    kl_sum, kl_count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.long)
    with accelerator.autocast():
        for rows in batches[accelerator.process_index::accelerator.num_processes]:
            out = model(**fetch(rows), topk=TOPK, exact=True)
            ce_sum += (out["ce"] * out["count"]).double().cpu()
            correct += out["correct"].cpu()
            count += out["count"].cpu()
            if "kl" in out:
                kl_sum += out["kl"].double().cpu() * out["kl_count"].cpu()
                kl_count += out["kl_count"].cpu()
    model.train()
    ce_sum, correct, count = (reduce_sum(accelerator, t).cpu() for t in (ce_sum, correct, count))
    kl_sum, kl_count = reduce_sum(accelerator, kl_sum).cpu(), reduce_sum(accelerator, kl_count).cpu()
    return summarise(ce_sum, correct, count, kl_sum if model.cfg.medusa2 else None, kl_count, num_heads, "eval/")


def format_eval(metrics: dict, num_heads: int) -> str:
    parts = [f"head{k} top1 {metrics[f'eval/head{k}/top1']:.3f} top5 {metrics[f'eval/head{k}/top5']:.3f}"
             for k in range(num_heads)]
    if "eval/kl" in metrics:
        parts.append(f"base KL {metrics['eval/kl']:.4f}")
    return " | ".join(parts)


def save_output(trainer: HeadTrainer, output_dir: Path, extra: dict) -> None:
    """Heads (+ the LoRA adapter for Medusa-2) into `output_dir`, via a temporary folder moved into place."""

    def write(tmp: Path) -> None:
        save_dtype = resolve_dtype(trainer.cfg.save_dtype) if trainer.cfg.save_dtype else None
        save_heads(trainer.heads, tmp, extra=extra, dtype=save_dtype)
        if trainer.cfg.medusa2:
            trainer.base.save_pretrained(str(tmp))  # adapter_config.json + adapter_model.safetensors
            (tmp / "README.md").unlink(missing_ok=True)  # peft's model card template: placeholders only

    # without Medusa-2, a stale adapter left in output_dir would be merged into the base at load time
    write_directory(output_dir, write, stale=() if trainer.cfg.medusa2 else ADAPTER_FILES)


# ====================================================================== the run
def build_trainer(accelerator, cfg: TrainingConfig, heads: MedusaHeads, base: nn.Module, convs: list[Conversation],
                  mixed: str, parts: list[range], log, loss_over_candidates: bool = False):
    """-> (HeadTrainer, fetch(rows) -> forward kwargs on the device, per-conversation lengths for batching).

    With precompute_hidden the base runs once here and the batches carry its cached hidden states; otherwise the
    trainer holds the base (with LoRA adapters for Medusa-2) and runs it on every batch. `parts` are the index
    ranges of the conversations of each data directory: each part has its own cache file, so adding a data
    directory computes only the new part.
    """
    compute_dtype = torch.bfloat16 if mixed == "bf16" else None
    lm_head = base.get_output_embeddings()
    options = {"compute_dtype": compute_dtype, "embed_tokens": base.get_input_embeddings(),
               "loss_over_candidates": loss_over_candidates}
    if cfg.precompute_hidden:
        # (with prompt_tokens the training conversations score from position 0, so their spans are whole anyway)
        lookback = cache_lookback(heads.config)
        base_key = {"format": CACHE_FORMAT, "base": base_fingerprint(base), "dtype": str(base.dtype),
                    "mixed_precision": mixed, "max_length": cfg.max_length, "lookback": lookback}
        if heads.config.feature_layers:  # (only then: the keys of existing caches stay valid)
            base_key["feature_layers"] = heads.config.feature_layers
        caches = []
        for part in parts:
            part_convs = [convs[i] for i in part]
            key_info = {**base_key, "data": data_fingerprint(part_convs)}
            key = hashlib.blake2b(json.dumps(key_info, sort_keys=True).encode(), digest_size=16).hexdigest()
            caches.append(build_hidden_cache(accelerator, base, part_convs, lookback,
                                             Path(cfg.cache_dir) / f"hidden-{key}.safetensors", key,
                                             cfg.precompute_batch_tokens, log, heads.config.feature_layers))
        cache = HiddenCache.concat(caches)

        def fetch(rows):
            return {k: v.to(accelerator.device) for k, v in cache.batch(rows).items()}

        lengths = (cache.offsets[1:] - cache.offsets[:-1]).tolist()
        return HeadTrainer(heads, lm_head, cfg, **options), fetch, lengths
    if cfg.medusa2:
        from peft import LoraConfig, get_peft_model

        base = get_peft_model(base, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                               target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM"))
    pad_id = base.config.pad_token_id if isinstance(base.config.pad_token_id, int) else 0  # masked out anyway

    def fetch(rows):
        batch = collate([{"input_ids": convs[i].ids, "response_start": convs[i].response_start} for i in rows],
                        pad_id, cfg.max_length)
        return {"input_ids": batch.input_ids.to(accelerator.device), "loss_mask": batch.loss_mask.to(accelerator.device),
                "attention_mask": batch.attention_mask.to(accelerator.device)}

    return HeadTrainer(heads, lm_head, cfg, base=base, **options), fetch, [len(c.ids) for c in convs]


def provenance(cfg: TrainingConfig, data_cfg: DataConfig, data_key: str, train_idx, eval_idx,
               train_tokens: tuple[int, int], run_state: dict, total_steps: int, wall: float, world: int, mixed: str,
               final: dict, num_heads: int) -> dict:
    """What `config.extra` records about the run: data, steps, time, and held-out accuracy per head."""
    training = {
        "method": "medusa-2" if cfg.medusa2 else "medusa-1", "data_dirs": [str(d) for d in (data_cfg.out_dir, *data_cfg.extra_dirs)], "data_key": data_key,
        "train_conversations": len(train_idx), "eval_conversations": len(eval_idx),
        "train_response_tokens": train_tokens[0], "train_scored_tokens": train_tokens[1],
        "tokens_seen": run_state["tokens_seen"], "steps": total_steps,
        "epochs": round(run_state["tokens_seen"] / max(train_tokens[1], 1), 3), "wall_time_s": round(wall, 1),
        "processes": world, "mixed_precision": mixed, "lr": cfg.lr, "head_decay": cfg.head_decay, "seed": cfg.seed,
    }
    evaluation = {f"head{k}": {name.split("/")[-1]: round(v, 4) for name, v in final.items()
                               if name.startswith(f"eval/head{k}/")} for k in range(num_heads)}
    if cfg.medusa2:
        training.update(lora_r=cfg.lora_r, lora_lr=cfg.lora_lr, kl_weight=cfg.kl_weight)
        evaluation["base_kl"] = final.get("eval/kl")
    return {"training": training, "eval": evaluation}


def shut_down(accelerator) -> None:
    """Free the DDP model, then close trackers and destroy the process group, in that order.

    DDP's Reducer holds the gloo process group. If the Reducer's destructor drops the last reference, the group's
    destructor joins its worker thread while holding the GIL, and that thread may need the GIL to free a finished
    collective's tensors: a deadlock seen here at exit (pytorch/pytorch#56297). Freed first (the caller deletes its
    own references), the Reducer only decrements the group's count; `destroy_process_group` then frees the group
    through its binding, which releases the GIL.
    """
    accelerator.free_memory()  # drops accelerate's references to the prepared model and optimizer, then gc.collect()
    accelerator.end_training()


@dataclass
class TrainResult:
    output_dir: Path | None  # None when the run stopped early (stop_after_steps)
    steps: int
    eval_history: list[dict] = field(default_factory=list)  # {"step": s, "eval/head0/top1": ..., ...}
    tokens_per_s: float = 0.0  # response tokens through the heads per second, all processes
    wall_time_s: float = 0.0


def train(cfgs: dict, *, resume: bool = False, stop_after_steps: int | None = None) -> TrainResult:
    """Run one training job from built config sections. `stop_after_steps` stops (as if preempted) after that
    many optimizer steps of this invocation, without writing the output (to test resumption)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    model_cfg: ModelConfig = cfgs["model"]
    data_cfg: DataConfig = cfgs["data"]
    heads_cfg: HeadsConfig = cfgs["heads"]
    cfg: TrainingConfig = cfgs["training"]
    if cfg.distill and heads_cfg.projection != "shared":
        raise ValueError("training.distill reads the base's distribution through its lm_head, which only shared-"
                         "projection heads use: set heads.projection shared or training.distill false")
    if cfg.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # no account needed; `wandb sync` uploads later
    # cpu=True on a host without an accelerator: torchrun-started processes then join one gloo group (without it
    # accelerate leaves each of them alone in a world of one).
    state = PartialState(cpu=_env_flag("ACCELERATE_USE_CPU") or not _accelerator_available(),
                         timeout=timedelta(hours=2))  # generous: the main process merges the hidden-state cache alone
    mixed = resolve_mixed_precision(cfg.mixed_precision, state.device)
    accelerator = Accelerator(mixed_precision=mixed, log_with="wandb" if cfg.report_to == "wandb" else None)
    main = accelerator.is_main_process
    check_distributed_type(accelerator)

    def log(message: str) -> None:
        if main:
            tqdm.write(message)

    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(cfg.seed)
    ckpt_root = checkpoint_root(cfg)
    if main:  # found now, not after every step: where the heads and checkpoints go must take files
        for directory in (Path(cfg.output_dir).parent, ckpt_root):
            check_writable(directory)
    resume_from = latest_checkpoint(ckpt_root)
    if resume and resume_from is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_root}; drop --resume to start a fresh run")
    if not resume and resume_from is not None:
        raise FileExistsError(f"{ckpt_root} holds checkpoints of an earlier run: pass --resume to continue it, or delete "
                              "them / set training.checkpoint_dir to start afresh")

    with accelerator.main_process_first():  # the first load of the embedded GGUF converts it once
        base, _ = load_base(model_cfg.base, dtype=model_cfg.dtype, device=accelerator.device)
    base.requires_grad_(False)
    base_ref = model_cfg.base or DEFAULT_BASE
    lm_head = base.get_output_embeddings()
    hidden_size, vocab_size = base.config.get_text_config().hidden_size, lm_head.weight.shape[0]
    data_dirs = [data_cfg.out_dir, *data_cfg.extra_dirs]
    convs, parts = [], []
    for data_dir in data_dirs:
        loaded = load_conversations(data_dir, cfg.max_length, vocab_size, prompt_only=cfg.prompt_tokens)
        parts.append(range(len(convs), len(convs) + len(loaded)))
        convs += loaded
    train_idx, eval_idx = split_eval(convs, cfg.eval_conversations)
    data_key = data_fingerprint(convs)
    heads = build_heads(heads_cfg, hidden_size, vocab_size, lm_head, base_ref).to(accelerator.device)
    if heads_cfg.vocab_subset_size:  # the candidate vocabulary: what proposing ranks, and maybe the loss's softmax
        heads.set_vocab_subset(frequent_tokens(
            (convs[i].ids[convs[i].response_start:] for i in train_idx), heads_cfg.vocab_subset_size, vocab_size))
    response_tokens = sum(convs[i].response_tokens for i in train_idx)
    if cfg.prompt_tokens:  # every position of a training conversation is scored (against the base's distribution)
        for i in train_idx:
            convs[i] = Conversation(convs[i].ids, 0)
    train_tokens = (response_tokens, sum(convs[i].response_tokens for i in train_idx))  # (responses, scored)
    log(f"{len(convs)} conversations in {', '.join(map(str, data_dirs))}: {len(train_idx)} train ({response_tokens} "
        f"response tokens" + (f", {train_tokens[1]} with the prompts" if cfg.prompt_tokens else "") + "), "
        f"{len(eval_idx)} held out; {world} process(es), mixed precision {mixed}")

    trainer, fetch, lengths = build_trainer(accelerator, cfg, heads, base, convs, mixed, parts, log,
                                            loss_over_candidates=bool(heads_cfg.vocab_subset_size) and heads_cfg.loss_over_candidates)
    del base  # the trainer holds what it needs (with precomputed hidden states: only lm_head)
    trainer.train()
    plan = StepPlan(train_idx, lengths, cfg, world)
    total_steps = plan.total_steps()
    eval_batches = pack(eval_idx, lengths, cfg.batch_size, cfg.batch_unit)
    optimizer = torch.optim.AdamW(param_groups(trainer, cfg), lr=cfg.lr)
    # Not passed to accelerator.prepare: its wrapper would step the schedule once per process.
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)
    snapshot = run_snapshot(heads_cfg, cfg, data_key, base_ref, world)
    run_state = {"tokens_seen": 0, "elapsed_s": 0.0, "eval_history": [], "snapshot": snapshot}
    start_step = 0
    if resume_from is not None:
        saved = json.loads((resume_from / "trainer_state.json").read_text())
        check_snapshot(resume_from, saved["snapshot"], snapshot)
        run_state = load_checkpoint(resume_from, trainer, optimizer, scheduler, rank, log)
        start_step = run_state.pop("step")
        log(f"resumed from {resume_from} at step {start_step}")
    trainer, optimizer = accelerator.prepare(trainer, optimizer)
    if cfg.report_to == "wandb":
        config = {f"{s}.{k}": v for s, c in cfgs.items() for k, v in asdict(c).items()}
        accelerator.init_trackers(cfg.wandb_project, config=json.loads(json.dumps(config, default=str)),
                                  init_kwargs={"wandb": {"name": cfg.run_name}} if cfg.run_name else {})
    num_heads = heads_cfg.num_heads
    positions = loss_positions(convs, num_heads)
    weights = head_weights(num_heads, cfg.head_decay, cfg.heads_coefficient)
    log(f"training {sum(p.numel() for p in trainer.parameters() if p.requires_grad):,} parameters for {total_steps} "
        f"steps ({plan.steps_in_epoch(0)} per epoch); head weights {[round(w, 3) for w in weights]}")

    def run_eval(step: int) -> dict:
        metrics = evaluate(accelerator, trainer, eval_batches, fetch, num_heads) if eval_batches else {}
        if metrics:
            log(f"eval @ step {step}: {format_eval(metrics, num_heads)}")
            accelerator.log(metrics, step=step)
            run_state["eval_history"].append({"step": step, **metrics})
        return metrics

    if start_step == 0:
        run_eval(0)  # the untrained heads: the baseline every later evaluation is read against
    bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="train heads", disable=not main)
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "t0": time.time()}
    run_start, tokens_at_start = time.time(), run_state["tokens_seen"]
    step = start_step
    for step in range(start_step, total_steps):
        if stop_after_steps is not None and step - start_step >= stop_after_steps:
            bar.close()
            del trainer, optimizer
            shut_down(accelerator)
            return TrainResult(None, step, run_state["eval_history"])
        micro = plan.micro_batches(step, rank)
        with_acc = (step + 1) % cfg.log_every == 0
        # Each loss is divided by its positions over the whole step (every micro-batch of every process, known from
        # the plan without communication); x world because DDP averages gradients. Micro-batches then add up to the
        # exact gradient of one large batch, whatever the split.
        normalizer = (positions[plan.step_rows(step)].sum(0) / world).float().to(accelerator.device)
        sums = None
        for i, rows in enumerate(micro):
            sync = nullcontext() if i == len(micro) - 1 else accelerator.no_sync(trainer)
            with sync:
                out = trainer(**fetch(rows), topk=TOPK if with_acc else 0, normalizer=normalizer)
                accelerator.backward(out["loss"])
            window["loss"] += out["loss"].item()
            if with_acc:
                part = (out["correct"].detach().cpu(), out["count"].detach().cpu())
                sums = part if sums is None else (sums[0] + part[0], sums[1] + part[1])
        if cfg.max_grad_norm:
            accelerator.clip_grad_norm_(trainer.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        step_tokens = sum(convs[i].response_tokens for i in plan.step_rows(step))  # all processes, no communication
        window["steps"] += 1
        window["tokens"] += step_tokens
        run_state["tokens_seen"] += step_tokens
        bar.update(1)
        if with_acc:
            loss = float(reduce_sum(accelerator, torch.tensor(window["loss"], dtype=torch.float64))) / (window["steps"] * world)
            correct, count = (reduce_sum(accelerator, t).cpu() for t in sums)
            tok_s = window["tokens"] / max(time.time() - window["t0"], 1e-9)
            top1 = " ".join(f"{float(correct[k, 0]) / max(int(count[k]), 1):.2f}" for k in range(num_heads))
            log(f"step {done}/{total_steps} loss {loss:.4f} top1/head {top1} lr {scheduler.get_last_lr()[0]:.2e} "
                f"{tok_s:.0f} tok/s")
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
            accelerator.log({"train/loss": loss, "train/tokens_per_s": tok_s, "train/lr": scheduler.get_last_lr()[0],
                             **{f"train/head{k}/top1": float(correct[k, 0]) / max(int(count[k]), 1)
                                for k in range(num_heads)}}, step=done)
            window = {"loss": 0.0, "steps": 0, "tokens": 0, "t0": time.time()}
        pause = time.time()  # evaluation and checkpoints stay out of the tokens/s window
        if cfg.eval_every and done % cfg.eval_every == 0 and done != total_steps:
            run_eval(done)
        if cfg.save_every and done % cfg.save_every == 0 and done != total_steps:
            elapsed = run_state["elapsed_s"] + time.time() - run_start
            save_checkpoint(accelerator, ckpt_root, done, trainer, optimizer, scheduler,
                            {**run_state, "elapsed_s": elapsed}, cfg.keep_checkpoints)
        window["t0"] += time.time() - pause
    bar.close()
    final = run_eval(total_steps)
    wall = run_state["elapsed_s"] + time.time() - run_start
    tok_s = (run_state["tokens_seen"] - tokens_at_start) / max(time.time() - run_start, 1e-9)
    log(f"trained {total_steps} steps in {wall:.0f} s: {tok_s:.0f} response tokens/s through the heads")
    output_dir = Path(cfg.output_dir)
    if main:
        extra = provenance(cfg, data_cfg, data_key, train_idx, eval_idx, train_tokens, run_state, total_steps, wall,
                           world, mixed, final, num_heads)
        save_output(accelerator.unwrap_model(trainer), output_dir, extra)
        log(f"heads written to {output_dir} (load with MedusaModel.from_pretrained({str(output_dir)!r}))")
    accelerator.wait_for_everyone()
    del trainer, optimizer
    shut_down(accelerator)
    return TrainResult(output_dir, total_steps, run_state["eval_history"], tok_s, wall)


def _env_flag(name: str, env=None) -> bool:
    return (os.environ if env is None else env).get(name, "").strip().lower() in ("1", "true", "yes")


def _accelerator_available() -> bool:
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accel.is_available() if accel is not None else torch.cuda.is_available()


def requested_cpu_processes(env=None, parent: list[str] | None = None) -> int | None:
    """N when this process was started by `accelerate launch --cpu --num_processes N` with N > 1, else None.

    accelerate 1.x starts a single process for that command (several CPU processes need mpirun; huggingface/accelerate
    issue 2741): the only traces are ACCELERATE_USE_CPU, a MASTER_ADDR with no WORLD_SIZE, and the launcher's own
    command line, which is our parent's.
    """
    env = os.environ if env is None else env
    launched = ("WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if not _env_flag("ACCELERATE_USE_CPU", env) or "MASTER_ADDR" not in env or any(v in env for v in launched):
        return None
    if parent is None:
        try:
            parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
        except OSError:  # not Linux: nothing to read
            return None
    if "launch" not in parent:
        return None
    launcher_args = parent[parent.index("launch") + 1:]
    script = next((i for i, arg in enumerate(launcher_args) if arg.endswith(".py")), len(launcher_args))
    launcher_args = launcher_args[:script]  # the training script's own arguments are not the launcher's
    values: dict[str, str] = {}
    for i, arg in enumerate(launcher_args):
        name, _, value = arg.partition("=")
        name = name.replace("-", "_")
        if name in ("__num_processes", "__num_machines"):
            values[name] = value or (launcher_args[i + 1] if i + 1 < len(launcher_args) else "")
    processes, machines = values.get("__num_processes", "1"), values.get("__num_machines", "1")
    if not (processes.isdigit() and machines in ("", "1")):
        return None
    return int(processes) if int(processes) > 1 else None


def relaunch_with_torchrun(processes: int, argv: list[str]) -> None:
    """Replace this process by `torch.distributed.run` with `processes` workers (DDP over gloo); never returns."""
    print(f"accelerate launch --cpu started one process for --num_processes {processes}: relaunching through "
          f"torch.distributed.run with {processes} processes (DDP over gloo)", flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_addr", os.environ["MASTER_ADDR"], "--master_port", os.environ.get("MASTER_PORT", "29500"),
               str(Path(__file__).resolve()), *argv]
    os.execv(sys.executable, command)


def check_writable(directory: Path) -> None:
    """Create `directory` if needed and write (then remove) a file in it; a clear error naming it otherwise."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".medusa-write-check-"):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write to {directory} ({err.strerror or err}): choose a writable "
                              "training.output_dir / training.checkpoint_dir") from err


def main(argv: list[str] | None = None) -> TrainResult:
    if argv is None and (processes := requested_cpu_processes()):
        relaunch_with_torchrun(processes, sys.argv[1:])
    args, cfgs = parse_args(
        __doc__, SECTIONS, argv,
        extra=lambda p: p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint"))
    return train(cfgs, resume=args.resume)


if __name__ == "__main__":
    main()
