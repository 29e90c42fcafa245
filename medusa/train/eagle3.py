"""Train an EAGLE-3 draft (medusa.eagle3) on the frozen target with training-time test: `train/train.py` with
`eagle3.enabled: true` comes here.

    accelerate launch train/train.py --config configs/smollm2-135m-eagle3.yaml [--resume]

Each micro-step runs the target over one conversation (its hidden states at the aux layers and its distribution at
every position: online; with eagle3.cache_features computed once and read from disk), unrolls the draft
`eagle3.ttt_steps` steps over its own outputs (medusa.eagle3.unrolled_outputs) and scores step j against the
target's distribution over the draft vocabulary at the position it predicts, weighted eagle3.step_decay**j
(EAGLE-3's loss). Answer positions only (every position with eagle3.prompt_tokens); positions whose target choice
lies outside the draft vocabulary are not scored (the draft cannot name it). The output directory is a
speculators-format draft (medusa.eagle3_io), loadable with `MedusaModel.from_draft_model(target, directory)`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from medusa.eagle3 import Eagle3Draft, default_aux_layers, unrolled_outputs
from medusa.eagle3_io import load_eagle3, resolve_draft, save_eagle3
from medusa.loading import DEFAULT_BASE
from medusa.train import checkpoints
from medusa.train.batches import data_fingerprint, load_directories, split_eval
from medusa.train.config import Config
from medusa.train.data import frequent_tokens
from medusa.train.sharding import full_trainable_state, shard_trainer
from medusa.train.trainer import load_frozen_base, precomputed_hidden


def build_draft(cfg: Config, base, vocabulary: torch.Tensor) -> Eagle3Draft:
    """A fresh draft whose output layer and final norm start as the target's own rows and norm (EAGLE-3 and
    speculators start there too): step 0 then begins near the target's next-token choice."""
    text = base.config.get_text_config()
    aux = cfg.eagle3.aux_layers or default_aux_layers(text.num_hidden_layers)
    draft = Eagle3Draft(base.config, aux, cfg.eagle3.draft_vocab_size, base.get_output_embeddings().weight.shape[0])
    draft.set_vocabulary(vocabulary)
    with torch.no_grad():
        draft.lm_head.weight.copy_(base.get_output_embeddings().weight[draft.target_ids])
        final_norm = base.get_decoder().norm
        draft.norm.load_state_dict(final_norm.state_dict())
    return draft


def continued_draft(cfg: Config, base, answers: Iterable[list[int]]) -> Eagle3Draft:
    """The draft `eagle3.init_from` names, as the float32 draft this section builds for `base`: its weights and its
    vocabulary (a vocabulary taken from new data would reorder the rows its lm_head learned). A larger
    `draft_vocab_size` grows the vocabulary by the most frequent tokens of `answers` it lacks, their lm_head rows the
    target's own, as a fresh draft's start."""
    reference = cfg.eagle3.init_from
    source = resolve_draft(reference)
    if source is None:
        raise ValueError(
            f"eagle3.init_from {reference!r} names no EAGLE-3 draft: give a directory with its config.json and "
            "model.safetensors (speculators or EAGLE-3 layout, as training writes), embedded:<name> or a Hub repo"
        )
    found, _ = load_eagle3(source)
    target_vocab = base.get_output_embeddings().weight.shape[0]
    wanted_aux = cfg.eagle3.aux_layers or default_aux_layers(base.config.get_text_config().num_hidden_layers)
    size, held = cfg.eagle3.draft_vocab_size, found.d2t.numel()
    problems = [
        f"{name} {theirs} where this run has {ours}"
        for name, theirs, ours in (
            ("target vocabulary", found.t2d.numel(), target_vocab),
            ("aux_layers", found.aux_layers, wanted_aux),
        )
        if theirs != ours
    ]
    if size < held:
        problems.insert(0, f"draft_vocab_size {held} where this run has {size} (a vocabulary grows, never shrinks)")
    if problems:
        raise ValueError(
            f"eagle3.init_from {reference} does not fit this run: {'; '.join(problems)}. Set the eagle3 section to "
            "the draft's values, or start from a draft trained for this target"
        )
    vocabulary, state = found.target_ids, found.state_dict()
    if size > held:
        by_frequency = frequent_tokens(answers, target_vocab, target_vocab).tolist()
        kept = set(vocabulary.tolist())
        added = [token for token in by_frequency if token not in kept][: size - held]
        vocabulary = torch.cat([vocabulary, torch.tensor(added, dtype=torch.long)]).sort().values
    draft = build_draft(cfg, base, vocabulary)
    if size > held:  # the learned rows move to their tokens' places; the added rows stay the target's
        head = draft.lm_head.weight.detach().clone()
        head[torch.searchsorted(vocabulary, found.target_ids)] = state["lm_head.weight"].to(head.dtype)
        state.update({"lm_head.weight": head, "d2t": draft.d2t, "t2d": draft.t2d})
    try:
        draft.load_state_dict(state)  # (copied into the float32 weights)
    except RuntimeError as err:  # another layer family or size: torch names each missing, extra or reshaped tensor
        raise ValueError(
            f"eagle3.init_from {reference} does not fit this run: {err}\nStart from a draft trained for this target"
        ) from err
    return draft


