"""fbgemm's GEMMs of a SmolLM2-135M step through medusa::fbgemm_sums, the layers apart (211 calls) against sibling
projections fused (q/k/v and gate/up: 121 calls), random int8 weights of its shapes, median ms of a pass at 1, 4 and
8 rows (plus fbgemm's pinning row), the two interleaved.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python docs/benchmarks/cpu-w8a8-avx2-libop-session41/fused_calls.py
"""

import statistics
import time

import torch

from medusa.runtime.prepack import fbgemm_weight

torch.manual_seed(0)
torch.set_num_threads(2)
HIDDEN, MLP, VOCAB, LAYERS = 576, 1536, 49152, 30
layouts = {
    "apart": [
        (HIDDEN, HIDDEN),
        (192, HIDDEN),
        (192, HIDDEN),
        (HIDDEN, HIDDEN),
        (MLP, HIDDEN),
        (MLP, HIDDEN),
        (HIDDEN, MLP),
    ],
    "fused": [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)],
}
weights = {}
for name, shapes in layouts.items():
    shapes = shapes * LAYERS + [(VOCAB, HIDDEN)]
    weights[name] = [torch.randint(-63, 64, (out, width), dtype=torch.int8) for out, width in shapes]
    for weight in weights[name]:
        fbgemm_weight(weight)


def one_pass(name, x):
    for weight in weights[name]:
        torch.ops.medusa.fbgemm_sums(x[weight.shape[1]], weight)


for rows in (1, 4, 8):
    x = {width: torch.randint(-127, 128, (rows + 1, width)).float() for width in (HIDDEN, MLP)}
    times = {name: [] for name in layouts}
    for _ in range(15):
        for name in layouts:
            start = time.perf_counter()
            one_pass(name, x)
            times[name].append(time.perf_counter() - start)
    print(f"rows {rows}", {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}, flush=True)
