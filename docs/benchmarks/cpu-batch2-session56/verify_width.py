"""A 2-row batched verify on the inductor engine's batch package (batch.time_batch_verify) for 1-4 tokens a row at
32, 256 and 768 cached tokens, twice: what a step's extra tokens cost, and what attending over a wide cache adds.
    python verify_width.py"""

import torch

from medusa import MedusaModel
from medusa.batch import time_batch_verify

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="float32", plan="off")
engine = model.engine("inductor")
engine.warm_up(batches=True)
for context in (32, 256, 768, 32, 256, 768):
    print(context, {n: round(ms, 2) for n, ms in time_batch_verify(engine, 2, [1, 2, 3, 4], context, 8).items()})
