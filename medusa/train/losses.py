"""Training losses for Medusa heads: which token each head predicts, weighted per-head cross-entropy, top-k accuracy.

Pure functions over tensors (no argparse, no wandb). The vocabulary projection dominates the cost (a [N, V] matrix
per head), so cross-entropy and KL are fused with the projection and computed in row chunks: memory stays at one
[chunk, V] block, and the gradient with respect to the projection's input is formed in the same pass.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from medusa.heads import MedusaHeads, following_tokens, head_target_offset, tokens_read

BASE_TARGET_OFFSET = 1  # the base lm_head at position t predicts token t+1
TOPK = 5  # accuracies reported: top-1 .. top-5
# rows per [rows, V] block of logits: those blocks, not the activations, set a checkpointed step's memory, and smaller
# ones trained no slower on the CPU (docs/training.md, "Memory")
CHUNK_TOKENS = 512


def head_weights(num_heads: int, decay: float = 0.8, coefficient: float = 1.0) -> list[float]:
    """Loss weight of each head: `coefficient * decay**k` for head k (0-based), the official Medusa recipe."""
    return [coefficient * decay**k for k in range(num_heads)]


def shifted_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets `offset` tokens ahead. input_ids, loss_mask (B, T) -> targets (B, T) long, valid (B, T) bool.

    targets[b, t] = input_ids[b, t + offset]; valid[b, t] is True only when t + offset < T and the target token is a
    training target (loss_mask 1: a response token, never padding). Invalid positions hold target 0.
    """
    if offset <= 0:
        raise ValueError(f"offset must be positive (a position predicts a later token), got {offset}")
    targets = torch.zeros_like(input_ids)
    valid = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if offset < input_ids.shape[1]:
        targets[:, :-offset] = input_ids[:, offset:]
        valid[:, :-offset] = loss_mask[:, offset:].bool()
    return targets, valid


def head_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What head `head` must predict at each position it reads: `shifted_targets` at `head_target_offset(head)`."""
    return shifted_targets(input_ids, loss_mask, head_target_offset(head))


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, topk: int = TOPK) -> torch.Tensor:
    """logits (N, V), targets (N,) -> (topk,) long: how many rows have their target among the top-1 .. top-k.

    The target's rank is the number of strictly larger logits (ties count in the target's favour).
    """
    target_logit = logits.gather(1, targets[:, None])  # (N, 1)
    rank = (logits > target_logit).sum(-1)  # (N,)
    ks = torch.arange(1, topk + 1, device=logits.device)
    return (rank[:, None] < ks).sum(0)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(C, H) @ (V, H).T -> (C, V) float32 logits (the matmul runs in x's and weight's dtype)."""
    logits = (x @ weight.T).float()
    if bias is not None:
        logits += bias.float()
    return logits


def _accumulate(grad, xc, w, rows: slice, grad_x, grad_w, grad_b) -> None:
    """Add one chunk's d loss / d logits (C, V) to the gradients of x (its rows), W and b (None: not needed)."""
    if grad_b is not None:
        grad_b += grad.float().sum(0)
    grad = grad.to(w.dtype)
    if grad_x is not None:
        grad_x[rows] = (grad @ w).to(grad_x.dtype)
    if grad_w is not None:
        grad_w += (grad.T @ xc).float()


