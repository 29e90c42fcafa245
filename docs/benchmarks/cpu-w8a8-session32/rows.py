"""One verify of a chain of six tokens against the same six verified one at a time, on the real model: the largest
logit difference per row (0 at a row computed as it would be alone). Apply w8a8.patch first; from the root:
    PYTHONPATH=. .venv/bin/python docs/benchmarks/cpu-w8a8-session32/rows.py w8a8|int8|float32 inductor|eager
"""

import sys

import torch

from medusa.decode import prefill
from medusa.precision import load_target
from medusa.runtime import EagerEngine, InductorEngine
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

torch.set_num_threads(2)
dtype = sys.argv[1]
model, tok = load_target(None, dtype=dtype)
eng = InductorEngine(model) if sys.argv[2] == "inductor" else EagerEngine(model)
if sys.argv[2] == "inductor":
    eng.warm_up(progress=False, max_length=300)
ids = tok("The history of the Roman Empire is long and complicated. It began when", return_tensors="pt").input_ids
extra = [262, 3417, 314, 253, 1379]
with torch.inference_mode():
    state = prefill(model, ids, SamplingConfig(), engine=eng, max_length=300)
    root = int(state.root_token)
    toks = torch.tensor([root] + extra)
    tree = build_buffers(TreeSpec(chain(len(extra))), len(extra))
    v = eng.verify(state.cache, Candidates(tokens=toks, tree=tree), state.length)
    together = v.logits.float().clone()
    state = prefill(model, ids, SamplingConfig(), engine=eng, max_length=300)
    one = build_buffers(TreeSpec([]), 1)
    length = state.length
    rows = []
    for t in toks.tolist():
        v1 = eng.verify(state.cache, Candidates(tokens=torch.tensor([t]), tree=one), length)
        rows.append(v1.logits[0].float().clone())
        eng.commit(state.cache, length, torch.tensor([0]))
        length += 1
    for k, r in enumerate(rows):
        print(
            dtype, sys.argv[2], "row", k, "max |chain - one at a time|", round((together[k] - r).abs().max().item(), 5)
        )
