"""Where a verify forward's time goes, kernel by kernel: the package compiled with inductor's kernel profiling
(`cpp.enable_kernel_profile`, which the package key does not see: give it a cache of its own with the converted base
linked in), 10 verifies of 1 and of 8 query tokens after 200 cached tokens under torch's profiler:

    mkdir -p /tmp/probe-cache && ln -sfn ~/.cache/medusa/gguf /tmp/probe-cache/gguf
    MEDUSA_CACHE=/tmp/probe-cache python docs/benchmarks/cpu-fp32-prefetch-session44/kernel_profile.py float32
"""

import functools
import sys

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from medusa import MedusaModel
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

inductor_config.cpp.enable_kernel_profile = True
torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype=sys.argv[1], plan="off")
engine = model.engine("inductor")


def tokens(n):
    return torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(n))


with torch.inference_mode():
    cache = engine.new_cache(512 - 64, progress=False)
    engine.prefill(cache, tokens(200), model.feature_layers)
    for query in (1, 8):
        tree = build_buffers(TreeSpec(chain(query - 1)), max(query - 1, 1))
        step = functools.partial(engine.verify, cache, Candidates(tokens(query)[0], tree), 200, model.feature_layers)
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
        print(f"===== {query} query tokens")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
