"""Where planned decoding's time goes: cProfile over three greedy answers (128 new tokens) to Spec-Bench's first
question on the shipped heads, w8a8, after one warm-up answer; prints the proposal's and the verify's cumulative times.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-w8a8-avx2-libop-session41/profile.py
"""

import cProfile
import json
import pstats

import torch
from transformers import GenerationConfig

from medusa import MedusaModel

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="w8a8")
question = json.loads(open("../shared/bench_data/spec_bench_question.jsonl").readline())
inputs = model.tokenizer.apply_chat_template(
    [{"role": "user", "content": question["turns"][0]}],
    add_generation_prompt=True,
    return_tensors="pt",
    return_dict=True,
)
config = GenerationConfig(max_new_tokens=128, do_sample=False)
model.generate(**inputs, generation_config=config)
profile = cProfile.Profile()
profile.enable()
for _ in range(3):
    model.generate(**inputs, generation_config=config)
profile.disable()
pstats.Stats(profile).sort_stats("cumtime").print_stats("propose|boxed_run|read|path_logits")
