"""Milliseconds of SmolLM2-135M's linear layers at M rows through aten's `F.linear`: bf16 (oneDNN's GEMM) and fp32
(MKL's), random weights of the model's shapes: one layer's q/k/v and gate/up (each concatenated), o and down, 30
times, then the lm_head. Medians of 15 after a warm-up, 2 threads.

    python docs/benchmarks/cpu-zen4-session68/gemm.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, VOCAB = 30, 576, 49152
SHAPES = [(HIDDEN, HIDDEN + 2 * 192), (HIDDEN, HIDDEN), (HIDDEN, 2 * 1536), (1536, HIDDEN)]  # (in, out)


def linears_ms(dtype: torch.dtype, rows: int) -> float:
    weights = [torch.randn(out, inp, dtype=dtype) * 0.02 for inp, out in SHAPES]
    inputs = [torch.randn(rows, inp, dtype=dtype) for inp, _ in SHAPES]
    head, last = torch.randn(VOCAB, HIDDEN, dtype=dtype) * 0.02, torch.randn(rows, HIDDEN, dtype=dtype)

    def forward():
        for _ in range(LAYERS):
            for x, w in zip(inputs, weights):
                F.linear(x, w)
        F.linear(last, head)

    forward()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    torch.set_num_threads(2)
    for rows in (1, 2, 4, 6, 8, 16):
        bf16, fp32 = linears_ms(torch.bfloat16, rows), linears_ms(torch.float32, rows)
        print(f"M={rows}: bf16 {bf16:.1f} ms, fp32 {fp32:.1f} ms", flush=True)
