"""Train Medusa heads on self-distillation data with `accelerate`: one process, or DDP over several (CPU or GPU).

    accelerate launch train/train.py --config configs/smollm2-135m.yaml              # Medusa-1: frozen base
    accelerate launch train/train.py --config configs/smollm2-135m-medusa2.yaml      # Medusa-2: LoRA base + heads
    torchrun --nproc_per_node 2 train/train.py --config configs/smollm2-135m.yaml    # DDP (gloo on CPU)
    ... --training.shard fsdp --training.precompute_hidden false     # FSDP2: the base sharded over the processes
    ... --training.max_steps 200 --training.lr 2e-3     # any `--section.key value` overrides the YAML
    ... --resume                                        # continue from the newest checkpoint
    ... --help                                          # every option, with what it does

Reads the shards train/generate_data.py wrote to `data.out_dir`, holds out `training.eval_conversations` of them
(chosen by a hash of their tokens), and writes `training.output_dir`: medusa_config.json + medusa_heads.safetensors
(+ adapter_config.json / adapter_model.safetensors for Medusa-2), loadable with `MedusaModel.from_pretrained(dir)`.
With a frozen base (Medusa-1) the base's last hidden states are computed once and cached in `training.cache_dir`.

The stages live beside this file: config.py (options), batches.py (conversations, held-out split, step plan),
hidden_cache.py, trainer.py (heads + loss as one module), checkpoints.py, evaluate.py (evaluation and output).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from medusa.loading import DEFAULT_BASE, hub_commit
from medusa.train import checkpoints
from medusa.train.batches import (
    Conversation,
    StepPlan,
    data_fingerprint,
    load_directories,
    loss_positions,
    pack,
    split_eval,
)  # noqa: E501
from medusa.train.config import Config, parse_args
from medusa.train.data import frequent_tokens
from medusa.train.evaluate import evaluate, format_eval, provenance, reduce_sum, save_output
from medusa.train.losses import TOPK, head_weights
from medusa.train.sharding import full_trainable_state, shard_trainer
from medusa.train.trainer import build_heads, build_trainer, load_frozen_base, param_groups


@dataclass
class TrainResult:
    output_dir: Path | None  # None when the run stopped early (stop_after_steps)
    steps: int
    eval_history: list[dict] = field(default_factory=list)  # {"step": s, "eval/head0/top1": ..., ...}
    tokens_per_s: float = 0.0  # response tokens through the heads per second, all processes
    wall_time_s: float = 0.0


def train(cfg: Config, *, resume: bool = False, stop_after_steps: int | None = None) -> TrainResult:
    """Run one training job. `stop_after_steps` stops (as if preempted) after that many optimizer steps of this
    invocation, without writing the output (to test resumption)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    launched_fsdp, state = start_processes()
    if cfg.eagle3.enabled:  # an EAGLE-3 draft instead of heads
        from medusa.train.eagle3 import train_eagle3

        return train_eagle3(cfg, resume=resume, stop_after_steps=stop_after_steps, launched_fsdp=launched_fsdp)
    tcfg = cfg.training
    if tcfg.distill and cfg.heads.projection != "shared":
        raise ValueError(
            "training.distill reads the base's distribution through its lm_head, which only shared-"
            "projection heads use: set heads.projection shared or training.distill false"
        )
    if tcfg.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # no account needed; `wandb sync` uploads later
    mixed = resolve_mixed_precision(tcfg.mixed_precision, state.device)
    accelerator = Accelerator(
        mixed_precision=mixed,
        log_with="wandb" if tcfg.report_to == "wandb" else None,
        project_config=checkpoints.project_configuration(tcfg),
    )
    main = accelerator.is_main_process
    check_distributed_type(accelerator)
    shard = resolve_shard(cfg, accelerator, launched_fsdp)
    tcfg = cfg.training

    def log(message: str) -> None:
        if main:
            tqdm.write(message)

    warn_single_cpu_launch(log)
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(tcfg.seed)
    ckpt_root = checkpoints.checkpoint_root(tcfg)
    if main:  # found now, not after every step: where the heads and checkpoints go must take files
        for directory in (Path(tcfg.output_dir).parent, ckpt_root):
            checkpoints.check_writable(directory)
    resume_from = checkpoints.check_resume(ckpt_root, resume)

    # ---- the base and the data
    with accelerator.main_process_first():  # the first load of the embedded GGUF converts it once
        # (sharded: loaded on the CPU, each process then moves only its shards to the device)
        base = load_frozen_base(cfg.model, torch.device("cpu") if shard else accelerator.device)
    base_ref = cfg.model.base or DEFAULT_BASE
    base_revision = hub_commit(cfg.model.base)  # the commit of a Hub base (else None), recorded with the heads
    lm_head = base.get_output_embeddings()
    hidden_size, vocab_size = base.config.get_text_config().hidden_size, lm_head.weight.shape[0]
    data_dirs = [cfg.data.out_dir, *cfg.data.extra_dirs]
    convs, parts = load_directories(data_dirs, tcfg.max_length, vocab_size, prompt_only=tcfg.prompt_tokens)
    train_idx, eval_idx = split_eval(convs, tcfg.eval_conversations)
    data_key = data_fingerprint(convs)

    # ---- the heads, the trainer around them, the optimizer
    heads = build_heads(cfg.heads, hidden_size, vocab_size, lm_head, base_ref, base_revision).to(accelerator.device)
    if cfg.heads.vocab_subset_size and (
        cfg.heads.init_from is None  # (init_from's own subset is kept)
        or heads.config.vocab_subset_size != cfg.heads.vocab_subset_size
    ):
        heads.set_vocab_subset(
            frequent_tokens(  # the candidate vocabulary: what proposing ranks
                (convs[i].ids[convs[i].response_start :] for i in train_idx), cfg.heads.vocab_subset_size, vocab_size
            )
        )
    response_tokens = sum(convs[i].response_tokens for i in train_idx)
    if tcfg.prompt_tokens:  # every position of a training conversation is scored (against the base's distribution)
        for i in train_idx:
            convs[i] = Conversation(convs[i].ids, 0)
    train_tokens = (response_tokens, sum(convs[i].response_tokens for i in train_idx))  # (responses, scored)
    log(
        f"{len(convs)} conversations in {', '.join(map(str, data_dirs))}: {len(train_idx)} train ({response_tokens} "
        f"response tokens" + (f", {train_tokens[1]} with the prompts" if tcfg.prompt_tokens else "") + "), "
        f"{len(eval_idx)} held out; {world} process(es), mixed precision {mixed}"
    )
    trainer, fetch, lengths = build_trainer(accelerator, tcfg, heads, base, convs, mixed, parts, log)
    del base  # the trainer holds what it needs (with precomputed hidden states: only lm_head)
    trainer.train()
    if shard:
        shard_trainer(trainer, accelerator.device)
        local = sum(p.to_local().numel() for p in trainer.parameters())
        log(f"FSDP2: this process holds {local:,} of {sum(p.numel() for p in trainer.parameters()):,} weights")
    plan = StepPlan(train_idx, lengths, tcfg, world)
    total_steps = plan.total_steps()
    eval_batches = pack(eval_idx, lengths, tcfg.batch_size, tcfg.batch_unit)
    optimizer = torch.optim.AdamW(param_groups(trainer, tcfg), lr=tcfg.lr)
    # Not passed to accelerator.prepare: its wrapper would step the schedule once per process.
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=tcfg.warmup_steps, num_training_steps=total_steps)
    # Sharded, the trainer and AdamW stay out of accelerate (it would wrap the trainer in DDP on CPU processes):
    # the loop and `checkpoints` do for them what accelerate does otherwise.
    sharded = (trainer, optimizer) if shard else None
    if not shard:
        trainer, optimizer = accelerator.prepare(trainer, optimizer)

    # ---- resumption: weights, AdamW, schedule, random states and counters come back through accelerate
    run_state = checkpoints.RunState()
    accelerator.register_for_checkpointing(scheduler, run_state)
    accelerator.register_save_state_pre_hook(checkpoints.save_trainable_only(trainer))
    accelerator.register_load_state_pre_hook(checkpoints.check_trainable(trainer))
    snapshot = checkpoints.run_snapshot(cfg, data_key, base_ref, world)
    if resume_from is not None:
        checkpoints.resume(accelerator, resume_from, snapshot, sharded)
        log(f"resumed from {resume_from} at step {run_state.step}")
    start_step = run_state.step
    if tcfg.report_to == "wandb":
        config = {f"{s}.{k}": v for s, c in asdict(cfg).items() for k, v in c.items()}
        accelerator.init_trackers(
            tcfg.wandb_project,
            config=json.loads(json.dumps(config, default=str)),
            init_kwargs={"wandb": {"name": tcfg.run_name}} if tcfg.run_name else {},
        )
    num_heads = cfg.heads.num_heads
    positions = loss_positions(convs, num_heads)
    weights = head_weights(num_heads, tcfg.head_decay, tcfg.heads_coefficient)
    log(
        f"training {sum(p.numel() for p in trainer.parameters() if p.requires_grad):,} parameters for {total_steps} "
        f"steps ({plan.steps_in_epoch(0)} per epoch); head weights {[round(w, 3) for w in weights]}"
    )

    def run_eval(step: int) -> dict:
        # trainer: bound before any call (ruff reads the `del` below as undefining it here)
        metrics = (
            evaluate(accelerator, trainer, eval_batches, fetch, num_heads, lockstep=shard)  # noqa: F821
            if eval_batches
            else {}
        )
        if metrics:
            log(f"eval @ step {step}: {format_eval(metrics, num_heads)}")
            accelerator.log(metrics, step=step)
            run_state.eval_history.append({"step": step, **metrics})
        return metrics

    # ---- the loop
    if start_step == 0:
        run_eval(0)  # the untrained heads: the baseline every later evaluation is read against
    bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="train heads", disable=not main)
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "t0": time.time()}
    run_start, tokens_at_start, elapsed_before = time.time(), run_state.tokens_seen, run_state.elapsed_s
    for step in range(start_step, total_steps):
        if stop_after_steps is not None and step - start_step >= stop_after_steps:
            bar.close()
            del trainer, optimizer
            shut_down(accelerator)
            return TrainResult(None, step, run_state.eval_history)
        micro = plan.micro_batches(step, rank)
        with_acc = (step + 1) % tcfg.log_every == 0
        # Each loss is divided by its positions over the whole step (every micro-batch of every process, known from
        # the plan without communication); x world because DDP averages gradients. Micro-batches then add up to the
        # exact gradient of one large batch, whatever the split.
        normalizer = (positions[plan.step_rows(step)].sum(0) / world).float().to(accelerator.device)
        sums = None
        for i, rows in enumerate(micro):
            last = i == len(micro) - 1
            if shard:  # FSDP2: reduce-scatter the gradients at the last micro-batch only; autocast as prepare would
                trainer.set_requires_gradient_sync(last)
                sync = accelerator.autocast()
            else:
                sync = nullcontext() if last else accelerator.no_sync(trainer)
            with sync:
                out = trainer(**fetch(rows), topk=TOPK if with_acc else 0, normalizer=normalizer)
                accelerator.backward(out["loss"])
            window["loss"] += out["loss"].item()
            if with_acc:
                part = (out["correct"].detach().cpu(), out["count"].detach().cpu())
                sums = part if sums is None else (sums[0] + part[0], sums[1] + part[1])
        if tcfg.max_grad_norm:
            accelerator.clip_grad_norm_(trainer.parameters(), tcfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        step_tokens = sum(convs[i].response_tokens for i in plan.step_rows(step))  # all processes, no communication
        window["steps"] += 1
        window["tokens"] += step_tokens
        run_state.tokens_seen += step_tokens
        bar.update(1)
        if with_acc:
            loss = float(reduce_sum(accelerator, torch.tensor(window["loss"], dtype=torch.float64))) / (
                window["steps"] * world
            )
            correct, count = (reduce_sum(accelerator, t).cpu() for t in sums)
            tok_s = window["tokens"] / max(time.time() - window["t0"], 1e-9)
            top1 = [float(correct[k, 0]) / max(int(count[k]), 1) for k in range(num_heads)]
            log(
                f"step {done}/{total_steps} loss {loss:.4f} top1/head {' '.join(f'{t:.2f}' for t in top1)} "
                f"lr {scheduler.get_last_lr()[0]:.2e} {tok_s:.0f} tok/s"
            )
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
            accelerator.log(
                {
                    "train/loss": loss,
                    "train/tokens_per_s": tok_s,
                    "train/lr": scheduler.get_last_lr()[0],
                    **{f"train/head{k}/top1": top1[k] for k in range(num_heads)},
                },
                step=done,
            )
            window = {"loss": 0.0, "steps": 0, "tokens": 0, "t0": time.time()}
        pause = time.time()  # evaluation and checkpoints stay out of the tokens/s window
        if tcfg.eval_every and done % tcfg.eval_every == 0 and done != total_steps:
            run_eval(done)
        if tcfg.save_every and done % tcfg.save_every == 0 and done != total_steps:
            run_state.step, run_state.elapsed_s = done, elapsed_before + time.time() - run_start
            checkpoints.save(accelerator, done, snapshot, sharded)
        window["t0"] += time.time() - pause

    # ---- the end: a last evaluation, then the heads directory
    bar.close()
    final = run_eval(total_steps)
    wall = elapsed_before + time.time() - run_start
    tok_s = (run_state.tokens_seen - tokens_at_start) / max(time.time() - run_start, 1e-9)
    log(f"trained {total_steps} steps in {wall:.0f} s: {tok_s:.0f} response tokens/s through the heads")
    output_dir = Path(tcfg.output_dir)
    full_state = full_trainable_state(trainer) if shard else None  # collective: every process gathers
    if main:
        extra = provenance(
            tcfg,
            cfg.data,
            data_key,
            train_idx,
            eval_idx,
            train_tokens,
            run_state,
            total_steps,
            wall,
            world,
            mixed,
            final,
            num_heads,
        )
        save_output(
            accelerator.unwrap_model(trainer),
            output_dir,
            extra,
            datasets=sorted({source.split(":")[-1] for source in cfg.data.sources}),
            full_state=full_state,
        )
        log(f"heads written to {output_dir} (load with MedusaModel.from_pretrained({str(output_dir)!r}))")
    accelerator.wait_for_everyone()
    del trainer, optimizer
    shut_down(accelerator)
    return TrainResult(output_dir, total_steps, run_state.eval_history, tok_s, wall)


def start_processes():
    """Join this launch's processes (if any) before an Accelerator is built. -> (whether `accelerate launch
    --use_fsdp` asked for sharding, accelerate's PartialState)."""
    from accelerate import PartialState

    launched_fsdp = _env_flag("ACCELERATE_USE_FSDP")  # `accelerate launch --use_fsdp`
    if launched_fsdp and not _accelerator_available():
        # accelerate 1.x builds its FSDP plugin for accelerator devices only (it raises on CPU): train.py shards
        # with FSDP2 itself in any case, so the launch's request is kept in training.shard instead
        os.environ["ACCELERATE_USE_FSDP"] = "false"
    # cpu=True on a host without an accelerator: torchrun-started processes then join one gloo group (without it
    # accelerate leaves each of them alone in a world of one).
    state = PartialState(
        cpu=_env_flag("ACCELERATE_USE_CPU") or not _accelerator_available(), timeout=timedelta(hours=2)
    )  # generous: the main process merges the hidden-state cache alone
    return launched_fsdp, state


def resolve_shard(cfg: Config, accelerator, launched_fsdp: bool) -> bool:
    """Whether this run shards with FSDP2 (training.shard fsdp, or `accelerate launch --use_fsdp`, which sets it in
    cfg.training); one process holds everything anyway. Refuses what cannot be sharded."""
    from accelerate.utils import DistributedType

    if cfg.training.shard == "none" and (launched_fsdp or accelerator.distributed_type == DistributedType.FSDP):
        cfg.training = replace(cfg, training=replace(cfg.training, shard="fsdp")).training  # the whole checked again
    if cfg.training.shard == "fsdp" and cfg.model.quantize != "none":
        raise NotImplementedError(
            "training.shard fsdp cannot shard the int8 (torchao) base: set model.quantize none (model.dtype "
            "bfloat16 halves the base instead), or train without sharding"
        )
    return cfg.training.shard == "fsdp" and accelerator.num_processes > 1


def check_distributed_type(accelerator) -> None:
    """Single process, DDP and FSDP (train.py shards itself, see sharding.py) are supported; DeepSpeed and Megatron
    are refused with the reason."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"train/train.py does not support {kind.value}: it owns gradient accumulation and stepping, which the "
            "step-wide loss normalisation does itself. Shard with FSDP instead (`accelerate launch --use_fsdp ...` "
            "or training.shard fsdp, with training.precompute_hidden false), or use DDP (`accelerate launch "
            "--multi_gpu --num_processes N train/train.py ...`); see docs/training.md, 'Several processes and GPUs'"
        )


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


def warn_single_cpu_launch(log) -> None:
    """`accelerate launch --cpu --num_processes N` starts one process whatever N (huggingface/accelerate#2741): its
    trace is ACCELERATE_USE_CPU with a MASTER_ADDR but no WORLD_SIZE. Say so, and what starts N."""
    if _env_flag("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:
        log(
            "note: `accelerate launch --cpu` runs one process whatever --num_processes says; for DDP over gloo use "
            "`torchrun --nproc_per_node N train/train.py ...` or `accelerate launch --multi_gpu --num_processes N ...`"
        )


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


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _accelerator_available() -> bool:
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accel.is_available() if accel is not None else torch.cuda.is_available()


def main(argv: list[str] | None = None) -> TrainResult:
    args, cfg = parse_args(
        __doc__,
        argv,
        extra=lambda p: p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint"),
    )
    return train(cfg, resume=args.resume)


if __name__ == "__main__":
    main()
