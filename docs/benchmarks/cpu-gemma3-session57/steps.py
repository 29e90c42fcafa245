"""Gemma 3 270M fp32 on this CPU: a one-token step and a 4- and 8-token verify per engine, and what the output layer
(262,144 x 640, 63% of the weights) costs alone. Usage: PYTHONPATH=CHECKOUT python steps.py GGUF [engines]"""

import statistics
import sys
import time

import torch

from medusa.loading import load_base
from medusa.runtime import engine_for
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

torch.set_num_threads(2)
base, _ = load_base(sys.argv[1], dtype="float32")
engines = sys.argv[2].split(",") if len(sys.argv) > 2 else ["eager", "compiled", "inductor"]
prompt = torch.randint(10, 1000, (1, 300), generator=torch.Generator().manual_seed(0))


def median_ms(fn, *args, repeats=15):
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def step(engine, cache, candidates, past):
    engine.verify(cache, candidates, past)
    engine.truncate(cache, past) if engine.name == "eager" else None


with torch.inference_mode():
    head = base.get_output_embeddings().weight
    for n in (1, 4, 8):
        x = torch.randn(n, head.shape[1])
        print(f"output layer alone, {n} rows: {median_ms(torch.matmul, x, head.T):.2f} ms", flush=True)
    for name in engines:
        engine = engine_for(base, name)
        cache = engine.new_cache(512)  # (the inductor engine loads or compiles its package here)
        engine.prefill(cache, prompt)
        past = prompt.shape[1]
        for n in (1, 4, 8):
            candidates = Candidates(torch.randint(10, 1000, (n,)), build_buffers(TreeSpec(chain(n - 1)), max(n - 1, 1)))
            print(
                f"{name}: {n} tokens after {past}: {median_ms(step, engine, cache, candidates, past):.2f} ms",
                flush=True,
            )
