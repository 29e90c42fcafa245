"""Where a batched bf16 verify's time goes on this CPU: torch profiler by op. `python batch_profile.py ENGINE ROWS
TOKENS` (eager 2 1: 2 rows x 1 query token each, 256 cached), 2 threads."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from medusa import MedusaModel
from medusa.batch import time_batch_verify
from medusa.runtime import engine_for

torch.set_num_threads(2)
engine_name = sys.argv[1]
rows = int(sys.argv[2])
n = int(sys.argv[3])
model = MedusaModel.from_pretrained(dtype="bfloat16", plan="off")
target = engine_for(model.base, engine_name)
print(engine_name, rows, n, time_batch_verify(target, rows, [n], 256, 10))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    time_batch_verify(target, rows, [n], 256, 5)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
