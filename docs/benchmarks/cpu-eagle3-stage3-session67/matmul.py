"""One linear layer of the EAGLE-3 draft's shapes in fp32, int8 (fbgemm, runtime.int8_copy) and int4 (aten's
_weight_int4pack_mm_for_cpu) at 1 and 4 rows: microseconds a call, medians of 5 rounds of 200.

    python docs/benchmarks/cpu-eagle3-stage3-session67/matmul.py
"""

import statistics
import time

import torch

from medusa.runtime import int8_copy
from medusa.runtime.quantize import INT4_GROUP, quantize_int4

torch.set_num_threads(2)
torch.manual_seed(0)


def microseconds(call) -> float:
    call()
    start = time.perf_counter()
    for _ in range(200):
        call()
    return (time.perf_counter() - start) / 200 * 1e6


with torch.inference_mode():
    for out_features, in_features in ((8192, 576), (1536, 576), (576, 1536), (576, 576)):
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        int8 = int8_copy(torch.nn.Sequential(linear))[0]
        packed, scales_and_zeros, _ = quantize_int4(linear.weight.data, torch.float32)
        for rows in (1, 4):
            x = torch.randn(rows, in_features)
            calls = {
                "fp32": lambda x=x, linear=linear: linear(x),
                "int8": lambda x=x, int8=int8: int8(x),
                "int4": lambda x=x, w=packed, s=scales_and_zeros: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, w, INT4_GROUP, s
                ),
            }
            times = {name: [] for name in calls}
            for _round in range(5):
                for name, call in calls.items():
                    times[name].append(microseconds(call))
            print(out_features, in_features, rows, {k: round(statistics.median(v), 1) for k, v in times.items()})
