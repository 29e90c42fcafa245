"""Plain decoding, a 4-node and a 6-node dynamic tree (the plan's choice that day), alternated per question in one
process on the same model: tokens/s (prefill included) and tokens per step over `medusa bench --limit 2`'s 12
Spec-Bench first turns, 128 new tokens, no guard.

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-session35/trees_ab.py --dtype w8a8
"""

import argparse
import json
import time

import torch

from medusa import MedusaModel

QUESTIONS = "../shared/bench_data/spec_bench_question.jsonl"
IDS = {81, 91, 161, 162, 241, 242, 321, 322, 401, 402, 481, 482}
TREES = {"plain": None, "dynamic 4": [[0], [1], [0, 0]], "dynamic 6": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="w8a8")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained(dtype=args.dtype, plan="off")
    questions = [q for q in map(json.loads, open(QUESTIONS)) if q["question_id"] in IDS]

    def run(ids, tree, max_new_tokens):
        proposer = "dynamic" if tree else "plain"
        return model.generate(
            ids, max_new_tokens=max_new_tokens, engine="inductor", tree=tree or [[0]], proposer=proposer,
            return_dict_in_generate=True,
        )  # fmt: skip

    def chat(text):
        message = [{"role": "user", "content": text}]
        return model.tokenizer.apply_chat_template(message, add_generation_prompt=True, return_tensors="pt")

    for tree in TREES.values():
        run(chat("Hi"), tree, 8)
    totals = {name: [0, 0.0, 0] for name in TREES}  # tokens, seconds, steps
    for i, question in enumerate(questions):
        ids = chat(question["turns"][0])
        for name, tree in list(TREES.items())[:: 1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            out = run(ids, tree, 128)
            totals[name][0] += out.stats.new_tokens
            totals[name][1] += time.perf_counter() - start
            totals[name][2] += out.stats.steps
    plain = totals["plain"][0] / totals["plain"][1]
    for name, (tokens, seconds, steps) in totals.items():
        rate = tokens / seconds
        print(f"{name}: {rate:.2f} tokens/s ({rate / plain:.3f}x plain), tau {tokens / steps:.2f}")


if __name__ == "__main__":
    main()
