"""What a lower-precision frozen base costs training: how far the bf16 base (`model.dtype: bfloat16`) and the int8 one
(`model.quantize: int8`, torchao weight-only) are from the float32 base on held-out text, per position.

    python scripts/base_precision.py [--base X] [--questions ../shared/bench_data/mt_bench_question.jsonl] [--limit 12]

Each question's first turn is answered greedily by the float32 base (`--new-tokens`); every base built as training
builds it (medusa.train.trainer.load_frozen_base) then reads those conversations once. Heads and drafts learn from
the base's last hidden state (or its feature layers) and its next-token distribution at each position, so reported
per precision, over the answer positions: the last hidden state's error relative to float32's (mean of
||h - h32|| / ||h32||), how often the next-token choice equals float32's, and the mean KL(p32 || p) in nats.
"""

from __future__ import annotations

import argparse

import torch

from medusa.loading import load_base
from medusa.questions import load_questions
from medusa.train.config import ModelConfig
from medusa.train.trainer import load_frozen_base

SETTINGS = {  # name -> ModelConfig fields: what training's model section asks for
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8 (torchao, bf16 activations)": dict(dtype="bfloat16", quantize="int8"),
    "int8 (torchao, fp32 activations)": dict(dtype="float32", quantize="int8"),
}


@torch.inference_mode()
def read(base, conversations: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """-> per conversation (last hidden state, next-token log-probabilities) at its answer positions, in float32."""
    out = []
    for ids, start in conversations:
        result = base(ids[None], output_hidden_states=True)
        out.append((result.hidden_states[-1][0, start:].float(), result.logits[0, start:].float().log_softmax(-1)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="directory, .gguf or Hub id (default: the embedded SmolLM2)")
    parser.add_argument("--questions", default="../shared/bench_data/mt_bench_question.jsonl")
    parser.add_argument("--limit", type=int, default=12, help="questions")
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()

    reference, tokenizer = load_base(args.base, dtype="float32", device="cpu")  # load_frozen_base's float32 base
    conversations = []
    for question in load_questions(args.questions)[: args.limit]:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question["turns"][0]}], add_generation_prompt=True, return_tensors="pt"
        )
        prompt = prompt if torch.is_tensor(prompt) else prompt["input_ids"]
        ids = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens, do_sample=False
        )[0]
        conversations.append((ids, prompt.shape[1] - 1))  # from the last prompt position: it predicts the answer
    exact = read(reference, conversations)
    positions = sum(hidden.shape[0] for hidden, _ in exact)
    print(f"{len(conversations)} questions of {args.questions}, {positions} answer positions\n")
    print("| frozen base | last hidden state error | same next token | KL(fp32 \\|\\| base) nats |")
    print("|---|---|---|---|")
    for name, fields in SETTINGS.items():
        base = reference if name == "float32" else load_frozen_base(ModelConfig(base=args.base, **fields), "cpu")
        errors, same, kl = [], 0, 0.0
        for (h32, logp32), (hidden, logp) in zip(exact, read(base, conversations)):
            errors.append(((hidden - h32).norm(dim=-1) / h32.norm(dim=-1)).mean().item() * hidden.shape[0])
            same += int((logp.argmax(-1) == logp32.argmax(-1)).sum())
            kl += float((logp32.exp() * (logp32 - logp)).sum())
        print(f"| {name} | {sum(errors) / positions:.4f} | {same / positions:.4f} | {kl / positions:.5f} |")


if __name__ == "__main__":
    main()
