"""Session 54's packages (one per cache size: its 1,024-row ones, made by that checkout) against this session's
(every cache size) on the same forwards in a 1,024-row cache, interleaved in one process, median ms of 24 after 6:
one sequence's verify of n tokens after `past` (and whether the logits are the same bit for bit), then a batch's step
of B rows of n tokens after 300 cached.
    PYTHONPATH=. python docs/benchmarks/cpu-one-package-session55/steps.py \\
        $MEDUSA_CACHE/aoti/1024-<digest>.pt2 $MEDUSA_CACHE/aoti/batch-1024-<digest>.pt2
(steps.txt and batch_steps.txt were printed by its two halves, run as two scripts)"""

import statistics
import sys
import time

import torch
import torch._inductor

from medusa import MedusaModel

model = MedusaModel.from_pretrained()
engine = model.engine("inductor")
engine.warm_up(batches=True)
config = model.base.config
rows, head_dim = 1024, config.hidden_size // config.num_attention_heads


def cache(batch: int) -> list[torch.Tensor]:
    return [
        torch.randn((batch, config.num_key_value_heads, rows, head_dim)) * 0.1
        for _ in range(2 * config.num_hidden_layers)
    ]


def inputs(batch: int, n: int, past: int):
    ids, positions = (
        torch.randint(0, 1000, (batch, n)),
        torch.arange(past, past + n)[None].expand(batch, n).contiguous(),
    )
    mask = torch.zeros((batch, 1, n, past + n))
    mask[..., past:] = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
    return ids, positions, mask


def interleaved(old, new, args) -> tuple[float, float]:
    times = {"old": [], "new": []}
    for r in range(30):
        for name, package in (("old", old), ("new", new)) if r % 2 else (("new", new), ("old", old)):
            start = time.perf_counter()
            package(*args)
            times[name].append(time.perf_counter() - start)
    return tuple(statistics.median(times[name][6:]) for name in ("old", "new"))


time.sleep(5)  # the first seconds after loading run slow (pages of the packages coming in)
with torch.inference_mode():
    old = torch._inductor.aoti_load_package(sys.argv[1])
    layers = cache(1)
    for past in (100, 700):
        for n in (1, 2, 4, 6, 8):
            args = (*inputs(1, n, past), torch.tensor(past), layers[::2], layers[1::2])
            o, w = interleaved(old, engine.package, args)
            same = torch.equal(old(*args)[0], engine.package(*args)[0])
            print(f"past {past} n {n}: old {1000 * o:.2f} ms new {1000 * w:.2f} ms ({w / o:.3f}x) same logits {same}")
    old = torch._inductor.aoti_load_package(sys.argv[2])
    for batch, n in [(1, 1), (2, 1), (4, 1), (2, 4), (4, 4), (8, 2)]:
        layers = cache(batch)
        args = (*inputs(batch, n, 300), torch.tensor([300] * batch), layers[::2], layers[1::2])
        o, w = interleaved(old, engine.batch_package, args)
        print(f"B={batch} n={n}: old {1000 * o:.1f} new {1000 * w:.1f} ms ({w / o:.3f}x)", flush=True)
