"""A verify (with its greedy acceptance) as the plan times it, by tree size and context: plain, 4- and 6-node dynamic
trees, each size alone (12 steps, medians, the cache set back after each) and then interleaved, over a prefilled
cache of CONTEXT random tokens. The same figures with `--dtype int8`.

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-session35/verify_by_context.py w8a8 512
"""

import statistics
import sys

import torch

from medusa import MedusaModel
from medusa.decode import prefill
from medusa.runtime import engine_for
from medusa.sampling import SamplingConfig
from medusa.tree_builder import grow_tree, time_step

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(dtype=sys.argv[1], plan="off")
context = int(sys.argv[2]) if len(sys.argv) > 2 else 256
engine = engine_for(model.base, "inductor")
prompt = torch.randint(0, 49152, (1, context), generator=torch.Generator().manual_seed(0))
state = prefill(
    model.base, prompt, SamplingConfig(), feature_layers=model.feature_layers, engine=engine, max_length=context + 40
)
order = grow_tree(model.accuracy, 24)
mk = lambda p, n: model.make_proposer(p, [list(x) for x in order[: n - 1]] or None, SamplingConfig(), None)
jobs = {("plain", 1): mk("plain", 1), ("dynamic", 4): mk("dynamic", 4), ("dynamic", 6): mk("dynamic", 6)}


def run(names, reps=12):
    out = {n: [] for n in names}
    for r in range(reps + 1):
        for n in names:
            p, v, a = time_step(model, engine, jobs[n], state, SamplingConfig())
            if r:
                out[n].append(v + a)
    return {f"{k[0]}{k[1]}": round(statistics.median(v), 2) for k, v in out.items()}


print("alone", {**run([("plain", 1)]), **run([("dynamic", 4)]), **run([("dynamic", 6)])})
print("interleaved", run([("plain", 1), ("dynamic", 4), ("dynamic", 6)]))
