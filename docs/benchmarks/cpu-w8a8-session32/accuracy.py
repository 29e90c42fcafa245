"""Teacher-forced top-1 agreement and KL with the fp32 target, int8 (weight-only) against w8a8, on 9 Spec-Bench first
turns answered by fp32 (96 tokens each), eager. Apply w8a8.patch first; run from the repository root:
    PYTHONPATH=. .venv/bin/python docs/benchmarks/cpu-w8a8-session32/accuracy.py
"""

import json
import time

import torch

from medusa.precision import load_target

torch.set_num_threads(2)
qs = [json.loads(line) for line in open("../shared/bench_data/spec_bench_question.jsonl")]
qs = [q for q in qs if q["question_id"] in (81, 91, 161, 162, 241, 321, 322, 401, 481)]
fp, tok = load_target(None, dtype="float32")
seqs = []
with torch.inference_mode():
    for q in qs:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if hasattr(ids, "input_ids") else ids
        out = fp.generate(ids, max_new_tokens=96, do_sample=False)
        seqs.append((ids.shape[1], out))
    ref = [fp(out).logits[0, p - 1 : -1].float() for p, out in seqs]
for prec in ("int8", "w8a8"):
    m, _ = load_target(None, dtype=prec)
    agree = total = 0
    kl = 0.0
    t0 = time.time()
    with torch.inference_mode():
        for (p, out), r in zip(seqs, ref):
            lg = m(out).logits[0, p - 1 : -1].float()
            agree += (lg.argmax(-1) == r.argmax(-1)).sum().item()
            total += lg.shape[0]
            kl += torch.nn.functional.kl_div(
                lg.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum"
            ).item()
    print(
        prec,
        "top-1 agreement with fp32 %.4f" % (agree / total),
        "mean KL(fp32||q) %.4f" % (kl / total),
        "positions",
        total,
        "time %.1f" % (time.time() - t0),
        flush=True,
    )
