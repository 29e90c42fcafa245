"""Tokens per step each dynamic tree size accepts on Spec-Bench first turns, against the heads' decoded taus:
`python taus.py QUESTIONS` (Spec-Bench's spec_bench_question.jsonl), SmolLM2 fp32 with the shipped heads, no plan,
16 questions spread through the file, one at a time, 64 new tokens, greedy, eager engine, the trees a batch may
take (the first n - 1 paths grown from the heads' accuracy table)."""

import sys

import torch

from medusa import MedusaModel
from medusa.questions import load_questions, spread
from medusa.tree_builder import grow_tree

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="float32", plan="off")
tokenizer = model.tokenizer
questions = spread(load_questions(sys.argv[1]), 16)
order = grow_tree(model.accuracy, 8)
decoded = model.decoded_taus["tau"]["dynamic"]
for nodes in (2, 3, 4, 6, 8):
    tree = [list(p) for p in order[: nodes - 1]]
    accepted, steps = 0, 0
    for question in questions:
        chat = [{"role": "user", "content": question["turns"][0]}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        out = model.generate(
            **inputs, max_new_tokens=64, proposer="dynamic", tree=tree, engine="eager", return_dict_in_generate=True
        )
        accepted += sum(out.stats.accepted_lengths)
        steps += len(out.stats.accepted_lengths)
    tau = accepted / steps
    expected = decoded.get(str(nodes))
    share = f", share of the guessed part {(tau - 1) / (expected - 1):.2f}" if expected else ""
    print(f"{nodes} nodes: tau {tau:.3f} (decoded on held-out prompts: {expected}){share}", flush=True)
