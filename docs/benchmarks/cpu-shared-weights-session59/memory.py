"""Memory of a process holding SmolLM2 fp32 on the inductor engine, its single-sequence and batch packages loaded,
after a call of each kind (/proc/self/status, MB).

    PYTHONPATH=CHECKOUT python memory.py
"""

import os

import torch

from medusa import MedusaModel


def rss():
    out = {}
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) // 1024
    return out


print("start", rss(), flush=True)
model = MedusaModel.from_pretrained(plan="off", engine="inductor")
print("loaded", rss(), flush=True)
engine = model.engine("inductor")
engine.warm_up(progress=False)
print("single package", rss(), flush=True)
engine.warm_up(progress=False, batches=True)
print("batch package too", rss(), flush=True)
ids = torch.tensor([[1, 2, 3, 4, 5]])
model.generate(ids, max_new_tokens=20)
model.generate(torch.cat([ids, ids]), attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=20)
print("after generating", rss(), flush=True)
