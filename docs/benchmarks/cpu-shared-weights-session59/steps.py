"""Tokens/s of SmolLM2 fp32 with its heads on the inductor engine, plain and planned, 128 tokens, best of 3.

PYTHONPATH=CHECKOUT python steps.py
"""

import time

import torch

from medusa import MedusaModel

model = MedusaModel.from_pretrained()
ids = model.tokenizer.apply_chat_template(
    [{"role": "user", "content": "Write a long story about a dragon."}], add_generation_prompt=True, return_tensors="pt"
)
ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
for proposer in ("plain", None):
    model.generate(ids, max_new_tokens=32, proposer=proposer, engine="inductor")
    t = []
    for _ in range(3):
        s = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=128, proposer=proposer, engine="inductor", return_dict_in_generate=True
        )
        t.append(time.perf_counter() - s)
    print(proposer, "tok/s", 128 / min(t), "steps", out.stats.steps)
