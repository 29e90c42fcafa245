"""Median ms of one plain step of a batch (the whole step: propose, batched forward, accept, commit; medusa.batch.
time_batch_step) of SmolLM2 with `rows` rows of 256 cached tokens, per engine:
    python batch_steps.py DTYPE ENGINE[,ENGINE...] ROWS[,ROWS...]     (from the repository root)"""

import sys

import torch

from medusa import MedusaModel
from medusa.batch import time_batch_step
from medusa.propose import PlainProposer
from medusa.runtime import engine_for

torch.set_num_threads(2)
dtype, engines, sizes = sys.argv[1], sys.argv[2].split(","), [int(s) for s in sys.argv[3].split(",")]
model = MedusaModel.from_pretrained(dtype=dtype, plan="off")
for name in engines:
    engine = engine_for(model.base, name)
    for rows in sizes:
        ms = time_batch_step(engine, lambda: PlainProposer(torch.device("cpu")), rows, 256, 8)
        print(f"{dtype} {name} rows={rows}: {ms:.1f} ms/step, {rows / ms * 1000:.0f} tok/s", flush=True)
