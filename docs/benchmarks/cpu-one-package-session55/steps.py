"""Session 54's package (one per cache size: its 1,024-row one, made by that checkout) against this session's (every
cache size) on the same verify forward, n tokens after `past` in a 1,024-row cache, interleaved in one process;
median ms of 24 after 6, and whether the logits are the same bit for bit.
    PYTHONPATH=. python docs/benchmarks/cpu-one-package-session55/steps.py $MEDUSA_CACHE/aoti/1024-<digest>.pt2"""

import statistics
import sys
import time

import torch
import torch._inductor

from medusa import MedusaModel

model = MedusaModel.from_pretrained()
config = model.base.config
old = torch._inductor.aoti_load_package(sys.argv[1])
new = model.engine("inductor").package
rows, head_dim = 1024, config.hidden_size // config.num_attention_heads


def rows_of_cache():
    return torch.randn((1, config.num_key_value_heads, rows, head_dim)) * 0.1


keys = [rows_of_cache() for _ in range(config.num_hidden_layers)]
values = [rows_of_cache() for _ in range(config.num_hidden_layers)]
with torch.inference_mode():
    for past in (100, 700):
        for n in (1, 2, 4, 6, 8):
            ids, positions = torch.randint(0, 1000, (1, n)), torch.arange(past, past + n)[None]
            mask = torch.zeros((1, 1, n, past + n))
            mask[..., past:] = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
            args = (ids, positions, mask, torch.tensor(past), keys, values)
            times = {"old": [], "new": []}
            for r in range(30):
                for name, package in (("old", old), ("new", new)) if r % 2 else (("new", new), ("old", old)):
                    start = time.perf_counter()
                    package(*args)
                    times[name].append(time.perf_counter() - start)
            same = torch.equal(old(*args)[0], new(*args)[0])
            o, w = (statistics.median(times[name][6:]) for name in ("old", "new"))
            print(f"past {past} n {n}: old {1000 * o:.2f} ms new {1000 * w:.2f} ms ({w / o:.3f}x) same logits {same}")
