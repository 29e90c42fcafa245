"""bf16 batches of 2 on Spec-Bench's 12 `--limit 2` first turns (chat-templated, 128 new tokens, greedy, prefill
included): tokens/s of plain decoding on the template's package against trees on either engine, alternated per round.

    python docs/benchmarks/cpu-zen4-batch-peers-session70/bf16_batch2.py DTYPE BATCH [ROUNDS]

(bf16_batch2.txt: `bfloat16 2 2`.)

Tokens count up to each row's end-of-sequence token; `planned` is generate with nothing named (the plan's layout).
"""

import json
import sys
import time

from medusa import MedusaModel
from medusa.evaluation import bench_data_dir
from medusa.questions import load_questions

dtype = sys.argv[1]
B = int(sys.argv[2])
model = MedusaModel.from_pretrained(dtype=dtype)
tok = model.tokenizer
tok.padding_side = "left"
qs = load_questions(str(bench_data_dir() / "spec_bench_question.jsonl"))
by = {}
for q in qs:
    by.setdefault(q["category"], []).append(q)
qs = [q for c in by.values() for q in c[:2]]
texts = [
    tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, tokenize=False)
    for q in qs
]
eos = tok.eos_token_id
variants = {
    "plain inductor": dict(proposer="plain", engine="inductor"),
    "[[0]] inductor": dict(proposer="dynamic", tree=[[0]], engine="inductor"),
    "[[0],[0,0]] inductor": dict(proposer="dynamic", tree=[[0], [0, 0]], engine="inductor"),
    "[[0],[0,0]] onednn": dict(proposer="dynamic", tree=[[0], [0, 0]], engine="inductor_onednn"),
    "[[0],[0,0],[0,0,0]] onednn": dict(proposer="dynamic", tree=[[0], [0, 0], [0, 0, 0]], engine="inductor_onednn"),
    "planned": dict(),
}


def run(kw):
    n, t = 0, 0.0
    for i in range(0, len(texts), B):
        enc = tok(texts[i : i + B], return_tensors="pt", padding=True)
        s = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=128, do_sample=False, **kw)
        t += time.perf_counter() - s
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            n += row.index(eos) + 1 if eos in row else len(row)
    return n / t


for kw in variants.values():  # warm
    enc = tok(texts[:B], return_tensors="pt", padding=True)
    model.generate(**enc, max_new_tokens=8, **kw)
for _round in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    print(json.dumps({name: round(run(kw), 2) for name, kw in variants.items()}), flush=True)
