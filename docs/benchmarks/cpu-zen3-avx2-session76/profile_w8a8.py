"""A plain w8a8 answer (128 tokens) on the inductor engine under torch.profiler: ms a step in fbgemm's GEMM and in
the op around it (medusa::fbgemm_sums), beside the whole step's.

    python docs/benchmarks/cpu-zen3-avx2-session76/profile_w8a8.py [PROPOSER]"""

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from medusa import MedusaModel

torch.set_num_threads(2)
proposer = sys.argv[1] if len(sys.argv) > 1 else "plain"
model = MedusaModel.from_pretrained(dtype="w8a8", plan="off")
messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
ids = ids if torch.is_tensor(ids) else ids["input_ids"]
settings = dict(max_new_tokens=128, engine="inductor", proposer=proposer)
model.generate(ids, **settings)
for _ in range(2):
    start = time.perf_counter()
    out = model.generate(ids, return_dict_in_generate=True, **settings)
    print("ms a step (prefill included):", (time.perf_counter() - start) / out.stats.steps * 1000, out.stats.steps)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    out = model.generate(ids, return_dict_in_generate=True, **settings)
steps = out.stats.steps
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
tot = collections.Counter()
for e in prof.key_averages():
    tot[e.key] = e.cpu_time_total / 1000 / steps
for k in ["medusa::fbgemm_sums", "aten::fbgemm_linear_int8_weight_fp32_activation"]:
    print(k, "ms a step", round(tot[k], 3))