def _no_autocast(device_type: str):
    """Autocast off; a device without autocast (meta: scripts/training_memory.py) has none to turn off."""
    return torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else nullcontext()


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(x_i W^T + b, y_i) without materialising all N x V logits; gradients are formed chunk by chunk."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, chunk_size, compute_dtype, topk):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        dtype = compute_dtype or weight.dtype
        with _no_autocast(x.device.type):  # precision is chosen here, explicitly
            w = weight.to(dtype)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            correct = torch.zeros(max(topk, 1), dtype=torch.long, device=x.device)
            grad_x = torch.empty_like(x) if need_x else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) if need_b else None
            for start in range(0, x.shape[0], chunk_size):
                xc, yc = x[start : start + chunk_size].to(dtype), targets[start : start + chunk_size]  # (C, H), (C,)
                # The (C, V) block stays in the matmul dtype: on CPU these passes are memory-bound, and
                # log_softmax accumulates in float32 internally (bf16: loss within ~1e-5 relative of float32).
                logits = xc @ w.T if bias is None else torch.addmm(bias.to(dtype), xc, w.T)  # (C, V)
                log_probs = torch.log_softmax(logits, -1)
                loss += -log_probs.gather(1, yc[:, None]).float().sum()
                if topk:
                    correct += topk_correct(logits, yc, topk)
                if need_x or need_w or need_b:
                    grad = log_probs.exp_()  # softmax, in place: d CE / d logits = softmax - onehot
                    grad[torch.arange(len(yc), device=x.device), yc] -= 1
                    _accumulate(grad, xc, w, slice(start, start + chunk_size), grad_x, grad_w, grad_b)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(correct)
        return loss, correct[:topk]

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        return (*_scaled(ctx.saved_tensors, ctx.dtypes, grad_loss), None, None, None, None)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
    topk: int = TOPK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of the projection `x @ weight.T + bias` against `targets`, and top-k hit counts.

    x (N, H), weight (V, H), bias (V,) or None, targets (N,) -> (loss_sum () float32, correct (topk,) long).
    Peak memory is one (chunk_size, V) float32 block. `compute_dtype` (e.g. bfloat16) sets the matmul precision;
    the softmax and the sum are float32. Gradients flow to x, weight and bias when they require them.
    """
    if x.shape[0] != targets.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but targets has {targets.shape[0]}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _LinearCrossEntropy.apply(x, weight, bias, targets, chunk_size, compute_dtype, topk)


class _LinearKL(torch.autograd.Function):
    """sum_i KL(softmax(r_i W^T + b) || softmax(x_i W^T + b)) chunk by chunk.

    The reference distribution is a constant (a teacher): gradients reach x, W and b only through the trained side.
    """

    @staticmethod
    def forward(ctx, x, ref_x, weight, bias, chunk_size, compute_dtype):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_b = bias is not None and ctx.needs_input_grad[3]
        dtype = compute_dtype or weight.dtype
        with _no_autocast(x.device.type):
            w = weight.to(dtype)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            grad_x = torch.empty_like(x) if need_x else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) if need_b else None
            for start in range(0, x.shape[0], chunk_size):
                xc = x[start : start + chunk_size].to(dtype)  # (C, H)
                log_q = _project(xc, w, bias).log_softmax(-1)  # (C, V) the model being trained
                log_p = _project(ref_x[start : start + chunk_size].to(dtype), w, bias).log_softmax(-1)  # reference
                p = log_p.exp()
                loss += (p * (log_p - log_q)).sum()
                if need_x or need_w or need_b:
                    grad = log_q.exp_().sub_(p)  # d KL / d logits = q - p
                    _accumulate(grad, xc, w, slice(start, start + chunk_size), grad_x, grad_w, grad_b)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, grad_b = _scaled(ctx.saved_tensors, ctx.dtypes, grad_loss)
        return grad_x, None, grad_w, grad_b, None, None


def linear_kl(
    x: torch.Tensor,
    ref_x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Summed KL(reference || model) of the projections of `ref_x` (reference) and `x` (trained) through one head.

    x, ref_x (N, H), weight (V, H) -> () float32. Used for Medusa-2: the adapted base must keep the frozen base's
    next-token distribution. Peak memory is a few (chunk_size, V) blocks.
    """
    if x.shape != ref_x.shape:
        raise ValueError(f"x {tuple(x.shape)} and ref_x {tuple(ref_x.shape)} must have the same shape")
    return _LinearKL.apply(x, ref_x, weight, bias, chunk_size, compute_dtype)


def _scaled(grads, dtypes, grad_loss):
    """The gradients precomputed in forward, times the incoming gradient, each in its input's dtype."""
    return tuple(None if g is None else (g * grad_loss).to(d) for g, d in zip(grads, dtypes))


@dataclass(frozen=True)
class HeadLoss:
    loss: torch.Tensor  # () weighted sum over heads of each head's mean cross-entropy; differentiable
    ce: torch.Tensor  # (K,) mean cross-entropy per head, detached
    correct: torch.Tensor  # (K, topk) long: positions whose target is in the head's top-1 .. top-k
    count: torch.Tensor  # (K,) long: positions that counted for each head


def scored_positions(length: int, response_start: int, offset: int) -> int:
    """How many positions t of a sequence have a response-token target `offset` ahead: response_start <= t + offset
    < length, t >= 0. The count `shifted_targets(...)[1].sum()` gives, without building tensors."""
    return max(0, length - max(offset, response_start))


