"""w8a8 plain and dynamic-tree (6 nodes) decoding on the inductor engine, fbgemm's op with its Python kernel (py) or
the C++ one (cpp), ms a step, 128 new tokens, prefill included, median of 5. Needs prepack.patch applied (it adds
MEDUSA_FBGEMM_KERNEL); alternate the two in separate processes:

    for v in py cpp py cpp; do python docs/benchmarks/cpu-zen3-avx2-session76/cpp-kernel-attempt/steps_ab.py $v; done"""

import os
import statistics
import sys
import time

import torch

variant = sys.argv[1]
os.environ["MEDUSA_FBGEMM_KERNEL"] = "python" if variant == "py" else "c++"
from medusa import MedusaModel  # noqa: E402 (after the variable it reads)
from medusa.plan import grow_tree  # noqa: E402

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype="w8a8", plan="off")
messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
ids = ids if torch.is_tensor(ids) else ids["input_ids"]
for proposer, tree in (("plain", None), ("dynamic", 6)):
    settings = dict(max_new_tokens=128, engine="inductor", proposer=proposer)
    if tree:
        settings["tree"] = [list(p) for p in grow_tree(model.accuracy, tree)]
    model.generate(ids, **settings)
    per_step, tps = [], []
    for _ in range(5):
        start = time.perf_counter()
        out = model.generate(ids, return_dict_in_generate=True, **settings)
        s = time.perf_counter() - start
        per_step.append(s / out.stats.steps * 1000)
        tps.append(out.stats.new_tokens / s)
    print(
        variant,
        proposer,
        "ms a step",
        round(statistics.median(per_step), 2),
        "tokens/s",
        round(statistics.median(tps), 1),
        "tau",
        round(out.stats.mean_accepted_tokens, 2),
        flush=True,
    )
