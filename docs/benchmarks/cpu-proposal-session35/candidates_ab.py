"""How many of the heads' 8,192 candidates (most frequent first) to rank on a CPU: each count alternated in one
process on the same model, dynamic 4-node tree, 128 new tokens. Tokens per step (tau), tokens/s and ms a step's
proposal, summed over the prompts. Training prompts decide (`--prompts alpaca|gsm8k`); `spec-bench` measures.

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-session35/candidates_ab.py --prompts alpaca --count 24
"""

import argparse
import json
import time

import torch

from medusa import MedusaModel
from medusa.propose import CandidateProjection

DATA = "../shared/bench_data"
SPEC_BENCH_IDS = {81, 91, 161, 162, 241, 242, 321, 322, 401, 402, 481, 482}  # `medusa bench --limit 2`'s
TREE = [[0], [1], [0, 0]]


def prompts(name: str, count: int) -> list[str]:
    if name == "alpaca":
        rows = json.load(open(f"{DATA}/stanford_alpaca_5000_subset.json"))[:: 5000 // count]
        return [r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "") for r in rows]
    if name == "gsm8k":
        return [json.loads(line)["question"] for line in list(open(f"{DATA}/gsm8k_train.jsonl"))[:count]]
    rows = map(json.loads, open(f"{DATA}/spec_bench_question.jsonl"))
    return [r["turns"][0] for r in rows if r["question_id"] in SPEC_BENCH_IDS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="w8a8")
    parser.add_argument("--prompts", default="alpaca", choices=["alpaca", "gsm8k", "spec-bench"])
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--counts", default="8192,4096,2048")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(dtype=args.dtype, plan="off")
    heads, lm_head = model.heads, model.base.get_output_embeddings()
    variants = {
        k: CandidateProjection.build(heads, lm_head, model.projection_dtype, int8=True, most_frequent=k)
        for k in map(int, args.counts.split(","))
    }

    def chat(text):
        message = [{"role": "user", "content": text}]
        return model.tokenizer.apply_chat_template(message, add_generation_prompt=True, return_tensors="pt")

    model.generate(chat("Hi"), max_new_tokens=8, engine="inductor", tree=TREE, proposer="dynamic")
    totals = {k: [0, 0, 0.0, 0.0] for k in variants}  # tokens, steps, seconds, proposing seconds
    for i, text in enumerate(prompts(args.prompts, args.count)):
        ids = chat(text)
        for k, projection in list(variants.items())[:: 1 if i % 2 == 0 else -1]:
            model.candidate_projection = projection
            start = time.perf_counter()
            out = model.generate(
                ids, max_new_tokens=128, engine="inductor", tree=TREE, proposer="dynamic", profile=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            total = totals[k]
            total[0] += out.stats.new_tokens
            total[1] += out.stats.steps
            total[2] += time.perf_counter() - start
            total[3] += out.stats.timings["propose"]
    for k, (tokens, steps, seconds, proposing) in totals.items():
        print(
            f"{k} candidates: tau {tokens / steps:.3f}, {tokens / seconds:.1f} tokens/s, "
            f"{proposing / steps * 1000:.2f} ms a step's proposal"
        )


if __name__ == "__main__":
    main()