def medusa_heads_loss(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lm_head: nn.Module,
    *,
    decay: float = 0.8,
    coefficient: float = 1.0,
    chunk_size: int = CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
    topk: int = TOPK,
    normalizer: torch.Tensor | None = None,
    embed_tokens: nn.Module | None = None,
    candidates_only: bool = False,
    distill: bool = False,
) -> HeadLoss:
    """Per-head shifted cross-entropy on the base's last hidden states.

    hidden (B, T, H) post-norm last hidden states (with feature layers, their features after them: see
    medusa.heads.base_features); input_ids, loss_mask (B, T). Head k reads hidden[:, t] (and, for
    heads conditioned on the next token, `embed_tokens(input_ids[:, t + 1])`) and is scored on
    input_ids[:, t + head_target_offset(k)] wherever that token is a response token. Only the positions that count
    are pushed through the head and its projection (the shared `lm_head` or the head's own).
    candidates_only: with a vocabulary subset on the heads, the softmax runs over the candidate tokens only (what
    proposing ranks; several times cheaper); a target outside the subset cannot be proposed, so it adds no loss
    and counts as a miss.
    distill: the loss is KL(base || head) instead of cross-entropy: head k at t learns the base's whole distribution
    over the token it guesses, read off the base's hidden state at t + offset - 1 through the shared projection
    (soft targets: more signal per position than the one token the data holds, sampled or not). Accuracy still
    counts the data's tokens.
    topk=0 skips the accuracy counts (they cost one more pass over the logits).
    normalizer (K,): divide head k's summed cross-entropy by normalizer[k] instead of its local position count, so
    that micro-batches and processes sharing one optimizer step add up to the mean over the whole step's positions.
    """
    num_heads = heads.config.num_heads
    weights = head_weights(num_heads, decay, coefficient)
    total = hidden.new_zeros((), dtype=torch.float32)
    ce, correct, count = [], [], []
    subset = getattr(heads, "vocab_subset", None) if candidates_only else None
    if subset is not None:  # token id -> candidate index, -1 outside the subset
        to_candidate = torch.full((heads.config.vocab_size,), -1, dtype=torch.long, device=input_ids.device)
        to_candidate[subset.to(input_ids.device)] = torch.arange(subset.numel(), device=input_ids.device)
    shared_weight = lm_head.weight if subset is None else lm_head.weight[subset]
    if heads.projections is None and compute_dtype is not None and not shared_weight.requires_grad:
        shared_weight = shared_weight.detach().to(compute_dtype)  # cast the frozen [V, H] matrix once, not per head
    shared_bias = getattr(lm_head, "bias", None)
    if shared_bias is not None and subset is not None:
        shared_bias = shared_bias[subset]
    if distill and heads.projections is not None:
        raise ValueError(
            "distillation reads the base's distribution through the shared lm_head: use projection "
            "'shared', or train own projections without distill"
        )
    base_hidden = hidden[..., : heads.config.hidden_size]  # the teacher's input: the last hidden state
    following = None  # (B, T, n) the tokens after each position that conditioned heads read
    if heads.config.condition_on_next_token:
        if embed_tokens is None:
            raise ValueError("heads conditioned on the next token need embed_tokens (the base's input embeddings)")
        following = following_tokens(input_ids, tokens_read(heads.config, num_heads - 1))
        # the context layer runs over every position (a head's read depends on the ones before it)
        hidden, _ = heads.contextualise(hidden, embed_tokens(following[..., 0]))
    for k in range(num_heads):
        targets, valid = head_targets(input_ids, loss_mask, k)
        # teacher forcing: a path head reads the target's own tokens, as on the path a step accepts
        x = heads.run_head_on_tokens(
            k, hidden[valid], None if following is None else following[valid], embed_tokens
        )  # (N_k, H)
        # (an empty selection still links the head into the graph)
        if heads.projections is None:
            weight, bias = shared_weight, shared_bias
        else:
            weight, bias = heads.projections[k].weight, heads.projections[k].bias
            if subset is not None:
                weight, bias = weight[subset], None if bias is None else bias[subset]
        if distill:  # the base's distribution at every scored position, targets outside the subset included
            offset = head_target_offset(k)
            teacher = base_hidden[:, offset - 1 :][
                valid[:, : base_hidden.shape[1] - offset + 1]
            ]  # (N_k, H) at t + offset - 1
            loss_sum = linear_kl(x, teacher, weight, bias, chunk_size=chunk_size, compute_dtype=compute_dtype)
        targets = targets[valid]
        n = valid.sum()
        if subset is not None:
            targets = to_candidate[targets]
            proposable = targets >= 0
            x, targets = x[proposable], targets[proposable]
        if not distill:
            loss_sum, hits = linear_cross_entropy(
                x, weight, targets, bias, chunk_size=chunk_size, compute_dtype=compute_dtype, topk=topk
            )
            mean = loss_sum / (n if subset is None else proposable.sum()).clamp(min=1)
        else:
            mean = loss_sum / n.clamp(min=1)
            if topk:  # accuracy still counts the data's tokens
                with torch.no_grad():
                    _, hits = linear_cross_entropy(
                        x.detach(), weight, targets, bias, chunk_size=chunk_size, compute_dtype=compute_dtype, topk=topk
                    )
        total = total + weights[k] * (mean if normalizer is None else loss_sum / normalizer[k].clamp(min=1e-9))
        ce.append(mean.detach())
        correct.append(hits if topk else torch.zeros(0, dtype=torch.long, device=hidden.device))
        count.append(n)
    return HeadLoss(total, torch.stack(ce), torch.stack(correct), torch.stack(count))


def base_kl_loss(
    hidden: torch.Tensor,
    ref_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lm_head: nn.Module,
    *,
    chunk_size: int = CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL(frozen base || adapted base) of the next-token distribution over response-token targets.

    hidden, ref_hidden (B, T, H): the adapted and the frozen base's last hidden states -> (mean KL (), count ()).
    normalizer: divide the summed KL by this instead of the local count (see medusa_heads_loss).
    """
    _, valid = shifted_targets(input_ids, loss_mask, BASE_TARGET_OFFSET)
    kl = linear_kl(
        hidden[valid],
        ref_hidden[valid].to(hidden.dtype),
        lm_head.weight,
        getattr(lm_head, "bias", None),
        chunk_size=chunk_size,
        compute_dtype=compute_dtype,
    )
    n = valid.sum()
    return kl / (n.clamp(min=1) if normalizer is None else normalizer), n
