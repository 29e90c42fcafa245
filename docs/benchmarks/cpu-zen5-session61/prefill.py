"""A prompt's forward on the inductor engine, through the copy its package is compiled from (aten's linears) and
through the one that runs prompts (oneDNN's, session 61): tokens/s at a few prompt lengths, median of 4 after one.
    python docs/benchmarks/cpu-zen5-session61/prefill.py DTYPE       (float32, bfloat16, w8a8, int8)"""

import statistics
import sys
import time

import torch

from medusa import MedusaModel

torch.set_num_threads(2)
dtype = sys.argv[1]
model = MedusaModel.from_pretrained(dtype=dtype, plan="off")
engine = model.engine("inductor")
for label, runner in (("aten", engine.runner), ("onednn", engine.eager_runner)):
    engine.eager_runner = runner
    for length in (16, 64, 256, 768):
        ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(length))
        seconds = []
        for _ in range(5):
            cache = engine.new_cache(length + 8)
            start = time.perf_counter()
            engine.prefill(cache, ids, model.feature_layers)
            seconds.append(time.perf_counter() - start)
        print(
            f"{dtype} {label:6s} {length:4d} tokens: {length / statistics.median(seconds[1:]):6.0f} tokens/s",
            flush=True,
        )
