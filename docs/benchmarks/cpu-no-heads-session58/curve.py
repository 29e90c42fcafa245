"""A verify's median ms for a chain of n tokens (n = 1 .. 12) after 300 cached, fp32, 2 threads, as JSON.

PYTHONPATH=CHECKOUT python curve.py [BASE] [ENGINE]   (default: the embedded SmolLM2, the inductor engine)
"""

import json
import statistics
import sys
import time

import torch

from medusa.loading import load_base
from medusa.runtime import engine_for
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

SIZES = range(1, 13)
torch.set_num_threads(2)
base, _ = load_base(sys.argv[1] if len(sys.argv) > 1 else None, dtype="float32")
prompt = torch.randint(10, 1000, (1, 300), generator=torch.Generator().manual_seed(0))


def step(engine, cache, candidates, past):
    engine.verify(cache, candidates, past)
    if engine.name == "eager":
        engine.truncate(cache, past)


with torch.inference_mode():
    engine = engine_for(base, sys.argv[2] if len(sys.argv) > 2 else "inductor")
    cache = engine.new_cache(512)
    engine.prefill(cache, prompt)
    past = prompt.shape[1]
    chains = {
        n: Candidates(torch.randint(10, 1000, (n,)), build_buffers(TreeSpec(chain(n - 1)), max(n - 1, 1)))
        for n in SIZES
    }
    times = {n: [] for n in SIZES}
    for repeat in range(13):  # sizes interleaved; the first round warms up
        for n in SIZES:
            start = time.perf_counter()
            step(engine, cache, chains[n], past)
            if repeat:
                times[n].append(1000 * (time.perf_counter() - start))
    print(json.dumps({n: round(statistics.median(ms), 2) for n, ms in times.items()}))
