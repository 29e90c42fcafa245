"""fbgemm's int8 GEMM over a w8a8 step's 121 weights (SmolLM2's fused shapes, 134 MB: more than the caches hold)
called directly from Python, ms at each number of input rows, median of 10; and oneDNN's `torch._int_mm` beside it.

    python docs/benchmarks/cpu-zen3-avx2-session76/fbgemm_rows.py"""

import statistics
import time
import warnings

import torch

warnings.simplefilter("ignore")  # torch calls both fbgemm functions deprecated
torch.set_num_threads(2)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randint(-63, 64, s, dtype=torch.int8) for s in SHAPES]
packed = [
    (torch.fbgemm_pack_quantized_matrix(w), w.sum(1, dtype=torch.int32), torch.zeros(w.shape[0])) for w in weights
]


def median_ms(fn, repeats=10):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000, 2)


def fbgemm(rows):
    return [
        torch.fbgemm_linear_int8_weight_fp32_activation(rows[w.shape[1]], w, p, s, 1.0, 0, z)
        for w, (p, s, z) in zip(weights, packed)
    ]


for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17):
    rows = {k: torch.randint(-127, 128, (m, k)).float() for k in (576, 1536)}
    print("rows", m, "fbgemm ms", median_ms(lambda rows=rows: fbgemm(rows)), flush=True)
for m in (2, 5, 9):
    rows = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8) for k in (576, 1536)}
    print(
        "rows",
        m,
        "torch._int_mm ms",
        median_ms(lambda rows=rows: [torch._int_mm(rows[w.shape[1]], w.t()) for w in weights]),
    )
