"""Where planned decoding's proposal goes, ms a step: the plan's proposer (a dynamic tree here) over the first three
Spec-Bench questions, 128 new tokens, after one warm-up answer; its context read, its heads' path logits, their
candidate projection (eager only: compiled, it is inside the heads' package) and the tree's cut, timed where the
proposers call them.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-proposal-compiled-session42/proposal_parts.py [w8a8|float32]
"""

import collections
import json
import sys
import time

import torch
from transformers import GenerationConfig

from medusa import MedusaModel, dynamic_tree, propose

torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "w8a8"
model = MedusaModel.from_pretrained(dtype=dtype)
totals, counts = collections.defaultdict(float), collections.Counter()


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[label] += time.perf_counter() - start
        counts[label] += 1
        return out

    setattr(owner, name, wrapper)


timed(dynamic_tree.DynamicTreeProposer, "propose", "propose")
timed(propose.MedusaProposer, "read", "context read")
timed(propose.MedusaProposer, "path_logits", "path logits")
timed(propose.CandidateProjection, "head_logits", "projection")
timed(dynamic_tree, "cut_tree", "cut")
questions = [json.loads(line) for line in open("../shared/bench_data/spec_bench_question.jsonl")][:3]
config = GenerationConfig(max_new_tokens=128, do_sample=False)


def inputs(question):
    messages = [{"role": "user", "content": question["turns"][0]}]
    return model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


model.generate(**inputs(questions[0]), generation_config=config)
totals.clear()
counts.clear()
start = time.perf_counter()
for question in questions:
    model.generate(**inputs(question), generation_config=config)
wall = time.perf_counter() - start
steps = counts["propose"]
print(f"{dtype}: {steps} steps, {1000 * wall / steps:.2f} ms a step (prefill included)")
for label, total in totals.items():
    print(f"  {label:13s} {1000 * total / steps:5.2f} ms a step ({counts[label]} calls)")
