"""One batch of self-distillation answers: the first ROWS Self-Instruct user-oriented prompts (training prompts) through
the chat template, answered by transformers' generate and by MedusaModel.generate with each proposer named (planned:
the plan's choice), each after a warm-up on the same batch (the plan's first layout at this size is timed there):
    python batch_ab.py DTYPE ROWS MAX_NEW_TOKENS planned,plain,prompt_lookup,transformers  (from the repository root)"""

import json
import sys
import time

import torch

from medusa import MedusaModel
from medusa.answers import answer_batch, stop_and_pad_ids

torch.set_num_threads(2)
dtype, rows, new, which = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
with open("../shared/bench_data/self_instruct_user_oriented_instructions.jsonl") as f:
    prompts = [json.loads(line) for line in f][:rows]
model = MedusaModel.from_pretrained(dtype=getattr(torch, dtype), plan="auto")
tokenizer = model.tokenizer


def text(prompt: dict) -> str:
    instance = (prompt.get("instances") or [{}])[0].get("input")
    return prompt["instruction"] + (f"\n\n{instance}" if instance else "")


ids = [
    tokenizer.apply_chat_template([{"role": "user", "content": text(p)}], add_generation_prompt=True) for p in prompts
]
ids = [i if isinstance(i, list) else i["input_ids"] for i in ids]
eos, pad = stop_and_pad_ids(model.base, tokenizer)
answers = {}
for name in which:
    target = model.base if name == "transformers" else model
    options = {} if name in ("transformers", "planned") else {"proposer": name}
    answer_batch(target, ids, pad, eos, 4, **options)
    start = time.perf_counter()
    answers[name] = answer_batch(target, ids, pad, eos, new, **options)
    seconds = time.perf_counter() - start
    tokens = sum(map(len, answers[name]))
    print(f"{name} {dtype} {rows} rows: {tokens} answer tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s")
reference = answers.get("transformers")
for name, rows_answered in answers.items():
    if reference is not None and name != "transformers":
        same = sum(x == y for x, y in zip(reference, rows_answered))
        print(f"{name} identical rows to transformers {same} of {len(rows_answered)}")
