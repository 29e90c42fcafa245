"""A 2-row batch's prefill and first token on the inductor engine, for Spec-Bench's 12 first turns in pairs (as
`medusa bench --batch-size 2` groups them): a round that warms up, then a timed one.
    python prefill.py QUESTIONS"""

import sys
import time

import torch

from medusa import MedusaModel
from medusa.questions import load_questions, spread

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="float32", plan="off")
tokenizer = model.tokenizer
tokenizer.padding_side = "left"
texts = [
    tokenizer.apply_chat_template(
        [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    for q in spread(load_questions(sys.argv[1]), 12)
]
model.engine("inductor").warm_up(batches=True)
for repeat in range(2):
    total, start = 0, time.perf_counter()
    for first in range(0, len(texts), 2):
        inputs = tokenizer(texts[first : first + 2], return_tensors="pt", padding=True, add_special_tokens=False)
        total += int(inputs.attention_mask.sum())
        began = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, engine="inductor", proposer="plain")
        print(repeat, inputs.attention_mask.sum(1).tolist(), f"{1000 * (time.perf_counter() - began):.0f} ms")
    print("prompt tokens", total, f"{time.perf_counter() - start:.2f} s")
