"""A batched verify's median ms on each engine: `python verify_times.py DTYPE` (bfloat16 or float32), SmolLM2 with no
plan, 2 threads, rows of 1, 2, 4, 8 x 1 and 4 query tokens over 256 cached tokens (medusa.batch.time_batch_verify:
the rows as decode_batch runs them; the inductor engine through its batch package, compiled first if needed); then
one sequence's verify + acceptance on the inductor engine's own package (medusa.plan.measure), for comparison."""

import sys

import torch

from medusa import MedusaModel
from medusa.batch import time_batch_verify
from medusa.plan import measure
from medusa.runtime import engine_for

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype=sys.argv[1], plan="off")
engines = {name: engine_for(model.base, name) for name in ("eager", "compiled", "inductor")}
engines["inductor"].new_rows_cache(300)  # its 512-row batch package, compiled or loaded before any timing
for rows in (1, 2, 4, 8):
    for name, engine in engines.items():
        ms = time_batch_verify(engine, rows, [1, 4], 256, 10)
        print(f"{sys.argv[1]} {name:9s} rows {rows}: 1 token {ms[1]:6.1f} ms, 4 tokens {ms[4]:6.1f} ms", flush=True)
one = measure(model, ["inductor"], sizes=(1, 4), repeats=10, context=256, progress=False)[0]["inductor"]
print(
    f"{sys.argv[1]} one sequence on its package: 1 token {one[('plain', 1)][1]:6.1f} ms, 4 nodes (medusa tree) "
    f"{one[('medusa', 4)][1]:6.1f} ms"
)
