"""The embedded model at w8a8 through the inductor engine's package: chains of 2 to 16 tokens after prompts of 9 to 1000
tokens, each row's logits against the same token verified alone (largest difference; 0.0 = bit for bit). From the
repository root: PYTHONPATH=. .venv/bin/python docs/benchmarks/cpu-w8a8-session33/rows_real_model.py
"""

import torch

from medusa.decode import prefill
from medusa.precision import load_target
from medusa.runtime import InductorEngine
from medusa.sampling import SamplingConfig
from medusa.tree import Candidates, TreeSpec, build_buffers, chain

torch.set_num_threads(2)
model, tok = load_target(None, dtype="w8a8")
engine = InductorEngine(model)
engine.warm_up(progress=False, max_length=1020)
text = " ".join(open(path).read() for path in ("README.md", "docs/engines.md"))
ids_all = tok(text, return_tensors="pt").input_ids
generator = torch.Generator().manual_seed(0)
alone = build_buffers(TreeSpec([]), 1)
with torch.inference_mode():
    for length in (9, 40, 150, 300, 600, 769, 880, 1000):
        ids = ids_all[:, :length]
        for n in (2, 4, 6, 9, 12, 16):
            tokens = torch.randint(100, 20000, (n,), generator=generator)
            state = prefill(model, ids, SamplingConfig(), engine=engine, max_length=1020)
            tree = build_buffers(TreeSpec(chain(n - 1)), n - 1)
            together = engine.verify(state.cache, Candidates(tokens=tokens, tree=tree), state.length).logits.float()
            together = together.clone()
            state = prefill(model, ids, SamplingConfig(), engine=engine, max_length=1020)
            gaps = []
            for k, token in enumerate(tokens.tolist()):
                one = engine.verify(state.cache, Candidates(tokens=torch.tensor([token]), tree=alone), state.length + k)
                gaps.append(round((together[k] - one.logits[0].float()).abs().max().item(), 3))
                engine.commit(state.cache, state.length + k, torch.tensor([0]))
            print("prompt", length, "chain", n, "largest logit gap per row", gaps, flush=True)
