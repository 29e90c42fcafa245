"""The target's own answers to user prompts, generated in left-padded batches through its chat template.

Training data is such answers (train/generate_data.py), and `medusa accuracy` scores heads on the greedy ones, so
both answer prompts with these functions and the heads are measured on the kind of text they were trained on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from medusa.batch import left_padded
from medusa.decode import stop_token_ids


def token_ids(encoded) -> list[int]:
    """A tokenizer's output (a BatchEncoding, a dict or a plain list of ids) -> its list of ids."""
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


def tokenize_prompts(tokenizer, mix, max_prompt_tokens: int) -> list[dict]:
    """(source, prompt) pairs -> {source, prompt, prompt_ids, index} for each prompt whose chat-template rendering
    with the generation prompt fits max_prompt_tokens (longer ones are left out)."""
    if tokenizer.chat_template is None:
        raise ValueError(
            "the base tokenizer has no chat template: answering prompts as the model would in use needs one "
            "(set tokenizer.chat_template or use an instruct model)"
        )
    items = []
    for source, prompt in mix:
        ids = token_ids(
            tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        )
        if len(ids) <= max_prompt_tokens:
            items.append({"source": source, "prompt": prompt, "prompt_ids": ids, "index": len(items)})
    return items


def stop_and_pad_ids(model, tokenizer) -> tuple[list[int], int]:
    """The stop ids answers end at (may be empty: answers then run to max_new_tokens) and a pad id for batching."""
    eos_ids = sorted(stop_token_ids(model, tokenizer, None))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
    return eos_ids, pad_id


@torch.inference_mode()
def answer_batch(
    model,
    prompt_ids: list[list[int]],
    pad_id: int,
    eos_ids: list[int],
    max_new_tokens: int,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    proposer: str | None = None,
) -> list[list[int]]:
    """Left-padded batched generation; returns each response up to and including its first stop token. `model`: a
    transformers model or a medusa one (MedusaModel: its `generate` decodes the rows together, each as the base
    would); `proposer` goes to a medusa model's `generate` (None: its plan's choice)."""
    input_ids, attention = left_padded(prompt_ids, pad_id)
    width = input_ids.shape[1]
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p}
    if proposer is not None:
        sampling["proposer"] = proposer
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention.to(model.device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_ids or None,
        top_k=None,
        **sampling,
    )[:, width:].tolist()
    responses = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        responses.append(row[:cut])
    return responses


def answer_prompts(
    model, prompt_ids: list[list[int]], pad_id: int, eos_ids: list[int], batch_size: int, **answer_args
) -> Iterator[tuple[int, list[int]]]:
    """Answer every prompt, batch_size at a time in order of length (less padding per batch): yields
    (index into prompt_ids, response). answer_args go to answer_batch (max_new_tokens, greedy, ...)."""
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        yield from zip(batch, answer_batch(model, [prompt_ids[i] for i in batch], pad_id, eos_ids, **answer_args))
