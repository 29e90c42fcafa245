"""Held-out evaluation, the run's provenance and the final heads directory."""

from __future__ import annotations

from pathlib import Path

import torch

from medusa.config import MedusaConfig
from medusa.fileio import write_directory
from medusa.heads import MedusaHeads
from medusa.heads_io import CARD_NAME, model_card, save_heads
from medusa.loading import resolve_dtype
from medusa.train.config import DataConfig, TrainingConfig
from medusa.train.losses import TOPK
from medusa.train.trainer import HeadTrainer

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def reduce_sum(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    return (
        accelerator.reduce(tensor.to(accelerator.device), reduction="sum") if accelerator.num_processes > 1 else tensor
    )


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
def evaluate(
    accelerator, trainer: HeadTrainer, batches: list[list[int]], fetch, num_heads: int, lockstep: bool = False
) -> dict:
    """Top-1..top-5 accuracy and cross-entropy per head on the held-out conversations (all processes share them).

    lockstep: every process runs as many forwards as the busiest one (FSDP's gathers are collectives); the extra
    ones repeat a batch and are not counted."""
    model = accelerator.unwrap_model(trainer)
    model.eval()
    ce_sum = torch.zeros(num_heads, dtype=torch.float64)
    correct = torch.zeros(num_heads, TOPK, dtype=torch.long)
    count = torch.zeros(num_heads, dtype=torch.long)
    kl_sum, kl_count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.long)
    with accelerator.autocast():
        mine = batches[accelerator.process_index :: accelerator.num_processes]
        rounds = -(-len(batches) // accelerator.num_processes) if lockstep else len(mine)
        for i in range(rounds):
            out = model(**fetch(mine[i] if i < len(mine) else batches[0]), topk=TOPK, exact=True)
            if i >= len(mine):
                continue
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
    parts = [
        f"head{k} top1 {metrics[f'eval/head{k}/top1']:.3f} top5 {metrics[f'eval/head{k}/top5']:.3f}"
        for k in range(num_heads)
    ]
    if "eval/kl" in metrics:
        parts.append(f"base KL {metrics['eval/kl']:.4f}")
    return " | ".join(parts)


def save_output(
    trainer: HeadTrainer, output_dir: Path, extra: dict, datasets: list[str] = (), full_state: dict | None = None
) -> None:
    """Heads (+ the LoRA adapter for Medusa-2) and their model card into `output_dir`, via a temporary folder moved
    into place. full_state: the trainer's trainable weights gathered whole (sharded runs; see sharding.py)."""

    def write(tmp: Path) -> None:
        save_dtype = resolve_dtype(trainer.cfg.save_dtype) if trainer.cfg.save_dtype else None
        heads, adapter = trainer.heads, None
        if full_state is not None:  # a plain copy of the heads holds the whole tensors
            heads = MedusaHeads(trainer.heads.config)
            heads.load_state_dict({k[len("heads.") :]: v for k, v in full_state.items() if k.startswith("heads.")})
            adapter = {k[len("base.") :]: v for k, v in full_state.items() if k.startswith("base.")}
        save_heads(heads, tmp, extra=extra, dtype=save_dtype)
        if trainer.cfg.medusa2:  # adapter_config.json + adapter_model.safetensors
            trainer.base.save_pretrained(str(tmp), state_dict=adapter)
        # ours replaces peft's card template (placeholders only)
        (tmp / CARD_NAME).write_text(model_card(MedusaConfig.load(tmp), datasets))

    # without Medusa-2, a stale adapter left in output_dir would be merged into the base at load time
    write_directory(output_dir, write, stale=() if trainer.cfg.medusa2 else ADAPTER_FILES)


def provenance(
    cfg: TrainingConfig,
    data_cfg: DataConfig,
    data_key: str,
    train_idx,
    eval_idx,
    train_tokens: tuple[int, int],
    run_state,
    total_steps: int,
    wall: float,
    world: int,
    mixed: str,
    final: dict,
    num_heads: int,
) -> dict:
    """What `config.extra` records about the run: data, steps, time, and held-out accuracy per head."""
    training = {
        "method": "medusa-2" if cfg.medusa2 else "medusa-1",
        "data_dirs": [str(d) for d in (data_cfg.out_dir, *data_cfg.extra_dirs)],
        "data_key": data_key,
        "train_conversations": len(train_idx),
        "eval_conversations": len(eval_idx),
        "train_response_tokens": train_tokens[0],
        "train_scored_tokens": train_tokens[1],
        "tokens_seen": run_state.tokens_seen,
        "steps": total_steps,
        "epochs": round(run_state.tokens_seen / max(train_tokens[1], 1), 3),
        "wall_time_s": round(wall, 1),
        "processes": world,
        "mixed_precision": mixed,
        "lr": cfg.lr,
        "head_decay": cfg.head_decay,
        "seed": cfg.seed,
    }
    evaluation = {
        f"head{k}": {name.split("/")[-1]: round(v, 4) for name, v in final.items() if name.startswith(f"eval/head{k}/")}
        for k in range(num_heads)
    }
    if cfg.medusa2:
        training.update(lora_r=cfg.lora_r, lora_lr=cfg.lora_lr, kl_weight=cfg.kl_weight)
        evaluation["base_kl"] = final.get("eval/kl")
    return {"training": training, "eval": evaluation}
