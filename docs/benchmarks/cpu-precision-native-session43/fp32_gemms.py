"""The fp32 GEMMs of a SmolLM2-135M step alone (30 layers' qkv, o, gate/up and down, and the 49,152-row head, random
weights), ms at each number of rows: aten's F.linear, MKL's packed sgemm, oneDNN's packed linear.

    python docs/benchmarks/cpu-precision-native-session43/fp32_gemms.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
HIDDEN, MLP, LAYERS, VOCAB = 576, 1536, 30, 49152
shapes = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)] * LAYERS + [(VOCAB, HIDDEN)]
weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in weights]
onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
KINDS = {
    "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights],
    "mkl packed": lambda xs: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, 16) for w, p in zip(weights, mkl)],
    "onednn packed": lambda xs: [
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, onednn)
    ],
}


def median_ms(kind: str, rows: int) -> float:
    xs = {i: torch.randn(rows, i) for _, i in shapes}
    KINDS[kind](xs)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        KINDS[kind](xs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


for kind in KINDS:
    print(kind, " ".join(f"{r}:{median_ms(kind, r):.1f}" for r in (1, 2, 3, 4, 6, 8, 12, 16)))
