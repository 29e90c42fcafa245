"""Where a plain (or guessing) step's milliseconds go on the inductor engine: the package's own run against the host
work around it (the verify's inputs and outputs, acceptance, commit), per step, median of 7 calls after a warm-up.

    PYTHONPATH=CHECKOUT python docs/benchmarks/cpu-zen4-step-host-session75/phases.py DTYPE PROPOSER LABEL

Runs against any checkout: it times the package's entry point the checkout's `aot.run` calls (`Package.run_flat`,
else `Package.__call__`, whose pytree walks then count as the package's)."""

import collections
import statistics
import sys
import time

import torch

from medusa import MedusaModel
from medusa.runtime import aot

dtype, proposer, label = sys.argv[1:4]
torch.set_num_threads(2)
spent = {"seconds": 0.0}
entry = "run_flat" if hasattr(aot.Package, "run_flat") else "__call__"
stock = getattr(aot.Package, entry)


def timed(self, *args):
    start = time.perf_counter()
    out = stock(self, *args)
    spent["seconds"] += time.perf_counter() - start
    return out


setattr(aot.Package, entry, timed)
model = MedusaModel.from_pretrained(dtype=dtype, plan="off")
messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
ids = ids if torch.is_tensor(ids) else ids["input_ids"]
settings = dict(max_new_tokens=128, engine="inductor", proposer=proposer)
model.generate(ids, **settings)
phases = collections.defaultdict(list)
for _ in range(7):
    spent["seconds"] = 0.0
    out = model.generate(ids, return_dict_in_generate=True, profile=True, **settings)
    steps = out.stats.steps - 1  # the prefill is a step of its own
    for phase, seconds in out.stats.timings.items():
        if phase != "prefill":
            phases[phase].append(seconds / steps * 1000)
    phases["package"].append(spent["seconds"] / steps * 1000)
    phases["verify outside the package"].append(phases["verify"][-1] - phases["package"][-1])
median = {phase: round(statistics.median(ms), 3) for phase, ms in phases.items()}
print(
    label, dtype, proposer, "ms a step:", median, "tokens", out.stats.new_tokens, "tau", out.stats.mean_accepted_tokens
)