def step_losses(draft, base, ids: torch.Tensor, first_scored: int, steps: int, decay: float, cached=None):
    """One conversation (1, T) -> (weighted loss, per-step [scored positions, top-1 agreements]). Predictions of
    tokens before `first_scored` are not scored. `cached` (1, T, (1 + A) H): the target's last hidden state and its
    A aux layers' features there (eagle3.cache_features), read instead of running the target. With
    draft.gradient_checkpointing each step's (T, V_draft) scoring is recomputed in backward instead of kept."""
    with torch.no_grad():
        if cached is None:
            out = base(ids, output_hidden_states=True)
            features = torch.cat([out.hidden_states[layer] for layer in draft.aux_layers], dim=-1).float()
            target_logits = out.logits[0].float()  # (T, V): position t predicts token t + 1
        else:
            lm_head, hidden_size = base.get_output_embeddings(), cached.shape[-1] // (1 + len(draft.aux_layers))
            features = cached[..., hidden_size:].float()
            target_logits = lm_head(cached[0, :, :hidden_size].to(lm_head.weight.dtype)).float()
        chosen = target_logits.argmax(-1)
        target_p = target_logits[:, draft.target_ids].softmax(-1)  # (T, V_draft)
        in_vocabulary = draft.t2d[chosen]
    outputs = unrolled_outputs(draft, base.get_input_embeddings(), features, ids, steps)
    length, total, stats = ids.shape[1], 0.0, []
    for step, hidden in enumerate(outputs):
        # anchor a predicts token a + step + 2, which the target predicts at position a + step + 1
        positions = torch.arange(length - 1, device=ids.device) + step + 1
        valid = positions < length - 1  # the last position predicts past the conversation
        positions = positions.clamp(max=length - 1)
        scored = valid & (positions + 1 >= first_scored) & in_vocabulary[positions]

        def score(hidden, positions):  # -> (cross-entropy to the target per position, the draft's choice)
            log_q = draft.logits(hidden).float().log_softmax(-1)
            return -(target_p[positions] * log_q).sum(-1), log_q.argmax(-1)

        if draft.gradient_checkpointing and torch.is_grad_enabled():
            per_position, choice = checkpoint(score, hidden[0], positions, use_reentrant=False)
        else:
            per_position, choice = score(hidden[0], positions)
        count = int(scored.sum())
        # nothing scored: a zero that still reaches every weight, so that processes stay in step (DDP and FSDP
        # reduce the gradients of every weight each backward)
        total = total + decay**step * (per_position[scored].mean() if count else per_position.sum() * 0.0)
        agree = (draft.target_ids[choice] == chosen[positions]) & scored
        stats.append([count, int(agree.sum())])
    return total, stats


