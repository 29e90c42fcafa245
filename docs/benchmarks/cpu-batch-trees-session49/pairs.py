"""Plain decoding against a 4-node dynamic tree for the same 2-row batches: `python pairs.py QUESTIONS`, SmolLM2 fp32,
no plan, the inductor engine's batch package, 16 Spec-Bench first turns in 8 batches of 2 (as batch_speed.py pairs
them), 64 new tokens, greedy; two rounds (the first loads the packages). Prints tokens/s, batch steps and seconds."""

import sys
import time

import torch

from medusa import MedusaModel
from medusa.questions import load_questions, spread
from medusa.tree_builder import grow_tree

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="float32", plan="off")
tokenizer = model.tokenizer
tokenizer.padding_side = "left"
questions = spread(load_questions(sys.argv[1]), 16)
texts = [
    tokenizer.apply_chat_template(
        [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    for q in questions
]
tree = [list(p) for p in grow_tree(model.accuracy, 8)[:3]]
for round_ in range(2):
    rates = {}
    for name, options in (("plain", dict(proposer="plain")), ("4 nodes", dict(proposer="dynamic", tree=tree))):
        seconds = steps = tokens = 0
        for start in range(0, len(texts), 2):
            inputs = tokenizer(texts[start : start + 2], return_tensors="pt", padding=True, add_special_tokens=False)
            begin = time.perf_counter()
            out = model.generate(
                **inputs, max_new_tokens=64, engine="inductor", return_dict_in_generate=True, **options
            )
            seconds += time.perf_counter() - begin
            steps, tokens = steps + out.stats.steps, tokens + out.stats.new_tokens
        rates[name] = tokens / seconds
        print(f"round {round_} {name}: {rates[name]:.1f} tok/s, {steps} batch steps, {seconds:.2f} s", flush=True)
    print(f"round {round_}: 4 nodes / plain {rates['4 nodes'] / rates['plain']:.2f}", flush=True)
