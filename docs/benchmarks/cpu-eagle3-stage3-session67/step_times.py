"""Median microseconds of each EAGLE-3 draft step call within a proposal (0: the feed of the newly committed rows,
1..: the tree's levels) and of a whole proposal ("all"), over the first three Spec-Bench answers: the shipped draft,
a 6-node tree, the inductor engine (its step compiled), 2 threads, 128 new tokens.

    python docs/benchmarks/cpu-eagle3-stage3-session67/step_times.py
"""

import statistics
import time

import torch

from medusa import MedusaModel, eagle3
from medusa.questions import encode_conversation, load_questions

torch.set_num_threads(2)
model = MedusaModel.from_draft_model(draft="embedded:smollm2-135m-instruct-eagle3", num_nodes=6, plan="off")
prompts = [
    torch.tensor([encode_conversation(model.tokenizer, [{"role": "user", "content": q["turns"][0]}])])
    for q in load_questions("../shared/bench_data/spec_bench_question.jsonl")[:3]
]
model.generate(prompts[0], engine="inductor", max_new_tokens=8)  # compiles (or loads) the step
times: dict = {}
call_index = [0]
step, propose = eagle3.Eagle3Proposer._step, eagle3.Eagle3Proposer.propose


def timed_step(self, *args, **kwargs):
    start = time.perf_counter()
    result = step(self, *args, **kwargs)
    times.setdefault(call_index[0], []).append(time.perf_counter() - start)
    call_index[0] += 1
    return result


def timed_propose(self, state):
    call_index[0] = 0
    start = time.perf_counter()
    result = propose(self, state)
    times.setdefault("all", []).append(time.perf_counter() - start)
    return result


eagle3.Eagle3Proposer._step, eagle3.Eagle3Proposer.propose = timed_step, timed_propose
for ids in prompts:
    model.generate(ids, engine="inductor", max_new_tokens=128)
for name, seconds in times.items():
    print(name, len(seconds), "calls, median us", round(statistics.median(seconds) * 1e6))