class Eagle3Trainer(nn.Module):
    """The frozen target and the draft as one module whose forward is a conversation's `step_losses`: what DDP
    wraps and FSDP shards (the target's decoder layers each, the rest at this root, whose weights are gathered for
    the whole forward, as the draft reads the target's embeddings between its own steps)."""

    def __init__(self, base: nn.Module, draft: Eagle3Draft):
        super().__init__()
        self.base, self.draft = base, draft

    def forward(self, ids: torch.Tensor, first_scored: int, steps: int, decay: float, cached=None):
        return step_losses(self.draft, self.base, ids, first_scored, steps, decay, cached)


def train_eagle3(
    cfg: Config, *, resume: bool = False, stop_after_steps: int | None = None, launched_fsdp: bool = False
):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    from medusa.train.train import TrainResult, check_distributed_type, resolve_mixed_precision, resolve_shard

    # bf16 autocast (`auto` where the hardware has it) runs the frozen target and the draft in bf16 with float32
    # master weights: about half the time of float32 per conversation on an AVX512-BF16 CPU (docs/training.md)
    mixed = resolve_mixed_precision(cfg.training.mixed_precision, PartialState().device)
    accelerator = Accelerator(mixed_precision=mixed, project_config=checkpoints.project_configuration(cfg.training))
    check_distributed_type(accelerator)
    shard = resolve_shard(cfg, accelerator, launched_fsdp)
    tcfg, ecfg = cfg.training, cfg.eagle3
    if shard and ecfg.cache_features:
        raise ValueError(
            "eagle3.cache_features computes the target's features once on one device, training.shard fsdp shards a "
            "target too large for one: set eagle3.cache_features false to shard (the features are then read online)"
        )
    main = accelerator.is_main_process
    set_seed(tcfg.seed)
    ckpt_root = checkpoints.checkpoint_root(tcfg)
    if main:
        for directory in (ckpt_root, Path(tcfg.output_dir).parent):
            checkpoints.check_writable(directory)
    resume_from = checkpoints.check_resume(ckpt_root, resume)

    with accelerator.main_process_first():  # sharded: loaded on the CPU, each process moves its shards only
        base = load_frozen_base(cfg.model, torch.device("cpu") if shard else accelerator.device)
    vocab_size = base.get_output_embeddings().weight.shape[0]
    convs, parts = load_directories(
        [cfg.data.out_dir, *cfg.data.extra_dirs], tcfg.max_length, vocab_size, prompt_only=ecfg.prompt_tokens
    )
    train_idx, eval_idx = split_eval(convs, tcfg.eval_conversations)
    answers = (convs[i].ids[convs[i].response_start :] for i in train_idx)
    if ecfg.init_from:
        draft = continued_draft(cfg, base, answers)
        vocabulary = draft.target_ids
    else:
        vocabulary = frequent_tokens(answers, ecfg.draft_vocab_size, vocab_size).sort().values
        draft = build_draft(cfg, base, vocabulary)
    draft.gradient_checkpointing = tcfg.gradient_checkpointing
    cache = None
    if ecfg.cache_features:  # whole conversations (lookback max_length): every position may be scored
        log = tqdm.write if main else lambda message: None
        cache = precomputed_hidden(accelerator, tcfg, base, convs, parts, mixed, tcfg.max_length, draft.aux_layers, log)
    trainer = Eagle3Trainer(base, draft)
    if shard:
        shard_trainer(trainer, accelerator.device)
        local = sum(p.to_local().numel() for p in trainer.parameters())
        accelerator.print(
            f"FSDP2: this process holds {local:,} of {sum(p.numel() for p in trainer.parameters()):,} weights"
        )
    else:
        trainer.draft.to(accelerator.device)

    steps_per_epoch = math.ceil(len(train_idx) / (tcfg.grad_accum * accelerator.num_processes))
    max_steps = tcfg.max_steps or tcfg.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(
        [p for p in trainer.draft.parameters() if p.requires_grad], lr=tcfg.lr, weight_decay=tcfg.weight_decay
    )
    # Not passed to accelerator.prepare: its wrapper would step the schedule once per process at every step.
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=tcfg.warmup_steps, num_training_steps=max_steps)
    accelerator.register_for_checkpointing(scheduler)
    # Sharded, the trainer and AdamW stay out of accelerate (it would wrap the trainer in DDP on CPU processes);
    # `checkpoints` saves and loads them whole.
    sharded = (trainer, optimizer) if shard else None
    if not shard:
        trainer, optimizer = accelerator.prepare(trainer, optimizer)
    accelerator.register_save_state_pre_hook(checkpoints.save_trainable_only(trainer))
    accelerator.register_load_state_pre_hook(checkpoints.check_trainable(trainer))
    snapshot = {
        "eagle3": asdict(ecfg),
        "training": {k: v for k, v in asdict(tcfg).items() if k not in checkpoints.RESUMABLE_CHANGES},
        "data": data_fingerprint(convs),
        "base": cfg.model.base or DEFAULT_BASE,
        "processes": accelerator.num_processes,
    }
    step = 0
    if resume_from is not None:
        checkpoints.resume(accelerator, resume_from, snapshot, sharded)
        step = json.loads((resume_from / checkpoints.STATE_NAME).read_text())["step"]
        accelerator.print(f"resumed from {resume_from} at step {step}")
    order = list(train_idx)
    mine = order[accelerator.process_index :: accelerator.num_processes]
    unwrapped = accelerator.unwrap_model(trainer)  # (sharded: the trainer itself, whose forward gathers)

    def conversation(index: int, evaluating: bool = False):
        """(ids (1, T), the first position scored, the cached features or None): held-out conversations score their
        answers only."""
        conv = convs[index]
        first = 2 if ecfg.prompt_tokens and not evaluating else conv.response_start
        cached = None if cache is None else cache.batch([index])["hidden"].to(accelerator.device)
        return torch.tensor([conv.ids], device=accelerator.device), first, cached

    def evaluate() -> dict:
        unwrapped.draft.eval()
        totals = [[0, 0] for _ in range(ecfg.ttt_steps)]
        with torch.no_grad(), accelerator.autocast():
            for index in eval_idx:  # every process evaluates them all (sharded, each forward is collective)
                ids, first, cached = conversation(index, True)
                _, stats = unwrapped(ids, first, ecfg.ttt_steps, ecfg.step_decay, cached)
                for total, (count, agree) in zip(totals, stats):
                    total[0] += count
                    total[1] += agree
        unwrapped.draft.train()
        return {f"eval/step{j}/top1": agree / max(count, 1) for j, (count, agree) in enumerate(totals)}

    start, history, done = time.perf_counter(), [], 0
    bar = tqdm(total=max_steps, initial=step, desc="eagle3", disable=not main)
    unwrapped.base.eval()  # frozen: no dropout (from_pretrained's mode, kept explicit)
    unwrapped.draft.train()
    while step < max_steps:
        epoch, within = divmod(step * tcfg.grad_accum, max(len(mine), 1))
        random.Random(tcfg.seed + epoch).shuffle(epoch_order := list(mine))
        for micro in range(tcfg.grad_accum):
            last = micro == tcfg.grad_accum - 1
            if shard:  # FSDP2: reduce-scatter the gradients at the last micro-step only
                trainer.set_requires_gradient_sync(last)
            index = epoch_order[(within + micro) % len(epoch_order)]
            # sharded, the trainer is not accelerate's: autocast as prepare would
            with accelerator.autocast() if shard else nullcontext() if last else accelerator.no_sync(trainer):
                ids, first, cached = conversation(index)
                loss, _ = trainer(ids, first, ecfg.ttt_steps, ecfg.step_decay, cached)
                accelerator.backward(loss / tcfg.grad_accum)
        if tcfg.max_grad_norm:
            accelerator.clip_grad_norm_(trainer.parameters(), tcfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        done += 1
        bar.update(1)
        if main and tcfg.log_every and step % tcfg.log_every == 0:
            bar.set_postfix(
                loss=f"{float(loss.detach() if torch.is_tensor(loss) else loss):.3f}",
                lr=f"{scheduler.get_last_lr()[0]:.2e}",
            )
        if tcfg.eval_every and step % tcfg.eval_every == 0 and step < max_steps:
            history.append({"step": step, **evaluate()})
            tqdm.write(json.dumps(history[-1]))
        if tcfg.save_every and step % tcfg.save_every == 0 and step < max_steps:
            checkpoints.save(accelerator, step, snapshot, sharded)
        if stop_after_steps is not None and done >= stop_after_steps:
            checkpoints.save(accelerator, step, snapshot, sharded)
            return TrainResult(None, step, history, 0.0, time.perf_counter() - start)
    bar.close()
    history.append({"step": step, **evaluate()})
    tqdm.write(json.dumps(history[-1]))
    output = None
    whole = whole_draft(trainer, vocabulary) if shard else unwrapped.draft  # sharded: gathered (collective)
    if main:
        card = model_card(
            cfg, whole, history[-1], len(train_idx), sum(convs[i].response_tokens for i in train_idx), step
        )
        output = save_eagle3(
            whole,
            tcfg.output_dir,
            verifier=cfg.model.base or DEFAULT_BASE,
            verifier_architectures=list(unwrapped.base.config.architectures or []),
            speculative_tokens=ecfg.speculative_tokens,
            dtype=torch.bfloat16 if tcfg.save_dtype == "bfloat16" else None,
            extra_files={"README.md": card, "training_history.json": json.dumps(history, indent=2) + "\n"},
        )
    accelerator.wait_for_everyone()
    return TrainResult(output, step, history, 0.0, time.perf_counter() - start)


def whole_draft(trainer: Eagle3Trainer, vocabulary: torch.Tensor) -> Eagle3Draft:
    """The sharded trainer's draft as one ordinary module on the CPU: its weights gathered whole (collective:
    every process calls this), its buffers rebuilt from the vocabulary."""
    state = {k.removeprefix("draft."): v for k, v in full_trainable_state(trainer).items() if k.startswith("draft.")}
    sharded = trainer.draft  # (its sizes and aux layers are plain attributes and unsharded buffers)
    draft = Eagle3Draft(trainer.base.config, sharded.aux_layers, sharded.d2t.numel(), sharded.t2d.numel())
    draft.set_vocabulary(vocabulary)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    trained = {name for name, _ in draft.named_parameters()}
    if unexpected or trained & set(missing):
        raise RuntimeError(
            f"gathering the sharded draft: missing {sorted(trained & set(missing))}, unexpected {unexpected}"
        )
    return draft


def model_card(cfg: Config, draft: Eagle3Draft, final: dict, conversations: int, tokens: int, steps: int) -> str:
    accuracy = " / ".join(f"{final[f'eval/step{j}/top1']:.3f}" for j in range(cfg.eagle3.ttt_steps))
    started = f", starting from the draft {cfg.eagle3.init_from}" if cfg.eagle3.init_from else ""
    return (
        f"# EAGLE-3 draft for {cfg.model.base or 'SmolLM2-135M-Instruct (embedded)'}\n\n"
        f"Trained by medusa's train/train.py (training-time test, {cfg.eagle3.ttt_steps} steps) on {conversations} "
        f"self-distilled conversations ({tokens} answer tokens; data: {cfg.data.out_dir}, {cfg.data.extra_dirs}), "
        f"{steps} optimizer steps{started}.\n\nHeld-out top-1 agreement with the target per draft step: {accuracy}.\n\n"
        f"Reads the target's layers {draft.aux_layers} (transformers' hidden_states index); draft vocabulary "
        f"{cfg.eagle3.draft_vocab_size} tokens. Load: `MedusaModel.from_draft_model(target, this_directory)`; "
        'serve: `vllm serve <target> --speculative-config \'{"model": "<this directory>", "method": "eagle3"}\'`.\n'
    )
