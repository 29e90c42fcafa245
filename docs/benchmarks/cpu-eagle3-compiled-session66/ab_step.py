"""The shipped EAGLE-3 draft's step eager against compiled ahead of time (medusa.eagle3.compile_draft_step), side by
side in one process: a fixed dynamic tree of NODES nodes (no plan, no guard) on the inductor engine over the first
three Spec-Bench questions, 128 new tokens, rounds alternated; medians of the seconds each part of decoding took.

    python docs/benchmarks/cpu-eagle3-compiled-session66/ab_step.py [NODES] [THREADS] [ROUNDS]
"""

import json
import statistics
import sys
import time

import torch

from medusa import MedusaModel

nodes, threads, rounds = (int(a) for a in (sys.argv[1:] + ["6", "2", "3"][len(sys.argv) - 1 :]))
torch.set_num_threads(threads)
model = MedusaModel.from_draft_model(draft="embedded:smollm2-135m-instruct-eagle3", num_nodes=nodes, plan="off")
with open("../shared/bench_data/spec_bench_question.jsonl") as f:
    questions = [json.loads(line) for line in f][:3]
prompts = [
    model.tokenizer.apply_chat_template(
        [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    for q in questions
]
model.generate(prompts[0], engine="inductor", max_new_tokens=8)  # compiles (or loads) the step
compiled = model.compiled_step
parts = {"eager": [], "compiled": []}
taus = {"eager": [], "compiled": []}
for _ in range(rounds):
    for name in parts:
        model.compiled_step = compiled if name == "compiled" else False
        total, tokens, start = {}, 0, time.perf_counter()
        for ids in prompts:
            out = model.generate(ids, engine="inductor", max_new_tokens=128, return_dict_in_generate=True, profile=True)
            for part, seconds in out.stats.timings.items():
                total[part] = total.get(part, 0.0) + seconds
            tokens += out.sequences.shape[1] - ids.shape[1]
            taus[name].append(out.stats.mean_accepted_tokens)
        total["tokens/s"] = tokens / (time.perf_counter() - start)
        parts[name].append(total)
for name, rows in parts.items():
    medians = {part: round(statistics.median(row[part] for row in rows), 3) for part in rows[0]}
    print(name, medians, "tau", round(statistics.mean(taus[name]), 3))
