"""A batched verify through the inductor engine's batch package (batch.time_batch_verify): ms for 1, 2, 4 and 8 rows
of 1, 2 and 4 tokens each at 128 cached tokens.
    python width.py DTYPE   (w8a8, float32)"""

import sys

import torch

from medusa import MedusaModel
from medusa.batch import time_batch_verify

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype=sys.argv[1], plan="off")
engine = model.engine("inductor")
engine.warm_up(batches=True)
for rows in (1, 2, 4, 8):
    timed = time_batch_verify(engine, rows, [1, 2, 4], 128, 10)
    print(sys.argv[1], "rows", rows, {n: round(ms, 2) for n, ms in timed.items()}, flush=True)
