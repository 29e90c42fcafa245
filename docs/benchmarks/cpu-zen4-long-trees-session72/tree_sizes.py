"""Decoding alone at ~4,000 cached tokens (profile timings, the prefill left out): plain decoding and the plan's
dynamic trees at 2, 4 and 6 nodes, interleaved per prompt (the order rotated each round), on the plan's engine.
Unguarded (an explicit tree): each size's own cost and acceptance.

    python docs/benchmarks/cpu-zen4-long-context-session71/long_questions.py OUT/long.jsonl --tokens 3500 --count 4
    python docs/benchmarks/cpu-zen4-long-trees-session72/tree_sizes.py bfloat16 OUT/long.jsonl 2
"""

import json
import statistics
import sys

from medusa import MedusaModel

dtype, questions, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = MedusaModel.from_pretrained(dtype=dtype)
plan = model.plan
prompts = [json.loads(line)["turns"][0] for line in open(questions)]
variants = [("plain", dict(proposer="plain"))]
variants += [(f"dynamic {n}", dict(proposer="dynamic", tree=plan.tree[: n - 1])) for n in (2, 4, 6)]
ms = {name: [] for name, _ in variants}
taus = {name: [] for name, _ in variants}
for r in range(rounds):
    for text in prompts:
        chat = [{"role": "user", "content": text}]
        ids = model.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ids = ids["input_ids"]
        for name, kwargs in variants[r % 4 :] + variants[: r % 4]:
            out = model.generate(
                ids, max_new_tokens=128, engine=plan.engine, profile=True, return_dict_in_generate=True, **kwargs
            )
            decoding = sum(s for phase, s in out.stats.timings.items() if phase != "prefill")
            ms[name].append(1000 * decoding / out.stats.new_tokens)
            taus[name].append(out.stats.mean_accepted_tokens)
        print(r, ids.shape[1], {n: round(v[-1], 2) for n, v in ms.items()}, flush=True)
for name, _ in variants:
    print(
        f"{dtype} {name}: median {statistics.median(ms[name]):.2f} ms a token, mean {statistics.mean(ms[name]):.2f}, "
        f"tau {statistics.mean(taus[name]):.2f}"
    )
