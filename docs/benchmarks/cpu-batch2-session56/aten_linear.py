"""SmolLM2-135M's linear layers (30 x q, k, v, o, gate, up, down, then the vocabulary's) on random fp32 weights
through eager aten F.linear for M input rows: the median ms of the whole stack, what a step of M tokens pays for its
GEMMs outside the inductor package (whose own: verify_width.txt).
    python aten_linear.py"""

import statistics
import time

import torch

torch.set_num_threads(2)
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randn(rows, columns) for rows, columns in shapes]
for m in (1, 2, 4, 6, 8, 12, 16):
    inputs = {width: torch.randn(m, width) for width in (576, 1536)}
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for weight in weights:
            torch.nn.functional.linear(inputs[weight.shape[1]], weight)
        times.append(time.perf_counter() - start)
    print(m, f"{1000 * statistics.median(times[2:]):.2f} ms")
