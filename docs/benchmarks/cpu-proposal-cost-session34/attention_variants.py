"""w8a8's exact attention (medusa.runtime.attention.reduction_sdpa) against a variant that pads the values with a
vector's width of ones instead of concatenating one column, compiled by inductor alone (no model): ms over 30 layers'
worth of keys. Whether the variant stays exact: tests/test_engine.py's reduction-attention test with it in
reduction_sdpa's place (it passes).

    PYTHONPATH=. python docs/benchmarks/cpu-proposal-cost-session34/attention_variants.py
"""

import statistics
import time

import torch

from medusa.runtime.attention import reduction_sdpa
from medusa.runtime.static import INDUCTOR_CPU_OPTIONS


def padded_sdpa(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
    key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    scores = (query.unsqueeze(-2) * key.unsqueeze(-3)).sum(-1) * scale + attn_mask
    weights = (scores - scores.amax(-1, keepdim=True)).exp().unsqueeze(-1)
    summed = (weights * torch.nn.functional.pad(value, (0, 16), value=1.0).unsqueeze(-3)).sum(-2)
    return summed[..., :64] / summed[..., 64:].amax(-1, keepdim=True)  # every lane read: see reduction_sdpa


def main() -> None:
    torch.set_num_threads(2)
    with torch.inference_mode(), torch._inductor.config.patch(INDUCTOR_CPU_OPTIONS):
        for name, sdpa in (("reduction_sdpa", reduction_sdpa), ("padded", padded_sdpa)):

            def layers(query, keys, values, mask, sdpa=sdpa):
                out = query
                for key, value in zip(keys.unbind(0), values.unbind(0)):
                    out = sdpa(out, key, value, mask, 0.125, True)
                return out

            thirty = torch.compile(layers, dynamic=False)
            timings = []
            for rows in (1, 16):
                keys = 300 + rows
                args = (torch.randn(1, 9, rows, 64), torch.randn(30, 1, 3, keys, 64), torch.randn(30, 1, 3, keys, 64))
                mask = torch.zeros(1, 1, rows, keys)
                for _ in range(5):
                    thirty(*args, mask)
                times = []
                for _ in range(50):
                    start = time.perf_counter()
                    thirty(*args, mask)
                    times.append(time.perf_counter() - start)
                timings.append(f"{rows} rows {statistics.median(times) * 1000:.2f} ms")
            print(f"{name}, 30 layers:", *timings)


if __name__ == "__main__":
    main()
